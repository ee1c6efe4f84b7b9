"""Several runs of the train_*.py scripts one after another in one launch, for tests that prove many
short behaviours (an equivalence row each): a launch costs torch's import in torchrun's agent and in
every rank, several times what a short run costs.

    torchrun ... tests/runs.py SCRIPT [flags] --then SCRIPT [flags] --then-after-stop SCRIPT [flags] ...

SCRIPT names a train_*.py (with its own strategy flags, e.g. train_fsdp.py --shard full) or
tests/faults.py (a fault injected). Each run is that script's own main(), joining and leaving its own
process group as a launch of its own does (its store keys under a prefix of its own, as torchrun
gives a restarted attempt), and what a run leaves in the process that a fresh one would not have is
put back before the next (`on_its_own`: the environment, the stop's signal handlers, the warnings
already shown, the random generators, torchrun's error file). Before each run rank 0 prints the line
`=== run K: SCRIPT FLAGS` on stdout and stderr (split_runs cuts either there; the console is rank
0's; an inline --storage-options value is shown as ***). A run that exits non-zero ends the launch
with its status: the runs after it are not started. One exception, asked for run by run: a run
followed by `--then-after-stop` may end stopped and saved (a SIGTERM or Ctrl-C every rank agreed on,
its checkpoint written: common.train.preemption.Preempted), and the next run starts (a cut and its
resume in one launch); rank 0 then prints `runs.py: run K stopped and saved: exit status N` on stderr
(`launched_runs` gives it as that run's status). Any other failure still ends the launch.

What a resume in the cut's processes cannot prove: that a fresh process finds and loads everything
it needs (module-level state, anything imported once). A guarantee proven by such a resume keeps at
least one resume in a process of its own (test_resume says which).
"""
from __future__ import annotations  # noqa: I001 - ruff wants a blank line above `# isort: split`, test_layout none

import tests.training_program  # noqa: F401 - first: the collector as in a train_*.py program (its docstring)
# isort: split
import contextlib
import importlib
import os
import random
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Collection, Iterator

import torch

from common import collector
from common.train.preemption import Preempted

SEPARATOR = "--then"
AFTER_STOP = "--then-after-stop"  # the run before it may end stopped and saved, and the next one starts
MARK = "=== run "
STOPPED = re.compile(r"^runs\.py: run \d+ stopped and saved: exit status (\d+)$", re.MULTILINE)


def planned_runs(argv: list[str]) -> list[tuple[list[str], bool]]:
    """Each run (SCRIPT and its flags) and whether it may end stopped and saved (AFTER_STOP follows it)."""
    runs: list[tuple[list[str], bool]] = []
    current: list[str] = []
    for arg in argv:
        if arg in (SEPARATOR, AFTER_STOP):
            runs.append((current, arg == AFTER_STOP))
            current = []
        else:
            current.append(arg)
    if not current and runs and runs[-1][1]:
        raise SystemExit(f"error: tests/runs.py: {AFTER_STOP} needs a run after it")
    return [(run, may_stop) for run, may_stop in [*runs, (current, False)] if run]


def arguments(runs: list[list[str]], stopping: Collection[int] = ()) -> list[str]:
    """The script and arguments that make these runs (each: SCRIPT and its flags) in one launch; the
    runs numbered in `stopping` may end stopped and saved, the next run starting (AFTER_STOP)."""
    separators = [[], *([AFTER_STOP if index in stopping else SEPARATOR] for index in range(len(runs) - 1))]
    return ["tests/runs.py", *[arg for separator, run in zip(separators, runs) for arg in [*separator, *run]]]


def shown(flags: list[str]) -> str:
    """The flags as the run's marker line shows them: an inline --storage-options value as *** (JSON that
    may hold a key; the credential tests search the whole output for theirs), as the launchers echo it."""
    return " ".join("***" if before == "--storage-options" and not flag.startswith(("@", "env:")) else flag
                    for before, flag in zip(["", *flags], flags))


def split_runs(output: str) -> list[str]:
    """The stdout (or stderr) of each run, in order (rank 0's lines: the console is rank 0's; a line
    another rank prints lands in the run rank 0 is in as it prints)."""
    parts = re.split(f"^{MARK}", output, flags=re.MULTILINE)[1:]
    return [part.split("\n", 1)[1] if "\n" in part else "" for part in parts]


def launched_runs(launch: subprocess.CompletedProcess) -> list[subprocess.CompletedProcess]:
    """Each run of a launch as if it were a launch of its own: its stdout, its stderr and its exit
    status (the one its `stopped and saved` line reports; else the launch's for the last run that
    started, 0 for the runs before it, which ended cleanly or the launch would have ended there)."""
    outs, errs = split_runs(launch.stdout), split_runs(launch.stderr)
    runs = []
    for index, (out, err) in enumerate(zip(outs, errs)):
        stopped = STOPPED.search(err)
        status = int(stopped[1]) if stopped else launch.returncode if index == len(errs) - 1 else 0
        runs.append(subprocess.CompletedProcess(launch.args, status, out, err))
    return runs


@contextlib.contextmanager
def on_its_own() -> Iterator[None]:
    """What one run may leave in its process, put back for the next as a fresh process would have it:
    the environment, the stop's signal handlers and wakeup fd, the warnings already shown (a warning
    filter change resets Python's registry of them), the collector's verdict on how the last run
    ended, torch.compile's graphs (a --compile run compiles afresh, never reusing or exhausting, past
    dynamo's recompile limit, what an earlier run compiled); and each run starts with the global
    random generators seeded afresh."""
    environ, handlers = dict(os.environ), {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    fresh_random_state()
    try:
        with warnings.catch_warnings():  # entering it invalidates every module's registry of warnings shown
            yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(-1)
        collector._Exit.clean = False
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()


def fresh_random_state() -> None:
    """Python's and torch's global generators seeded from the OS, as a fresh process's are: a run
    that leans on the generator state an earlier run left (a resume that does not restore its own)
    would pass in the cut's processes and fail in a fresh one; reseeded, it fails in both."""
    random.seed()
    torch.seed()


def stopped_and_saved(stop: SystemExit) -> bool:
    """The run ended on a stop every rank agreed on, after its checkpoint (app.main exits with
    Preempted's status while handling it), not on any other failure."""
    return isinstance(stop.__context__, Preempted) and stop.code == stop.__context__.exit_code


def forget_error_file() -> None:
    """The stop's report in torchrun's per-rank error file, which a later run that fails without
    writing one (a crash) would otherwise be summarised by."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def main() -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    printing = os.environ.get("RANK", "0") == "0"
    for index, ((script, *flags), may_stop) in enumerate(planned_runs(sys.argv[1:])):
        if printing:
            for stream in (sys.stdout, sys.stderr):
                print(f"{MARK}{index}: {script} {shown(flags)}", file=stream, flush=True)
        with on_its_own():
            os.environ["TORCHELASTIC_RESTART_COUNT"] = f"{attempt}.run{index}"
            try:
                importlib.import_module(Path(script).stem).main(flags)
            except SystemExit as stop:
                if stop.code and not (may_stop and stopped_and_saved(stop)):
                    raise
                if stop.code:
                    forget_error_file()
                    if printing:
                        print(f"runs.py: run {index} stopped and saved: exit status {stop.code}", file=sys.stderr,
                              flush=True)
        sys.stdout.flush()
    collector.ended_cleanly()  # every run did


if __name__ == "__main__":
    main()
