"""Benchmark reference only: trains with NO gradient synchronization, so replicas drift apart.
Its step time is the compute floor that every real strategy is measured against."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.app import main as run  # noqa: E402
from common.strategy import Strategy  # noqa: E402


class NoSync(Strategy):
    name = "nosync"


if __name__ == "__main__":
    run(NoSync())
