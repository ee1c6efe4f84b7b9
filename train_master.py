"""Master/worker: gradients are summed onto rank 0 with reduce, averaged there and sent back with
broadcast, in buckets launched from backward hooks.

    torchrun --standalone --nproc_per_node=2 train_master.py [--master-update]

--master-update is parameter-server style: only rank 0 keeps optimizer state and steps, then
broadcasts the updated parameters.
"""
from __future__ import annotations  # noqa: I001 - ruff wants a blank line above `# isort: split`, test_layout none

# First, before torch and any sorted block: importing `common` pauses the garbage collector while torch
# loads, and registers the collector's exit handler before any other (common/collector.py says why).
# `isort: split` keeps an import sorter (isort, ruff's I rules) from moving torch above this line.
from common.train.app import main as run
# isort: split
import argparse

import torch
from torch import nn

from common.config import Config
from common.parallel.comm import Bucket, GradientBuckets, broadcast_coalesced, float_buffers
from common.parallel.context import DistContext
from common.parallel.transport import Handle
from common.train.precision import Precision
from common.train.strategy import HandWrittenSync


class MasterWorkerStrategy(HandWrittenSync):
    name = "master"
    default_dataset = "mnist"

    @classmethod
    def add_flags(cls, group: argparse._ArgumentGroup) -> None:
        super().add_flags(group)
        group.add_argument("--master-update", action="store_true",
                           help="only rank 0 holds optimizer state and steps; it broadcasts the new parameters")

    def configure(self, cfg: Config) -> None:
        super().configure(cfg)
        self.master_update = cfg.options["master_update"]

    def describe(self) -> str:
        return ("master/update" if self.master_update else "master") + self.compressed()

    def make_sync(self, model: nn.Module, ctx: DistContext) -> GradientBuckets:
        """Each rank's gradients, divided by W, are summed onto rank 0 (the average), then sent back."""
        self.is_master, self.device, self.transport = ctx.is_primary, ctx.comm_device, ctx.transport
        if self.master_update:  # only rank 0 needs the average; it sends parameters and buffers after its step
            self.sent_by_master = [*model.parameters(), *float_buffers(model)]
            return GradientBuckets(model, self.bucket_mb, ctx.transport.reduce, rank=ctx.rank, device=ctx.comm_device,
                                   scale=1.0 / ctx.world_size, wire_dtype=self.wire_dtype)

        def broadcast_average(bucket: Bucket) -> Handle:
            return ctx.transport.broadcast(bucket.flat, 0)

        return GradientBuckets(model, self.bucket_mb, ctx.transport.reduce, rank=ctx.rank, device=ctx.comm_device,
                               scale=1.0 / ctx.world_size, then=broadcast_average, root_buffers=float_buffers(model),
                               wire_dtype=self.wire_dtype)

    def step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        if not self.master_update:
            precision.step(optimizer)
            return
        if self.is_master:  # workers' gradients are partial sums: only the master may step
            precision.step(optimizer)
        # The master's parameters, buffers and (fp16) loss scale: the workers take all three.
        scale = torch.tensor([precision.scale()], dtype=torch.float32, device=self.device)
        broadcast_coalesced([*self.sent_by_master, scale], self.device, transport=self.transport)
        if not self.is_master and precision.scaler:  # read only with fp16: on a GPU the read waits for the step
            precision.follow(scale.item())


def main(argv: list[str] | None = None) -> None:
    run(MasterWorkerStrategy(), argv)


if __name__ == "__main__":
    main()
