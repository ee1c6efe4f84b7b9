"""Save checkpoints in a loop with the real writer until killed, or until STOP_FILE exists; prints
each completed step.

    python tests/save_loop.py CHECKPOINT_DIR RUN FIRST_STEP [STOP_FILE]

Used by tests/test_resume.py to SIGKILL a writer at random moments, and by tests/test_stores.py as
a job that saves all the time while others start in the same folder."""
from __future__ import annotations

import os
import sys

import torch

from common.storage import LocalStorage
from common.train.checkpoint import CheckpointFolder

IDENTITY = {"model": "save-loop"}


def state(step: int, weights: torch.Tensor) -> dict:
    return {"model": {"w": weights + step}, "optimizer": {}, "scheduler": {}, "epoch": 0, "step_in_epoch": step,
            "global_step": step, "config": {}, "world_size": 1, "identity": IDENTITY}


if __name__ == "__main__":
    folder, run, step = CheckpointFolder(LocalStorage(sys.argv[1]), keep=3), sys.argv[2], int(sys.argv[3])
    stop_file = sys.argv[4] if len(sys.argv) > 4 else None
    weights = torch.randn(2_000_000)  # 8 MB: a save takes long enough to be cut in the middle
    while not (stop_file and os.path.exists(stop_file)):
        step += 1
        folder.write(run, state(step, weights))
        print(step, flush=True)
