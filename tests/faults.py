"""Run a train_*.py strategy with a fault injected, under torchrun, to prove the suite survives it
or catches it.

    torchrun ... tests/faults.py STRATEGY FAULT STEP [training flags]

STRATEGY: ddp, allreduce, master, dp, fsdp (--shard full), zero1 (--shard optimizer), localsgd, or
nosync (never synchronizes).
FAULT, after the STEP-th optimizer step of this process:
  none     nothing
  sigterm  every rank sends itself SIGTERM (preemption)
  sigkill  rank 1 SIGKILLs itself, on torchrun's first attempt only
  raise    rank 1 raises RuntimeError
  drift    rank 1 nudges one weight (the replicas drift apart)
  warn     rank 1 issues a Python warning
"""
from __future__ import annotations

import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist

from common.train.app import main as run
from common.train.precision import Precision
from common.train.strategy import Strategy
from train_allreduce import AllReduceStrategy
from train_ddp import DDPStrategy
from train_dp import DataParallelStrategy
from train_fsdp import FullShard, ZeroOne
from train_localsgd import LocalSGDStrategy
from train_master import MasterWorkerStrategy


class NoSync(Strategy):
    name = "nosync"


STRATEGIES = {"ddp": DDPStrategy, "allreduce": AllReduceStrategy, "master": MasterWorkerStrategy,
              "dp": DataParallelStrategy, "fsdp": FullShard, "zero1": ZeroOne, "localsgd": LocalSGDStrategy,
              "nosync": NoSync}


def _nudge(optimizer: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        optimizer.param_groups[0]["params"][2].add_(1e-3)


def inject(fault: str, optimizer: torch.optim.Optimizer) -> None:
    rank = dist.get_rank()
    if fault == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif fault == "sigkill" and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "raise" and rank == 1:
        raise RuntimeError("injected failure on rank 1")
    elif fault == "drift" and rank == 1:
        _nudge(optimizer)
    elif fault == "warn" and rank == 1:
        warnings.warn("injected warning on rank 1", stacklevel=1)


def faulty(base: type[Strategy], fault: str, at_step: int) -> Strategy:
    class Faulty(base):  # type: ignore[misc, valid-type]
        steps = 0

        def step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
            super().step(optimizer, precision)
            self.steps += 1
            if self.steps == at_step:
                inject(fault, optimizer)

    return Faulty()


if __name__ == "__main__":
    name, fault, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    del sys.argv[1:4]
    run(faulty(STRATEGIES[name], fault, step))
