"""The seam between the shared training loop and the four ways of synchronizing gradients.

The loop calls only these methods; each train_*.py implements them. common/ never asks which
strategy it runs.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from common.distributed import DistContext
from common.errors import ConfigError


class Strategy:
    """Defaults describe a strategy that needs no help: override what yours does differently."""

    name: str = "base"
    default_dataset: str = "cifar10"

    @classmethod
    def add_flags(cls, group: argparse._ArgumentGroup) -> None:
        """The strategy's own flags; their values arrive in configure()."""

    def configure(self, options: dict[str, Any]) -> None:
        pass

    def describe(self) -> str:
        """Name plus the options that change how it synchronizes, for logs and reports."""
        return self.name

    def check_world(self, world_size: int) -> None:
        """Raise ConfigError if the strategy cannot run at this world size (before anything starts)."""

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        """Called once, after the checkpoint is loaded into the plain model."""
        return model

    def after_backward(self, model: nn.Module) -> None:
        """Make gradients equal on every rank before the optimizer sees them. Time spent here is
        logged as time/sync_ms: the synchronization that backward did not hide."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model: what is saved (no 'module.' prefix) and what evaluation runs."""
        return model


class HandWrittenSync(Strategy):
    """What train_allreduce.py and train_master.py share: replicas start from rank 0's weights,
    and a gradient synchronizer built by the subclass runs after backward (it also keeps the
    BatchNorm buffers equal to rank 0's, as DDP does)."""

    @classmethod
    def add_flags(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--bucket-mb", type=float, default=25.0,
                           help="gradient bucket size in MB; each bucket is one collective (default: %(default)s)")

    def configure(self, options: dict[str, Any]) -> None:
        if options["bucket_mb"] <= 0:
            raise ConfigError(f"--bucket-mb must be > 0 (got {options['bucket_mb']})")
        self.bucket_mb = options["bucket_mb"]

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        from common.comm import replicate_from_rank0

        replicate_from_rank0(model, ctx.comm_device)
        self.sync = self.make_sync(model, ctx)
        return model

    def make_sync(self, model: nn.Module, ctx: DistContext) -> Any:
        """An object whose finish() leaves every rank with the averaged gradients."""
        raise NotImplementedError

    def after_backward(self, model: nn.Module) -> None:
        self.sync.finish()
