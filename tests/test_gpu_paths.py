"""GPU paths whose bug can be shown without a GPU (the rest: `python -m bench gpu` on a CUDA machine)."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from train_dp import ReplicaAutocast

pytestmark = pytest.mark.quick  # no launch: the quick tier (pytest -m quick)


def test_a_dataparallel_replica_thread_autocasts_in_the_runs_dtype():
    """nn.DataParallel runs each GPU's replica in a thread of its own and enters autocast there with
    enabled=True but no dtype: the thread's default (fp16 on CUDA, bf16 on the CPU), not the run's.
    The CPU shows it the other way round: the run's fp16 must survive a thread that defaults to bf16."""
    replica, seen = ReplicaAutocast(nn.Linear(4, 4), torch.float16), []

    def run_as_parallel_apply_does() -> None:
        with torch.autocast("cpu", enabled=True):
            seen.append(replica(torch.randn(2, 4)).dtype)

    thread = threading.Thread(target=run_as_parallel_apply_does)
    thread.start()
    thread.join()
    assert seen == [torch.float16]
