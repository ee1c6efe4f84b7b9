"""Faults at the worst moments (issue 41): whatever dies, nothing outlives the job and each process
that ends says so in one line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ENDS_PROMPTLY_S, ROOT, child_env

# A torchrun worker in set-up: it has imported the package (as every script does first), says so in a
# file, and then waits as a worker importing torch or reading its data would.
IN_SET_UP = """
import sys, time
from pathlib import Path
import common
Path(sys.argv[1]).write_text("importing")
time.sleep(600)
"""


def test_a_worker_whose_torchrun_agent_is_killed_during_its_set_up_ends_with_one_line(tmp_path):
    """SIGKILL of the agent while its worker sets up (before any step or process group): the worker,
    re-parented, ends within a second or so with one line naming the agent, instead of living on."""
    ready, script = tmp_path / "ready", tmp_path / "in_set_up.py"
    script.write_text(IN_SET_UP)
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                              str(script), str(ready)], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + ENDS_PROMPTLY_S
    while not ready.exists():
        assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[0]
        time.sleep(0.05)  # polling for the worker's file, with a deadline
    worker = next(int(pid) for pid in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split())
    os.kill(agent.pid, signal.SIGKILL)
    killed = time.monotonic()
    while Path(f"/proc/{worker}").exists() and time.monotonic() < killed + ENDS_PROMPTLY_S:
        time.sleep(0.05)  # polling for the orphan's end, with a deadline
    gone = time.monotonic() - killed
    output = agent.communicate(timeout=30)[0]
    assert not Path(f"/proc/{worker}").exists(), f"worker {worker} outlived its agent:\n{output}"
    print(f"\nthe orphaned worker ended {gone:.1f} s after its agent's SIGKILL")
    assert f"error: rank 0's torchrun agent (pid {agent.pid}) is gone: this worker stops" in output, output
    assert "Traceback" not in output, output


@pytest.mark.quick
def test_a_chaos_schedule_draws_every_kind_at_distinct_steps_inside_the_run_the_same_for_a_seed():
    from bench.chaos import FT_KINDS, RESTART_KINDS, draw

    for kinds in (FT_KINDS, RESTART_KINDS):
        faults = draw(kinds, 30, 1000, 3, seed=7)
        assert {f.kind for f in faults} == set(kinds) and len(faults) == 30
        steps = [f.step for f in faults]
        assert steps == sorted(set(steps)) and 100 <= steps[0] and steps[-1] < 850  # 10% to 85% of the run
        assert all(0 <= f.target < 3 and 2 <= f.seconds <= 8 for f in faults)
        assert draw(kinds, 30, 1000, 3, seed=7) == faults != draw(kinds, 30, 1000, 3, seed=8)
