"""Every benchmark behind one entry, run from the repository root:

    python -m bench                  # list them, one line each: what it measures
    python -m bench NAME [args]      # run one; NAME --help lists its flags

Where their latest figures are, and how they were measured: docs/benchmarks.md.
"""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = {  # name (a module of this package) -> what it measures
    "strategies": "images/s and the data / compute / sync split of every strategy, beside a no-sync floor",
    "steps": "each strategy's step time over a plain one-process loop; --items: each item of a step alone",
    "recipes": "images/s in fp32, bf16 and --compile; accumulation with and without no_sync; compression",
    "sharding": "memory: training state per rank (DDP, ZeRO-1, FSDP2); localsgd: accuracy against bytes sent",
    "checkpoint_stall": "how long a save pauses training, beside its background write (local S3 server, disk)",
    "compare": "the six strategies trained on the same data, then the report (table, curves, time split)",
    "wall": "the 10-epoch run's wall time, start-up and accuracy: this tree against another checkout",
    "own_data": "your own images: the MNIST reader against its ImageFolder and shard copies (10 epochs); "
                "the data share of a 224-px JPEG ResNet-18 step",
    "scale": "your own images at 1 M / 10 M samples: a streamed epoch's time per sample, the index's memory per "
             "process, the statistics' and the decode's time and peak memory",
    "pipeline": "images per CPU-second of our training input path and torchvision's reference transform, decode_jpeg "
                "alone, with and without RandAugment, from --max-side shards too; the cores an 8-GPU node needs",
    "accuracy": "top-1 on real photos: our ImageFolder run beside torchvision's reference train.py (same model, "
                "epochs, batch, schedule), and ours from --max-side shards; seeds, their mean, CPU seconds",
    "finetune": "transfer from --weights against from scratch, the recipe's items one by one; LARS/LAMB at 8x the "
                "batch; images/s of each optimizer on each strategy; AdamW's state per rank when sharded",
    "ft": "train_ft.py: images/s against DDP when nothing fails; a group SIGKILLed: time to the next step, steps "
          "lost, throughput while it is away, time to heal, beside DDP's restart from a checkpoint",
    "chaos": "seeded random faults of every kind through a whole run (replica groups; checkpoint-and-restart): "
             "survived, pauses, time back, and the fault-free run's weights, processes and files left",
    "forecast": "each strategy on 8 to 1,024 GPUs from a cost model (step, images/s, efficiency, bytes, memory, "
                "launch command); --published: against Goyal et al. and the DDP paper; --calibrate: against this "
                "machine's own step times",
    "gpu": "the GPU paths in one command (nccl, CUDA equivalence, DataParallel, cpu,cuda, resume): pass/fail",
}


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[1].rstrip() + "\n")
        width = max(map(len, BENCHMARKS))
        for name, what in BENCHMARKS.items():
            print(f"{name:<{width}}  {what}")
        return
    name = argv[0]
    if name not in BENCHMARKS:
        print(f"error: python -m bench {name}: no such benchmark; python -m bench lists them "
              f"({', '.join(BENCHMARKS)})", file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"python -m bench {name}", *argv[1:]]  # argparse's usage line names the way it was run
    importlib.import_module(f"bench.{name}").main()


if __name__ == "__main__":
    main(sys.argv[1:])
