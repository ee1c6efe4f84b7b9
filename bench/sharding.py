"""Sharded and low-communication training against DDP.

    python -m bench sharding memory          # per-rank training state, ResNet-18, W = 1, 2, 4
    python -m bench sharding localsgd        # accuracy against bytes communicated, H = 1, 4, 16, 64

memory: parameters + gradients + optimizer state each rank holds (the mem/state_mb the suite logs:
every storage once, a shard where sharded), and images/s at W=2.
localsgd: final test accuracy on the same synthetic MNIST-shaped data for every row, and the bytes
each rank sends per epoch (a ring all-reduce sends 2(W-1)/W of its payload).
"""
from __future__ import annotations

import argparse
import os

from bench.strategies import run, synthetic, timing
from common.models import build_model

SHARDED = {"ddp": ["train_ddp.py"], "fsdp --shard optimizer (ZeRO-1)": ["train_fsdp.py", "--shard", "optimizer"],
           "fsdp --shard full (FSDP2)": ["train_fsdp.py", "--shard", "full"]}


def memory(worlds: list[int], per_rank: int) -> None:
    print(f"\nResNet-18 (CIFAR shape): training state per rank, MB (and images/s at W=2, {per_rank} images per rank)\n")
    print("| strategy | " + " | ".join(f"W={w}" for w in worlds) + " | images/s, W=2 |\n|---|"
          + "---|" * (len(worlds) + 1))
    for label, script in SHARDED.items():
        cells, speed = [], ""
        for world in worlds:
            scalars = run(script, synthetic("resnet18", per_rank * world, 4, 2), world)
            cells.append(f"{scalars['mem/state_mb'][-1]:.1f}")
            if world == 2:
                speed = f"{1000 * per_rank * world / timing(scalars).step_ms:,.1f}"
        print(f"| {label} | " + " | ".join(cells) + f" | {speed} |")


def localsgd(epochs: int, world: int) -> None:
    net = build_model("convnet", 1, 28, 10, 0)
    params = sum(p.numel() for p in net.parameters()) * 4
    state = params + sum(b.numel() for b in net.buffers() if b.is_floating_point()) * 4
    batch, train = 128, 10000
    steps = train // batch
    ring = 2 * (world - 1) / world
    flags = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "convnet", "--epochs", str(epochs)]
    print(f"\nconvnet, synthetic MNIST shape, global batch {batch}, {epochs} epochs, world {world}: accuracy against "
          "bytes sent per rank per epoch\n")
    print("| run | averagings per epoch | MB sent per rank per epoch | final test acc |\n|---|---|---|---|")
    ddp = run(["train_ddp.py"], flags, world)
    print(f"| ddp (every step, gradients) | {steps} | {steps * params * ring / 2**20:.2f} | "
          f"{100 * ddp['test/acc'][-1]:.2f}% |")
    for every in (1, 4, 16, 64):
        syncs = steps // every + (1 if steps % every else 0)  # and one at each epoch end
        for outer in ("sgd", "nesterov"):
            scalars = run(["train_localsgd.py", "--sync-every", str(every), "--outer-optimizer", outer], flags, world)
            label = f"localsgd H={every}" + (", DiLoCo outer Nesterov (lr 0.7, momentum 0.9)" if outer == "nesterov"
                                             else ", averaging")
            print(f"| {label} | {syncs} | {syncs * state * ring / 2**20:.2f} | {100 * scalars['test/acc'][-1]:.2f}% |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=("memory", "localsgd"))
    p.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--per-rank", type=int, default=8, help="images per rank for the memory table")
    p.add_argument("--epochs", type=int, default=4, help="epochs of the localsgd runs")
    a = p.parse_args()
    print(f"{os.cpu_count()} cores; gloo; one thread per rank")
    if a.table == "memory":
        memory(a.worlds, a.per_rank)
    else:
        localsgd(a.epochs, 2)


if __name__ == "__main__":
    main()
