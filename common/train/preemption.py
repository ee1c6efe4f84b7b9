"""SIGTERM / SIGINT: every rank stops at the same step boundary, after a checkpoint.

A signal only sets a flag. Every CHECK_EVERY steps the flag is all-reduced (MAX) asynchronously as
a step starts, so the round trip hides behind the step, and read at its end: every rank sees the
same verdict after the same step, at most CHECK_EVERY steps after the signal. torchrun forwards
SIGTERM to its workers and kills them 30 s later. The same check carries rank 0's news that a
checkpoint written in the background failed (SAVE_FAILED, above every signal number).
"""
from __future__ import annotations

import signal
from typing import Callable

import torch
import torch.distributed as dist

from common.dist.context import DistContext
from common.errors import UserError

SIGNALS = (signal.SIGTERM, signal.SIGINT)
SAVE_FAILED = 1024  # wins the MAX over any signal: the stop would have to save, and saving is what failed


class Preempted(UserError):
    prefix = ""  # not an error: the run stopped where it was asked to

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention for "ended by signal N"


class StopRequest:
    """Checked every CHECK_EVERY steps, at the same global steps on every rank (so all stop after the
    same step): the async all-reduce is launched as such a step begins and read as it ends, hidden
    behind it, and costs one small collective per CHECK_EVERY steps instead of one per step."""

    CHECK_EVERY = 10

    def __init__(self, ctx: DistContext, save_failed: Callable[[], bool]) -> None:
        self.ctx, self.save_failed = ctx, save_failed
        self.received = 0
        self.flag = torch.zeros(1, dtype=torch.int32, device=ctx.comm_device)
        self.handle = None
        self.previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received = signum
        signal.signal(signum, self.previous[signum])  # a second signal acts as it would have

    def begin_step(self, global_step: int) -> None:
        if global_step % self.CHECK_EVERY == 0:
            self.flag.fill_(SAVE_FAILED if self.save_failed() else self.received)
            self.handle = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)

    def agreed_signal(self, global_step: int) -> int:
        """0, SAVE_FAILED, or the signal some rank received before this check began (same answer on every rank).
        `global_step`: the step that just ran (counted from 0)."""
        if global_step % self.CHECK_EVERY or self.handle is None:
            return 0
        self.handle.wait()
        self.handle = None
        return int(self.flag.item())

    def close(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
