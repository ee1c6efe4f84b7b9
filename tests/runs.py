"""Several runs of the train_*.py scripts one after another in one launch, for tests that prove many
short behaviours (an equivalence row each): a launch costs torch's import in torchrun's agent and in
every rank, several times what a short run costs.

    torchrun ... tests/runs.py SCRIPT [flags] --then SCRIPT [flags] --then ...

SCRIPT names a train_*.py (with its own strategy flags, e.g. train_fsdp.py --shard full). Each run is
that script's own main(), joining and leaving its own process group as a launch of its own does (its
store keys under a prefix of its own, as torchrun gives a restarted attempt). Before each run every
rank's stdout gets the line `=== run K: SCRIPT FLAGS` (split_runs cuts the output there). A run that
exits non-zero ends the launch with its status: the runs after it are not started.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

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


def split_runs(stdout: str) -> list[str]:
    """The stdout of each run, in order (rank 0's lines: the console is rank 0's)."""
    return [part.split("\n", 1)[1] if "\n" in part else "" for part in stdout.split(MARK)[1:]]


def main() -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for index, (script, *flags) in enumerate(planned_runs(sys.argv[1:])):
        if os.environ.get("RANK", "0") == "0":
            print(f"{MARK}{index}: {script} {' '.join(flags)}", flush=True)
        os.environ["TORCHELASTIC_RESTART_COUNT"] = f"{attempt}.run{index}"
        try:
            importlib.import_module(Path(script).stem).main(flags)
        except SystemExit as stop:
            if stop.code:
                raise
        sys.stdout.flush()


if __name__ == "__main__":
    main()
