"""Hand-written gradient averaging with all_reduce, done the way DDP does it: flattened buckets,
each launched from a backward hook as soon as its gradients are ready, waited on before the step.

    torchrun --standalone --nproc_per_node=2 train_allreduce.py [--allreduce torch|ring|per-param]
"""
from __future__ import annotations  # noqa: I001 - ruff wants a blank line above `# isort: split`, test_layout none

# First, before torch and any sorted block: importing `common` pauses the garbage collector while torch
# loads, and registers the collector's exit handler before any other (common/collector.py says why).
# `isort: split` keeps an import sorter (isort, ruff's I rules) from moving torch above this line.
from common.train.app import main as run
# isort: split
import argparse

from torch import nn

from common.config import Config
from common.errors import ConfigError
from common.parallel.comm import GradientBuckets, PerParameterAllReduce, float_buffers, launch_all_reduce
from common.parallel.context import DistContext
from common.train.strategy import HandWrittenSync


class AllReduceStrategy(HandWrittenSync):
    name = "allreduce"
    default_dataset = "mnist"

    @classmethod
    def add_flags(cls, group: argparse._ArgumentGroup) -> None:
        super().add_flags(group)
        group.add_argument("--allreduce", default="torch", choices=("torch", "ring", "gather", "per-param"),
                           help="torch: dist.all_reduce per bucket; ring: the hand-written ring all-reduce; gather: "
                                "one all_gather round and a local sum (fewer round trips, for small buckets); "
                                "per-param: the tutorials' blocking all_reduce per parameter after backward "
                                "(a baseline, slow) (default: %(default)s)")

    def configure(self, cfg: Config) -> None:
        super().configure(cfg)
        self.mode = cfg.options["allreduce"]
        self.uses_transport = self.mode == "torch"  # ring, gather and per-param are written on the process group
        if self.mode == "per-param" and self.wire_dtype is not None:
            raise ConfigError("--allreduce per-param is the tutorials' uncompressed baseline; drop "
                              "--grad-compression, or use the buckets (--allreduce torch or ring)")

    def describe(self) -> str:
        return f"allreduce/{self.mode}{self.compressed()}"

    def make_sync(self, model: nn.Module, ctx: DistContext) -> GradientBuckets | PerParameterAllReduce:
        if self.mode == "per-param":
            return PerParameterAllReduce(model, scale=1.0 / ctx.world_size, device=ctx.comm_device)
        return GradientBuckets(model, self.bucket_mb, launch_all_reduce(self.mode, ctx.transport), rank=ctx.rank,
                               device=ctx.comm_device, scale=1.0 / ctx.world_size, root_buffers=float_buffers(model),
                               wire_dtype=self.wire_dtype)


def main(argv: list[str] | None = None) -> None:
    run(AllReduceStrategy(), argv)


if __name__ == "__main__":
    main()
