"""Hand-written collectives against torch's, in real gloo processes."""
from __future__ import annotations

import pytest

from tests.conftest import run_script


@pytest.mark.parametrize("world", [2, 3])
def test_ring_all_reduce_equals_dist_all_reduce(world):
    result = run_script(["tests/comm_checks.py", "ring"], nproc=world, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ok ring size") == 4


def test_ring_all_reduce_single_rank():
    result = run_script(["tests/comm_checks.py", "ring"], nproc=1, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("check", ["buckets", "buckets-fp16-accumulate"])
def test_buckets_fire_once_per_step_and_reduce_every_gradient(check):
    result = run_script(["tests/comm_checks.py", check], nproc=2, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "one launch each per step, unused grad None" in result.stdout


def test_powersgd_state_is_split_by_the_parameters_it_belongs_to():
    """The per-parameter PowerSGD checkpoint state follows the hook's own layout (shape groups)."""
    result = run_script(["tests/comm_checks.py", "powersgd-factors"], nproc=2, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ok powersgd factors" in result.stdout
    print("\n" + result.stdout.strip())


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_transport_matches_gloo(world):
    result = run_script(["tests/comm_checks.py", "shm"], nproc=world, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ok shm size") == 4
    assert result.stdout.count("shm): ") == 2
