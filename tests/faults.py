"""Run a train_*.py strategy with a fault injected, under torchrun, to prove the suite survives it
or catches it.

    torchrun ... tests/faults.py STRATEGY FAULT STEP [training flags]

(or a run of tests/runs.py: `tests/faults.py STRATEGY FAULT STEP [flags] --then-after-stop ...`, a
stop and what follows it in one launch)

STRATEGY: ddp, allreduce, master, dp, fsdp (--shard full), zero1 (--shard optimizer), localsgd, or
nosync (never synchronizes).
FAULT, after the STEP-th optimizer step of this process (FAULT_AT_FILE, if set, names a file that
receives rank 1's "time.time() pid" as it injects, for tests that time what follows):
  none     nothing
  sigterm  every rank sends itself SIGTERM (preemption)
  sigterm-job            rank 0 sends SIGTERM to torchrun, then to every worker (Slurm's scancel,
                         with torchrun forwarding its own copy)
  sigterm-workers-first  the same, every worker first, torchrun last
  sigint-job             rank 0 sends SIGINT to torchrun and every worker (a terminal's Ctrl-C)
  sigint-twice           the same, and again FORCE_AFTER_S + 0.5 s later (a deliberate second Ctrl-C)
FAULT at another point:
  sigterm-eval    every rank sends itself SIGTERM at its STEP-th evaluation batch
  sigterm-saving  rank 0's writer, writing the checkpoint of global step STEP, sends SIGTERM to
                  every worker and torchrun in the middle of its write (a slow store), once
                  training has passed that save's stop check
Without torchrun the job is this one process.
  sigkill  rank 1 SIGKILLs itself, on torchrun's first attempt only
  raise    rank 1 raises RuntimeError
  segfault rank 1 dies of SIGSEGV (a crash in native code)
  drift    rank 1 nudges one weight (the replicas drift apart)
  warn     rank 1 issues a Python warning
"""
from __future__ import annotations  # noqa: I001 - ruff wants a blank line above `# isort: split`, test_layout none

import tests.training_program  # noqa: F401 - first: the collector as in a train_*.py program (its docstring)
# isort: split
import ctypes
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from common.parallel import procs
from common.train.app import main as run
from common.train.checkpoint import CheckpointFolder
from common.train.precision import Precision
from common.train.preemption import FORCE_AFTER_S
from common.train.run import Position
from common.train.strategy import Strategy
from common.train.trainer import Trainer
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


def job(torchrun_first: bool = True) -> list[int]:
    """torchrun (this rank's parent) and every worker it started, in the order the signals land."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return [os.getpid()]
    torchrun = os.getppid()
    workers = procs.children(torchrun)
    assert os.getpid() in workers, (torchrun, workers)  # this process is one of them: else the list is wrong
    return [torchrun, *workers] if torchrun_first else [*workers, torchrun]


def signal_job(signum: int, torchrun_first: bool = True) -> None:
    for pid in job(torchrun_first):
        os.kill(pid, signum)


def inject(fault: str, optimizer: torch.optim.Optimizer) -> None:
    rank = dist.get_rank()
    # torchrun's attempt: "0", or "0.runK" for run K of tests/runs.py on the first attempt
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").split(".")[0] == "0"
    if rank == 1 and os.environ.get("FAULT_AT_FILE") and (fault != "sigkill" or first_attempt):
        Path(os.environ["FAULT_AT_FILE"]).write_text(f"{time.time()!r} {os.getpid()}")
    if fault == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif fault in ("sigterm-job", "sigterm-workers-first") and rank == 0:
        signal_job(signal.SIGTERM, torchrun_first=fault == "sigterm-job")
    elif fault in ("sigint-job", "sigint-twice") and rank == 0:
        signal_job(signal.SIGINT)
        if fault == "sigint-twice":
            time.sleep(FORCE_AFTER_S + 0.5)  # the pause under test: a deliberate second Ctrl-C comes this late
            print(f"second SIGINT sent at {time.time():.3f}", file=sys.stderr, flush=True)
            signal_job(signal.SIGINT)
    elif fault == "sigkill" and rank == 1 and first_attempt:
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "raise" and rank == 1:
        raise RuntimeError("injected failure on rank 1")
    elif fault == "segfault" and rank == 1:
        ctypes.string_at(0)  # reads address 0
    elif fault == "drift" and rank == 1:
        _nudge(optimizer)
    elif fault == "warn" and rank == 1:
        warnings.warn("injected warning on rank 1", stacklevel=1)


def signal_during_evaluation(model: torch.nn.Module, at_batch: int) -> None:
    batches = 0

    def count(module: torch.nn.Module, args: object) -> None:
        nonlocal batches
        if not module.training:
            batches += 1
            if batches == at_batch:
                os.kill(os.getpid(), signal.SIGTERM)
    model.register_forward_pre_hook(count)


def signal_during_save(global_step: int) -> None:
    """Rank 0's checkpoint writer (only rank 0 writes) slows down and signals the job mid-write, once
    rank 0's training has passed that save's stop check (a collective: every rank has), so that the
    signal counts at the next save, which waits for this write, on a host of any speed."""
    write, save = CheckpointFolder.write, Trainer.save
    checked = threading.Event()

    def save_then_mark(self: Trainer, at: Position, wait: bool, check_stop: bool = True) -> str:
        path = save(self, at, wait, check_stop)
        if self.run.global_step(at) == global_step:
            checked.set()
        return path

    def slow_write(self: CheckpointFolder, run: str, state: dict, previous: str | None = None) -> str:
        if state["global_step"] == global_step:
            checked.wait(timeout=120)  # bounded: a save that waits for its own write would never mark it
            signal_job(signal.SIGTERM, torchrun_first=False)  # a slow store's write, signalled halfway
            time.sleep(0.5)  # the write's second half
        return write(self, run, state, previous)
    CheckpointFolder.write, Trainer.save = slow_write, save_then_mark


def faulty(base: type[Strategy], fault: str, at_step: int) -> Strategy:
    class Faulty(base):  # type: ignore[misc, valid-type]
        steps = 0

        def wrap(self, model: torch.nn.Module, ctx):  # the plain model: what evaluation runs
            if fault == "sigterm-eval":
                signal_during_evaluation(model, at_step)
            return super().wrap(model, ctx)

        def step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
            super().step(optimizer, precision)
            self.steps += 1
            if self.steps == at_step:
                inject(fault, optimizer)

    return Faulty()


def main(argv: list[str] | None = None) -> None:
    """argv: STRATEGY FAULT STEP and the training flags (default: this program's)."""
    name, fault, step, *flags = sys.argv[1:] if argv is None else argv
    if fault == "sigterm-saving":
        if argv is not None:  # a patch of CheckpointFolder that would outlive this run
            raise SystemExit("error: tests/faults.py: sigterm-saving patches every later save of its process; "
                             "give it a launch of its own")
        signal_during_save(int(step))
    run(faulty(STRATEGIES[name], fault, int(step)), flags)


if __name__ == "__main__":
    main()
