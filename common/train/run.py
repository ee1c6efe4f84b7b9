"""What a training job is made of, built once and handed around as one bundle."""
from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from common.config import Config
from common.data.geometry import Resampling
from common.data.loader import Dataset, TrainLoader
from common.parallel.context import DistContext
from common.train.ema import EMA
from common.train.mixing import Mixing
from common.train.precision import Precision
from common.train.strategy import Strategy

AUTO_POINTS_PER_EPOCH = 10  # --log-every left unset: at least this many step-level points per epoch
AUTO_MAX_INTERVAL = 50
DEFAULT_MEMORY_FORMAT = "channels_last"  # --memory-format's default (what bench pipeline hands the model too)
# --eval-batch-size left unset. On a CPU a batch's activations should stay in the caches: one core
# scores the convnet's test images 1.6-2.2x faster in batches of 32-128 than in batches of 500.
# A strategy whose forward is itself a collective (FSDP) keeps the large batch: each forward
# all-gathers the weights, so smaller batches would multiply those collectives.
EVAL_BATCH_LARGE, EVAL_BATCH_CPU = 1000, 64


def add_run_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flags of the run's length, batch and seed."""
    add = group.add_argument
    add("--epochs", type=int, default=None, help="training epochs (default: per data set)")
    add("--batch-size", type=int, default=None, help="GLOBAL batch, split evenly across ranks (default: per data set)")
    add("--seed", type=int, default=0, help="seed of weights, shuffling and augmentation (default: %(default)s)")
    add("--max-steps", type=int, default=0, help="cap on optimizer steps per epoch, for smoke runs (0: no cap)")
    add("--eval-batch-size", type=int, default=None,
        help="per-rank evaluation batch (default: 64 where any rank is on a CPU, where larger batches spill out of "
             "the caches; 1000 where every rank is on a GPU, and for FSDP's full sharding: one size for the job)")


def check_run_flags(p: argparse.ArgumentParser, a: argparse.Namespace, world_size: int) -> None:
    if a.batch_size < 1:
        p.error(f"--batch-size must be >= 1 (got {a.batch_size})")
    if a.batch_size % world_size:
        p.error(f"--batch-size {a.batch_size} is the global batch and must divide evenly across the "
                f"world size {world_size}; use a multiple of {world_size}")
    if a.epochs < 1:
        p.error(f"--epochs must be >= 1 (got {a.epochs})")


def add_model_placement_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flags of how the model is laid out and compiled (torch_memory_format)."""
    add = group.add_argument
    add("--compile", action="store_true", help="torch.compile the model (the collectives stay outside)")
    add("--deterministic", action="store_true",
        help="on a GPU, the same kernels in every process (torch.use_deterministic_algorithms, cuDNN's benchmark "
             "off): a resumed run's weights then equal the uninterrupted run's bit for bit, as on a CPU, at some speed")
    add("--memory-format", default=DEFAULT_MEMORY_FORMAT, choices=("channels_last", "contiguous"),
        help="layout of images and conv weights; channels_last is faster for these nets on CPU and "
             "GPU (default: %(default)s)")


def check_model_placement_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.compile and a.device != "cuda" and not _cpp_compiler():
        p.error("--compile on the CPU needs a C++ compiler for TorchInductor, and none was found (g++, c++, "
                "clang++ or $CXX): install one (Debian/Ubuntu: apt-get install g++) or drop --compile")


def _cpp_compiler() -> str | None:
    return next(filter(None, (shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)),
                None)


def torch_memory_format(name: str) -> torch.memory_format:
    """--memory-format's value (as a Config or a checkpoint's config holds it) as torch's layout."""
    return torch.channels_last if name == "channels_last" else torch.contiguous_format


def default_eval_batch(devices: Sequence[str], collective_forward: bool = False) -> int:
    """--eval-batch-size left unset: cache-sized where any rank (`devices`: every rank's device type)
    is on a CPU, unless each forward is a collective. One size for the whole job: every rank runs as
    many evaluation batches, and the stop is checked at the same ones (a CUDA rank beside a CPU one
    that took its own default aborted gloo with a collective mismatch)."""
    if not devices:  # a DistContext made outside distributed(): no device in it would read as no CPU
        raise ValueError("default_eval_batch: no rank's device type is known (DistContext.devices is empty: "
                         "distributed() gathers it); pass every rank's, or an --eval-batch-size")
    return EVAL_BATCH_CPU if "cpu" in devices and not collective_forward else EVAL_BATCH_LARGE


@dataclass(frozen=True)
class Position:
    """Where training stands: `step` optimizer steps of epoch `epoch` (0-based) are done."""

    epoch: int
    step: int

    def global_step(self, steps_per_epoch: int) -> int:
        return self.epoch * steps_per_epoch + self.step


@dataclass
class Run:
    cfg: Config
    ctx: DistContext
    strategy: Strategy
    data: Dataset
    loader: TrainLoader
    model: nn.Module  # as wrapped by the strategy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    compiled: nn.Module | None = None  # torch.compile(model) with --compile: what the training step calls
    ema: EMA | None = None  # --ema: the moving average of the weights
    mixing: Mixing | None = None  # --mixup / --cutmix
    pretrained: dict | None = None  # the data config that came with --weights (timm's), for the checkpoint
    resampling: Resampling = Resampling()  # --image-size's crop fraction and filter, as chosen (for the checkpoint)
    class_weights: torch.Tensor | None = None  # --class-weights, one per class on the device (common/train/step.py)

    @property
    def plain(self) -> nn.Module:
        """The unwrapped model: what evaluation runs and what is saved."""
        return self.strategy.unwrap(self.model)

    @property
    def step_model(self) -> nn.Module:
        return self.compiled if self.compiled is not None else self.model

    @property
    def memory_format(self) -> torch.memory_format:
        return torch_memory_format(self.cfg.memory_format)

    @property
    def log_every(self) -> int:
        """--log-every, or an interval that gives every epoch, however short, a curve."""
        if self.cfg.log_every:
            return self.cfg.log_every
        return max(1, min(AUTO_MAX_INTERVAL, self.steps_per_epoch // AUTO_POINTS_PER_EPOCH))

    @property
    def eval_batch_size(self) -> int:
        return self.cfg.eval_batch_size or default_eval_batch(self.ctx.devices, self.strategy.collective_forward)

    @property
    def steps_per_epoch(self) -> int:
        return self.loader.steps_per_epoch

    @property
    def total_steps(self) -> int:
        return self.cfg.last_epoch * self.steps_per_epoch

    def global_step(self, at: Position) -> int:
        return at.global_step(self.steps_per_epoch)
