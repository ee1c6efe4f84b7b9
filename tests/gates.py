"""Step gates: a fault lands at a known training step whatever the host's speed.

A training process started through tests/patched.py with `gate=WHO@POINT` (several such patches
for several points) stops at POINT and waits there until the test releases it:

  WHO    all, gN (replica group N of train_ft.py: REPLICA_GROUP_ID), rN (global rank: RANK) or nN
         (node: GROUP_RANK)
  POINT  a global step STEP (held after the STEP-th optimizer step, its checkpoint and stop check
         done: a stop signal that comes while it is held is agreed on at the next stop check, so
         with STEP a multiple of StopRequest.CHECK_EVERY the run stops after step STEP + 1),
         `heal` (train_ft.py: held as the group loads a live peer's state, before it does),
         `heal-sum` (train_ft.py: held before the first cross-group sum of a step the group heals
         in; its peer's state has arrived, torchft loads it as the step's vote begins),
         `first-quorum` (train_ft.py: held as it asks for its first quorum, its heartbeat already
         on: groups held there and released together meet in their first quorum, where a group
         up a little before its peers would otherwise get a quorum of its own at once and they
         would heal from it; with a heal gate on a late group, held at step 1),
         `data` (a point of start-up: held as the run begins to prepare its data set, the process
         group joined, nothing trained; train_ft.py's group not yet known to the Lighthouse),
         `restart-data` (the same point, where only WHO's processes after the first are held: a
         group that ft.sh starts again kept out of the quorum until the test lets it in), or
         `output` (predict.py: held as it writes its --output CSV file, the first line written and
         flushed, the others not yet)

Held, the process writes GATE_DIR/WHO@POINT.{pid}.held ("held at POINT pid P") and waits for
GATE_DIR/WHO@POINT.go, which the test writes (Gate.release). A released gate stays open: a process
restarted before that step passes it. Every wait has a deadline (GATE_DEADLINE_S, default 300 s):
a gate never released ends the process with one line rather than hanging the suite. A stop
signal taken while held is marked in GATE_DIR/WHO@POINT.{pid}.signalled (Gate.signalled): a test
that signals a held job releases it once the signal is in, so the stop lands after a known step
even where a launcher passes the signal on to the workers later.

train_ft.py's groups also say when they ask the Lighthouse for a quorum: each request of a gated
process (whichever of its points match it) appends "pid P step S" to GATE_DIR/gN.quorum
(Gate.asked_quorum), so that a test releases the groups it
holds only once a group that starts or thaws is waiting in the quorum too (else the held groups'
next quorum could form without it).

The test's side is Gate below: `Gate(folder).env()` goes into the job's environment.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

from common.parallel.procs import running

POLL_S = 0.02  # how often a held process looks for its release (and a test for a marker)
DEADLINE_S = 300.0
_told_quorums = False  # this process's Manager.start_quorum writes its requests down (once, however many points)


def _who_matches(who: str) -> bool:
    if who == "all":
        return True
    env = {"g": "REPLICA_GROUP_ID", "r": "RANK", "n": "GROUP_RANK"}[who[0]]
    return os.environ.get(env) == who[1:]


def hold(folder: Path, point: str, signalled: Callable[[], bool] = lambda: False) -> None:
    """Hold this process at `point` (WHO@POINT) until the test releases it, or end it at the deadline.
    A stop signal this process takes while held (`signalled`) is marked too, so that the test
    releases it only once the signal is in: the stop lands after a known step."""
    go = folder / f"{point}.go"
    if go.exists():
        return
    told = False
    (folder / f"{point}.{os.getpid()}.held").write_text(f"held at {point} pid {os.getpid()}\n")
    seconds = float(os.environ.get("GATE_DEADLINE_S", DEADLINE_S))
    deadline = time.monotonic() + seconds
    while not go.exists():
        if not told and signalled():
            (folder / f"{point}.{os.getpid()}.signalled").write_text(f"signalled at {point} pid {os.getpid()}\n")
            told = True
        if time.monotonic() > deadline:
            print(f"error: gate {point}: not released within {seconds:g} s (GATE_DEADLINE_S); the test that set "
                  "it is gone or stuck", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(POLL_S)  # a poll with a deadline: the release is a file another process writes


def install(point: str) -> None:
    """Patch the training process (tests/patched.py's `gate=POINT`). Several calls add points."""
    folder = Path(os.environ["GATE_DIR"])
    who, at = point.split("@")
    if "REPLICA_GROUP_ID" in os.environ:  # a group of train_ft.py's: its quorum requests, gate or not
        _tell_quorums(folder)
    if not _who_matches(who):
        return
    if at == "heal":
        _gate_heals(folder, point)
    elif at == "heal-sum":
        _gate_heal_sums(folder, point)
    elif at == "first-quorum":
        _gate_first_quorum(folder, point)
    elif at in ("data", "restart-data"):
        _gate_data(folder, point, restarts_only=at == "restart-data")
    elif at == "output":
        _gate_output(folder, point)
    else:
        _gate_step(folder, point, int(at))


def _gate_step(folder: Path, point: str, step: int) -> None:
    from common.train.trainer import Trainer

    real = Trainer.after_step

    def after_step(self, done) -> None:
        real(self, done)
        if self.run.global_step(done) == step:
            hold(folder, point, lambda: bool(self.stop.received))
    Trainer.after_step = after_step


def _gate_data(folder: Path, point: str, restarts_only: bool) -> None:
    from common.train import app

    real = app.load_dataset

    def load_dataset(*args, **kwargs):
        if not (restarts_only and _first_to_arrive(folder / f"{point}.arrived")):
            hold(folder, point)
        return real(*args, **kwargs)
    app.load_dataset = load_dataset


def _first_to_arrive(marker: Path) -> bool:
    """Whether this process made `marker` (an exclusive create: of processes arriving together, one)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class _HeldAfterTheFirstLine:
    """A file open for writing that holds the process after its first write (csv.writer writes a
    line at a time), flushed: a file half-written where the program writes it."""

    def __init__(self, file, folder: Path, point: str) -> None:
        self.file, self.folder, self.point, self.writes = file, folder, point, 0

    def write(self, text: str) -> int:
        written = self.file.write(text)
        self.writes += 1
        if self.writes == 1:
            self.file.flush()
            hold(self.folder, self.point)
        return written

    def __enter__(self) -> "_HeldAfterTheFirstLine":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def _gate_output(folder: Path, point: str) -> None:
    from common.use import predicting

    def held_open(path, *args, **kwargs):
        return _HeldAfterTheFirstLine(open(path, *args, **kwargs), folder, point)
    predicting.open = held_open  # the module's `open` (its CSV writer's file), builtins' everywhere else


def _gate_heals(folder: Path, point: str) -> None:
    from common.train.ft import Manager  # through train_ft.py's module: it sets torchft's log level first

    real = Manager.register_state_dict_fn

    def register_state_dict_fn(self, key, load_state_dict, state_dict) -> None:
        def load(received) -> None:
            hold(folder, point)
            load_state_dict(received)
        real(self, key, load, state_dict)
    Manager.register_state_dict_fn = register_state_dict_fn


def _gate_heal_sums(folder: Path, point: str) -> None:
    from common.train.ft import Manager  # through train_ft.py's module: it sets torchft's log level first

    real = Manager.allreduce

    def allreduce(self, *args, **kwargs):
        if self._healing:  # torchft's own flag: set by the quorum that sent this group its peer's state
            hold(folder, point)
        return real(self, *args, **kwargs)
    Manager.allreduce = allreduce


def _gate_first_quorum(folder: Path, point: str) -> None:
    from common.train.ft import Manager  # through train_ft.py's module: it sets torchft's log level first

    real, asked = Manager.start_quorum, []

    def start_quorum(self, *args, **kwargs):
        if not asked:
            asked.append(True)
            hold(folder, point)
        return real(self, *args, **kwargs)
    Manager.start_quorum = start_quorum


def _tell_quorums(folder: Path) -> None:
    global _told_quorums
    from common.train.ft import Manager  # through train_ft.py's module: it sets torchft's log level first

    if Manager is None or _told_quorums:  # no torchft (train_ft.py refuses to run), or told already
        return
    _told_quorums = True
    real = Manager.start_quorum

    def start_quorum(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        with open(folder / f"g{os.environ.get('REPLICA_GROUP_ID')}.quorum", "a") as told:
            told.write(f"pid {os.getpid()} step {self.current_step()}\n")
        return result
    Manager.start_quorum = start_quorum


class Gate:
    """The test's side: where the markers go, waiting for a hold, releasing it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.job_output: Callable[[], str] | None = None
        folder.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        return {"GATE_DIR": str(self.folder)}

    def held(self, point: str, processes: int = 1, timeout: float = 180) -> list[int]:
        """Wait until `processes` processes are held at `point`; their pids. The deadline separates a
        run that reaches the step from one that hangs or ended before it: the run waits for us."""
        return self._marked(point, "held", processes, timeout)

    def signalled(self, point: str, processes: int = 1, timeout: float = 60) -> list[int]:
        """Wait until `processes` processes held at `point` took a stop signal; their pids."""
        return self._marked(point, "signalled", processes, timeout)

    def _marked(self, point: str, what: str, processes: int, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # whole lines only: a marker is seen as soon as it is created, before its line is written
            lines = [text for m in self.folder.glob(f"{point}.*.{what}") if (text := m.read_text()).endswith("\n")]
            pids = [pid for line in lines if running(pid := int(line.split()[-1]))]  # a killed one is held no more
            if len(pids) >= processes:
                return pids
            time.sleep(POLL_S)  # a poll with a deadline
        raise AssertionError(f"no {processes} process(es) {what} at {point} within {timeout} s{self.output()}")

    def output(self) -> str:
        """What the job printed, for a failed wait's message (self.job_output, set by the test)."""
        return f":\n{self.job_output()[-6000:]}" if self.job_output else ""

    def release(self, point: str) -> None:
        (self.folder / f"{point}.go").write_text("go\n")

    def quorum_requests(self, group: int) -> int:
        """How many quorum requests group `group`'s processes made so far."""
        return len(self._requests(group))

    def _requests(self, group: int) -> list[str]:
        """Group `group`'s quorum requests so far, whole lines only (a line may be half written)."""
        told = self.folder / f"g{group}.quorum"
        text = told.read_text() if told.exists() else ""
        return text[:text.rfind("\n") + 1].splitlines()

    def asked_quorum(self, group: int, beyond: int, timeout: float = 180) -> tuple[int, int]:
        """Wait for group `group`'s quorum request number `beyond` + 1 (after a restart or a thaw, with
        `beyond` counted before it): (the asking pid, the step its manager stood at)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self._requests(group)
            if len(lines) > beyond:
                _, pid, _, step = lines[beyond].split()
                return int(pid), int(step)
            time.sleep(POLL_S)  # a poll with a deadline
        raise AssertionError(f"group {group} asked for no quorum beyond its first {beyond} within {timeout} s"
                             f"{self.output()}")
