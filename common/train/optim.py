"""Optimizer and learning-rate schedule of the default recipe."""
from __future__ import annotations

import math

from typing import Iterable

import torch

from common.config import Config

WARMUP = 0.25  # share of the steps spent rising to the peak lr in the one-cycle schedule


def make_optimizer(cfg: Config, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0,
                           weight_decay=cfg.weight_decay)


def lr_factor(schedule: str, step: int, total: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` of `total`.

    one-cycle: linear rise from 1/25 of the peak over the first 25% of the steps, then cosine to 0.
    """
    progress = min(step, total) / max(total, 1)
    if schedule == "onecycle":
        if progress < WARMUP:
            return 0.04 + 0.96 * progress / WARMUP
        return 0.5 * (1 + math.cos(math.pi * (progress - WARMUP) / (1 - WARMUP)))
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per optimizer step. A pure function of the step, so a checkpoint stores only the
    step count, and a resumed run with more --epochs stretches the schedule instead of failing."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg.schedule, step, total_steps))
