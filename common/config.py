"""Command-line flags -> one frozen Config, validated before any process group exists."""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Sequence

from common.credentials import read_storage_options
from common.models import MODELS, model_problem
from common.optimizers import OPTIMIZERS
from common.storage import log_url_problem, url_problem
from common.timm_models import is_timm
from common.weights import NORMALIZATIONS, weights_problem

DATASETS = ("cifar10", "mnist", "synthetic", "imagefolder", "shards", "hf")
SCHEDULES = ("onecycle", "cosine", "constant", "step")
AUGMENTS = ("basic", "randaugment", "trivialaugment", "autoaugment")
INTERPOLATIONS = ("bilinear", "bicubic")  # --interpolation: torch's antialiased kernels of both take uint8 on a CPU
OWN_DATASETS = ("imagefolder", "shards", "hf")  # your own images (common/shards.py, common/data/hf.py: their layouts)
# --storage-timeout-s's default: generous, so that it covers a large checkpoint on a slow store, with
# the storage layer's own bounded retries of transient errors, and a data set's download.
STORAGE_TIMEOUT_S = 1800.0


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
# folders), how two runs differ (differences) and the flags that continue one (settings_flags,
# way_to_continue). One module: checkpoints, resume and the banner read it from here.

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


def way_to_continue(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """How to continue a run of another identity: its flags; or, for a run of an earlier version
    (whose identity lacks settings every run has now), that this version cannot."""
    if newer := sorted(key for key in IDENTITY if key in now and key not in saved):
        flags = ", ".join("--" + key.replace("_", "-") for key in newer[:3]) + (" ..." if len(newer) > 3 else "")
        return (f"It was written by an earlier version of the suite, before {flags} existed, and this version "
                "cannot continue it: finish it with the version it was trained with")
    return (f"To continue it, rerun with its settings: {shlex.join(settings_flags(saved))} (with the flags that are "
            "not settings, such as --checkpoint-dir, as before)")


class RankZeroParser(argparse.ArgumentParser):
    """Every rank parses the same argv; only one of them needs to print the usage error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """One line, not the usage block: the message names the flag and what to do."""
        if os.environ.get("RANK", "0") == "0":
            self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
        self.exit(2)


def build_parser(strategy: str, default_dataset: str) -> argparse.ArgumentParser:
    p = RankZeroParser(
        prog=f"train_{strategy}.py",
        description=f"Data-parallel training ({strategy}). Launch with torchrun, or plain python for one process.",
    )
    add = p.add_argument
    add("--dataset", default=default_dataset, help=f"one of {', '.join(DATASETS)} (default: %(default)s)")
    add("--data-dir", default="./data", help="where data sets live or are downloaded: a folder, or an object-store URL "
                                            "(s3://bucket/prefix, any fsspec URL) copied into --cache-dir "
                                            "(default: %(default)s)")
    add("--no-download", dest="download", action="store_false", help="never download; fail if files are missing")
    add("--download-from", default="", metavar="BASE_URL",
        help="download the data set's archives from BASE_URL/<file name> (a mirror) instead of their home sites")
    add("--cache-dir", default="", help="local copy of a --data-dir URL, one per node "
                                        "(default: $XDG_CACHE_HOME/dp-suite or ~/.cache/dp-suite)")
    add("--storage-options", default="{}", metavar="JSON|@FILE|env:VAR",
        help='fsspec options for URLs in --data-dir, --checkpoint-dir and --resume: a JSON object such as '
             '\'{"endpoint_url": "http://minio:9000"}\', or @FILE (read from that JSON file) or env:VAR (from that '
             "environment variable). Give credentials in a file or a variable: a command line is readable by every "
             "user of the machine (ps). They are never printed or saved "
             "(default: the standard AWS variables, profile or instance role)")
    add("--synthetic-shape", default="cifar", choices=("cifar", "mnist"), help="image shape of --dataset synthetic")
    own = p.add_argument_group("your own images (--dataset imagefolder | shards | hf; docs/data.md)")
    own.add_argument("--image-size", type=int, default=0, metavar="S",
                     help="train at S x S: random-resized crops + flips for training, resize + centre crop for "
                          "evaluation; needed when the images differ in size (default: their common size)")
    own.add_argument("--workers", type=int, default=None, metavar="N",
                     help="DataLoader worker processes per rank decoding a streamed set (default: the node's cores "
                          "/ ranks per node - 1, at least 1)")
    own.add_argument("--decode", default="cpu", choices=("cpu", "gpu", "auto"),
                     help="where a streamed set's JPEGs are decoded for training: cpu (the workers decode, crop and "
                          "augment), gpu (the workers read the bytes; each CUDA rank decodes its batch with nvJPEG and "
                          "crops it on its device, the same crops), auto (gpu on CUDA ranks for an all-JPEG set) "
                          "(default: %(default)s)")
    own.add_argument("--skip-broken", action="store_true",
                     help="train without images that do not decode (each replaced by the next sample; counted and "
                          "named in the log) instead of stopping at the first")
    own.add_argument("--cache-gb", type=float, default=20.0, metavar="GB",
                     help="decode a set that fits in this many GB once per node into --cache-dir, else stream it "
                          "(default: %(default)s)")
    own.add_argument("--shard-cache-gb", type=float, default=10.0, metavar="GB",
                     help="the most a node keeps of shards from a --data-dir URL, or of a parquet set's row groups "
                          "(--dataset hf), while streaming; the least recently used are deleted beyond it "
                          "(default: %(default)s)")
    own.add_argument("--verify-data", action="store_true",
                     help="tell the set's files apart by their bytes, not their names, sizes and dates (which "
                          "cp -p and rsync -a keep): reads the whole set at every start")
    own.add_argument("--hf-image-key", default=None, metavar="COLUMN",
                     help="--dataset hf: the column of the images (default: image)")
    own.add_argument("--hf-label-key", default=None, metavar="COLUMN",
                     help="--dataset hf: the column of the class indices, a ClassLabel names them (default: label)")
    own.add_argument("--crop-pct", type=float, default=None, metavar="F",
                     help="with --image-size S, evaluate on the centre S of the short side resized to floor(S / F), "
                          "as timm does (default: the pretrained config's that came with --weights, as timm evaluates "
                          "them; else S / 0.875, 256 for 224)")
    own.add_argument("--interpolation", default=None, choices=INTERPOLATIONS,
                     help="with --image-size, the antialiased filter of the evaluation's resize and the training's "
                          "random-resized crops (default: the pretrained config's that came with --weights; else "
                          "bilinear)")
    add("--model", default=None, help=f"one of {', '.join(MODELS)}; torchvision:NAME, a torchvision classification "
                                      "model, untrained; timm:NAME[.TAG], any model of timm.list_models() (pip "
                                      "install timm), untrained; or MODULE:FUNCTION, your FUNCTION(channels, size, "
                                      "classes) returning an nn.Module, from PYTHONPATH or the current directory "
                                      "(default: per data set)")
    add("--weights", default="", metavar="SOURCE",
        help="start from trained weights: for torchvision:NAME a weights name of its registry (DEFAULT, "
             "IMAGENET1K_V1, ...), read from the torch hub cache; for timm:NAME[.TAG] DEFAULT, timm's pretrained "
             "weights of that tag, read from the Hugging Face cache (HF_HUB_OFFLINE honoured); for any model "
             "local-dir:FOLDER (what `hf download REPO --local-dir FOLDER` writes), or a file or URL of a state "
             "dict or of a checkpoint of this suite (its weights only). A head of another shape is replaced "
             "(docs/recipes.md)")
    add("--normalization", default="auto", choices=NORMALIZATIONS,
        help="with --weights, the mean and std images are normalized with: auto (the weights' own where they are "
             "torchvision's, by name or as a file of its registry, found by its name or its content; timm's "
             "pretrained config for DEFAULT or a local-dir folder; else the data set's statistics), data (the data "
             "set's), imagenet (ImageNet's, for weights trained on it elsewhere) (default: %(default)s)")
    add("--epochs", type=int, default=None, help="training epochs (default: per data set)")
    add("--batch-size", type=int, default=None, help="GLOBAL batch, split evenly across ranks (default: per data set)")
    add("--seed", type=int, default=0, help="seed of weights, shuffling and augmentation (default: %(default)s)")
    add("--max-steps", type=int, default=0, help="cap on optimizer steps per epoch, for smoke runs (0: no cap)")
    add("--eval-batch-size", type=int, default=None,
        help="per-rank evaluation batch (default: 64 on a CPU, where larger batches spill out of the caches; "
             "1000 on a GPU and for FSDP's full sharding)")
    add("--device", default="auto", help="auto | cpu | cuda (auto: cuda:LOCAL_RANK when there are enough GPUs)")
    add("--backend", default="auto", choices=("auto", "gloo", "nccl"),
        help="auto: nccl when every rank is on CUDA, else gloo")
    add("--transport", default="auto", choices=("auto", "shm", "gloo"),
        help="how gradient collectives travel between CPU ranks: shm (one shared-memory region per node; "
             "one node, x86-64 Linux), gloo (the process group, TCP), or auto: shm where it can serve, else the "
             "process group; GPUs always use the process group (default: %(default)s)")
    add("--timeout-s", type=float, default=300.0,
        help="process-group timeout: a dead peer ends the job after this (default: %(default)s)")
    add("--storage-timeout-s", type=float, default=STORAGE_TIMEOUT_S,
        help="the longest a node's data preparation or one of rank 0's checkpoint reads and saves may take; the "
             "other ranks wait for it outside the process group, so --timeout-s does not bound it, and a process "
             "that dies meanwhile is noticed within 30 s by its heartbeat (default: %(default)s)")
    add("--log-dir", default="", help="TensorBoard directory, or an s3:// (or other fsspec) URL (default: the "
                                      "resumed run's, or runs/<script>-<dataset>-<model>-w<world>-<time>)")
    add("--checkpoint-dir", default="", help="where checkpoints are written: a folder or an object-store URL "
                                             "(default: checkpoints/<script>-<dataset>-<model>-<run id>)")
    add("--resume", nargs="?", const="auto", default="auto",
        help="auto: continue this run (same settings) from its newest valid checkpoint in --checkpoint-dir, if any; "
             "none: start a new run (other runs' files are kept); or a checkpoint file of this run (default: auto)")
    add("--keep", type=int, default=3, help="checkpoints kept, newest first; at least 2 (default: %(default)s)")
    add("--save-every-steps", type=int, default=0, metavar="S",
        help="also save every S optimizer steps inside an epoch (epoch ends always save; 0: only those)")
    add("--log-every", type=int, default=None, help="steps between step-level TensorBoard points (default: enough for "
                                                   "at least 10 points per epoch, at most every 50 steps)")
    add("--log-all-ranks", action="store_true", help="every rank prints its console lines, tagged [rank N]")
    add("--check-equivalence", type=int, default=0, metavar="K",
        help="train K steps beside a one-process reference on the same global batches, print max |dw|, "
             "exit non-zero above 1e-5")
    add("--sync-bn", action="store_true",
        help="BatchNorm statistics over the global batch instead of each rank's share (one all-reduce per layer)")
    add("--check-replicas", type=int, default=0, metavar="N",
        help="every N steps, stop with an error if any parameter or buffer differs across ranks")
    _add_optimizer_flags(p.add_argument_group("optimizer and schedule"))
    _add_regularization_flags(p.add_argument_group("regularization"))
    recipe = p.add_argument_group("recipes")
    recipe.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                        help="autocast dtype of forward and loss; fp16 adds loss scaling (default: %(default)s)")
    recipe.add_argument("--accumulate", type=int, default=1, metavar="N",
                        help="micro-batches per optimizer step, gradients synchronized once per step; the global "
                             "batch stays --batch-size (default: %(default)s)")
    recipe.add_argument("--grad-compression", default="none", choices=("none", "fp16", "bf16", "powersgd"),
                        help="gradients on the wire: fp16/bf16 halve the bytes, powersgd (DDP only) sends a rank-1 "
                             "approximation with error feedback (default: %(default)s)")
    recipe.add_argument("--compile", action="store_true", help="torch.compile the model (the collectives stay outside)")
    recipe.add_argument("--profile", action="store_true",
                        help="trace a few steps after warm-up with torch.profiler: one Chrome/Perfetto trace per rank "
                             "next to the TensorBoard run, and the top operators on the console")
    recipe.add_argument("--memory-format", default="channels_last", choices=("channels_last", "contiguous"),
                        help="layout of images and conv weights; channels_last is faster for these nets on CPU and "
                             "GPU (default: %(default)s)")
    return p


def _add_optimizer_flags(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--optimizer", default="sgd", choices=OPTIMIZERS,
        help="sgd (nesterov momentum), adamw, lars (SGD with layer-wise trust ratios) or lamb (AdamW with them), "
             "for large batches (default: %(default)s)")
    add("--lr", type=float, default=None, help="peak learning rate (default: per data set and optimizer, scaled "
                                               "linearly with --batch-size)")
    add("--momentum", type=float, default=0.9, help="momentum of sgd and lars (default: %(default)s)")
    add("--betas", type=_floats, default=(0.9, 0.999), metavar="B1,B2",
        help="adamw and lamb's moment decays (default: 0.9,0.999)")
    add("--eps", type=float, default=1e-8, help="adamw and lamb's epsilon (default: %(default)s)")
    add("--weight-decay", type=float, default=None,
        help="decoupled for adamw and lamb (default: " + ", ".join(f"{r.weight_decay:g} for {name}" for name, r in
                                                                    OPTIMIZERS.items()) + ")")
    add("--decay-norm-and-bias", action="store_true",
        help="decay every parameter; by default norm layers' weights and all biases get no weight decay (the "
             "torchvision and timm references' practice; before it, this suite decayed everything)")
    add("--layer-decay", type=float, default=0.0, metavar="D",
        help="fine-tuning a timm:NAME model: layer-wise lr decay, each parameter's lr x D ** (depth from the head), "
             "timm's grouping by depth (BEiT's rule; 0.65-0.75 are usual for ViTs) (0: off)")
    add("--backbone-lr-scale", type=float, default=1.0, metavar="F",
        help="fine-tuning: every parameter but the classifier head trains at F x the lr (with --layer-decay's "
             "factor); 0 freezes the backbone (a linear probe), a value < 1 gives the head a higher lr than the "
             "backbone (default: %(default)s)")
    add("--schedule", default="onecycle", choices=SCHEDULES,
        help="lr schedule: onecycle, cosine, constant, or step (x --gamma at each of --milestones) "
             "(default: %(default)s)")
    add("--warmup", type=float, default=None, metavar="N",
        help="steps of linear warm-up from 1/100 of the peak lr, or a fraction of the run when < 1 (default: 0.25 "
             "for onecycle, else 0)")
    add("--extend-to", type=int, default=0, metavar="N",
        help="train a finished run of this command on to epoch N: a new segment of the schedule over the added "
             "epochs (--schedule again, its warm-up included; step keeps the lr the run ended at), from the run's "
             "last checkpoint, saved as a run of its own beside it (0: no extension)")
    add("--min-lr", type=float, default=0.0, help="the lr that onecycle and cosine end at (default: %(default)s)")
    add("--milestones", type=_ints, default=(), metavar="E1,E2,...",
        help="with --schedule step: the epochs after which the lr is multiplied by --gamma")
    add("--gamma", type=float, default=0.1, help="with --schedule step: the factor at each milestone (default: "
                                                  "%(default)s)")


def _add_regularization_flags(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--drop-path", type=float, default=0.0, metavar="P",
        help="stochastic depth of a timm:NAME model: each residual block skipped with probability up to P "
             "(timm's drop_path_rate; 0.1 is usual for fine-tuning a ViT) (0: off)")
    add("--label-smoothing", type=float, default=0.0, metavar="X",
        help="cross-entropy against (1 - X) on the label and X spread over every class (default: %(default)s)")
    add("--class-weights", default="", metavar="balanced|FILE",
        help="weight the loss by class, for an imbalanced set: balanced (the inverse class frequency of the training "
             "split, n / (classes x count), as scikit-learn's), or FILE of one weight per line in class order (also "
             "W1,W2,... inline); the weighted mean over the global batch, as CrossEntropyLoss(weight=...) at any "
             "world size (default: none)")
    add("--mixup", type=float, default=0.0, metavar="ALPHA",
        help="blend pairs of images and their labels by a Beta(ALPHA, ALPHA) weight, drawn per global batch "
             "(0: off; with --cutmix, one of the two per global batch)")
    add("--cutmix", type=float, default=0.0, metavar="ALPHA",
        help="paste a box of a paired image, labels weighted by its area, Beta(ALPHA, ALPHA) (0: off)")
    add("--augment", default="basic", choices=AUGMENTS,
        help="training augmentation: basic (the data set's crop and flip), or that plus randaugment, "
             "trivialaugment or autoaugment (ImageNet policy), drawn per sample of the global batch "
             "(default: %(default)s)")
    add("--random-erase", type=float, default=0.0, metavar="P",
        help="erase a random box of each training image with probability P (default: %(default)s)")
    add("--ema", type=float, default=0.0, metavar="DECAY",
        help="keep an exponential moving average of the weights (decay per optimizer step, with a warm-up), "
             "evaluated every epoch beside them and saved in every checkpoint (0: off)")
    add("--clip-grad-norm", type=float, default=None, metavar="MAX",
        help="scale the synchronized gradient down to this global L2 norm when above it")


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


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


def _validate(p: argparse.ArgumentParser, a: argparse.Namespace, world_size: int) -> None:
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


def _resolve_defaults(a: argparse.Namespace) -> None:
    """The defaults that depend on other flags: the data set's recipe, the optimizer's lr and decay."""
    recipe = RECIPES.get(a.dataset, RECIPES["synthetic"])
    a.model = a.model or recipe.model
    a.epochs = recipe.epochs if a.epochs is None else a.epochs
    a.batch_size = recipe.batch_size if a.batch_size is None else a.batch_size
    rule = OPTIMIZERS[a.optimizer]
    if a.lr is None:  # linear scaling; a bad --batch-size is reported by _validate, not as a bad lr
        a.lr = rule.default_lr(recipe.lr, recipe.batch_size, max(a.batch_size, 1))
    if a.weight_decay is None:
        a.weight_decay = rule.weight_decay
    if a.warmup is None:
        a.warmup = 0.25 if a.schedule == "onecycle" else 0.0


# The settings whose value changes other settings' defaults: given first, so that those follow.
LEADING = ("dataset", "optimizer", "schedule", "batch_size")


def settings_flags(identity: dict[str, Any]) -> list[str]:
    """The fewest flags that give a run's identity: its --dataset (the scripts' defaults differ) and
    each setting whose value is not the default that the flags before it give (an lr that follows
    from --batch-size is left out; so is --momentum under adamw, which does not read it). A
    strategy's own settings (not known here) follow as --NAME VALUE. Values are plain, as saved."""
    p = build_parser("any", default_dataset=identity.get("dataset") or "synthetic")
    actions = {a.dest: a for a in p._actions if a.option_strings}
    argv = ["--dataset", str(identity.get("dataset"))]
    order = [*LEADING, *(key for key in identity if key not in LEADING)]
    for key in (k for k in order if k in actions and k in identity):
        a = p.parse_args(argv)
        _resolve_defaults(a)
        default = vars(a)[key]
        if _plain(default) != identity[key]:
            argv += _flag(actions[key], identity[key])
    extra = [key for key in identity if key not in actions and identity[key] not in (None, "", False)]
    for key in extra:
        flag = "--" + key.replace("_", "-")
        argv += [flag] if identity[key] is True else [flag, str(identity[key])]
    return argv


def _plain(value: Any) -> Any:
    """A parsed value as Config.as_plain_dict keeps it (a tuple as one comma-separated string)."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else value


def _flag(action: argparse.Action, value: Any) -> list[str]:
    """The arguments that set `action`'s setting to `value`: the flag alone for an on/off flag."""
    if action.nargs == 0:
        return [action.option_strings[0]] if value == action.const else []
    return [action.option_strings[-1], str(value)]


def parse_args(argv: Sequence[str] | None = None, *, strategy: str, default_dataset: str,
               world_size: int | None = None,
               add_flags: Callable[[argparse.ArgumentParser], None] | None = None,
               identity_options: Sequence[str] = ()) -> Config:
    """Parse and validate; exits 2 with a message naming the flag on bad input.
    `add_flags` lets a strategy add its own flags; they land in Config.options. `identity_options`
    names those of them that change the trained weights (part of the run's identity)."""
    p = build_parser(strategy, default_dataset)
    if add_flags is not None:
        add_flags(p.add_argument_group(f"{strategy} strategy"))
    a = p.parse_args(argv)
    world_size = world_size_from_env() if world_size is None else world_size
    _resolve_defaults(a)
    _validate(p, a, world_size)
    common = {f.name for f in fields(Config)}
    values = vars(a)
    options = {k: v for k, v in values.items() if k not in common}
    cfg = Config(strategy=strategy, options=options, identity_options=tuple(identity_options),
                 **{k: v for k, v in values.items() if k in common})
    if not cfg.checkpoint_dir:
        cfg = replace(cfg, checkpoint_dir=default_checkpoint_dir(cfg))
    return cfg

