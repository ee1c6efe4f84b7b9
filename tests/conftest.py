from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Sequence

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.datagen import write_cifar10, write_mnist
from tests.runs import arguments as one_launch
from tests.runs import launched_runs, split_runs

# Every launch counted per test, the totals printed at the end; the quick tier kept free of torchrun.
pytest_plugins = ["tests.launches"]

ROOT = Path(__file__).resolve().parent.parent


# The files whose tests take minutes (their launches: the table `--launches-json` and the run's end
# print), longest first. pytest.ini's `--dist loadfile` runs a file on one worker, and xdist hands the
# files out in collection order (its default reordering, by number of tests, is off: it put these
# few-test files last, where each ran for minutes beside idle workers): started first, the cheap files
# fill in around them. Measured at -n 3 on 2 cores: test_chaos and test_ft about 4.5 minutes each.
LONGEST_FIRST = ("test_chaos.py", "test_ft.py", "test_resume.py", "test_object_storage.py", "test_launchers.py",
                 "test_trust.py", "test_recipes.py", "test_own_data.py", "test_stores.py", "test_strategies.py",
                 "test_optimizers.py", "test_waits.py", "test_failures.py", "test_multinode.py", "test_elastic.py",
                 "test_bench.py", "test_slurm.py", "test_e2e.py", "test_data_edges.py", "test_downloads.py")


def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first (LONGEST_FIRST; the others after them, in their order; a file's tests
    in theirs). A test marked slow is out of the quick tier: in a `-m` expression that names quick
    and not slow (`-m quick`, `-m "quick and not ft"`) it is left out, so that the inner loop stays
    under a minute; without `-m` (the full suite), or with one that names slow, it runs. pytest's own
    selection, which sees its quick mark, runs too: this one only takes away."""
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST
               else len(LONGEST_FIRST))  # stable: the rest keep their order
    markexpr = config.getoption("markexpr")
    if "quick" not in markexpr or "slow" in markexpr:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


# The gradient-averaging strategies, as every test that loops over strategies names them.
AVERAGING = {
    "ddp": ["train_ddp.py"],
    "allreduce": ["train_allreduce.py"],
    "allreduce-ring": ["train_allreduce.py", "--allreduce", "ring"],
    "master": ["train_master.py"],
    "master-update": ["train_master.py", "--master-update"],
}


# A deadline in a test separates "ends by itself" from "hangs", never a performance figure (those are
# printed, and measured in bench/): on a loaded slow host a launch's start-up alone takes 20 s or more.
# Two minutes is well under what a hang waits for: a collective's --timeout-s (default 300 s), a
# store's --storage-timeout-s (1800 s), torchrun's rendezvous (600 s).
ENDS_PROMPTLY_S = 120
# torchrun's agent SIGKILLs workers this long after passing a stop on: a bound below it tells a rank that
# ended by itself from one that was killed.
TORCHRUN_GRACE_S = 30
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def as_from_a_terminal() -> None:
    """SIGINT and SIGQUIT at their defaults, as a terminal starts a command: a suite started in the
    background by a shell without job control (nohup CMD &) inherits them ignored, and bash cannot
    trap a signal ignored at its start, so the launcher would never see the Ctrl-C under test."""
    for name in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(name, signal.SIG_DFL)


def child_env() -> dict[str, str]:
    """One thread per rank: several ranks share 2 cores. No torchrun variables leak in. PYTHONPATH:
    the scripts a test starts (tests/faults.py, a train_*.py run from elsewhere) import the
    checkout's package, installed or not."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")  # torchrun of this venv
    return env


def script_command(args: list[str], nproc: int | None = None, torchrun: Sequence[str] = ()) -> list[str]:
    """`torchrun --standalone --nproc_per_node=N script ...`, or plain python when nproc is None.
    The script's path is relative to the repository, whatever the working directory."""
    args = [str(ROOT / args[0]), *args[1:]]
    if nproc is None:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun,
            *args]


def run_script(args: list[str], nproc: int | None = None, timeout: float = 240, cwd: Path = ROOT,
               env: dict[str, str] | None = None, torchrun: Sequence[str] = ()) -> subprocess.CompletedProcess:
    return subprocess.run(script_command(args, nproc, torchrun), cwd=cwd, env=env or child_env(),
                          capture_output=True, text=True, timeout=timeout)


def refusal_in_process(args: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """`python SCRIPT ARGS` refusing its flags before any process group, as the script's own main()
    in this process (world 1): its exit status and what it printed to stderr, without a process's
    start (a second of torch's import each). A command that reaches the process group fails the test
    there (it would train in this process otherwise)."""
    from common import collector
    from common.train import app

    def not_refused(cfg):
        raise AssertionError(f"{' '.join(args)} was not refused before the process group")
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(app, "distributed", not_refused)
    script = importlib.import_module(Path(args[0]).stem)
    collecting = gc.isenabled()  # main() pauses the collector during set-up, as in a training process
    try:
        with pytest.raises(SystemExit) as exit_:
            script.main(args[1:])
    finally:
        atexit.unregister(collector._at_exit)
        if collecting:
            gc.enable()
    return exit_.value.code, capsys.readouterr().err


EQUIVALENCE = re.compile(r"equivalence: max \|dw\| = (\S+) after (\d+) steps "
                         r"\(([\w/+-]+), world (\d+), tolerance (\S+)\)")


@dataclass(frozen=True)
class Equivalence:
    """One `--check-equivalence` verdict, as the run printed it."""
    max_dw: float
    steps: int
    label: str
    world: int
    tolerance: float
    console: str  # the run's rank-0 console


def equivalence(console: str, world: int | None) -> Equivalence:
    """The `--check-equivalence` verdict a run printed on its rank-0 console, asserted made at this
    world size (None: one process)."""
    found = EQUIVALENCE.search(console)
    assert found, f"no equivalence verdict in:\n{console[-4000:]}"
    verdict = Equivalence(float(found[1]), int(found[2]), found[3], int(found[4]), float(found[5]), console)
    assert verdict.world == (world or 1), verdict
    return verdict


def equivalences(runs: list[list[str]], world: int | None, tmp_path: Path, timeout: float = 500) -> list[Equivalence]:
    """Each run's `--check-equivalence` verdict (a run: SCRIPT and its flags), the runs made one after
    another in one launch (tests/runs.py: torch is imported once, not once a run). Asserts that the
    launch succeeded and that every run printed its verdict at this world size."""
    runs = [[*run, *own_folders(tmp_path, str(index))] for index, run in enumerate(runs)]
    result = run_script(one_launch(runs), nproc=world, timeout=timeout)
    consoles = split_runs(result.stdout)
    assert result.returncode == 0 and len(consoles) == len(runs), \
        f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-3000:]}"
    return [equivalence(console, world) for console in consoles]


def own_folders(parent: Path, name: str) -> list[str]:
    """A run's own --log-dir and --checkpoint-dir under `parent` (tb-NAME, ckpt-NAME)."""
    return ["--log-dir", str(parent / f"tb-{name}"), "--checkpoint-dir", str(parent / f"ckpt-{name}")]


@dataclass(frozen=True)
class SharedLaunch:
    """One launch of named runs (tests/runs.py): each run's stdout, stderr and exit status as if it
    were a launch of its own (launched_runs), for the tests that each read some of them."""
    result: subprocess.CompletedProcess
    runs: dict[str, subprocess.CompletedProcess]

    def __getitem__(self, name: str) -> subprocess.CompletedProcess:
        """The run; a run that never started (a run before it ended the launch) fails the test that reads it."""
        assert name in self.runs, (f"run {name!r} never started: the launch ended with exit {self.result.returncode}"
                                   f"\n{self.result.stdout[-3000:]}\n{self.result.stderr[-4000:]}")
        return self.runs[name]


def shared_launch(runs: dict[str, list[str]], nproc: int | None, stopping: Collection[str] = (), **options
                  ) -> SharedLaunch:
    """The runs (a name: SCRIPT and its flags) one after another in one launch; the runs named in
    `stopping` may end stopped and saved, the next one starting (--then-after-stop). `options`: run_script's."""
    names = list(runs)
    result = run_script(one_launch(list(runs.values()), stopping=[names.index(name) for name in stopping]),
                        nproc=nproc, **options)
    return SharedLaunch(result, dict(zip(names, launched_runs(result))))


def read_scalars(log_dir: Path) -> tuple[EventAccumulator, dict[str, list[tuple[int, float]]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return acc, {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_after(signalled_at: int, steps_per_epoch: int = 0, save_every: int = 0) -> int:
    """The step after which a run stops when a signal arrives during step `signalled_at` (counted
    from 1): the ranks agree on it at the next step whose 0-based index is a multiple of
    StopRequest.CHECK_EVERY, and stop once that step is done; or, if the epoch ends first, after
    its last step, at the first check of its evaluation (steps_per_epoch 0: no epoch ends first);
    or, if a save (--save-every-steps) comes first, right after it (save_every 0: no such saves)."""
    from common.train.preemption import StopRequest

    every = StopRequest.CHECK_EVERY
    ends = [-(-signalled_at // every) * every + 1]
    ends += [-(-signalled_at // n) * n for n in (steps_per_epoch, save_every) if n]
    return min(ends)


def saved_position(stop: int, steps_per_epoch: int) -> tuple[int, int]:
    """(epoch counted from 0, step in it) of the checkpoint a run stopped after global step `stop`
    writes: a stop after an epoch's last step is saved before that epoch's evaluation."""
    return (stop - 1) // steps_per_epoch, (stop - 1) % steps_per_epoch + 1


def latest_checkpoint(folder: Path) -> Path:
    """The checkpoint named by the pointer of the most recently saved run under a --checkpoint-dir."""
    pointers = [json.loads(p.read_text()) for p in folder.glob("*/latest.json")]
    assert pointers, f"no run with a checkpoint under {folder}"
    return folder / max(pointers, key=lambda p: p["saved_at"])["checkpoint"]


def latest_state(folder: Path) -> dict:
    return torch.load(latest_checkpoint(folder), weights_only=True)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory) -> Path:
    return write_cifar10(tmp_path_factory.mktemp("cifar"))


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory) -> Path:
    return write_mnist(tmp_path_factory.mktemp("mnist"))


@pytest.fixture(scope="session")
def mnist_gz_root(tmp_path_factory) -> Path:
    return write_mnist(tmp_path_factory.mktemp("mnist_gz"), gz=True)
