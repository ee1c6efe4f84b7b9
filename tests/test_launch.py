"""Launchers are valid shell and print the torchrun command they run."""
from __future__ import annotations

import subprocess

from tests.conftest import ROOT, child_env


def test_single_node_dry_run_prints_torchrun_command():
    env = {**child_env(), "DRY_RUN": "1", "NPROC": "3"}
    out = subprocess.run(["bash", "launch/single_node.sh", "train_ddp.py", "--dataset", "mnist"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "torchrun --standalone --nproc_per_node=3 train_ddp.py --dataset mnist"


def test_launchers_parse():
    for script in (ROOT / "launch").glob("*.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True)
