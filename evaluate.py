"""Score a trained checkpoint on a test set, exactly, at any world size: top-1, top-5, loss,
per-class accuracy and the confusion matrix (common/use/evaluating.py).

    torchrun --standalone --nproc_per_node=N evaluate.py --checkpoint FILE_OR_DIR [--ema] [data flags]
    python evaluate.py --checkpoint FILE_OR_DIR            # one process
"""
# The package's import comes first (this script's only one): a Ctrl-C from torch's import on ends the
# program with one line and status 130, its output never cut (common/interrupts.py).
from common.use.evaluating import main

if __name__ == "__main__":
    main()
