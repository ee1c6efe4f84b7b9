"""Deliberately broken strategies, run under torchrun by the tests to prove the checks can fail.

    torchrun ... tests/broken_strategies.py nosync|drift [training flags]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.app import main as run  # noqa: E402
from common.strategy import Strategy  # noqa: E402
from train_allreduce import AllReduceStrategy  # noqa: E402


class NoSync(Strategy):
    """Never averages gradients: each rank trains on its own shard only."""

    name = "nosync"


class DriftingReplica(AllReduceStrategy):
    """A correct strategy, except that rank 1 nudges one weight after its third step."""

    name = "drift"
    steps = 0

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        super().step(optimizer)
        self.steps += 1
        if self.steps == 3 and dist.get_rank() == 1:
            with torch.no_grad():
                optimizer.param_groups[0]["params"][2].add_(1e-3)


if __name__ == "__main__":
    strategy = {"nosync": NoSync, "drift": DriftingReplica}[sys.argv.pop(1)]()
    run(strategy)
