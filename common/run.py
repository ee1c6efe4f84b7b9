"""What a training job is made of, built once and handed around as one bundle."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from common.config import Config
from common.data import Dataset, TrainLoader
from common.distributed import DistContext
from common.strategy import Strategy


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

    @property
    def plain(self) -> nn.Module:
        """The unwrapped model: what evaluation runs and what is saved."""
        return self.strategy.unwrap(self.model)

    @property
    def steps_per_epoch(self) -> int:
        return self.loader.steps_per_epoch

    @property
    def total_steps(self) -> int:
        return self.cfg.epochs * self.steps_per_epoch

    def global_step(self, at: Position) -> int:
        return at.global_step(self.steps_per_epoch)
