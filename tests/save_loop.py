"""Save checkpoints in a loop with the real writer until killed, or until STOP_FILE exists; prints
each completed step.

    python tests/save_loop.py CHECKPOINT_DIR RUN FIRST_STEP [STOP_FILE]

Used by tests/test_stores.py as a job that saves all the time while others start in the same folder,
and by tests/test_resume.py to SIGKILL a writer at random moments: there `save_until_stopped` runs in
processes forked from one that imported torch once (multiprocessing's forkserver), not a fresh
interpreter per kill (a second or more of torch's import each, twelve times)."""
from __future__ import annotations

import os
import sys
from typing import Callable

import torch

from common.storage import LocalStorage
from common.train.checkpoint import CheckpointFolder

IDENTITY = {"model": "save-loop"}


def state(step: int, weights: torch.Tensor) -> dict:
    return {"model": {"w": weights + step}, "optimizer": {}, "scheduler": {}, "epoch": 0, "step_in_epoch": step,
            "global_step": step, "config": {}, "world_size": 1, "identity": IDENTITY}


def save_until_stopped(directory: str, run: str, step: int, stop_file: str | None,
                       completed: Callable[[int], None]) -> None:
    """Checkpoints of steps after `step` with the real writer, each reported once complete, until
    `stop_file` exists (never, when None: until killed)."""
    folder = CheckpointFolder(LocalStorage(directory), keep=3)
    weights = torch.randn(2_000_000)  # 8 MB: a save takes long enough to be cut in the middle
    while not (stop_file and os.path.exists(stop_file)):
        step += 1
        folder.write(run, state(step, weights))
        completed(step)


if __name__ == "__main__":
    save_until_stopped(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None,
                       lambda step: print(step, flush=True))
