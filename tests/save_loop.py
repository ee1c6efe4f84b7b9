"""Save checkpoints in a loop with the real writer until killed; prints each completed step.
Used by tests/test_resume.py to SIGKILL a writer at random moments."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.checkpoint import CheckpointWriter  # noqa: E402

if __name__ == "__main__":
    writer = CheckpointWriter(sys.argv[1], keep=3, enabled=True)
    weights = torch.randn(2_000_000)  # 8 MB: a save takes long enough to be cut in the middle
    step = int(sys.argv[2])
    while True:
        step += 1
        writer.save({"model": {"w": weights + step}, "optimizer": {}, "scheduler": {}, "epoch": 0,
                     "step_in_epoch": step, "global_step": step, "config": {}, "world_size": 1})
        print(step, flush=True)
