"""SIGTERM / SIGINT: every rank stops at the same point, after a checkpoint.

A signal only sets a flag. Every CHECK_EVERY steps (a strategy may ask for another interval) the flag
is all-reduced (MAX) asynchronously as a step starts, so the round trip hides behind the step, and
read at its end: every rank sees the same verdict after the same step, at most CHECK_EVERY steps
after the signal. Evaluation checks
the same way every CHECK_EVERY of its batches, and a save checks once as it returns (a save can
be long: a signal that came while it was waited for stops the run at that checkpoint). The same
check carries rank 0's news that a checkpoint written in the background failed (SAVE_FAILED,
above every signal number).

The handler stays installed for the life of the process, because a stop request rarely comes as
one signal: Slurm (proctrack/cgroup), systemd (KillMode=control-group) and a terminal's Ctrl-C
signal every process of the job, torchrun forwards its own copy milliseconds later, in either
order (and SIGKILLs its workers when its shutdown timeout, 30 s by default, runs out). Every
further signal is the same request, except a SIGINT FORCE_AFTER_S or more after the first signal:
a deliberate second Ctrl-C, which ends the process at once, unsaved, even while the main thread
waits in a collective (a watcher thread, woken through the signal wakeup fd, does that).
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable

import torch
import torch.distributed as dist

from common.errors import UserError
from common.interrupts import SignalWatch, start_up_over
from common.parallel.context import DistContext

SIGNALS = (signal.SIGTERM, signal.SIGINT)
SAVE_FAILED = 1024  # wins the MAX over any signal: the stop would have to save, and saving is what failed
# A terminal's Ctrl-C reaches torchrun and every worker at once, and torchrun forwards its own
# SIGINT a moment later: copies closer together than this are one request, not a second Ctrl-C.
FORCE_AFTER_S = 2.0


class Preempted(UserError):
    """Raised on every rank at the same point. Rank 0 prints the line; the others exit at once,
    without PeerFailed's wait: the printing rank keeps its handler, so the SIGTERM torchrun sends it
    when a peer exits first cannot cut its line or its exit."""

    prefix = ""  # not an error: the run stopped where it was asked to

    def __init__(self, message: str, signum: int, printing: bool) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention for "ended by signal N"
        self.printing = printing

    def should_print(self) -> bool:
        return self.printing


class StopRequest:
    """Checked every CHECK_EVERY steps (or evaluation batches), at the same indices on every rank
    (so all stop at the same point): the async all-reduce is launched as such a step begins and
    read as it ends, hidden behind it, and costs one small collective per CHECK_EVERY steps
    instead of one per step."""

    CHECK_EVERY = 10  # the default interval

    def __init__(self, ctx: DistContext, save_failed: Callable[[], bool], check_every: int = CHECK_EVERY) -> None:
        self.ctx, self.save_failed, self.check_every = ctx, save_failed, check_every
        self.received = 0  # the request: the first signal's number
        self.first_at: float | None = None  # when the watcher saw the first signal
        self.flag = torch.zeros(1, dtype=torch.int32, device=ctx.comm_device)
        self.handle = None
        self._watch_signals()

    def _watch_signals(self) -> None:
        """The watcher thread does the work (common/interrupts.py: a hung rank's main thread would
        never see the second Ctrl-C); the handler itself only records the request, so that a signal
        a rank sends itself is seen before its next bytecode, as it was before the thread. From here
        a Ctrl-C is this request, no longer start-up's."""
        SignalWatch(SIGNALS, self._record, self._on_signal)
        start_up_over()

    def _record(self, signum: int) -> None:
        if not self.received:  # repeats are the same request
            self.received = signum

    def _on_signal(self, signum: int) -> None:
        """In the watcher thread, once per signal: records the request (if the handler has not yet),
        tells a Ctrl-C how to force the exit, and ends the process on a deliberate second Ctrl-C.
        os.write, not print: the main thread may be printing."""
        self._record(signum)
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
            if signum == signal.SIGINT and self.ctx.is_node_primary:
                os.write(2, f"stopping: a checkpoint first, then the exit; Ctrl-C again, {FORCE_AFTER_S:g} s or "
                            "more from now, to end at once without saving\n".encode())
        elif signum == signal.SIGINT and now - self.first_at >= FORCE_AFTER_S:
            if self.ctx.is_node_primary:
                os.write(2, b"stopped by a second Ctrl-C, at once and without saving; run the same command again "
                            b"to resume from the last checkpoint\n")
            os._exit(128 + signum)  # now: whatever the main thread waits for (a collective, a save)

    def begin_step(self, index: int) -> None:
        """`index`: the global step about to run (counted from 0), or the evaluation batch."""
        if index % self.check_every == 0:
            self.flag.fill_(self._local_verdict())
            self.handle = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)

    def agreed_signal(self, index: int) -> int:
        """0, SAVE_FAILED, or the signal some rank received before this check began (same answer on
        every rank). `index`: the step (or evaluation batch) that just ran, as given to begin_step."""
        if index % self.check_every or self.handle is None:
            return 0
        self.drain()
        return int(self.flag.item())

    def drain(self) -> None:
        """Wait for the check in flight, if any, and forget it: for a loop that leaves its step
        before reading the verdict (a replica group moved to another step by a heal)."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def agree_now(self) -> int:
        """A blocking check (a collective), for a point every rank reaches together with no step to
        hide it behind: the end of a save."""
        self.flag.fill_(self._local_verdict())
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX)
        return int(self.flag.item())

    def _local_verdict(self) -> int:
        return SAVE_FAILED if self.save_failed() else self.received
