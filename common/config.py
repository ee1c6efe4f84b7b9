"""The training scripts' flags -> one frozen Config, validated before any process group exists:
the rules between flags (validate), the defaults that follow from other flags (resolve_defaults)
and the run's identity. Each flag is registered beside what reads it (an add_*_flags function of its
module); common/train/flags.py composes the parser."""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Sequence

from common.credentials import read_storage_options
from common.errors import ConfigError, exit_quietly_after_the_printer, node_prints
from common.models import model_problem
from common.optimizers import OPTIMIZERS
from common.storage import log_url_problem, url_problem
from common.timm_models import is_timm
from common.weights import weights_problem

DATASETS = ("cifar10", "mnist", "synthetic", "imagefolder", "shards", "hf")
INTERPOLATIONS = ("bilinear", "bicubic")  # --interpolation: torch's antialiased kernels of both take uint8 on a CPU
OWN_DATASETS = ("imagefolder", "shards", "hf")  # your own images (common/shards.py, common/data/hf.py: their layouts)


@dataclass(frozen=True)
class Recipe:
    """Per-data-set defaults. lr is the peak of the one-cycle schedule for batch_size images."""

    model: str
    epochs: int
    batch_size: int
    lr: float


# Why these: SGD+nesterov with a one-cycle schedule is the fastest reliable recipe for both sets.
# MNIST: the BatchNorm convnet passes 99% within 4 epochs. CIFAR-10: ResNet-18 at batch 512 with
# peak lr 0.4 (0.1 per 128 images, the linear-scaling rule) reaches about 94% in 30 epochs.
RECIPES = {
    "cifar10": Recipe(model="resnet18", epochs=30, batch_size=512, lr=0.4),
    "mnist": Recipe(model="convnet", epochs=4, batch_size=128, lr=0.1),
    "synthetic": Recipe(model="convnet", epochs=2, batch_size=128, lr=0.05),
    # Your own images: the torchvision reference recipe's model, at a batch that fits a small GPU.
    "imagefolder": Recipe(model="resnet18", epochs=30, batch_size=256, lr=0.2),
    "shards": Recipe(model="resnet18", epochs=30, batch_size=256, lr=0.2),
    "hf": Recipe(model="resnet18", epochs=30, batch_size=256, lr=0.2),
}


@dataclass(frozen=True)
class Config:
    strategy: str
    dataset: str
    data_dir: str
    download: bool
    download_from: str
    cache_dir: str
    synthetic_shape: str
    image_size: int
    workers: int | None
    skip_broken: bool
    cache_gb: float
    shard_cache_gb: float
    verify_data: bool
    decode: str
    hf_image_key: str
    hf_label_key: str
    crop_pct: float | None
    interpolation: str | None
    model: str
    weights: str
    normalization: str
    epochs: int
    extend_to: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    schedule: str
    optimizer: str
    betas: tuple[float, float]
    eps: float
    decay_norm_and_bias: bool
    layer_decay: float
    backbone_lr_scale: float
    drop_path: float
    warmup: float
    min_lr: float
    milestones: tuple[int, ...]
    gamma: float
    label_smoothing: float
    class_weights: str
    mixup: float
    cutmix: float
    augment: str
    random_erase: float
    ema: float
    clip_grad_norm: float
    seed: int
    max_steps: int
    eval_batch_size: int | None
    device: str
    backend: str
    transport: str
    timeout_s: float
    storage_timeout_s: float
    log_dir: str
    checkpoint_dir: str
    resume: str
    keep: int
    save_every_steps: int
    log_every: int
    log_all_ranks: bool
    check_equivalence: int
    check_replicas: int
    sync_bn: bool
    precision: str
    accumulate: int
    grad_compression: str
    compile: bool
    profile: bool
    memory_format: str
    # May hold credentials: never logged, saved, or shown in a repr of the Config.
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    options: dict[str, Any] = field(default_factory=dict)  # the strategy's own flags
    identity_options: tuple[str, ...] = ()  # those of the strategy's flags that change the trained weights

    def as_plain_dict(self) -> dict[str, Any]:
        """Only str/int/float/bool values, the strategy's flags inline: safe for
        torch.load(weights_only=True) and TensorBoard hparams."""
        plain = {key: ",".join(map(str, value)) if isinstance(value, tuple) else value
                 for key, value in asdict(self).items()}  # --betas, --milestones: one string each
        options = plain.pop("options")
        plain.pop("identity_options")
        plain.pop("storage_options")  # credentials stay out of logs, TensorBoard and checkpoints
        return {**plain, **options}

    def identity(self) -> dict[str, Any]:
        """What defines the run: everything that changes the trained weights. Not the world size,
        device, backend, logging or checkpoint cadence: those may change between restarts."""
        return run_identity(self.as_plain_dict(), self.identity_options)

    @property
    def run_id(self) -> str:
        return identity_digest(self.identity())

    @property
    def last_epoch(self) -> int:
        """The epoch training ends at: --epochs, or --extend-to's."""
        return self.extend_to or self.epochs


# Run identity: what defines a run (IDENTITY, run_identity), its name (identity_digest, the default
# folders) and how two runs differ (differences): checkpoints, resume and the banner read it from
# here. The command that continues a run (settings_flags, way_to_continue) needs every setting's
# flag: common/train/settings.py, above the flags' owners.

# Settings that change the trained weights. --synthetic-shape matters only for --dataset synthetic;
# --data-dir and --image-size only for your own images (the built-in sets are the same anywhere).
IDENTITY = ("dataset", "model", "weights", "batch_size", "lr", "momentum", "weight_decay", "schedule", "epochs", "seed",
            "max_steps", "sync_bn", "precision", "accumulate", "grad_compression", "optimizer", "betas", "eps",
            "decay_norm_and_bias", "warmup", "min_lr", "milestones", "gamma", "label_smoothing", "mixup", "cutmix",
            "augment", "random_erase", "ema", "clip_grad_norm")


# Settings that join the identity only when chosen (their default here): a run of the default keeps
# the identity it had before the flag existed.
WHEN_CHOSEN = {"normalization": "auto", "layer_decay": 0.0, "backbone_lr_scale": 1.0, "drop_path": 0.0,
               "crop_pct": None, "interpolation": None, "class_weights": ""}


def run_identity(flags: dict[str, Any], strategy_options: Sequence[str] = ()) -> dict[str, Any]:
    """The identity of a run from its flags (a Config's, or those saved in a checkpoint)."""
    keys = [*IDENTITY, *(["synthetic_shape"] if flags.get("dataset") == "synthetic" else []),
            *(key for key, default in WHEN_CHOSEN.items() if flags.get(key, default) != default),
            *(["extend_to"] if flags.get("extend_to") else []),  # an extension: a run of its own
            *(["data_dir", "image_size"] if flags.get("dataset") in OWN_DATASETS else []),
            *(["hf_image_key", "hf_label_key"] if flags.get("dataset") == "hf" else []), *strategy_options]
    return {key: flags.get(key) for key in keys}


def identity_digest(identity: dict[str, Any]) -> str:
    """Eight hex digits that name a run's identity in folder names and the banner."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    return [f"{key} {saved.get(key)!r} -> {now.get(key)!r}" for key in sorted(saved.keys() | now.keys())
            if saved.get(key) != now.get(key)]


class RankZeroParser(argparse.ArgumentParser):
    """Every rank parses the same argv; one of each node (its console) prints the usage error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """One line, not the usage block: the message names the flag and what to do. Printed once
        per node, as a ConfigError is: a refusal that depends on the node (a --class-weights file
        missing there) would otherwise be printed nowhere, its ranks waiting for rank 0 in vain."""
        if node_prints():
            self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
        exit_quietly_after_the_printer(ConfigError.quiet_exit_delay_s)  # the node's local rank 0 refuses the same
        self.exit(2)


def default_checkpoint_dir(cfg: Config) -> str:
    """One folder per run identity: a changed command never continues another run. An extension
    (--extend-to) lives in the folder of the run it extends, as a run of its own beside it."""
    extended = replace(cfg, extend_to=0) if cfg.extend_to else cfg
    return os.path.join("checkpoints", f"{cfg.strategy}-{cfg.dataset}-{path_part(cfg.model)}-{extended.run_id}")


def default_log_dir(cfg: Config, world_size: int) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{cfg.strategy}-{cfg.dataset}-{path_part(cfg.model)}-w{world_size}-{stamp}")


def path_part(text: str) -> str:
    """`text` as one folder-name part on any OS: a --model such as torchvision:resnet18 or
    my.models:build has ':' (Windows) and may have '/' (every OS)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate(p: argparse.ArgumentParser, a: argparse.Namespace, world_size: int) -> None:
    """Every rule between the flags, on the parsed values (resolve_defaults first): exits 2 with one
    line naming the flag."""
    if a.dataset not in DATASETS:
        p.error(f"--dataset {a.dataset!r} is unknown; choose one of {', '.join(DATASETS)}")
    _validate_own_data(p, a)
    if problem := model_problem(a.model):
        p.error(f"--model {a.model!r} {problem}")
    if a.batch_size < 1:
        p.error(f"--batch-size must be >= 1 (got {a.batch_size})")
    if a.batch_size % world_size:
        p.error(f"--batch-size {a.batch_size} is the global batch and must divide evenly across the "
                f"world size {world_size}; use a multiple of {world_size}")
    if a.epochs < 1:
        p.error(f"--epochs must be >= 1 (got {a.epochs})")
    if not 0 < a.lr < math.inf:
        p.error(f"--lr must be > 0 and finite (got {a.lr})")
    if a.max_steps < 0 or (a.eval_batch_size is not None and a.eval_batch_size < 1) or a.timeout_s <= 0 or \
            a.storage_timeout_s <= 0 or (a.log_every is not None and a.log_every < 1):
        p.error("--max-steps must be >= 0, --eval-batch-size >= 1, --timeout-s and --storage-timeout-s > 0 and "
                "--log-every >= 1")
    if a.keep < 2:
        p.error(f"--keep must be >= 2 (got {a.keep}): the newest checkpoint may be the one a crash cut short")
    if a.save_every_steps < 0:
        p.error(f"--save-every-steps must be >= 0 (got {a.save_every_steps})")
    if a.check_equivalence < 0 or a.check_replicas < 0:
        p.error("--check-equivalence and --check-replicas take a step count >= 0")
    _validate_recipes(p, a, world_size)
    _validate_optimizer(p, a)
    _validate_fine_tuning(p, a)
    _validate_regularization(p, a, world_size)
    _validate_storage(p, a)
    if a.normalization != "auto" and not a.weights:
        p.error(f"--normalization {a.normalization} chooses how images are normalized for --weights; without "
                "--weights the data set's statistics are used: drop it or give --weights")
    if problem := weights_problem(a.weights, a.model):
        p.error(f"--weights {a.weights} {problem}")


def _validate_optimizer(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.extend_to and a.extend_to <= a.epochs:
        p.error(f"--extend-to {a.extend_to} must be more than --epochs {a.epochs}: the epoch the extension trains "
                "the finished run on to")
    if len(a.betas) != 2 or not all(0 <= b < 1 for b in a.betas):
        p.error(f"--betas takes two decays in [0, 1) as B1,B2 (got {','.join(map(str, a.betas))})")
    if not (0 < a.eps < math.inf and 0 <= a.weight_decay < math.inf and 0 <= a.momentum < 1):
        p.error(f"--eps must be > 0, --weight-decay >= 0 (both finite) and --momentum in [0, 1) (got {a.eps}, "
                f"{a.weight_decay}, {a.momentum})")
    if not (0 <= a.warmup < math.inf and 0 <= a.min_lr < a.lr and 0 < a.gamma < math.inf):
        p.error(f"--warmup must be >= 0 (steps, or a fraction of the run when < 1), --min-lr in [0, --lr {a.lr:g}) "
                f"and --gamma > 0 (got {a.warmup:g}, {a.min_lr:g}, {a.gamma:g})")
    if (a.schedule == "step") != bool(a.milestones):
        p.error("--schedule step and --milestones E1,E2,... go together: the epochs after which the lr drops")
    if list(a.milestones) != sorted(set(a.milestones)) or any(not 0 < m < a.epochs for m in a.milestones):
        p.error(f"--milestones {','.join(map(str, a.milestones))}: increasing epochs between 1 and --epochs - 1 "
                f"({a.epochs - 1})")
    _refuse_unused(p, a)


def _validate_fine_tuning(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    ranges = (("--layer-decay", a.layer_decay, 0 <= a.layer_decay <= 1, "in (0, 1], or 0 for off"),
              ("--backbone-lr-scale", a.backbone_lr_scale, 0 <= a.backbone_lr_scale < math.inf, ">= 0 and finite"),
              ("--drop-path", a.drop_path, 0 <= a.drop_path < 1, "in [0, 1), 0 for off"))
    for flag, value, valid, bounds in ranges:
        if not valid:
            p.error(f"{flag} must be {bounds} (got {value:g})")
    if a.drop_path and a.check_equivalence:
        p.error("--check-equivalence cannot pass with --drop-path: stochastic depth draws its own masks on each rank, "
                "unlike one process over the whole batch; check without --drop-path")
    needs_timm = [flag for flag, value in (("--layer-decay", a.layer_decay), ("--drop-path", a.drop_path)) if value]
    if needs_timm and not is_timm(a.model):
        p.error(f"{' and '.join(needs_timm)} need{'s' if len(needs_timm) == 1 else ''} a timm model (timm's grouping "
                f"by depth, its stochastic depth); --model {a.model} is not one: give --model timm:NAME or drop it")


def _refuse_unused(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """A setting the chosen optimizer or schedule does not read is a mistake to say, not to ignore."""
    defaults = {action.dest: action.default for action in p._actions}
    changed = {dest for dest in ("betas", "eps", "momentum", "gamma", "min_lr") if getattr(a, dest) != defaults[dest]}
    reads = OPTIMIZERS[a.optimizer].reads
    unused = {"betas": "betas" not in reads, "eps": "eps" not in reads, "momentum": "momentum" not in reads,
              "gamma": a.schedule != "step", "min_lr": a.schedule not in ("onecycle", "cosine")}
    readers = "; ".join(f"--{flag}: {', '.join(n for n, r in OPTIMIZERS.items() if flag in r.reads)}"
                        for flag in ("betas", "eps", "momentum"))
    if wasted := sorted(dest for dest in changed if unused[dest]):
        p.error(f"{', '.join('--' + d.replace('_', '-') for d in wasted)} {'has' if len(wasted) == 1 else 'have'} no "
                f"effect with --optimizer {a.optimizer} --schedule {a.schedule} ({readers}; --gamma: step; "
                "--min-lr: onecycle, cosine); drop it or choose what reads it")


def _validate_regularization(p: argparse.ArgumentParser, a: argparse.Namespace, world_size: int) -> None:
    if not (0 <= a.label_smoothing < 1 and 0 <= a.random_erase <= 1 and 0 <= a.ema < 1):
        p.error(f"--label-smoothing must be in [0, 1), --random-erase in [0, 1] and --ema in (0, 1), or 0 for off "
                f"(got {a.label_smoothing:g}, {a.random_erase:g}, {a.ema:g})")
    if not (0 <= a.mixup < math.inf and 0 <= a.cutmix < math.inf):
        p.error(f"--mixup and --cutmix take a Beta distribution's ALPHA > 0, or 0 for off (got {a.mixup:g}, "
                f"{a.cutmix:g})")
    if a.class_weights not in ("", "balanced"):
        a.class_weights = read_class_weights(p, a.class_weights)
    if a.clip_grad_norm is not None and not 0 < a.clip_grad_norm < math.inf:
        p.error(f"--clip-grad-norm must be > 0 (got {a.clip_grad_norm:g}); leave it out for no clipping")
    per_rank = a.batch_size // world_size
    if (a.mixup or a.cutmix) and per_rank % 2:
        p.error(f"--mixup/--cutmix pair position g of each global batch with g + B/2, which stays on one rank only "
                f"when each rank's batch is even (--batch-size {a.batch_size} / {world_size} rank(s) = {per_rank}); "
                f"use a --batch-size that is a multiple of {2 * world_size}")


def read_class_weights(p: argparse.ArgumentParser, flag: str) -> str:
    """--class-weights FILE (one weight per line) or W1,W2,...: the weights as W1,W2,... (what the
    run's identity and checkpoint keep: a changed file is another run). Each > 0 and finite."""
    text = flag
    if os.path.isfile(flag):
        try:
            text = ",".join(line.strip() for line in open(flag).read().splitlines() if line.strip())
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"--class-weights {flag}: reading it failed ({e}); give a text file of one weight per line")
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        p.error(f"--class-weights {flag}: neither balanced, nor a file, nor numbers W1,W2,...; give balanced or a "
                "FILE of one weight per line in class order")
    if not all(0 < w < math.inf for w in weights):
        p.error(f"--class-weights {flag}: every weight must be > 0 and finite (got {','.join(map(str, weights))})")
    return ",".join(map(repr, weights))


def _validate_own_data(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    own = a.dataset in OWN_DATASETS
    if own and a.data_dir.startswith("file://"):
        a.data_dir = a.data_dir.removeprefix("file://")  # a local folder, read as one (the converter takes both)
    if a.image_size and not own:
        p.error(f"--image-size applies to --dataset {' or '.join(OWN_DATASETS)}; the built-in sets have one size")
    if own and a.data_dir == "./data":
        p.error(f"--dataset {a.dataset} needs --data-dir: the folder (or, for shards and hf, the URL) of your images")
    keys = [flag for flag, value in (("--hf-image-key", a.hf_image_key), ("--hf-label-key", a.hf_label_key)) if value]
    if keys and a.dataset != "hf":
        p.error(f"{' and '.join(keys)} {'apply' if len(keys) > 1 else 'applies'} to --dataset hf (the columns of a "
                "Hugging Face data set)")
    a.hf_image_key, a.hf_label_key = a.hf_image_key or "image", a.hf_label_key or "label"
    if own and a.dataset == "imagefolder" and "://" in a.data_dir:
        p.error("--dataset imagefolder reads a local folder; for a store, convert it to shards "
                "(python -m common.shards FOLDER URL) and pass --dataset shards")
    chosen = [flag for flag, value in (("--crop-pct", a.crop_pct), ("--interpolation", a.interpolation))
              if value is not None]
    if chosen and not (own and a.image_size):
        p.error(f"{' and '.join(chosen)} choose{'s' if len(chosen) == 1 else ''} how --image-size S resizes your own "
                "images (--dataset imagefolder, shards or hf); without it the images train and evaluate as stored: "
                "drop it or give --image-size S")
    if a.crop_pct is not None and not 0 < a.crop_pct <= 1:
        p.error(f"--crop-pct must be in (0, 1]: the fraction of the resized short side the centre crop keeps "
                f"(got {a.crop_pct:g})")
    if a.image_size < 0 or (a.workers is not None and a.workers < 0) or not 0 <= a.cache_gb < math.inf \
            or not 0 < a.shard_cache_gb < math.inf:
        p.error("--image-size, --workers and --cache-gb must be >= 0 and --shard-cache-gb > 0 (finite: for no bound, "
                "give more than the disk holds)")


def _validate_recipes(p: argparse.ArgumentParser, a: argparse.Namespace, world_size: int) -> None:
    per_rank = a.batch_size // world_size
    if a.accumulate < 1:
        p.error(f"--accumulate must be >= 1 (got {a.accumulate})")
    if per_rank % a.accumulate:
        p.error(f"--accumulate {a.accumulate}: each rank's batch (--batch-size {a.batch_size} / {world_size} rank(s) = "
                f"{per_rank}) does not split into {a.accumulate} equal micro-batches; use a divisor of {per_rank} "
                "or another --batch-size")
    if a.check_equivalence and a.grad_compression == "powersgd":
        p.error("--check-equivalence compares against exact gradient averaging, which PowerSGD approximates on "
                "purpose; drop one of the two flags")
    if a.compile and a.device != "cuda" and not _cpp_compiler():
        p.error("--compile on the CPU needs a C++ compiler for TorchInductor, and none was found (g++, c++, "
                "clang++ or $CXX): install one (Debian/Ubuntu: apt-get install g++) or drop --compile")


def _cpp_compiler() -> str | None:
    return next(filter(None, (shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)),
                None)


def _validate_storage(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """URLs this installation cannot open are found here, before any process group starts."""
    try:
        a.storage_options = read_storage_options(a.storage_options)
    except ValueError as e:
        p.error(f"--storage-options {e}")
    for flag, value in (("--data-dir", a.data_dir), ("--checkpoint-dir", a.checkpoint_dir), ("--resume", a.resume)):
        if problem := url_problem(value):
            p.error(f"{flag} {value}: {problem}")
    if problem := log_url_problem(a.log_dir):
        p.error(f"--log-dir {a.log_dir}: {problem}")


def resolve_defaults(a: argparse.Namespace) -> None:
    """The defaults that depend on other flags: the data set's recipe, the optimizer's lr and decay."""
    recipe = RECIPES.get(a.dataset, RECIPES["synthetic"])
    a.model = a.model or recipe.model
    a.epochs = recipe.epochs if a.epochs is None else a.epochs
    a.batch_size = recipe.batch_size if a.batch_size is None else a.batch_size
    rule = OPTIMIZERS[a.optimizer]
    if a.lr is None:  # linear scaling; a bad --batch-size is reported by validate, not as a bad lr
        a.lr = rule.default_lr(recipe.lr, recipe.batch_size, max(a.batch_size, 1))
    if a.weight_decay is None:
        a.weight_decay = rule.weight_decay
    if a.warmup is None:
        a.warmup = 0.25 if a.schedule == "onecycle" else 0.0


def make_config(a: argparse.Namespace, strategy: str, identity_options: Sequence[str] = ()) -> Config:
    """The Config of parsed and validated flags: a strategy's own flags land in Config.options."""
    common = {f.name for f in fields(Config)}
    values = vars(a)
    options = {k: v for k, v in values.items() if k not in common}
    cfg = Config(strategy=strategy, options=options, identity_options=tuple(identity_options),
                 **{k: v for k, v in values.items() if k in common})
    if not cfg.checkpoint_dir:
        cfg = replace(cfg, checkpoint_dir=default_checkpoint_dir(cfg))
    return cfg
