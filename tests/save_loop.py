"""Save checkpoints in a loop with the real writer until killed; prints each completed step.
Used by tests/test_resume.py to SIGKILL a writer at random moments."""
from __future__ import annotations

import sys

import torch

from common.train.checkpoint import CheckpointFolder
from common.storage import LocalStorage

IDENTITY = {"model": "save-loop"}


def state(step: int, weights: torch.Tensor) -> dict:
    return {"model": {"w": weights + step}, "optimizer": {}, "scheduler": {}, "epoch": 0, "step_in_epoch": step,
            "global_step": step, "config": {}, "world_size": 1, "identity": IDENTITY}


if __name__ == "__main__":
    folder, run, step = CheckpointFolder(LocalStorage(sys.argv[1]), keep=3), sys.argv[2], int(sys.argv[3])
    weights = torch.randn(2_000_000)  # 8 MB: a save takes long enough to be cut in the middle
    while True:
        step += 1
        folder.write(run, state(step, weights))
        print(step, flush=True)
