"""--ema DECAY: an exponential moving average of the weights, kept where the strategy keeps them.

Each rank averages the tensors it updates (Strategy.ema_tensors: the parameters and BatchNorm's
running statistics; under ZeRO-1 and FSDP2 its shard), so the average costs 1/W of the model per
rank where training does. It is evaluated and saved by swapping it into the model (the strategy
then gathers or spreads it as it does the weights), so checkpoints hold it as a full state dict
that resumes at any world size. Local SGD's replicas differ between averagings: the EMA follows
the averaged model, updated at each averaging with the decay of the steps since the last.
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from common.train.strategy import Strategy

WARMUP = 10  # the decay rises as (1 + n) / (WARMUP + n) over the first updates (timm's, TensorFlow's)


def add_ema_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flag of EMA."""
    group.add_argument("--ema", type=float, default=0.0, metavar="DECAY",
                       help="keep an exponential moving average of the weights (decay per optimizer step, with a "
                            "warm-up), evaluated every epoch beside them and saved in every checkpoint (0: off)")


class EMA:
    def __init__(self, decay: float, strategy: Strategy, model: nn.Module) -> None:
        self.decay, self.strategy, self.model = decay, strategy, model
        self.shadow = [t.detach().clone() for t in self._tensors()]
        self.steps = 0  # optimizer steps the average has followed

    def _tensors(self) -> list[torch.Tensor]:
        return self.strategy.ema_tensors(self.model)

    def decay_at(self, step: int) -> float:
        """The decay of optimizer step `step` (1-based): low at first, so the average does not keep
        the initial weights for thousands of steps."""
        return min(self.decay, (1 + step) / (WARMUP + step))

    @torch.no_grad()
    def update(self, global_step: int) -> None:
        """After optimizer step `global_step`, once the replicas are equal: the steps since the last
        update at once (their decays multiplied), as the weights did not change between them."""
        kept = 1.0
        for step in range(self.steps + 1, global_step + 1):
            kept *= self.decay_at(step)
        self.steps = global_step
        torch._foreach_lerp_(self.shadow, [t.detach() for t in self._tensors()], 1.0 - kept)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The model holds the average inside the block, its own weights again after it."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for live, average in zip(self._tensors(), self.shadow):
            held = live.detach().clone()
            live.copy_(average)
            average.copy_(held)
        self.strategy.spread(self.model)

    def state(self) -> dict[str, torch.Tensor]:
        """A collective: the average as a full state dict of the plain model (rank 0's buffers),
        copied (a plain model's state dict holds its live tensors, which the swap back restores)."""
        with self.swapped():
            self.strategy.consolidate(self.model)
            return {name: t.detach().clone() for name, t in self.strategy.model_state(self.model).items()}

    def load(self, state: dict[str, torch.Tensor], steps: int) -> None:
        with self.swapped():
            self.strategy.load_model_state(self.model, state)
        self.steps = steps
