"""The fine-tuning recipe, measured: transfer from pretrained weights, large batches with LARS and
LAMB, and what each optimizer costs on each strategy.

    python -m bench finetune                       # all three tables (about 15 minutes on 2 CPU cores)
    python -m bench finetune --tables transfer     # or: large-batch, cost

transfer: pretrain convnet on one generated set (CIFAR-shaped, 10,000 images of 100 classes, an
ImageFolder of PNGs), then train on a different small set (10 other classes, 50 images per class)
from those weights with --weights (the 100-class head replaced), against from scratch, same
epochs; then the recipe's items one at a time on top of the fine-tuned baseline.
large-batch: SGD at the default global batch against SGD, LARS and LAMB at 8x it, same epochs.
cost: images/s of each optimizer on each strategy (convnet, W=2) against SGD's; AdamW's training
state per rank under DDP, ZeRO-1 and FSDP2 at W=2 and 4 (ResNet-18).
All at world 2, gloo, one thread per rank, real torchrun processes.
"""
from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from bench.strategies import run, synthetic, timing, train
from common.data.loader import Dataset, Split, make_synthetic
from tests.datagen import write_image_tree

PRETRAIN_EPOCHS = 8
PRETRAIN_SEED, SMALL_SET_SEED = 1000, 4321  # the small set's 10 classes are none of the pretraining's 100
RECIPE_ITEMS = {  # on top of the fine-tuning baseline (SGD)
    "AdamW (lr 1e-3)": ["--optimizer", "adamw", "--lr", "1e-3"],
    "label smoothing 0.1": ["--label-smoothing", "0.1"],
    "mixup 0.2 + cutmix 1.0": ["--mixup", "0.2", "--cutmix", "1.0"],
    "RandAugment": ["--augment", "randaugment"],
    "EMA 0.99 (its accuracy)": ["--ema", "0.99"],
}
STRATEGIES = {"ddp": ["train_ddp.py"], "allreduce": ["train_allreduce.py"], "master": ["train_master.py"],
              "zero1": ["train_fsdp.py", "--shard", "optimizer"], "fsdp": ["train_fsdp.py", "--shard", "full"],
              "localsgd H4": ["train_localsgd.py", "--sync-every", "4"]}
OPTIMIZERS = {"sgd": [], "adamw": [], "lars": ["--lr", "10"], "lamb": []}
SHARDED = {"ddp": ["train_ddp.py"], "zero1": ["train_fsdp.py", "--shard", "optimizer"],
           "fsdp": ["train_fsdp.py", "--shard", "full"]}


def accuracy(script: list[str], flags: list[str], tag: str = "test/acc") -> float:
    return 100 * run(script, flags, 2)[tag][-1]


def many_classes(groups: int, per_group: int, noise: float) -> Dataset:
    """Generated images of groups x 10 classes (each group's templates from a seed of its own), the
    way a large labelled set covers many kinds of images: what pretraining learns general features from."""
    sets = [make_synthetic("cifar", train_size=per_group, test_size=per_group // 10, seed=PRETRAIN_SEED + k,
                           noise=noise) for k in range(groups)]

    def union(parts: list[Split]) -> Split:
        return Split(torch.cat([p.images for p in parts]),
                     torch.cat([p.labels + 10 * k for k, p in enumerate(parts)]))
    spec = replace(sets[0].spec, classes=10 * groups)
    return Dataset("pretraining", spec, union([s.train for s in sets]), union([s.test for s in sets]))


def transfer(tmp: Path, epochs: int, noise: float) -> None:
    pretraining = many_classes(10, 1000, noise)
    small = make_synthetic("cifar", train_size=500, test_size=1000, seed=SMALL_SET_SEED, noise=noise)
    common = ["--dataset", "imagefolder", "--cache-dir", str(tmp / "cache"), "--model", "convnet"]
    pretrained = tmp / "pretrained"
    done = train(["train_ddp.py"], [*common, "--data-dir", str(write_image_tree(pretraining, tmp / "big", ("png",))),
                                    "--epochs", str(PRETRAIN_EPOCHS), "--checkpoint-dir", str(pretrained)], 2)
    if done.returncode:
        raise SystemExit(f"pretraining failed:\n{done.stderr[-3000:]}")
    weights = str(sorted(pretrained.glob("*/step-*.pt"))[-1])  # the last epoch
    base = [*common, "--data-dir", str(write_image_tree(small, tmp / "small", ("png",))), "--batch-size", "52",
            "--epochs", str(epochs)]
    tuned = [*base, "--weights", weights]
    print(f"\ntransfer: convnet pretrained on 10,000 generated CIFAR-shaped images of 100 classes (noise {noise}, "
          f"{PRETRAIN_EPOCHS} epochs), then "
          f"{epochs} epochs on 500 images of 10 other classes (50 per class), test on 1,000\n")
    print("| run | test accuracy % |\n|---|---|")
    scratch, finetuned = accuracy(["train_ddp.py"], base), accuracy(["train_ddp.py"], tuned)
    print(f"| from scratch | {scratch:.1f} |\n| fine-tuned (--weights) | {finetuned:.1f} |")
    print(f"\ngap: {finetuned - scratch:+.1f} points in favour of fine-tuning\n")
    print("| fine-tuned, plus | test accuracy % | vs the fine-tuned baseline |\n|---|---|---|")
    for label, flags in RECIPE_ITEMS.items():
        tag = "test/acc_ema" if "--ema" in flags else "test/acc"
        value = accuracy(["train_ddp.py"], [*tuned, *flags], tag)
        print(f"| {label} | {value:.1f} | {value - finetuned:+.1f} |")


def large_batch(epochs: int) -> None:
    default = 128
    rows = {f"sgd, batch {default}": ["--batch-size", str(default)],
            f"sgd, batch {8 * default} (lr scaled 8x)": ["--batch-size", str(8 * default)],
            f"lars, batch {8 * default} (lr 10)": ["--batch-size", str(8 * default), "--optimizer", "lars", "--lr",
                                                    "10"],
            f"lamb, batch {8 * default} (lr 0.02)": ["--batch-size", str(8 * default), "--optimizer", "lamb", "--lr",
                                                     "0.02"]}
    print(f"\nlarge batch: convnet on synthetic MNIST-shaped images (10,000), {epochs} epochs, one-cycle\n")
    print("| run | steps | test accuracy % |\n|---|---|---|")
    for label, flags in rows.items():
        scalars = run(["train_ddp.py"], ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "convnet",
                                         "--epochs", str(epochs), *flags], 2)
        steps = epochs * (10000 // int(flags[1]))
        print(f"| {label} | {steps} | {100 * scalars['test/acc'][-1]:.1f} |")


def cost(worlds: list[int]) -> None:
    print("\ncost: images/s, convnet (MNIST shape), global batch 128, W=2 (x SGD's on the same strategy)\n")
    print("| strategy | " + " | ".join(OPTIMIZERS) + " |\n|---|" + "---|" * len(OPTIMIZERS))
    for name, script in STRATEGIES.items():
        speeds = [1000 * 128 / timing(run(script, [*synthetic("convnet", 128, 60, 10), "--optimizer", o, *f], 2))
                  .step_ms for o, f in OPTIMIZERS.items()]
        print(f"| {name} | " + " | ".join(f"{s:,.0f} ({s / speeds[0]:.2f}x)" for s in speeds) + " |")
    print("\nAdamW: training state per rank (parameters, gradients, exp_avg, exp_avg_sq), ResNet-18, MB\n")
    print("| strategy | " + " | ".join(f"W={w}" for w in worlds) + " |\n|---|" + "---|" * len(worlds))
    for name, script in SHARDED.items():
        cells = [run(script, [*synthetic("resnet18", 8 * w, 2, 1), "--optimizer", "adamw"], w)["mem/state_mb"][-1]
                 for w in worlds]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench finetune", description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", nargs="+", default=["transfer", "large-batch", "cost"],
                   choices=["transfer", "large-batch", "cost"])
    p.add_argument("--epochs", type=int, default=10, help="fine-tuning epochs (default: %(default)s)")
    p.add_argument("--noise", type=float, default=0.45,
                   help="noise of both generated sets (the built-in synthetic set's: 0.35) (default: %(default)s)")
    p.add_argument("--large-batch-epochs", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="for the memory table (default: 2 4)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if "transfer" in a.tables:
            transfer(Path(tmp), a.epochs, a.noise)
    if "large-batch" in a.tables:
        large_batch(a.large_batch_epochs)
    if "cost" in a.tables:
        cost(a.worlds)


if __name__ == "__main__":
    main()
