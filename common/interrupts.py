"""Signals acted on at once, whatever the main thread is doing; and Ctrl-C before training's own
handler, or for the whole run of a program that uses a trained model.

Python runs a signal's handler in the main thread between two bytecodes, never while that thread
waits in native code: torch's import loading its libraries, a store's wait, joining the process
group, a collective, a save, an evaluation's forward. So a thread woken through the signal wakeup fd
(written by the C-level handler the moment a signal lands) acts on it (SignalWatch): training's stop
request (common/train/preemption.py) and, before it, a Ctrl-C during start-up.

Which programs a Ctrl-C ends with one line, and with which line, is decided here alone, by the
program's file name (ctrl_c_line): the package's import asks for the program Python runs where it
is one of the suite's own (common/collector.py suite_program) and the interpreter was started with
it (run_by_the_interpreter: not one a driver runs through runpy), tests/training_program.py for the
script a test program stands for, launch/quiet_torchrun.py for the script it starts. Any other
program (pytest, python -c, a user's script importing the package, whatever its name) keeps
Python's KeyboardInterrupt, which it may catch; so does a program started with SIGINT ignored (a
background job of a script), where it stays ignored.

Ctrl-C during a training script's start-up (importing torch, preparing the data, joining the process
group, building the model, reading the checkpoint to resume from) ends the process at once, with
status 130 and one line from local rank 0 of each node (a terminal's Ctrl-C reaches every process of
the job), instead of a KeyboardInterrupt traceback from every rank. Nothing was trained, so nothing
is saved. Not an exception unwinding the main thread: it would wait out a collective or a store's
wait that a peer, ended first, will never answer, and turn into that peer's failure (a second line);
a finally block meeting a peer already gone could wait too. What a cut start-up leaves (a temp file
in the data cache, a shared-memory region, a lock) is what a SIGKILL leaves, and the next start
clears it. Training's stop request takes over where it is installed (start_up_over): from there a
Ctrl-C stops the run at a step, saved.

evaluate.py, predict.py and export.py keep the guard for their whole run: they have nothing to save
that a second run would not redo, and a stop agreed on between ranks would only delay the end (an
evaluation's batches run for minutes). So a Ctrl-C anywhere (torch's import, the checkpoint's read,
the data, the evaluation, the export, the writing of the output) ends the process at once with one
line. Their output is written under staging names and put in place by renames
(common/use/program.py, staged): a Ctrl-C before the renames removes what was staged
(removed_on_ctrl_c) and says that no file was written; one during them (microseconds) waits for
them to end (output_in_place), and from then on the line says the output is whole. A SIGTERM
removes the staged output alike, and the process then ends by the signal, without a line, as
without the guard (_end_by).
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

from common.collector import end_without_teardown, is_training_script, run_by_the_interpreter
from common.errors import node_prints

if TYPE_CHECKING:  # imported at the program's start, before the guard is up: each import widens that gap
    from pathlib import Path

STARTUP_LINE = "interrupted (Ctrl-C) during start-up: nothing was trained; the same command starts again"
USE_PROGRAMS = ("evaluate.py", "predict.py", "export.py")  # the programs that use a trained model
# The first thread to end the process says the line; a second one waits for the exit. Held by the main
# thread too while a use program's output is put in place (output_in_place).
_ENDING = threading.Lock()


def ctrl_c_line(program: str) -> str | None:
    """The line a Ctrl-C ends `program` (a file name: train_ddp.py, evaluate.py, ...) with, or None
    where it keeps Python's KeyboardInterrupt. The one place that decides (this module's docstring)."""
    if is_training_script(program):
        return STARTUP_LINE
    if program in USE_PROGRAMS:
        return f"interrupted (Ctrl-C): {program} stopped and wrote no file; the same command starts again"
    return None


def written_line(program: str) -> str:
    """A use program's line once its output is in place."""
    return f"interrupted (Ctrl-C) as {program} ended: its output was already written in full"


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


class _Guard:
    watch: SignalWatch | None = None  # while it lasts
    pid = 0  # the process that installed it: a child forked meanwhile (a data worker) forgets it
    program = ""  # what it was installed for
    line = STARTUP_LINE  # what a Ctrl-C ends the process with
    leftovers: list[Path] = []  # staged output, removed as a Ctrl-C ends the process


def end_on_ctrl_c(program: str) -> None:
    """From here (a training script: until start_up_over), a SIGINT ends this process at once, with
    `program`'s line (ctrl_c_line) from local rank 0, status 130; nothing changes for a program that
    keeps Python's KeyboardInterrupt. A use program's SIGTERM removes its staged output too, and the
    process ends by it, silent as without the guard. A signal the process was started ignoring (a
    background job of a script: `python evaluate.py ... &`) stays ignored, as Python leaves it. From
    the main thread, before torch's import (the package's import)."""
    if (line := ctrl_c_line(program)) is None:
        return
    wanted = (signal.SIGINT, signal.SIGTERM) if program in USE_PROGRAMS else (signal.SIGINT,)
    if not (signals := tuple(s for s in wanted if signal.getsignal(s) is not signal.SIG_IGN)):
        return
    _Guard.program, _Guard.line = program, line
    _Guard.watch, _Guard.pid = SignalWatch(signals, end_now, end_now), os.getpid()
    os.register_at_fork(after_in_child=_forget_in_child)


def says_on_ctrl_c(line: str) -> None:
    """A launcher's line (launch/quiet_torchrun.py: its workers' own, for the script it starts)."""
    _Guard.line = line


def start_up_over() -> None:
    """Training's own handler took the signals (after it installed its SignalWatch)."""
    if _Guard.watch is not None:
        _Guard.watch.close()
        _Guard.watch = None


def end_now(signum: int) -> None:
    """The process ends now, with the guard's line where it prints for its node: from the main
    thread's handler or the watcher, whichever runs first (os.write and os._exit: the other thread
    may be anywhere, printing or in native code), or from a launcher's handler before its workers
    start. The main thread never waits for the lock: held by the watcher, which is ending the
    process, or by the main thread itself, putting output in place, which the watcher waits for."""
    if not _ENDING.acquire(blocking=threading.current_thread() is not threading.main_thread()):
        return
    if signum == signal.SIGINT and node_prints():
        try:
            os.write(2, f"{_Guard.line}\n".encode())
        except OSError:  # stderr's reader gone (2>&1 | head): the process must end all the same
            pass
    if _Guard.leftovers:
        _remove_leftovers()
    if signum != signal.SIGINT:
        _end_by(signum)
    os._exit(128 + signum)  # a Ctrl-C's status (and, should the signal not end it, a SIGTERM's)


def _end_by(signum: int) -> None:
    """The process ends as `signum`'s default action ends it, as without the guard: its parent (a
    shell, torchrun) sees the signal, not an exit status (torchrun's report tells them apart). From
    any thread: Python's signal.signal is the main thread's alone, libc's is not."""
    import ctypes  # here, not at this module's import: see the imports above

    ctypes.CDLL(None).signal(signum, None)  # SIG_DFL
    os.kill(os.getpid(), signum)


def _remove_leftovers() -> None:
    """The staged output goes, without a word more (_silence)."""
    import shutil  # loaded long before (staged output comes late), not at this module's import: see above

    _silence()
    for path in list(_Guard.leftovers):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _silence() -> None:
    """Nothing more reaches the console: the main thread, writing where the leftovers are removed,
    may meet the removal and would print its error after the line."""
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)


@contextmanager
def removed_on_ctrl_c(path: Path) -> Iterator[None]:
    """`path` (a staging file or folder) is removed if a Ctrl-C ends the process during the block: a
    cut output leaves nothing, not even under its staging name."""
    _Guard.leftovers.append(path)
    try:
        yield
    finally:
        _Guard.leftovers.remove(path)


@contextmanager
def output_in_place() -> Iterator[None]:
    """The renames that put a use program's output in place: a Ctrl-C during them ends the process
    once they are done (the watcher waits), and from then on says the output is whole."""
    with _ENDING:
        yield
        if _Guard.program in USE_PROGRAMS:
            _Guard.line = written_line(_Guard.program)


def finished(status: int) -> None:
    """A use program's work is over, its lines said: where the guard is installed for it, the process
    ends now with `status`, without the interpreter's teardown (common/collector.py
    end_without_teardown). A Ctrl-C during that teardown could get no line: the watcher, a daemon
    thread, stops as the interpreter finalizes, and Python then resets SIGINT to its default, which
    kills the process silently. Elsewhere (a test calling a program's main, a driver running the
    program through runpy: run_by_the_interpreter) it returns."""
    if _Guard.watch is not None and _Guard.program in USE_PROGRAMS and run_by_the_interpreter():
        end_without_teardown(status)


def _forget_in_child() -> None:
    """A child forked while the guard lasts (a DataLoader worker indexing or decoding the data) takes
    SIGINT as Python does by default (its loader ends it quietly on KeyboardInterrupt), SIGTERM by its
    default action (the loader's way to end a worker that does not stop), and leaves the wakeup fd,
    the parent's pipe, alone: its Ctrl-C is its parent's to act on."""
    if _Guard.watch is not None and _Guard.pid != os.getpid():
        signal.set_wakeup_fd(-1)
        for s in _Guard.watch.signals:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        _Guard.watch = None
