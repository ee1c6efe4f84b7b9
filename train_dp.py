"""nn.DataParallel: ONE process scatters each global batch over the visible GPUs and gathers the
outputs; gradients are summed onto the first GPU by autograd. On a CPU-only host it runs on the CPU.

    python train_dp.py [--gpus 0,1]
"""
from __future__ import annotations  # noqa: I001 - ruff wants a blank line above `# isort: split`, test_layout none

# First, before torch and any sorted block: importing `common` pauses the garbage collector while torch
# loads, and registers the collector's exit handler before any other (common/collector.py says why).
# `isort: split` keeps an import sorter (isort, ruff's I rules) from moving torch above this line.
from common.train.app import main as run
# isort: split
import argparse
import os

import torch
from torch import nn

from common.config import Config
from common.errors import ConfigError
from common.parallel.context import DistContext
from common.train.precision import PRECISIONS
from common.train.strategy import Strategy


class DataParallelStrategy(Strategy):
    name = "dp"
    default_dataset = "cifar10"

    @classmethod
    def add_flags(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--gpus", default="", help="comma list of GPU ids to use (default: all visible)")

    def configure(self, cfg: Config) -> None:
        super().configure(cfg)
        if cfg.options["gpus"]:
            choose_gpus(cfg.options["gpus"], cfg.device)
        self.autocast_dtype = PRECISIONS[cfg.precision]

    def compression_hint(self) -> str:
        return ("nn.DataParallel sums gradients inside one process, over no network: drop --grad-compression, or "
                "use train_ddp.py or train_allreduce.py")

    def check_world(self, world_size: int) -> None:
        if world_size > 1:
            raise ConfigError(f"train_dp.py runs as one process (nn.DataParallel splits each batch over the GPUs "
                              f"inside it), but torchrun started {world_size}: run `python train_dp.py`, or "
                              "`torchrun --nproc_per_node=1 train_dp.py`; for one process per GPU use train_ddp.py")

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        return nn.DataParallel(ReplicaAutocast(model, self.autocast_dtype))  # on a CPU-only host: a pass-through

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module.module


def choose_gpus(gpus: str, device: str) -> None:
    """--gpus as CUDA_VISIBLE_DEVICES, set before CUDA starts (the chosen GPUs become cuda:0, cuda:1, ...).
    CUDA reads the list up to its first bad entry and --device auto falls back to the CPU: a typo
    (0,l) would train on fewer GPUs, or on the CPU, silently."""
    ids = gpus.split(",")
    if device == "cpu" or not all(i.isdigit() or i.startswith(("GPU-", "MIG-")) for i in ids):
        raise ConfigError(f"--gpus {gpus}: give GPU ids as nvidia-smi lists them (numbers or GPU-/MIG- UUIDs), "
                          "comma-separated, without --device cpu")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    if torch.cuda.device_count() < len(ids):
        raise ConfigError(f"--gpus {gpus}: {torch.cuda.device_count()} of these {len(ids)} GPU(s) are visible on "
                          "this host; give the ids nvidia-smi lists, or leave --gpus out for all of them")


class ReplicaAutocast(nn.Module):
    """nn.DataParallel runs each GPU's replica in a thread of its own and enters autocast there with
    that thread's default dtype (float16 on CUDA), not the run's: --precision bf16 would run the
    replicas in fp16, with no loss scaling. This restates the run's dtype inside the replica."""

    def __init__(self, module: nn.Module, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.dtype is None or not torch.is_autocast_enabled(images.device.type):
            return self.module(images)
        with torch.autocast(images.device.type, dtype=self.dtype):
            return self.module(images)


def main(argv: list[str] | None = None) -> None:
    run(DataParallelStrategy(), argv)


if __name__ == "__main__":
    main()
