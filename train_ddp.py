"""DistributedDataParallel: gradients are averaged in buckets, overlapped with backward, by DDP itself.

    torchrun --standalone --nproc_per_node=2 train_ddp.py
"""
from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from common.app import main as run
from common.distributed import DistContext
from common.strategy import Strategy


class DDPStrategy(Strategy):
    name = "ddp"
    default_dataset = "cifar10"

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module


def main(argv: list[str] | None = None) -> None:
    run(DDPStrategy(), argv)


if __name__ == "__main__":
    main()
