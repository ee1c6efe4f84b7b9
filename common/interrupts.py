"""Signals acted on at once, whatever the main thread is doing; and Ctrl-C during start-up.

Python runs a signal's handler in the main thread between two bytecodes, never while that thread
waits in native code: torch's import loading its libraries, a store's wait, joining the process
group, a collective, a save. So a thread woken through the signal wakeup fd (written by the C-level
handler the moment a signal lands) acts on it (SignalWatch): training's stop request
(common/train/preemption.py) and, before it, a Ctrl-C during start-up.

Ctrl-C during start-up (importing torch, preparing the data, joining the process group, building the
model, reading the checkpoint to resume from) ends the process at once, with status 130 and one line
from local rank 0 of each node (a terminal's Ctrl-C reaches every process of the job), instead of a
KeyboardInterrupt traceback from every rank. Nothing was trained, so nothing is saved. Not an
exception unwinding the main thread: it would wait out a collective or a store's wait that a peer,
ended first, will never answer, and turn into that peer's failure (a second line); a finally block
meeting a peer already gone could wait too. What a cut start-up leaves (a temp file in the data
cache, a shared-memory region, a lock) is what a SIGKILL leaves, and the next start clears it.
Training's stop request takes over where it is installed (start_up_over): from there a Ctrl-C
stops the run at a step, saved.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Callable

from common.errors import node_prints

STARTUP_LINE = "interrupted (Ctrl-C) during start-up: nothing was trained; the same command starts again"
_ENDING = threading.Lock()  # the first thread to end the process says the line; a second one waits for the exit


class SignalWatch:
    """`record(signum)` in the main thread as Python runs a handler (between two bytecodes: a
    signal a process sends itself is seen before its next one), and `act(signum)` in a watcher
    thread as the signal lands, for `signals` (the wakeup fd also carries other caught signals'
    numbers, which it skips). Installed from the main thread; the last one installed gets the signals."""

    def __init__(self, signals: tuple[int, ...], record: Callable[[int], None], act: Callable[[int], None]) -> None:
        self.signals, self.act = signals, act
        read_end, self.write_end = os.pipe()
        os.set_blocking(self.write_end, False)
        for s in signals:
            signal.signal(s, lambda signum, frame: record(signum))
        signal.set_wakeup_fd(self.write_end, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_end,), name="signal-watch", daemon=True).start()

    def _watch(self, read_end: int) -> None:
        while chunk := os.read(read_end, 64):  # one byte per signal (its number); empty once closed
            for signum in chunk:
                if signum in self.signals:
                    self.act(signum)
        os.close(read_end)

    def close(self) -> None:
        """End the watcher, once another watch holds the wakeup fd (it must never name a closed fd)."""
        os.close(self.write_end)


class _StartUp:
    watch: SignalWatch | None = None  # while start-up lasts
    pid = 0  # the process that installed it: a child forked meanwhile (a data worker) forgets it


def end_start_up_on_ctrl_c() -> None:
    """From here until start_up_over: a SIGINT ends this process at once, with STARTUP_LINE from
    local rank 0, status 130. From the main thread, before torch's import (the package's import)."""
    _StartUp.watch, _StartUp.pid = SignalWatch((signal.SIGINT,), end_start_up, end_start_up), os.getpid()
    os.register_at_fork(after_in_child=_forget_in_child)


def start_up_over() -> None:
    """Training's own handler took the signals (after it installed its SignalWatch)."""
    if _StartUp.watch is not None:
        _StartUp.watch.close()
        _StartUp.watch = None


def end_start_up(signum: int) -> None:
    """The process ends now, with STARTUP_LINE where it prints for its node: from the main thread's
    handler or the watcher, whichever runs first (os.write and os._exit: the other thread may be
    anywhere, printing or in native code), or from a launcher's handler before its workers start."""
    with _ENDING:
        if node_prints():
            os.write(2, f"{STARTUP_LINE}\n".encode())
        os._exit(128 + signum)


def _forget_in_child() -> None:
    """A child forked during start-up (a DataLoader worker indexing or decoding the data) takes SIGINT
    as Python does by default (its loader ends it quietly on KeyboardInterrupt) and leaves the wakeup
    fd, the parent's pipe, alone: its Ctrl-C is its parent's to act on."""
    if _StartUp.watch is not None and _StartUp.pid != os.getpid():
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _StartUp.watch = None
