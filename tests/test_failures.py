"""Every way a rank dies ends the job non-zero with one line naming it (rank, pid, host, how it
ended, and what the job was doing), through launch/single_node.sh and plain torchrun, over the
shared-memory transport and over gloo; and /dev/shm keeps no region of a killed set-up."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.parallel.failures import how_it_ended
from common.parallel.transport import SHM_FOLDER, create_region
from tests.conftest import ENDS_PROMPTLY_S, ROOT, child_env, error_lines, script_command

FLAGS = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--batch-size", "32",
         "--epochs", "1", "--max-steps", "40"]
FAULT_STEP = 3  # rank 1 fails after its 3rd step: rank 0 is then in step 4's gradient exchange
HOW = {"sigkill": "was killed by SIGKILL (the out-of-memory killer sends it too: dmesg names what it killed) "
                  "during the gradient exchange at step 4",
       "segfault": "was killed by SIGSEGV (a crash in native code) during the gradient exchange at step 4",
       "raise": "failed with RuntimeError during the training step at step 3 (traceback above)"}


def run_with_fault(launcher: str, transport: str, fault: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess,
                                                                                        float, int]:
    """The job's result, the seconds from the fault to the end of the job, and the failing rank's pid."""
    args = ["tests/faults.py", "ddp", fault, str(FAULT_STEP), *FLAGS, "--transport", transport,
            "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "tb")]
    stamp = tmp_path / "fault_at"
    env = {**child_env(), "FAULT_AT_FILE": str(stamp), "NPROC": "2"}
    command = ["bash", "launch/single_node.sh", *args] if launcher == "single_node" else script_command(args, nproc=2)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=2 * ENDS_PROMPTLY_S)
    ended = time.time()
    assert stamp.exists(), result.stderr[-3000:]
    at, pid = stamp.read_text().split()
    return result, ended - float(at), int(pid)


@pytest.mark.parametrize("launcher, transport, fault", [
    ("single_node", "shm", "sigkill"), ("single_node", "gloo", "sigkill"), ("single_node", "shm", "segfault"),
    ("single_node", "gloo", "raise"), ("torchrun", "shm", "sigkill"), ("torchrun", "gloo", "segfault"),
    ("torchrun", "shm", "raise"),
])
def test_a_rank_that_dies_is_named_in_one_line(launcher, transport, fault, tmp_path):
    result, seconds, pid = run_with_fault(launcher, transport, fault, tmp_path)
    print(f"\n{launcher} {transport} {fault}: job ended {seconds:.1f} s after the fault, exit {result.returncode}")
    assert result.returncode != 0
    assert f"gradients via {transport}" in result.stdout
    named = f"rank 1 (pid {pid}) on {socket.gethostname()} "
    lines = [line for line in error_lines(result.stderr) if line.startswith(f"error: {named}")]
    assert len(lines) == 1, result.stderr[-3000:]
    if launcher == "single_node" or fault == "raise":  # plain torchrun's reaping may beat the survivor's look
        assert HOW[fault] in lines[0], lines[0]
    else:
        assert "during the gradient exchange at step 4" in lines[0], lines[0]
    if fault == "raise":  # the failing rank's traceback, once
        assert result.stderr.count("RuntimeError: injected failure on rank 1") == 1, result.stderr[-3000:]
    else:  # no rank printed a traceback (plain torchrun's report is its own)
        assert "common/" not in result.stderr, result.stderr[-3000:]
    assert seconds < ENDS_PROMPTLY_S  # not the 300 s a survivor blocked in a collective would wait


def _hold_region() -> subprocess.Popen:
    """A process that creates a region as rank 0's set-up does, prints its path and waits."""
    code = ("import sys, time; from common.parallel.transport import create_region; "
            "region, _ = create_region(2); print(region.path, flush=True); time.sleep(60)")  # killed by the test
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True)


def _age(path: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_killed_set_up_leaves_no_region_for_good(tmp_path):
    """A region whose creator was SIGKILLed before every rank mapped it is removed by the next set-up;
    one that a live set-up still holds is kept, however old."""
    if not os.path.isdir(SHM_FOLDER):
        pytest.skip(f"needs {SHM_FOLDER}")
    killed, live = _hold_region(), _hold_region()
    try:
        killed_path, live_path = killed.stdout.readline().strip(), live.stdout.readline().strip()
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert os.path.exists(killed_path)  # nothing could remove it
        for path in (killed_path, live_path):
            _age(path, 60)
        region, problem = create_region(2)
        assert region is not None, problem
        region.remove()
        assert not os.path.exists(killed_path)
        assert os.path.exists(live_path)
    finally:
        live.kill()
        live.wait()
        if os.path.exists(live_path):
            os.unlink(live_path)


@pytest.mark.quick
def test_a_sigkill_is_not_blamed_on_memory():
    """A kill -9 the user sent reads as SIGKILL, with the OOM killer as a possibility, not a verdict."""
    said = how_it_ended(-signal.SIGKILL)
    assert said.startswith("was killed by SIGKILL (") and "out of memory?" not in said
    assert "the out-of-memory killer sends it too" in said
