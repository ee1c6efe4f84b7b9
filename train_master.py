"""Master/worker: gradients are summed onto rank 0 with reduce, averaged there and sent back with
broadcast, in buckets launched from backward hooks.

    torchrun --standalone --nproc_per_node=2 train_master.py [--master-update]

--master-update is parameter-server style: only rank 0 keeps optimizer state and steps, then
broadcasts the updated parameters.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common.app import main as run
from common.comm import Bucket, GradientBuckets, Handle, broadcast_coalesced, float_buffers, launch_reduce_to_root
from common.distributed import DistContext
from common.strategy import HandWrittenSync


class MasterWorkerStrategy(HandWrittenSync):
    name = "master"
    default_dataset = "mnist"

    @classmethod
    def add_flags(cls, group: argparse._ArgumentGroup) -> None:
        super().add_flags(group)
        group.add_argument("--master-update", action="store_true",
                           help="only rank 0 holds optimizer state and steps; it broadcasts the new parameters")

    def configure(self, options: dict[str, Any]) -> None:
        super().configure(options)
        self.master_update = options["master_update"]

    def describe(self) -> str:
        return "master/update" if self.master_update else "master"

    def make_sync(self, model: nn.Module, ctx: DistContext) -> GradientBuckets:
        self.is_master = ctx.is_primary
        if self.master_update:  # only rank 0 needs the average; it sends parameters and buffers after its step
            self.replicated, self.device = [*model.parameters(), *float_buffers(model)], ctx.comm_device
            return GradientBuckets(model, self.bucket_mb, launch_reduce_to_root, rank=ctx.rank, device=ctx.comm_device,
                                   scale=1.0 / ctx.world_size)

        def average_on_master_then_broadcast(bucket: Bucket) -> Handle:
            bucket.grads.div_(ctx.world_size)  # meaningful on rank 0; the broadcast overwrites the others
            return dist.broadcast(bucket.flat, src=0, async_op=True)

        return GradientBuckets(model, self.bucket_mb, launch_reduce_to_root, rank=ctx.rank, device=ctx.comm_device,
                               then=average_on_master_then_broadcast, root_buffers=float_buffers(model))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.master_update:
            optimizer.step()
            return
        if self.is_master:  # workers' gradients are partial sums: only the master may step
            optimizer.step()
        broadcast_coalesced(self.replicated, self.device)


def main(argv: list[str] | None = None) -> None:
    run(MasterWorkerStrategy(), argv)


if __name__ == "__main__":
    main()
