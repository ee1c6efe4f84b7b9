"""The training scripts' flags -> one frozen Config: the defaults that follow from other flags
(resolve_defaults) and the run's identity. Each flag is registered beside what reads it (an
add_*_flags function of its module), and its rules are checked there too (check_*_flags);
common/train/flags.py composes both, and holds the few rules that span several owners."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Sequence

from common.errors import ConfigError, exit_quietly_after_the_printer, node_prints
from common.optimizers import OPTIMIZERS

DATASETS = ("cifar10", "mnist", "synthetic", "imagefolder", "shards", "hf")
INTERPOLATIONS = ("bilinear", "bicubic")  # --interpolation: torch's antialiased kernels of both take uint8 on a CPU
OWN_DATASETS = ("imagefolder", "shards", "hf")  # your own images (common/shards.py, common/data/hf.py: their layouts)
# Shards: each epoch shuffles the shards, then deals each window of this many into as many lanes
# (--shard-lanes' default; common/data/loader.py's global_order; a checkpoint records its own).
SHUFFLE_WINDOW = 4


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
    shard_lanes: int
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
    deterministic: bool
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
    """Every rank parses the same argv; one of each node (its console) prints the usage error. No
    abbreviated flags: a prefix is taken silently for the one flag it starts (another script's
    --shard 4 would set --shard-cache-gb 4 here), and a flag added later would change its meaning."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

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


def resolve_defaults(a: argparse.Namespace) -> None:
    """The defaults that depend on other flags: the data set's recipe, the optimizer's lr and decay."""
    recipe = RECIPES.get(a.dataset, RECIPES["synthetic"])
    a.model = a.model or recipe.model
    a.epochs = recipe.epochs if a.epochs is None else a.epochs
    a.batch_size = recipe.batch_size if a.batch_size is None else a.batch_size
    rule = OPTIMIZERS[a.optimizer]
    if a.lr is None:  # linear scaling; a bad --batch-size is reported by check_flags, not as a bad lr
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
