"""Chaos: a seeded schedule of faults through a whole run, then the oracle.

Two modes, each against its fault-free run:
  ft       replica groups (launch/ft.sh, train_ft.py --exact-sums): the weights must be the fault-free
           run's bit for bit, whatever failed when (faults: a worker SIGKILLed, frozen for 2-8 s, SIGKILLed
           during its set-up or while it heals; its torchrun agent SIGKILLed; a group SIGTERMed, which
           leaves, and started again by hand, which rejoins; the Lighthouse SIGKILLed, which ft.sh starts
           again; the link between the groups slowed, or made lossy, for 2-8 s: the job runs in a network
           namespace of its own, whose loopback gets a `tc` queue, netem's delay and loss where the kernel
           has it, else a rate limit)
  restart  checkpoint-and-restart (train_ddp.py at world 2 under torchrun --max-restarts): exact resume,
           the uninterrupted run's weights (faults: a rank SIGKILLed, during its set-up, during a save,
           during the epoch's evaluation; a rank frozen; torchrun's agent SIGKILLed, after which the
           same command is run again, as a cluster's scheduler would), once with its checkpoints on a disk
           (a small tmpfs, which fills up before a save: the job ends with its one line, the runner frees the
           disk as an operator would, and torchrun's next restart resumes) and once in the local S3 server
           (tests/s3server.py), stopped for 2-8 s during a save, or as the restarted ranks resume

A fault is drawn at a training step (the run's progress, read from its TensorBoard points), not at
a time, so that the schedule means the same on any host; it lands as soon as the run reaches it.
Then one table: faults per kind, survived, steps trained again, the survivors' pause (median/max),
time until the target is back, and for the run: exit status, max |dw|, processes and temporary
files left, tracebacks in the output.

    python -m bench chaos --mode ft --faults 30 --seed 1
    python -m bench chaos --mode restart --faults 30 --seed 1

A kind this host cannot inject (a tmpfs needs root; a slowed link needs `ip netns` and `tc`) is not
drawn, and the table says why.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.parallel.procs import children, command_line, start_ticks
from tests.conftest import child_env, free_port, latest_state
from tests.datagen import write_mnist
from tests.s3server import S3Server

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# What torch itself makes in TMPDIR and keeps by design (temp_files): the compiler's cache folder
# (torchinductor_USER, made empty at torch._dynamo's import: kept only while empty), and in restart mode,
# which runs plain torchrun, its log folder, one per launch (ft.sh's quiet_torchrun deletes its own).
INDUCTOR_CACHE = "torchinductor_"
TORCHRUN_LOGS = "torchelastic_"
TAG = "train/loss"
FT_KINDS = ("kill-worker", "freeze-worker", "kill-in-set-up", "kill-while-healing", "kill-agent", "leave-and-rejoin",
            "kill-lighthouse", "slow-link")
RESTART_KINDS = ("kill-rank", "freeze-rank", "kill-in-set-up", "kill-while-saving", "kill-during-evaluation",
                 "kill-agent")
STORES = {"disk": ("full-disk",), "s3": ("store-down-in-save", "store-down-in-resume")}  # restart mode's, by store
# Restart mode's faults that end every rank by design, no kill behind it (a failed save): torchrun
# restarts the group once for each. Its agent says each restart at INFO (LOGLEVEL=INFO for the job).
ENDS_EVERY_RANK = ("full-disk", "store-down-in-save")
TORCHRUN_RESTARTED = re.compile(r"\d+/\d+ attempts left; will restart worker group")
# Seconds added to each step under chaos, by mode: a restart stops the run while it recovers, but
# replica groups train on while one recovers (20-90 s on 2 loaded cores), so their run is made long
# enough for 30 faults to land, at most two groups away at once (2,000 steps of about 0.45 s).
SLOW_STEPS = {"restart": 0.05, "ft": 0.4}
FT_TIMEOUT_S = 5.0  # ft mode's train_ft.py --ft-timeout-s (bench chaos --ft-timeout-s)
JOB_WIDE = ("kill-lighthouse", "slow-link")  # ft faults that hit every group, not one
ENDED_FOR_GOOD = (0, 2, 3, 130, 143)  # launch/ft.sh does not start a group that ended so again
STALL_S = 600  # a run under chaos that trains no step for this long is ended as hung (recoveries take 20-90 s)
OUTPUT_HELD_S = 30  # a launcher ended: its tree's output is read until it closes, at most this long
RUN_S = 3600  # the most a run (or a group started again by hand) is waited for once its faults have landed
# launch/ft.sh's lines for a group's process that ended: `lost ... restarted` is one restart, the others its end
GROUP_ENDED = re.compile(r"^ft: group (\d+) (finished|gave up|left|ended|lost \(exit \d+\); (no restarts|restarted))")
BUCKET = "chaos"
IMAGES = 1200  # of the generated MNIST-format training set (tests/datagen.py's default)
DISK_SIZE = "64m"  # the tmpfs of the checkpoints: a few lenet checkpoints (~3.5 MB each) and room to spare


@dataclass
class Fault:
    kind: str
    step: int  # lands once the run has trained this many steps
    target: int  # a group (ft) or a rank (restart)
    seconds: float  # how long a freeze lasts, or a group stays away
    landed: float = 0.0  # time.monotonic() when it landed
    back: float | None = None  # when its target trained again
    notes: list[str] = field(default_factory=list)


def fault_steps(steps: int) -> range:
    """The steps a fault may be drawn at: 10% to 85% of a run of `steps` steps."""
    return range(steps // 10, steps * 85 // 100)


def draw(kinds: tuple[str, ...], count: int, steps: int, targets: int, seed: int) -> list[Fault]:
    """`count` faults, every kind drawn (in turn, shuffled), at distinct steps between 10% and 85% of
    the run, each on a random target."""
    rng = random.Random(seed)
    picked = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(picked)
    at = sorted(rng.sample(fault_steps(steps), count))
    return [Fault(kind, step, rng.randrange(targets), round(rng.uniform(2, 8), 1)) for kind, step in zip(picked, at)]


class Progress:
    """Step ends (step -> time.time()) from a run's TensorBoard files (one per process that wrote
    points), read incrementally."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.readers = folder, {}

    def points(self) -> dict[Path, dict[int, float]]:
        found = {}
        for events in sorted(self.folder.rglob("events.out.tfevents.*")):
            reader = self.readers.setdefault(events, EventAccumulator(str(events), size_guidance={"scalars": 0}))
            reader.Reload()
            if TAG in reader.Tags()["scalars"]:
                found[events] = {e.step: e.wall_time for e in reader.Scalars(TAG)}
        return found

    def ends(self) -> dict[int, float]:
        merged: dict[int, float] = {}
        for ends in self.points().values():
            for step, at in ends.items():
                merged[step] = max(merged.get(step, 0.0), at)
        return merged

    def step(self) -> int:
        return max(self.ends(), default=0)

    def trained_after(self, wall: float, fresh: bool) -> bool:
        """A step ended after `wall`, by a process started after it when `fresh`."""
        return any(max(ends.values()) > wall and (not fresh or min(ends.values()) > wall)
                   for ends in self.points().values() if ends)

    def trained_again(self) -> int:
        """Steps that more than one process logged (per folder of points: each group's own)."""
        steps: dict[tuple[Path, int], int] = {}
        for events, ends in self.points().items():
            for step in ends:
                steps[(events.parent, step)] = steps.get((events.parent, step), 0) + 1
        return sum(n - 1 for n in steps.values())


class Job:
    """A launcher's process tree, its output kept with the time each line came. Each runs in a
    session of its own (a terminal's Ctrl-C reaches the benchmark alone), so every one started is
    kept in STARTED for a stopped benchmark to end (end_every_run)."""

    def __init__(self, command: list[str], env: dict[str, str], prefix: str = "") -> None:
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, errors="replace", start_new_session=True)
        STARTED.append(self)
        self.lines: list[tuple[float, str]] = []
        self.prefix = prefix
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), self.prefix + line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        """Its status once it ended and its last lines are read (see status), or TimeoutExpired. A
        process of its tree that outlives it holds its output open: `held` says so (the reader gave up)."""
        self.process.wait(timeout)
        self.reader.join(OUTPUT_HELD_S)
        return self.status()

    @property
    def held(self) -> bool:
        return self.reader.is_alive()

    def status(self) -> int | None:
        """Its exit status as a shell gives it (128 + N for a signal N); None while it runs."""
        code = self.process.poll()
        return 128 - code if code is not None and code < 0 else code

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


STARTED: list[Job] = []


def held_output(jobs: list[Job]) -> list[str]:
    """A process that outlived its launcher by OUTPUT_HELD_S still held the launcher's output: one left
    behind, which may have ended by the time the run's processes are counted."""
    return [f"a process still held the output of `{' '.join(job.process.args[-3:])}` {OUTPUT_HELD_S} s after it "
            "ended" for job in jobs if job.process.poll() is not None and job.held]


class Stopped(Exception):
    """A SIGTERM to the benchmark: it ends its runs as on a Ctrl-C."""


def stop_on_sigterm(signum: int, frame: object) -> None:
    raise Stopped


def end_every_run(folder: Path) -> None:
    """SIGKILL to each launcher's process group whose leader is not yet reaped (a reaped leader's
    pid, and so its group's id, may be another process's by now), then to any process that names
    the runs' folder (a group whose leader ended first, an orphan)."""
    for job in STARTED:
        if job.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(job.process.pid, signal.SIGKILL)
    for pid in left_behind(folder):
        signal_pid(pid, signal.SIGKILL)


def worker_of(agent: int, script: str, timeout: float = 120) -> int | None:
    """The training process under a torchrun agent (None if none comes within `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:  # looked for once at least (timeout 0: now)
        for pid in children(agent):
            if script in command_line(pid):
                return pid
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def identity(pid: int | None) -> tuple[int, int] | None:
    """A process as (pid, its start time in clock ticks since boot): a reused pid is another process."""
    ticks = start_ticks(pid) if pid else None
    return None if ticks is None else (pid, ticks)


def signal_pid(pid: int | None, signum: int) -> bool:
    """False when there was no such process (it had ended, or never came)."""
    if not pid:
        return False
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


def hit(fault: Fault, pid: int | None, signum: int) -> bool:
    """signal_pid, a miss noted on the fault: a fault whose signal found no process did not happen."""
    if signal_pid(pid, signum):
        return True
    fault.notes.append(f"{signal.Signals(signum).name} found no process ({'pid ' + str(pid) if pid else 'none'})")
    return False


def after(seconds: float, action: Callable[..., object], *args: object) -> None:
    """action(*args) in `seconds`, on a daemon thread: a stopped benchmark does not wait for it."""
    timer = threading.Timer(seconds, action, args)
    timer.daemon = True
    timer.start()


def left_behind(folder: Path) -> list[int]:
    """Processes whose command line names the run's folder, or whose environment has the run's TMPDIR
    (run_env gives it every process a run starts: a Lighthouse, ft.sh's own helpers, a spawned child,
    whatever its command line), orphans included."""
    mine, scratch = str(folder), f"TMPDIR={folder}/".encode()  # a run's TMPDIR, or any run's under a root
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            named = mine in command_line(int(proc.name))
            ours = any(entry.startswith(scratch) for entry in (proc / "environ").read_bytes().split(b"\0"))
            if (named or ours) and int(proc.name) != os.getpid():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def temp_files(folder: Path, torch_keeps: tuple[str, ...]) -> list[Path]:
    """What the run left that was to be temporary: a write's temp file beside its target, and anything
    in the run's TMPDIR (run_env) but what torch keeps there by design: the compiler's cache folder while
    empty, and the folders named by `torch_keeps` (the mode's: plain torchrun's logs in restart mode)."""
    def kept(left: Path) -> bool:
        if left.name.startswith(INDUCTOR_CACHE):
            return not any(left.rglob("*"))
        return left.name.startswith(torch_keeps)
    scratch = [left for left in (folder / "tmp").glob("*") if not kept(left)]
    return sorted(folder.rglob(".*.tmp-*")) + sorted(scratch)


def run_env(folder: Path) -> dict[str, str]:
    """The environment of a run's processes: TMPDIR a folder of the run's, so that temp_files sees
    what they leave there."""
    (folder / "tmp").mkdir(parents=True, exist_ok=True)
    return {**child_env(), "TMPDIR": str(folder / "tmp")}


def max_dw(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference between two states of the same keys; inf where the keys or a shape differ,
    nan where either holds a NaN (neither is 0: the oracle fails)."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return math.inf
    gaps = [(a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0 for k in a]
    return math.nan if any(math.isnan(g) for g in gaps) else max(gaps, default=0.0)


def tracebacks(text: str) -> int:
    """Python's tracebacks and fatal errors, C++ frame dumps and uncaught exceptions, Rust panics (the
    Lighthouse's)."""
    return (text.count("Traceback (most recent call last)") + text.count("Fatal Python error")
            + text.count("terminate called") + text.count("panicked at")
            + len(re.findall(r"^\S*\s*frame #0", text, re.M)))


def said_since(job: Job, since: float, pattern: str, timeout: float) -> str | None:
    """The first line matching `pattern` the job printed after `since` (time.monotonic()), waited for
    until `timeout` seconds from now or the job's end (None if none came)."""
    wanted, deadline = re.compile(pattern), time.monotonic() + timeout
    while True:
        ended = job.process.poll() is not None
        found = [line for at, line in list(job.lines) if at > since and wanted.search(line)]
        if found or ended or time.monotonic() > deadline:
            return found[0] if found else None
        time.sleep(0.1)


def fill(path: Path) -> None:
    """Write `path` until its disk is full."""
    with path.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 20))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


def mount_tmpfs(path: Path, size: str) -> str | None:
    """A tmpfs of `size` at `path`; why not, where this host cannot (it needs root)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                             text=True, timeout=30)
    return f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}" if mounted.returncode else None


class Dropper:
    """A stopped store's port that accepts every connection and closes it at once (as a proxy in front of
    a stopped store does), counting them: the runner knows when a client met the outage."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", port))
        self.listener.settimeout(0.2)  # a blocked accept() would keep the port open after close()
        self.dropped, self.over = 0, threading.Event()
        self.thread = threading.Thread(target=self._drop, daemon=True)
        self.thread.start()

    def _drop(self) -> None:
        while not self.over.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            connection.close()
            self.dropped += 1

    def tried(self, timeout: float) -> bool:
        """Whether a connection came (since `dropped` was last set to 0) within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.dropped and time.monotonic() < deadline:
            time.sleep(0.05)
        return bool(self.dropped)

    def __enter__(self) -> Dropper:
        return self

    def __exit__(self, *_) -> None:
        self.over.set()
        self.thread.join(5)
        self.listener.close()


class Namespace:
    """A network namespace of its own for a job (its loopback up), whose loopback a fault can slow
    without touching anything else on the host."""

    NETEM = ["netem", "delay", "20ms", "10ms", "loss", "2%"]
    RATE = ["tbf", "rate", "8mbit", "burst", "32kb", "latency", "200ms"]  # ~0.15 s more per step for the convnet

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: list[str] = []

    def __enter__(self) -> Namespace:
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True, timeout=30)
        self.exec("ip", "link", "set", "lo", "up")
        return self

    def __exit__(self, *_) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def exec(self, *command: str) -> bool:
        return not subprocess.run([*self.prefix(), *command], capture_output=True, timeout=30).returncode

    def slow(self) -> bool:
        return self.exec("tc", "qdisc", "add", "dev", "lo", "root", *self.queue)

    def restore(self) -> bool:
        return self.exec("tc", "qdisc", "del", "dev", "lo", "root")

    def pick_queue(self) -> str | None:
        """netem's delay and loss where the kernel has it, else a rate limit; why not, where neither."""
        for queue in (self.NETEM, self.RATE):
            self.queue = queue
            if self.slow():
                self.restore()
                return None
        return "tc has neither netem nor tbf on this host"

    def describe(self) -> str:
        if self.queue == self.NETEM:
            return "netem: 20 +- 10 ms delay and 2% loss on every packet"
        return "a rate limit of 8 Mbit/s (tbf): this kernel has no netem, so no delay or loss"


def link_refusal() -> str | None:
    """Why this host cannot slow a job's link (None: it can)."""
    missing = [tool for tool in ("ip", "tc") if not shutil.which(tool)]
    if missing:
        return f"no {' or '.join(missing)} on this host"
    probe = Namespace(f"chaos-probe-{os.getpid()}")
    try:
        with probe:
            return probe.pick_queue()
    except subprocess.CalledProcessError as e:
        return f"cannot make a network namespace (needs root): {e.stderr.decode(errors='replace').strip()}"


class Chaos:
    """One mode's run with its faults, and what the oracle needs of it."""

    script = ""

    model = "lenet"
    kept = 3  # --keep of the training script: its default, unless --checkpoints-kept says more
    launcher_code: int | None = None  # the launcher's own status, where the job's is not it (ReplicaGroups)
    torch_keeps: tuple[str, ...] = ()  # what torch leaves in TMPDIR by design under this mode's launcher

    def __init__(self, folder: Path, data: Path, epochs: int, batch: int, slow_steps: float) -> None:
        self.folder, self.data, self.epochs, self.batch = folder, data, epochs, batch
        self.kills: dict[int, int] = {}  # target -> its processes the runner SIGKILLed (each once)
        self.kill_times: list[float] = []  # time.monotonic() of each of those kills
        self.killed: set[tuple[int, int] | None] = set()  # those processes (identity: a pid may be reused)
        self.run_notes: list[str] = []  # what went wrong with the run as a whole (the oracle fails on any)
        self.stalled = False  # ended as hung (wait_for)
        self.patches = f"slow-steps={slow_steps}"  # steps long enough for a fault's recovery to be a part of the run
        self.progress = Progress(folder / "tb")
        self.checkpoints = str(folder / "ckpt")  # --checkpoint-dir: a folder, or a URL
        self.job: Job | None = None

    def flags(self) -> list[str]:
        return ["--dataset", "mnist", "--data-dir", str(self.data), "--model", self.model, "--epochs", str(self.epochs),
                "--batch-size", str(self.batch), "--lr", "0.05", "--log-every", "1",
                "--checkpoint-dir", self.checkpoints, "--log-dir", str(self.folder / "tb"), "--keep", str(self.kept)]

    def run(self, faults: list[Fault]) -> int:
        """Each fault lands once the run has reached its step and a target is free (its action in a
        thread of its own, so that a slow one does not hold the schedule)."""
        self.start()
        self.landed: list[Fault] = []
        for fault in faults:
            self.wait_for(fault.step)
            deadline = time.monotonic() + 300
            while self.running() and not self.free(fault) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.running():
                fault.notes.append("the run had ended")
                continue
            if not self.free(fault):
                fault.notes.append("no target free within 300 s")
                continue
            fault.landed = time.monotonic()
            self.landed.append(fault)
            threading.Thread(target=self.land, args=(fault,), daemon=True).start()
        return self.finish()

    def wait_for(self, step: int) -> None:
        """Until the run has trained `step` steps or ended; a run that trains no step for STALL_S is ended
        (a run note: the oracle fails), so that a hung job does not hold the benchmark."""
        reached, moved = self.progress.step(), time.monotonic()
        while reached < step and self.running():
            time.sleep(0.2)
            now = self.progress.step()
            if now != reached:
                reached, moved = now, time.monotonic()
            elif time.monotonic() - moved > STALL_S:
                self.stalled = True
                self.run_notes.append(f"the run trained no step for {STALL_S} s after step {reached}: ended")
                end_every_run(self.folder)
                return

    def land(self, fault: Fault) -> None:
        """The fault's action; one that fails says so in the table (it never comes back)."""
        try:
            getattr(self, fault.kind.replace("-", "_"))(fault)
        except Exception as e:  # noqa: BLE001 - any failure of the runner's own action is the fault's note
            fault.notes.append(f"the runner's action failed: {type(e).__name__}: {e}")

    def free(self, fault: Fault) -> bool:
        """Whether the fault may land now (and on which target: it may change `fault.target`)."""
        return all(f.back is not None for f in self.landed)

    def back_when_trained(self, fault: Fault, progress: Progress | None = None, fresh: bool = True,
                          since: float | None = None) -> None:
        """The target is back when it trains a step after the fault (`since`, a time.time(); default:
        now): a process started after it (a restart, a heal), or, `fresh` False, the same process (a
        freeze, after its thaw). A run that ends first leaves it not back."""
        progress = progress or self.progress
        since = (time.time() if since is None else since) + (fault.seconds if not fresh else 0.0)

        def wait() -> None:
            while True:
                ended = not self.running()  # read first: a run that trains and ends between two polls is read once more
                if progress.trained_after(since, fresh):
                    fault.back = time.monotonic()
                    return
                if ended:
                    break
                time.sleep(0.2)
            fault.notes.append("its target had not trained again when the run ended")
        threading.Thread(target=wait, daemon=True).start()

    def process(self, target: int, timeout: float = 60) -> int | None:
        """The training process a fault hits (a group's worker, a rank); None if none within `timeout`."""
        raise NotImplementedError

    def processes(self) -> set[int]:
        """Every training process of the run now."""
        raise NotImplementedError

    def back(self, fault: Fault, fresh: bool = True, since: float | None = None) -> None:
        """Mark the fault's target back once it trains again (see back_when_trained)."""
        raise NotImplementedError

    def kill(self, fault: Fault, pid: int | None) -> bool:
        """SIGKILL to one of the target's processes, counted once per process: each is to explain one
        restart (a second signal to a dying one explains nothing more)."""
        process = identity(pid)
        if not hit(fault, pid, signal.SIGKILL):
            return False
        if process is None or process not in self.killed:  # None: gone as it was signalled
            self.killed.add(process)
            self.kills[fault.target] = self.kills.get(fault.target, 0) + 1
            self.kill_times.append(time.monotonic())
        return True

    def was_killed(self, pid: int | None) -> bool:
        process = identity(pid)
        return process is not None and process in self.killed

    def kill_worker(self, fault: Fault) -> None:
        self.kill(fault, self.process(fault.target))
        self.back(fault)

    def freeze_worker(self, fault: Fault) -> None:
        worker = self.process(fault.target)
        hit(fault, worker, signal.SIGSTOP)
        after(fault.seconds, signal_pid, worker, signal.SIGCONT)
        self.back(fault, fresh=False)

    def kill_in_set_up(self, fault: Fault) -> None:
        """Killed, and its restarted process killed again 1 s after it started (importing torch, joining).
        The restarted process is looked for afresh at each poll: its launcher (a group's torchrun) may
        be a new one, whose pid replaces the old one's only once that one has ended."""
        before = self.processes()  # a process of these is not the restart (a dying peer, a zombie's neighbour)
        self.kill(fault, self.process(fault.target))
        last_kill = time.time()  # wall time, as the TensorBoard points that say the target is back
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = self.process(fault.target, timeout=0.5)
            if new and new not in before and not self.was_killed(new):
                time.sleep(1.0)  # into the new process's set-up
                if self.kill(fault, new):
                    last_kill = time.time()
                break
            time.sleep(0.1)  # a poll with a deadline: the launcher starts the process again
        else:
            fault.notes.append("no process started again within 60 s")
        self.back(fault, since=last_kill)

    def start(self) -> None:
        raise NotImplementedError

    def running(self) -> bool:
        raise NotImplementedError

    def finish(self) -> int:
        raise NotImplementedError

    def output(self) -> str:
        raise NotImplementedError


class ReplicaGroups(Chaos):
    script = "train_ft.py"
    model = "convnet"  # BatchNorm: its statistics go through the faults too

    def __init__(self, folder: Path, data: Path, epochs: int, batch: int, slow_steps: float, groups: int,
                 ft_timeout_s: float, namespace: Namespace | None = None) -> None:
        super().__init__(folder, data, epochs, batch, slow_steps)
        self.groups, self.logs, self.namespace = groups, folder / "ft-logs", namespace
        self.env = {**run_env(folder), "FT_PORT": str(free_port()), "FT_LOGS": str(self.logs), "FT_RESTARTS": "100",
                    "FT_LIGHTHOUSE_RESTARTS": "100"}
        self.ft_timeout_s = ft_timeout_s  # train_ft.py's: how long a cross-group sum waits for a dead group
        self.rejoined: dict[int, Job] = {}  # a group started again by hand: its latest launch
        self.rejoins: list[Job] = []  # every such launch, for the output
        self.relaunched: dict[int, int] = {}  # group -> the times the runner started a rejoined group again
        self.supervisors: list[threading.Thread] = []

    def training(self) -> list[str]:
        return ["tests/patched.py", self.patches, self.script, *self.flags(),
                "--groups", str(self.groups), "--exact-sums", "--ft-timeout-s", f"{self.ft_timeout_s:g}"]

    def start(self) -> None:
        self.job = Job([*self.inside(), "bash", "launch/ft.sh", str(self.groups), "1", *self.training()], self.env)

    def inside(self) -> list[str]:
        """What runs a command in the job's network namespace (ip netns exec execs it: the pid is the same)."""
        return self.namespace.prefix() if self.namespace else []

    def running(self) -> bool:
        return self.job.process.poll() is None

    def finish(self) -> int:
        self.wait_for(math.inf)  # its end, or a stall (then it is ended)
        code = self.job.wait(60)
        for supervisor in list(self.supervisors):  # each sees the run ended: it starts nothing more
            supervisor.join(RUN_S)
        self.launcher_code = code
        self.run_notes += self.unfinished() + self.unexplained_restarts() + held_output(self.launches())
        return self.job_status(code)

    def group_ends(self) -> dict[int, list[str]]:
        """Group -> how each of its processes started by ft.sh ended, in order (ft.sh's lines)."""
        ends: dict[int, list[str]] = {}
        for _, line in list(self.job.lines):
            if said := GROUP_ENDED.match(line):
                ends.setdefault(int(said[1]), []).append(said[2])
        return ends

    def unfinished(self) -> list[str]:
        """Every group must finish the run (ft.sh exits 0 once one did): its last process, ft.sh's or
        one the runner started again by hand, ended 0."""
        ends, notes = self.group_ends(), []
        for group in range(self.groups):
            if group in self.rejoined:
                code = self.rejoined[group].status()
                if code != 0:
                    notes.append(f"group {group}, started again by hand, did not finish the run (status {code})")
            elif not ends.get(group) or ends[group][-1] != "finished":
                last = ends[group][-1] if ends.get(group) else "no end said by ft.sh"
                notes.append(f"group {group} did not finish the run ({last})")
        return notes

    def unexplained_restarts(self) -> list[str]:
        """A group's process that died with no kill of this runner's behind it is a failure a restart hid."""
        ends, notes = self.group_ends(), []
        for group in range(self.groups):
            lost = sum(1 for end in ends.get(group, []) if end.startswith("lost")) + self.relaunched.get(group, 0)
            killed = self.kills.get(group, 0)
            if lost > killed:
                notes.append(f"group {group} was lost {lost} times, {killed} of them by this runner's kills: a process "
                             "died of something else")
        return notes

    def job_status(self, code: int) -> int:
        """ft.sh's status, or the groups' that finished the run in its place. ft.sh says 143 when every
        group it started left on SIGTERM (test_ft: its groups left) and none of them finished: where
        that SIGTERM was this runner's (leave-and-rejoin, every group), the run is the rejoined groups',
        and their last launches say how it ended."""
        last = [job.status() for job in self.rejoined.values()]
        if code != 128 + signal.SIGTERM or set(self.rejoined) != set(range(self.groups)) or None in last:
            return code
        return next((status for status in last if status), 0)

    def output(self) -> str:
        """Every launch's lines, and the Lighthouse's log (ft.sh appends each restart's to it)."""
        lighthouse = self.logs / "lighthouse.log"
        log = lighthouse.read_text(errors="replace") if lighthouse.exists() else ""
        return "\n".join([*(job.text() for job in self.launches()), log])

    def lines(self) -> list[tuple[float, str]]:
        return [line for job in self.launches() for line in list(job.lines)]

    def launches(self) -> list[Job]:
        """ft.sh's, then every group started again by hand."""
        return [self.job, *self.rejoins]

    def agent(self, group: int) -> int | None:
        if group in self.rejoined:
            return self.rejoined[group].process.pid
        try:
            return int((self.logs / f"group{group}.pid").read_text())
        except (OSError, ValueError):
            return None

    def worker(self, group: int, timeout: float = 60) -> int | None:
        agent = self.agent(group)
        return worker_of(agent, self.script, timeout) if agent else None

    def free(self, fault: Fault) -> bool:
        """One group at least is never faulted at once: the run goes on through anything else. A
        fault whose target is away moves to a group that is not."""
        if fault.kind in JOB_WIDE:
            return all(f.back is not None for f in self.landed if f.kind == fault.kind)
        away = {f.target for f in self.landed if f.back is None and f.kind not in JOB_WIDE}
        if len(away) + 1 >= self.groups:
            return False
        if fault.target in away:
            fault.target = min(set(range(self.groups)) - away)
        return True

    def back(self, fault: Fault, fresh: bool = True, since: float | None = None) -> None:
        """The target group is back when it trains a step after the fault (healed, or thawed)."""
        self.back_when_trained(fault, Progress(self.folder / "tb" / f"group{fault.target}"), fresh, since)

    def process(self, target: int, timeout: float = 60) -> int | None:
        return self.worker(target, timeout)

    def processes(self) -> set[int]:
        return {pid for group in range(self.groups) if (pid := self.worker(group, timeout=0))}

    def kill_while_healing(self, fault: Fault) -> None:
        """Killed, and again as its restart heals: once its quorum says it copies a live group's state
        (the copy comes with the step's commit, a few ms to a few s later). A restart that joins without
        a heal (it resumed from a checkpoint of the very step its peers were held at, waiting for a
        quorum) is killed again as the first time, until one heals."""
        self.kill(fault, self.worker(fault.target))
        killed, deadline = time.time(), time.monotonic() + 120
        while met := self.restart_in_quorum(fault.target, deadline):
            pid, healing = met
            self.kill(fault, pid)
            killed = time.time()
            if healing:
                break
        else:
            fault.notes.append("no heal to interrupt")
        self.back(fault, since=killed)  # a process started after the last kill: not after the wait for a heal

    def restart_in_quorum(self, group: int, deadline: float) -> tuple[int, bool] | None:
        """(pid, whether it heals) of the group's next restart, once its quorum line came: a line said
        after that process was first seen, so that a line the killed process said as it died, read
        late, is not taken for its restart's. None by the deadline."""
        quorum = re.compile(rf"^\[g{group}\] quorum of .*(\(healing\)|is number)")
        restart, seen = None, 0.0
        while time.monotonic() < deadline:
            pid = self.worker(group, timeout=0)
            if pid and pid != restart and not self.was_killed(pid):
                restart, seen = pid, time.monotonic()
            if restart:
                met = [match for at, line in self.lines() if at >= seen and (match := quorum.search(line))]
                if met:
                    return restart, met[0][1] == "(healing)"
            time.sleep(0.02)
        return None

    def kill_agent(self, fault: Fault) -> None:
        self.kill(fault, self.agent(fault.target))
        self.back(fault)

    def leave_and_rejoin(self, fault: Fault) -> None:
        """SIGTERM: the group leaves (ft.sh does not restart it); started again by hand later."""
        agent = self.agent(fault.target)
        try:
            os.killpg(agent, signal.SIGTERM)
        except (ProcessLookupError, TypeError):
            fault.notes.append("no group to stop")
            return
        supervisor = threading.Thread(target=self.rejoin, args=(fault,), daemon=True)
        self.supervisors.append(supervisor)
        supervisor.start()
        self.back(fault)

    def rejoin(self, fault: Fault) -> None:
        """The group started again by hand `fault.seconds` after it left, and kept as ft.sh keeps its
        groups: started again whenever it dies, but not once it finished, left, refused its flags or
        gave up (ft.sh's ENDED_FOR_GOOD statuses), nor after the run ended."""
        time.sleep(fault.seconds)
        if not self.running():  # alone, it would wait for a quorum that no Lighthouse gives
            fault.notes.append("the run had ended before the group was started again")
            return
        env = {**self.env, "REPLICA_GROUP_ID": str(fault.target), "FT_GROUPS": str(self.groups),
               "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{self.env['FT_PORT']}"}
        while True:
            job = Job([*self.inside(), sys.executable, "launch/quiet_torchrun.py", "--standalone",
                       "--nproc_per_node=1", *self.training()], env, f"[g{fault.target}] ")
            self.rejoined[fault.target] = job
            self.rejoins.append(job)
            try:
                code = job.wait(RUN_S)
            except subprocess.TimeoutExpired:
                self.run_notes.append(f"group {fault.target}, started again by hand, still ran {RUN_S} s later")
                return
            if code in ENDED_FOR_GOOD or not self.running():
                return
            self.relaunched[fault.target] = self.relaunched.get(fault.target, 0) + 1  # it died: started again

    def kill_lighthouse(self, fault: Fault) -> None:
        """Back: the groups' next step after ft.sh said it started the Lighthouse again."""
        try:
            found = hit(fault, int((self.logs / "lighthouse.pid").read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            fault.notes.append("no Lighthouse")
            found = False
        if not found:  # not back from nothing, but done: the schedule's next kill-lighthouse waits for it
            fault.back = time.monotonic()
            return
        if not said_since(self.job, fault.landed, r"^ft: the Lighthouse died .*; restarted", 60):
            fault.notes.append("ft.sh did not say it started the Lighthouse again within 60 s")
        fault.seconds = 0.0
        self.back_when_trained(fault, fresh=False)

    def slow_link(self, fault: Fault) -> None:
        """Every link of the job slowed (or lossy) for `fault.seconds`; back: a step after that."""
        if not self.namespace.slow():
            fault.notes.append(f"tc refused {' '.join(self.namespace.queue)}")
        after(fault.seconds, self.namespace.restore)
        self.back_when_trained(fault, fresh=False)


class Restarts(Chaos):
    script = "train_ddp.py"
    torch_keeps = (TORCHRUN_LOGS,)  # plain torchrun keeps a log folder per launch

    def __init__(self, folder: Path, data: Path, epochs: int, batch: int, slow_steps: float, save_every: int,
                 server: S3Server | None = None) -> None:
        """Checkpoints in the S3 server's bucket when one is given (--checkpoint-dir s3://...), else in
        the run's folder (a tmpfs, where the caller mounted one)."""
        super().__init__(folder, data, epochs, batch, slow_steps)
        self.save_every, self.jobs, self.restarting, self.server = save_every, [], False, server
        self.env = {**run_env(folder), "LOGLEVEL": "INFO"}  # torchrun's agent says each restart
        if server:
            self.checkpoints = f"s3://{BUCKET}/{folder.name}"
            self.env.update(server.env())

    def command(self) -> list[str]:
        return [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=100", "tests/patched.py",
                self.patches, self.script, *self.flags(),
                "--save-every-steps", str(self.save_every)]

    def start(self) -> None:
        self.jobs.append(Job(self.command(), self.env))
        self.job = self.jobs[-1]

    def running(self) -> bool:
        return self.job.process.poll() is None or self.restarting

    def finish(self) -> int:
        self.wait_for(math.inf)  # its end, or a stall (then it is ended)
        while True:
            job = self.job
            code = job.wait(RUN_S)
            while self.restarting:
                time.sleep(0.2)
            if self.job is job:
                self.run_notes += self.unexplained_restarts() + held_output(self.jobs)
                return code

    def unexplained_restarts(self) -> list[str]:
        """Each of torchrun's restarts must follow one of this runner's kills or failed saves not yet
        spent on an earlier restart: else a rank died of something else, and a restart hid it."""
        restarts = sorted(t for job in self.jobs for t, line in list(job.lines) if TORCHRUN_RESTARTED.search(line))
        causes = sorted([*self.kill_times, *(f.landed for f in self.landed if f.kind in ENDS_EVERY_RANK)])
        unexplained, spent = [], 0
        for at in restarts:
            if spent < len(causes) and causes[spent] <= at:
                spent += 1
            else:
                unexplained.append(at)
        if not unexplained:
            return []
        return [f"torchrun restarted the ranks {len(restarts)} times, {len(unexplained)} of them after none of this "
                "runner's kills and failed saves not yet spent: a rank died of something else"]

    def output(self) -> str:
        return "\n".join(job.text() for job in self.jobs)

    def rank(self, rank: int) -> int | None:
        """The worker of `rank`: torchrun's children in local-rank order."""
        workers = sorted(self.processes())
        return workers[rank] if len(workers) > rank else None

    def processes(self) -> set[int]:
        return {pid for pid in children(self.job.process.pid) if self.script in command_line(pid)}

    def process(self, target: int, timeout: float = 60) -> int | None:
        """The rank's worker now (torchrun restarts every rank at once: kill_in_set_up polls)."""
        return self.rank(target)

    def back(self, fault: Fault, fresh: bool = True, since: float | None = None) -> None:
        self.back_when_trained(fault, fresh=fresh, since=since)

    kill_rank, freeze_rank = Chaos.kill_worker, Chaos.freeze_worker

    def kill_while_saving(self, fault: Fault) -> None:
        """Rank 0 (the writer) as the run passes the next --save-every-steps step."""
        due = self.next_save()
        while self.progress.step() < due and self.running():
            time.sleep(0.02)
        self.kill(fault, self.rank(0))
        self.back_when_trained(fault)

    def next_save(self) -> int:
        return (self.progress.step() // self.save_every + 1) * self.save_every

    def full_disk(self, fault: Fault) -> None:
        """The checkpoint disk filled to less than a checkpoint's room: the next save fails, and every
        rank ends with the one line docs/fault-tolerance.md promises (checked). Then, as an operator
        would, the disk is freed; the same command (torchrun's next restart) resumes."""
        filler = Path(self.checkpoints) / "filler"
        fill(filler)
        line = said_since(self.job, fault.landed, r"^error: saving checkpoint .* failed \(No space left on device", 120)
        if not line:
            fault.notes.append("no ENOSPC line within 120 s")
        elif "is intact and the same command resumes from it" not in line:
            fault.notes.append(f"the line names no intact checkpoint: {line}")
        filler.unlink()
        self.back_when_trained(fault)

    def store_down_in_save(self, fault: Fault) -> None:
        """The store stopped until the next save has failed (the ranks end with one line), and `fault.seconds`
        more: torchrun restarts the ranks, and their resume waits for the store (RESUME_RETRY_S)."""
        self.server.stop()
        try:
            if not said_since(self.job, fault.landed, r"^error: saving checkpoint s3://.* failed", 120):
                fault.notes.append("no failed save within 120 s")
            time.sleep(fault.seconds)  # the outage's length, drawn
        finally:
            self.server.start()
        self.back_when_trained(fault)

    def store_down_in_resume(self, fault: Fault) -> None:
        """Once the store holds a checkpoint, a rank SIGKILLed and the store stopped: torchrun's restarted
        ranks find no store at resume, which asks again until it answers. Its port meanwhile drops every
        connection, counting them: the store starts again `fault.seconds` after the resume's first try
        (the client's own retries or the resume's, "the store did not answer at first", outlast it)."""
        if not said_since(self.job, 0.0, r"^saved s3://", 300):
            fault.notes.append("no checkpoint in the store within 300 s")
        before = self.processes()
        self.server.stop()
        try:
            with Dropper(self.server.port) as port:
                self.kill(fault, self.rank(fault.target))
                deadline = time.monotonic() + 120
                while self.rank(fault.target) in before | {None} and time.monotonic() < deadline:
                    time.sleep(0.1)  # a poll with a deadline: torchrun starts the ranks again
                port.dropped = 0  # the killed rank's writer is gone: what comes now is the resume
                if not port.tried(120):
                    fault.notes.append("no resume reached the store within 120 s")
                time.sleep(fault.seconds)  # the outage's length, drawn
        finally:
            self.server.start()
        self.back_when_trained(fault)

    def kill_during_evaluation(self, fault: Fault) -> None:
        """As the epoch's last step ends (its evaluation follows)."""
        per_epoch = IMAGES // self.batch
        due = (self.progress.step() // per_epoch + 1) * per_epoch
        while self.progress.step() < due and self.running():
            time.sleep(0.02)
        self.kill(fault, self.rank(fault.target))
        self.back_when_trained(fault)

    def kill_agent(self, fault: Fault) -> None:
        """torchrun's agent SIGKILLed: the job is gone (its workers end with it), and the same command is
        run again, as a cluster's scheduler would."""
        self.restarting = True
        try:
            hit(fault, self.job.process.pid, signal.SIGKILL)
            self.job.process.wait(60)
            if not self.stalled:  # a run ended as hung is not started again
                self.start()
        finally:  # else running() would stay true, and the schedule and finish() wait for ever
            self.restarting = False
        self.back_when_trained(fault)


def survivors_pause(ends_by_run: dict[int, float], fault: Fault, step_s: float) -> float:
    """The longest gap between two step ends in the 60 s after the fault, less a usual step."""
    times = sorted(t for t in ends_by_run.values())
    landed = time.time() - (time.monotonic() - fault.landed)
    gaps = [b - max(a, landed) for a, b in zip(times, times[1:]) if b > landed and a < landed + 60]
    return max(0.0, max(gaps, default=0.0) - step_s)


def report(mode: str, faults: list[Fault], chaos: Chaos, code: int, dw: float, processes: list[int],
           files: list[Path]) -> str:
    ends = chaos.progress.ends()
    steps = sorted(ends)
    step_s = statistics.median([ends[s] - ends[s - 1] for s in steps[1:] if s - 1 in ends] or [0.0])
    text = chaos.output()
    # steps logged by two processes (redone after a restart), and steps a group retried in place (train_ft.py)
    again = chaos.progress.trained_again() + len(re.findall(r"trained again on the same samples", text))
    rows = [f"| fault ({mode}) | drawn | landed | survivors' pause, median / max (s) | back after, median / max (s) |",
            "|---|---|---|---|---|"]
    for kind in sorted({f.kind for f in faults}):
        mine = [f for f in faults if f.kind == kind]
        landed = [f for f in mine if f.landed]
        pauses = [survivors_pause(ends, f, step_s) for f in landed]
        backs = [f.back - f.landed for f in landed if f.back]
        rows.append(f"| {kind} | {len(mine)} | {len(landed)} | {_stat(pauses)} | {_stat(backs)} ({len(backs)} back) |")
    rows += ["", f"faults landed {sum(1 for f in faults if f.landed)} of {len(faults)}; "
                 f"exit {code}{launched_as(chaos, code)}; max |dw| against the fault-free run {dw:.3g}; "
                 f"steps trained again {again}; "
                 f"processes left {len(processes)}; temporary files left {len(files)}; tracebacks {tracebacks(text)}; "
                 f"median step {step_s * 1000:.0f} ms"]
    notes = [f"{f.kind} at step {f.step}: {'; '.join(f.notes)}" for f in faults if f.notes]
    return "\n".join(rows + notes + [f"the run: {note}" for note in chaos.run_notes])


def launched_as(chaos: Chaos, code: int) -> str:
    if chaos.launcher_code in (None, code):
        return ""
    how = "finished the run" if code == 0 else f"ended with status {code}"
    return (f" (launch/ft.sh's {chaos.launcher_code}: every group it started had left; the groups started again in "
            f"their place {how})")


def _stat(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} / {max(values):.1f}" if values else "-"


def fault_free(mode: str, folder: Path, data: Path, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The fault-free run's weights (restart mode: one run for both stores: where checkpoints go does
    not change what is trained)."""
    chaos = make(mode, folder, data, args)
    code = chaos.run([])
    if code or chaos.run_notes:
        raise SystemExit(f"the fault-free {mode} run failed (exit {code}; {'; '.join(chaos.run_notes) or 'no note'}):"
                         f"\n{chaos.output()[-4000:]}")
    return latest_state(folder / "ckpt")["model"]


def make(mode: str, folder: Path, data: Path, args: argparse.Namespace, namespace: Namespace | None = None,
         server: S3Server | None = None) -> Chaos:
    chaos: Chaos = ReplicaGroups(folder, data, args.epochs, args.batch_size, args.slow_steps, args.groups,
                                 args.ft_timeout_s, namespace) \
        if mode == "ft" else Restarts(folder, data, args.epochs, args.batch_size, args.slow_steps, args.save_every,
                                      server)
    chaos.kept = args.checkpoints_kept
    return chaos


@contextlib.contextmanager
def s3_store() -> Iterator[S3Server]:
    """The local S3 server with the runs' bucket, for one run."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    server = S3Server(free_port())
    server.start()
    try:
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


def from_store(server: S3Server, prefix: str, folder: Path) -> Path:
    """The run's objects copied into `folder` (keys as paths), to read as a local checkpoint folder."""
    client = server.client()
    for found in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/").get("Contents", []):
        path = folder / found["Key"].removeprefix(f"{prefix}/")
        path.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(BUCKET, found["Key"], str(path))
    return folder


def prepare(mode: str, store: str | None, folder: Path, data: Path, args: argparse.Namespace,
            stack: contextlib.ExitStack) -> tuple[Chaos, tuple[str, ...], list[str]]:
    """The run under chaos in what its kinds need (a network namespace, a tmpfs, the S3 server, each
    given back by `stack`), the kinds it draws, and lines on how they land (or why one is not drawn)."""
    if mode == "ft":
        why = link_refusal()
        if why:
            return make(mode, folder, data, args), tuple(k for k in FT_KINDS if k != "slow-link"), \
                [f"slow-link not drawn: {why}"]
        namespace = stack.enter_context(Namespace(f"chaos-{os.getpid()}-{folder.name}"))
        namespace.pick_queue()
        return make(mode, folder, data, args, namespace), FT_KINDS, [f"slow-link: {namespace.describe()}"]
    if store == "s3":
        server = stack.enter_context(s3_store())
        return make(mode, folder, data, args, server=server), RESTART_KINDS + STORES[store], \
            [f"checkpoints in the local S3 server: --checkpoint-dir s3://{BUCKET}/{folder.name}"]
    why = mount_tmpfs(folder / "ckpt", DISK_SIZE)
    if why:
        return make(mode, folder, data, args), RESTART_KINDS, [f"full-disk not drawn: {why}"]
    stack.callback(subprocess.run, ["umount", "-l", str(folder / "ckpt")], capture_output=True, timeout=30)
    return make(mode, folder, data, args), RESTART_KINDS + STORES[store], [f"checkpoints on a tmpfs of {DISK_SIZE}"]


@dataclass
class Outcome:
    """A run under chaos against the oracle."""
    lines: list[str]  # how its kinds land, or why one is not drawn
    faults: list[Fault]
    code: int
    dw: float  # max |dw| against the fault-free run
    processes: list[int]
    files: list[Path]
    tracebacks: int
    table: str
    run_notes: list[str]  # what went wrong with the run as a whole: a group that did not finish, a hidden death

    @property
    def not_back(self) -> list[Fault]:
        return [f for f in self.faults if f.landed and not f.back]

    @property
    def proved(self) -> bool:
        """The oracle held, and every fault happened as drawn: it landed, its target came back, and it has
        no note (a note says what did not go as drawn: a signal that found no process, a save that did not
        fail, a resume that never met the outage, a group not started again), and the run has none (every
        group finished, no process died that the runner did not kill, no stall)."""
        return (self.code == 0 and self.dw == 0 and not self.processes and not self.files and not self.tracebacks
                and all(f.landed and not f.notes for f in self.faults) and not self.not_back and not self.run_notes)


def chaos_run(mode: str, store: str | None, seed: int, count: int, args: argparse.Namespace, tmp: Path, data: Path,
              planned: dict[str, torch.Tensor]) -> Outcome:
    folder = tmp / f"{mode}{'-' + store if store else ''}-seed{seed}"
    with contextlib.ExitStack() as stack:
        chaos, kinds, lines = prepare(mode, store, folder, data, args, stack)
        kinds = tuple(k for k in kinds if not args.kinds or k in args.kinds)
        if not kinds:  # the kinds asked for are ones this host cannot inject: the lines say why
            raise SystemExit(f"error: --kinds {','.join(args.kinds)}: none can be drawn in {mode} mode "
                             f"{f'with the {store} store ' if store else ''}on this host ({'; '.join(lines)})")
        faults = draw(kinds, count, run_steps(args), args.groups if mode == "ft" else 2, seed)
        code = chaos.run(faults)
        (folder / "output.txt").write_text(chaos.output())
        time.sleep(5)  # what a fault orphaned has its deadline to end (a watch polls every 0.5 s)
        saved = from_store(chaos.server, folder.name, folder / "ckpt") if store == "s3" else folder / "ckpt"
        if not any(saved.rglob("step-*.pt")):
            raise SystemExit(f"the {mode} run under chaos saved nothing (exit {code}):\n{chaos.output()[-4000:]}")
        dw = max_dw(latest_state(saved)["model"], planned)
        processes, files = left_behind(folder), temp_files(folder, chaos.torch_keeps)
    for pid in processes:
        signal_pid(pid, signal.SIGKILL)
    return Outcome(lines, faults, code, dw, processes, files, tracebacks(chaos.output()),
                   report(mode, faults, chaos, code, dw, processes, files), chaos.run_notes)


def run_steps(args: argparse.Namespace) -> int:
    return args.epochs * (IMAGES // args.batch_size)


def room(steps: int) -> int:
    """How many faults a run of `steps` steps has distinct steps for."""
    return len(fault_steps(steps))


def runs_kinds(modes: tuple[str, ...], stores: list[str]) -> dict[str, tuple[str, ...]]:
    """Each run's kinds (before --kinds and the host's limits), by its name in an error."""
    kinds = {"ft mode": FT_KINDS} if "ft" in modes else {}
    if "restart" in modes:
        kinds.update({f"restart mode with --stores {store}": RESTART_KINDS + STORES[store] for store in stores})
    return kinds


def checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[int], list[str], tuple[str, ...]]:
    """The seeds, stores and modes; a flag that would fail a run (after its fault-free run, minutes
    in) or prove nothing is one line and exit 2 now."""
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds {args.seeds}: a comma-separated list of integers, such as 1,2,3")
    stores = args.stores.split(",")
    if not set(stores) <= set(STORES):
        p.error(f"--stores {args.stores}: each store is one of {', '.join(STORES)}")
    for flag, value, least in (("--faults", args.faults, 1), ("--epochs", args.epochs, 1),
                               ("--batch-size", args.batch_size, 1), ("--save-every", args.save_every, 1),
                               ("--groups", args.groups, 2), ("--slow-steps", args.slow_steps or 0, 0),
                               ("--ft-timeout-s", args.ft_timeout_s, 0.5),
                               ("--checkpoints-kept", args.checkpoints_kept, 2)):
        if not value >= least:  # nan too
            p.error(f"{flag} {value}: at least {least}")
    if args.keep and Path(args.keep).exists() and (not Path(args.keep).is_dir() or any(Path(args.keep).iterdir())):
        p.error(f"--keep {args.keep}: not a new or empty folder (runs in a used one would resume from its "
                "checkpoints); name a new folder")
    if args.batch_size > IMAGES:
        p.error(f"--batch-size {args.batch_size}: at most {IMAGES} (the training set's images)")
    if args.faults > room(run_steps(args)):
        p.error(f"--faults {args.faults}: a run of {run_steps(args)} steps (--epochs {args.epochs}, --batch-size "
                f"{args.batch_size}) has room for {room(run_steps(args))}; ask for fewer faults or more epochs")
    modes = ("ft", "restart") if args.mode == "both" else (args.mode,)
    known = {kind for kinds in runs_kinds(("ft", "restart"), list(STORES)).values() for kind in kinds}
    if args.kinds and not set(args.kinds) <= known:
        p.error(f"--kinds: {', '.join(sorted(set(args.kinds) - known))} unknown; the kinds: {', '.join(sorted(known))}")
    for run, kinds in runs_kinds(modes, stores).items():
        if args.kinds and not set(args.kinds) & set(kinds):
            p.error(f"--kinds {','.join(args.kinds)}: none is drawn in {run} (its kinds: {', '.join(kinds)}); "
                    "add one of them, or choose --mode or --stores")
    return seeds, stores, modes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("ft", "restart", "both"), default="both")
    p.add_argument("--faults", type=int, default=30, help="faults per run, every kind drawn (default: %(default)s)")
    p.add_argument("--seeds", default="1,2,3", help="one run per seed (default: %(default)s)")
    p.add_argument("--stores", default="disk,s3",
                   help="restart mode: one run per seed for each of these checkpoint stores (default: %(default)s)")
    p.add_argument("--kinds", type=lambda text: text.split(","),
                   help="draw only these kinds, a comma-separated list (default: every kind of the mode)")
    p.add_argument("--epochs", type=int, default=40, help="of 1,200 MNIST-format images (default: %(default)s)")
    p.add_argument("--slow-steps", type=float, default=None,
                   help="seconds added to each step of a run under chaos, so that recoveries happen inside the run "
                        f"(default: {', '.join(f'{s} in {m} mode' for m, s in SLOW_STEPS.items())}: in ft mode the "
                        "others train on while a group recovers; the fault-free run is not slowed)")
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--groups", type=int, default=3, help="ft mode: replica groups of one process")
    p.add_argument("--ft-timeout-s", type=float, default=FT_TIMEOUT_S,
                   help="ft mode: train_ft.py's --ft-timeout-s, how long the survivors' cross-group sum waits for a "
                        "group that died inside it (default: %(default)g)")
    p.add_argument("--save-every", type=int, default=20, help="restart mode: --save-every-steps")
    p.add_argument("--keep", help="a folder to keep the runs' files in (default: a temporary one)")
    p.add_argument("--checkpoints-kept", type=int, default=3,
                   help="each run's checkpoints kept (its --keep): more, with --keep, to find the first step at "
                        "which a run that was not proved left the fault-free one (default: %(default)s)")
    return p


def run_all(args: argparse.Namespace, seeds: list[int], stores: list[str], modes: tuple[str, ...],
            tmp: Path) -> bool:
    """Every mode's fault-free run, then its runs under chaos, each reported as it ends; True if
    every one was proved."""
    data = write_mnist(tmp / "mnist")
    proved = True
    for mode in modes:
        unslowed = argparse.Namespace(**{**vars(args), "slow_steps": 0})  # the weights do not depend on it
        planned = fault_free(mode, tmp / f"{mode}-fault-free", data, unslowed)
        slow = SLOW_STEPS[mode] if args.slow_steps is None else args.slow_steps
        slowed = argparse.Namespace(**{**vars(args), "slow_steps": slow})
        for store in stores if mode == "restart" else [None]:
            for seed in seeds:
                outcome = chaos_run(mode, store, seed, args.faults, slowed, tmp, data, planned)
                title = f"{mode}{f' ({store})' if store else ''}, seed {seed}, {args.faults} faults"
                table = "\n".join([*outcome.lines, "", outcome.table])
                print(f"\n## {title}: {'proved' if outcome.proved else 'NOT proved'}\n\n{table}", flush=True)
                proved &= outcome.proved
    return proved


def main() -> None:
    p = parser()
    args = p.parse_args()
    seeds, stores, modes = checked(p, args)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep or scratch)
        try:
            proved = run_all(args, seeds, stores, modes, tmp)
        except (KeyboardInterrupt, Stopped) as stop:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the ending short
            end_every_run(tmp)
            how, code = ("Ctrl-C", 130) if isinstance(stop, KeyboardInterrupt) else ("SIGTERM", 143)
            kept = f"; the runs' files are in {args.keep}" if args.keep else ""
            print(f"bench chaos: stopped ({how}); every process of its runs was ended{kept}", file=sys.stderr)
            sys.exit(code)
        except Exception:  # the runner's own failure: its runs' processes (each in a session of its own) end too
            end_every_run(tmp)
            raise
    sys.exit(0 if proved else 1)


if __name__ == "__main__":
    main()
