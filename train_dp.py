"""nn.DataParallel: ONE process scatters each global batch over the visible GPUs and gathers the
outputs; gradients are summed onto the first GPU by autograd. On a CPU-only host it runs on the CPU.

    python train_dp.py [--gpus 0,1]
"""
from __future__ import annotations

from common.train.app import main as run
from common.train.strategy import Strategy
from common.config import Config
from common.dist.context import DistContext
from common.errors import ConfigError

import argparse
import os

from torch import nn


class DataParallelStrategy(Strategy):
    name = "dp"
    default_dataset = "cifar10"

    @classmethod
    def add_flags(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--gpus", default="", help="comma list of GPU ids to use (default: all visible)")

    def configure(self, cfg: Config) -> None:
        super().configure(cfg)
        if cfg.options["gpus"]:  # set before CUDA starts; the chosen GPUs become cuda:0, cuda:1, ...
            os.environ["CUDA_VISIBLE_DEVICES"] = cfg.options["gpus"]

    def compression_hint(self) -> str:
        return ("nn.DataParallel sums gradients inside one process, over no network: drop --grad-compression, or "
                "use train_ddp.py or train_allreduce.py")

    def check_world(self, world_size: int) -> None:
        if world_size > 1:
            raise ConfigError(f"train_dp.py runs as one process (nn.DataParallel splits each batch over the GPUs "
                              f"inside it), but torchrun started {world_size}: run `python train_dp.py`, or "
                              "`torchrun --nproc_per_node=1 train_dp.py`; for one process per GPU use train_ddp.py")

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        return nn.DataParallel(model)  # on a CPU-only host: a pass-through

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module


def main(argv: list[str] | None = None) -> None:
    run(DataParallelStrategy(), argv)


if __name__ == "__main__":
    main()
