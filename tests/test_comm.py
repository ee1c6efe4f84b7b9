"""Hand-written collectives against torch's, in real gloo processes: each world size's checks one
after another in one launch (tests/comm_checks.py), each test reading its own check's lines."""
from __future__ import annotations

import re

import pytest

from tests.comm_checks import MARK
from tests.conftest import run_script

CHECKS = {1: ["ring"], 2: ["ring", "buckets", "buckets-fp16-accumulate", "powersgd-factors", "shm"], 3: ["ring", "shm"]}


@pytest.fixture(scope="module")
def checked():
    """The console of one check at one world size; each world's launch made at the first test that asks."""
    launches: dict[int, tuple] = {}

    def console(world: int, check: str) -> str:
        if world not in launches:
            result = run_script(["tests/comm_checks.py", *CHECKS[world]], nproc=world, timeout=400)
            parts = re.split(f"^{re.escape(MARK)}(\\S+)\n", result.stdout, flags=re.M)[1:]
            launches[world] = result, dict(zip(parts[::2], parts[1::2]))
        result, consoles = launches[world]
        assert result.returncode == 0, result.stderr[-3000:]
        return consoles[check]
    return console


@pytest.mark.parametrize("world", [2, 3])
def test_ring_all_reduce_equals_dist_all_reduce(world, checked):
    assert checked(world, "ring").count("ok ring size") == 4


def test_ring_all_reduce_single_rank(checked):
    assert checked(1, "ring").count("ok ring size") == 4


@pytest.mark.parametrize("check", ["buckets", "buckets-fp16-accumulate"])
def test_buckets_fire_once_per_step_and_reduce_every_gradient(check, checked):
    assert "one launch each per step, unused grad None" in checked(2, check)


def test_powersgd_state_is_split_by_the_parameters_it_belongs_to(checked):
    """The per-parameter PowerSGD checkpoint state follows the hook's own layout (shape groups)."""
    console = checked(2, "powersgd-factors")
    assert "ok powersgd factors" in console
    print("\n" + console.strip())


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_transport_matches_gloo(world, checked):
    console = checked(world, "shm")
    assert console.count("ok shm size") == 4
    assert console.count("shm): ") == 2
