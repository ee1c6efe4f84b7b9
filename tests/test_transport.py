"""The shared-memory gradient transport: chosen where it can serve, refused in one line where it
cannot, and a peer that never arrives ends the wait within --timeout-s."""
from __future__ import annotations

import mmap
import shutil
import subprocess
import time

import pytest
import torch

from common.errors import PeerVanished
from common.parallel.transport import FLAG_STRIDE, SharedMemoryTimeout, SharedMemoryTransport
from tests.conftest import child_env, error_lines, one_launch, script_command
from tests.runs import launched_runs

SMOKE = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--batch-size", "32",
         "--epochs", "1", "--max-steps", "3"]


@pytest.mark.quick
def test_a_peer_that_never_arrives_ends_the_wait():
    """Rank 0 of a two-rank region whose rank 1 never posts: one clear error after --timeout-s."""
    region = mmap.mmap(-1, SharedMemoryTransport.size(2))
    transport = SharedMemoryTransport(region, rank=0, world=2, timeout_s=0.5)
    with pytest.raises(SharedMemoryTimeout, match=r"rank\(s\) 1 did not reach .* within 0.5 s \(--timeout-s\)"):
        transport.all_reduce(torch.ones(10))  # a wait without the deadline would hang: pytest-timeout fails it


@pytest.mark.quick
def test_a_peer_that_exited_ends_the_wait_at_once():
    """Shared memory does not close like a socket: the waiting rank sees the late peer's pid gone."""
    region = mmap.mmap(-1, SharedMemoryTransport.size(2))
    exited = subprocess.Popen(["true"])
    exited.wait()
    SharedMemoryTransport(region, rank=1, world=2, timeout_s=60).flags[1 * FLAG_STRIDE + 1] = exited.pid
    transport = SharedMemoryTransport(region, rank=0, world=2, timeout_s=60)
    started = time.monotonic()
    with pytest.raises(PeerVanished, match=r"rank\(s\) 1 ended during shared-memory exchange 1"):
        transport.all_reduce(torch.ones(10))
    assert time.monotonic() - started < 30  # seen, well before the 60 s deadline (which raises another error)


@pytest.fixture(scope="module")
def small_dev_shm(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """One launch (tests/runs.py) of 2 ranks in a private mount namespace whose /dev/shm holds 64 KB:
    the run that falls back to gloo, then the one that asks for shm (last: it fails). Each run's own
    output and status, by its script."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to give the run its own small /dev/shm")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace (needs root): {probe.stderr.strip()}")
    folder = tmp_path_factory.mktemp("small-dev-shm")
    runs = {"auto": ["train_allreduce.py"], "shm": ["train_ddp.py", "--transport", "shm"]}
    command = " ".join(script_command(one_launch([[*args, *SMOKE, "--log-dir", str(folder / f"tb-{name}"),
                                                   "--checkpoint-dir", str(folder / f"ck-{name}")]
                                                  for name, args in runs.items()]), nproc=2))
    launch = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs /dev/shm && {command}"],
                            env=child_env(), capture_output=True, text=True, timeout=180)
    return dict(zip(runs, launched_runs(launch)))


def test_auto_falls_back_to_gloo_when_dev_shm_is_full(small_dev_shm):
    result = small_dev_shm["auto"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gradients via gloo (not shm: /dev/shm has no room for 4 MB" in result.stdout


def test_explicit_shm_without_room_is_one_line_naming_both_ways_out(small_dev_shm):
    """The launch's last run (a run that fails ends its launch)."""
    assert "shm" in small_dev_shm, "the run never started: the run before it ended the launch"
    result = small_dev_shm["shm"]
    assert result.returncode != 0
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr[-3000:]
    assert "--transport shm: /dev/shm has no room for 4 MB" in lines[0]
    assert "--transport auto" in lines[0] and "gloo" in lines[0]
    assert "common/" not in result.stderr, "a rank printed a traceback"  # torchrun's own summary follows the line
