"""Benchmark reference only: DDP that synchronizes gradients after every micro-batch of
--accumulate (what forgetting no_sync does), the same maths at N times the communication."""
from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.app import main as run  # noqa: E402
from train_ddp import DDPStrategy  # noqa: E402


class SyncEveryMicroBatch(DDPStrategy):
    def no_sync(self, model):  # noqa: ANN001, ANN201
        return nullcontext()


if __name__ == "__main__":
    run(SyncEveryMicroBatch())
