"""Several runs of the train_*.py scripts one after another in one launch, for tests that prove many
short behaviours (an equivalence row each): a launch costs torch's import in torchrun's agent and in
every rank, several times what a short run costs.

    torchrun ... tests/runs.py SCRIPT [flags] --then SCRIPT [flags] --then ...

SCRIPT names a train_*.py (with its own strategy flags, e.g. train_fsdp.py --shard full). Each run is
that script's own main(), joining and leaving its own process group as a launch of its own does (its
store keys under a prefix of its own, as torchrun gives a restarted attempt), and what a run leaves
in the process that a fresh one would not have is put back before the next (`on_its_own`: the
environment, the stop's signal handlers, the warnings already shown). Before each run rank 0
prints the line `=== run K: SCRIPT FLAGS` (split_runs cuts the output there; the console is rank 0's;
an inline --storage-options value is shown as ***). A run that exits non-zero ends the launch with
its status: the runs after it are not started.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Iterator

from common import collector

SEPARATOR = "--then"
MARK = "=== run "


def planned_runs(argv: list[str]) -> list[list[str]]:
    runs, current = [], []
    for arg in argv:
        if arg == SEPARATOR:
            runs.append(current)
            current = []
        else:
            current.append(arg)
    return [run for run in [*runs, current] if run]


def arguments(runs: list[list[str]]) -> list[str]:
    """The script and arguments that make these runs (each: SCRIPT and its flags) in one launch."""
    return ["tests/runs.py", *[arg for index, run in enumerate(runs) for arg in ([SEPARATOR] if index else []) + run]]


def shown(flags: list[str]) -> str:
    """The flags as the run's marker line shows them: an inline --storage-options value as *** (JSON that
    may hold a key; the credential tests search the whole output for theirs), as the launchers echo it."""
    return " ".join("***" if before == "--storage-options" and not flag.startswith(("@", "env:")) else flag
                    for before, flag in zip(["", *flags], flags))


def split_runs(stdout: str) -> list[str]:
    """The stdout of each run, in order (rank 0's lines: the console is rank 0's)."""
    return [part.split("\n", 1)[1] if "\n" in part else "" for part in stdout.split(MARK)[1:]]


@contextlib.contextmanager
def on_its_own() -> Iterator[None]:
    """What one run may leave in its process, put back for the next as a fresh process would have it:
    the environment, the stop's signal handlers, the warnings already shown (a warning filter change
    resets Python's registry of them), the collector's verdict on how the last run ended, and
    torch.compile's graphs (a --compile run compiles afresh, never reusing or exhausting, past
    dynamo's recompile limit, what an earlier run compiled)."""
    environ, handlers = dict(os.environ), {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with warnings.catch_warnings():  # entering it invalidates every module's registry of warnings shown
            yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        collector._Exit.clean = False
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()


def main() -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for index, (script, *flags) in enumerate(planned_runs(sys.argv[1:])):
        if os.environ.get("RANK", "0") == "0":
            print(f"{MARK}{index}: {script} {shown(flags)}", flush=True)
        with on_its_own():
            os.environ["TORCHELASTIC_RESTART_COUNT"] = f"{attempt}.run{index}"
            try:
                importlib.import_module(Path(script).stem).main(flags)
            except SystemExit as stop:
                if stop.code:
                    raise
        sys.stdout.flush()
    collector.ended_cleanly()  # every run did


if __name__ == "__main__":
    main()
