"""Reference strategies the benchmarks measure against; not for training. Run under torchrun as a
module from the repository root, the strategy's name first:

    torchrun --standalone --nproc_per_node=2 -m bench.references nosync [training flags]

nosync                  no gradient synchronization at all, so the replicas drift apart: the step
                        time every real strategy is measured against (strategies, steps)
sync-every-micro-batch  DDP that synchronizes after every micro-batch of --accumulate (what
                        forgetting no_sync does): the same maths at N times the communication (recipes)
"""
from __future__ import annotations

import sys
from contextlib import nullcontext

from common.train.app import main
from common.train.strategy import Strategy
from train_ddp import DDPStrategy


class NoSync(Strategy):
    name = "nosync"


class SyncEveryMicroBatch(DDPStrategy):
    def no_sync(self, model):  # noqa: ANN001, ANN201
        return nullcontext()


REFERENCES = {"nosync": NoSync, "sync-every-micro-batch": SyncEveryMicroBatch}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in REFERENCES:
        sys.exit(f"usage: torchrun ... -m bench.references {{{','.join(REFERENCES)}}} [training flags]")
    main(REFERENCES[sys.argv[1]](), sys.argv[2:])
