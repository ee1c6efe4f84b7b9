"""The seam between the shared training loop and the four ways of synchronizing gradients.

The loop calls only these methods; each train_*.py implements them. common/ never asks which
strategy it runs.
"""
from __future__ import annotations

import torch
from torch import nn

from common.distributed import DistContext


class Strategy:
    """Defaults describe a strategy that needs no help: override what yours does differently."""

    name: str = "base"
    default_dataset: str = "cifar10"

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        """Called once, after the checkpoint is loaded into the plain model."""
        return model

    def after_backward(self, model: nn.Module) -> None:
        """Make gradients equal on every rank before the optimizer sees them."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model: what is saved (no 'module.' prefix) and what evaluation runs."""
        return model
