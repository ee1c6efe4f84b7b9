"""Waits with deadlines: a node's data preparation killed mid-way, and rank 0's storage I/O slower
than --timeout-s or hung for good. Real torchrun processes; the faults come from tests/patched.py."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from common.parallel import context as distributed
from common.parallel.context import DeadlinePassed, Heartbeat, Unanswered, run_with_heartbeat, wait_for_keys
from tests.conftest import ENDS_PROMPTLY_S, ROOT, child_env, error_lines, script_command

SMALL = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--batch-size", "32",
         "--epochs", "1", "--max-steps", "2"]
STALE_S = 5  # the heartbeat bound the tests run with (stale-after=5); the default is 30 s
SLEEP_AT = re.compile(r"storage op \d+ \(\w+ \S+\) sleeps \S+ s at ([\d.]+)")


def test_a_killed_preparing_process_ends_the_other_node(mnist_root, tmp_path):
    """Before: node 0 polled the store for node 1's data for ever."""
    pid_file = tmp_path / "preparing.pid"
    command = ["bash", "launch/local_two_nodes.sh", "tests/patched.py",
               f"stale-after={STALE_S},hang-preparing={pid_file}", "train_ddp.py", "--dataset", "mnist", "--model",
               "lenet", "--batch-size", "32", "--epochs", "1", "--max-steps", "2", "--data-dir", str(mnist_root),
               "--cache-dir", str(tmp_path / "cache"),
               "--checkpoint-dir", str(tmp_path / "ckpt")]
    job = subprocess.Popen(command, cwd=ROOT, env={**child_env(), "NPROC": "1"}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        pid = wait_for_pid(pid_file, job)
        os.kill(pid, signal.SIGKILL)  # what the OOM killer does
        killed = time.monotonic()
        out, err = job.communicate(timeout=STALE_S + 2 * ENDS_PROMPTLY_S)
        seconds = time.monotonic() - killed
    finally:
        job.kill()
    print(f"\nnode 1's preparing process SIGKILLed: the job ended {seconds:.1f} s later (heartbeat bound {STALE_S} s)")
    assert job.returncode != 0
    errors = error_lines(err) + error_lines(out)
    assert len(errors) == 1, out[-2000:] + err[-3000:]
    assert errors[0].startswith(f"error: the data preparation on node 1 (host {os.uname().nodename}, pid {pid})"), \
        errors
    assert seconds < STALE_S + ENDS_PROMPTLY_S  # not a wait for ever


def wait_for_pid(pid_file: Path, job: subprocess.Popen, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while not (pid_file.is_file() and pid_file.read_text()):
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, "node 1 never started preparing its data"
        time.sleep(0.2)  # a poll with a deadline
    return int(pid_file.read_text())


def run_patched(patch: str, tmp_path: Path, *flags: str,
                timeout: float = 2 * ENDS_PROMPTLY_S) -> subprocess.CompletedProcess:
    command = script_command(["tests/patched.py", patch, str(ROOT / "train_ddp.py"), *SMALL, "--checkpoint-dir",
                              str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "tb"), *flags], nproc=2)
    return subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)


def test_storage_slower_than_the_timeout_completes(tmp_path):
    """Before: rank 1 waited in a collective bounded by --timeout-s while rank 0 wrote or read,
    and timed out with a traceback. Op 2 is the step file's write in the last save (op 1: the
    folder's write probe), then, resuming, the step file's read (op 1: the pointer's)."""
    saved = run_patched("slow-storage=5@2", tmp_path, "--timeout-s", "3")
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert SLEEP_AT.search(saved.stderr) and "step-00000002.pt" in saved.stderr
    resumed = run_patched("slow-storage=5@2", tmp_path, "--timeout-s", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert SLEEP_AT.search(resumed.stderr) and "training already complete" in resumed.stdout


@pytest.mark.parametrize("during, op, what", [("resume", 1, "checkpoint read from"),
                                               ("save", 2, "checkpoint save at step 2")])
def test_storage_hung_beyond_its_deadline_ends_every_rank(tmp_path, during, op, what):
    """Before: rank 1 waited in a collective until --timeout-s (300 s) and died with a traceback."""
    started = time.time()
    result = run_patched(f"slow-storage=600@{op}", tmp_path, "--storage-timeout-s", "4")
    ended = time.time()
    hung_at = float(SLEEP_AT.search(result.stderr).group(1))
    print(f"\nrank 0's storage hung during {during}: every rank ended {ended - hung_at:.1f} s later "
          f"(--storage-timeout-s 4; {ended - started:.1f} s in all)")
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and errors[0].startswith(f"error: rank 0's {what}"), result.stderr[-3000:]
    assert "did not finish within 4 s (--storage-timeout-s)" in errors[0]
    assert "/common/" not in result.stderr  # no rank's traceback (torchrun's own summary stays)
    assert ended - hung_at < 4 + ENDS_PROMPTLY_S


def test_a_waiter_tells_a_slow_worker_from_a_dead_or_late_one(monkeypatch):
    """The rules the tests above rely on, in one process with a real store and real threads."""
    monkeypatch.setattr(distributed, "STALE_AFTER_S", 1.5)
    store = dist.HashStore()
    worker = threading.Thread(target=lambda: store.set("slow", str(run_with_heartbeat(store, "slow", slow_work, 10))))
    worker.start()
    wait_for_keys(store, ["slow"], 10)  # 2.5 s of work, longer than the heartbeat bound: waited for
    assert store.get("slow") == b"7"
    started = time.monotonic()
    with pytest.raises(Unanswered, match="stopped responding") as dead:
        wait_for_keys(store, ["never-started"], 60)
    # Told by the heartbeat's absence (1.5 s), well before the 60 s deadline.
    assert 1.5 <= time.monotonic() - started < 30 and dead.value.pending == ["never-started"]
    with Heartbeat(store, "late"), pytest.raises(Unanswered, match=r"did not finish within 0.5 s") as late:
        wait_for_keys(store, ["late"], 0.5)  # alive, but silent past its deadline and the grace after it
    assert late.value.who == {"late": f" (host {os.uname().nodename}, pid {os.getpid()})"}
    with pytest.raises(DeadlinePassed):
        run_with_heartbeat(store, "hung", lambda: time.sleep(60), 0.5)  # the hung work the deadline cuts


def slow_work() -> int:
    time.sleep(2.5)  # work longer than the deadline, whose heartbeat keeps it alive: not a point in training
    return 7


# A DataLoader worker stuck where no SIGTERM reaches it (in native code, on a lock held when it was
# forked, as seen once under load; here: SIGTERM blocked, then a sleep), behind a 1 s loader deadline.
STUCK_WORKER = """
import signal, sys, time
import torch
from common.data import reading
from common.errors import UserError

class Stuck(torch.utils.data.Dataset):
    root = "a stuck set"
    def __len__(self):
        return 2
    def __getitem__(self, i):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        time.sleep(600)

reading.LOADER_TIMEOUT_S = 1.0
try:
    next(reading.batches_of(Stuck(), [[0], [1]], workers=1))
except UserError as e:
    print(f"error: {e}", flush=True)
time.sleep(1)  # a killed worker's SIGCHLD would reach torch's handler by now
"""


@pytest.mark.quick
def test_a_loader_worker_that_takes_no_sigterm_does_not_hold_the_rank_past_its_deadline():
    """The loader's deadline passes, the rank says so in one line and exits: its stuck worker is
    killed, not waited for (multiprocessing joins its children as the interpreter exits: forever)."""
    done = subprocess.run([sys.executable, "-c", STUCK_WORKER], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=ENDS_PROMPTLY_S)
    assert done.stdout.startswith("error: a DataLoader worker delivered no batch of a stuck set in 1 s"), done
    assert done.returncode == 0 and "Traceback" not in done.stderr, done
