"""Recipes side by side: images/s per strategy for fp32, bf16 and --compile; gradient accumulation
with and without skipped synchronizations; gradient compression (bytes per step, accuracy).

    python -m bench recipes                      # all three tables (a few minutes on 2 CPU cores)
    python -m bench recipes --tables compression --epochs 4
    python -m bench recipes --tables throughput --models resnet18 --strategies master dp

World 2, gloo, one thread per rank (train_dp.py: one process with both threads), synthetic data.
"""
from __future__ import annotations

import argparse
import os

import torch

from bench.strategies import MODELS, run, synthetic, timing
from common.models import build_model

STRATEGIES = {"ddp": ["train_ddp.py"], "allreduce": ["train_allreduce.py"], "master": ["train_master.py"],
              "dp": ["train_dp.py"]}
RECIPES = {"fp32": [], "bf16": ["--precision", "bf16"], "compile": ["--compile"]}
STEPS = {"convnet": (60, 10), "resnet18": (9, 3)}  # steps, logging interval (the first interval is warm-up)


def throughput(models: list[str], batch: int, strategies: list[str]) -> None:
    for model in models:
        steps, every = STEPS[model]
        print(f"\n{model} ({MODELS[model][0]} shape), global batch {batch}: images/s (compile: its start-up s)\n")
        print("| strategy | " + " | ".join(RECIPES) + " |\n|---|" + "---|" * len(RECIPES))
        for name in strategies:
            script, cells = STRATEGIES[name], []
            for recipe, flags in RECIPES.items():
                scalars = run(script, [*synthetic(model, batch, steps, every), *flags], 1 if name == "dp" else 2,
                              2 if name == "dp" else 1)
                cell = f"{1000 * batch / timing(scalars).step_ms:,.0f}"
                if recipe == "compile":  # the first interval holds the compilation
                    first = scalars["time/compute_ms"][0] * every / 1000
                    cell += f" ({first:.0f} s)"
                cells.append(cell)
            print(f"| {name} | " + " | ".join(cells) + " |")


def accumulation(batch: int, micro: int) -> None:
    """DDP with no_sync on all but the last micro-batch, against syncing every one of them."""
    flags = [*synthetic("convnet", batch, 60, 10), "--accumulate", str(micro)]
    skipped = timing(run(["train_ddp.py"], flags, 2))
    every = timing(run(["-m", "bench.references", "sync-every-micro-batch"], flags, 2))
    print(f"\naccumulation: ddp, convnet, global batch {batch} in {micro} micro-batches per rank, world 2\n")
    print("| gradients synchronized | ms per step | images/s |\n|---|---|---|")
    for label, t in (("once per step (no_sync on the others)", skipped), ("after every micro-batch", every)):
        print(f"| {label} | {t.step_ms:.1f} | {1000 * batch / t.step_ms:,.0f} |")


def payload_bytes(model: str, compression: str) -> int:
    """Gradient bytes each rank hands to the collectives per step (a ring moves 2(W-1)/W of them)."""
    shape = MODELS[model][0]
    net = build_model(model, 1 if shape == "mnist" else 3, 28 if shape == "mnist" else 32, 10, 0)
    if compression in ("fp16", "bf16"):
        return sum(2 * p.numel() for p in net.parameters())
    if compression == "none":
        return sum(4 * p.numel() for p in net.parameters())
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    total = 0
    for p in net.parameters():  # PowerSGD, rank 1: P (n) and Q (m) for each matrix worth it, the rest as is
        n, m = p.shape[0], p.numel() // p.shape[0]
        total += 4 * ((n + m) if p.dim() > 1 and _should_compress(n, m, 1, 2)[0] else p.numel())
    return total


def compression(epochs: int) -> None:
    rows = [("ddp", c) for c in ("none", "fp16", "bf16", "powersgd")] + [("allreduce", c) for c in ("fp16", "bf16")]
    print(f"\ncompression: convnet, synthetic MNIST shape, global batch 128, {epochs} epochs, world 2\n")
    print("| strategy | compression | gradient bytes per step per rank | ms per step | final test acc |\n"
          "|---|---|---|---|---|")
    flags = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "convnet", "--epochs", str(epochs)]
    for name, kind in rows:
        scalars = run(STRATEGIES[name], [*flags, "--grad-compression", kind], 2)
        print(f"| {name} | {kind} | {payload_bytes('convnet', kind) / 1024:,.1f} KB | {timing(scalars).step_ms:.1f} | "
              f"{100 * scalars['test/acc'][-1]:.2f}% |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", nargs="+", default=["throughput", "accumulation", "compression"])
    p.add_argument("--models", nargs="+", default=["convnet", "resnet18"], choices=list(STEPS))
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES),
                   help="rows of the throughput table")
    p.add_argument("--batch-size", type=int, default=64, help="global batch of the throughput table")
    p.add_argument("--epochs", type=int, default=3, help="epochs of the compression runs")
    a = p.parse_args()
    print(f"{os.cpu_count()} cores, torch {torch.__version__}")
    if "throughput" in a.tables:
        throughput(a.models, a.batch_size, a.strategies)
    if "accumulation" in a.tables:
        accumulation(128, 4)
    if "compression" in a.tables:
        compression(a.epochs)


if __name__ == "__main__":
    main()
