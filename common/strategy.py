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
    identity_options: tuple[str, ...] = ()  # the strategy's flags that change the trained weights

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
        """Called once, before the optimizer is built and a checkpoint (if any) is loaded."""
        return model

    def after_backward(self, model: nn.Module) -> None:
        """Make gradients equal on every rank before the optimizer sees them. Time spent here is
        logged as time/sync_ms: the synchronization that backward did not hide."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model: what is saved (no 'module.' prefix) and what evaluation runs."""
        return model

    # Checkpoints hold the plain model's full state dict and a full optimizer state, whatever the
    # strategy, so any script resumes any other's checkpoint at any world size. A strategy that
    # shards state gathers it here (called on every rank: may be a collective) and re-shards on load.

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return self.unwrap(model).state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        self.unwrap(model).load_state_dict(state)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)


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
