"""The own-data issue's targets, measured in one run.

1. Readers: the 10-epoch run of `python -m bench wall` (torchrun, 2 ranks, one thread each,
   convnet, global batch 64) on a generated 4,000 / 1,000-image MNIST-format set, read three ways:
   the built-in MNIST reader (IDX files), an ImageFolder copy of the same images (PNG and JPEG in
   turn) and the shards the converter writes from that copy. Cold: a fresh --cache-dir (indexing
   and decoding included); warm: the same command again. Test accuracy and wall time, each against
   the MNIST reader's.
2. The data share of a step: ResNet-18 on 224-pixel JPEGs (about 500 x 375, as photos), 32 images
   per rank, world 2, --image-size 224, streamed (--cache-gb 0) by the default workers: the
   `data` share of the step time (TensorBoard's time/data_ms over the step), after a warm-up.

    python -m bench own_data                 # both, 2 seeds for 1
    python -m bench own_data --only readers --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench.strategies import run, timing
from bench.wall import ROOT, one_run
from common.data.formats import read_mnist


def data_flags(reader: str, data: Path, cache: Path) -> list[str]:
    dataset = {"mnist": "mnist", "folder": "imagefolder", "shards": "shards"}[reader]
    return ["--dataset", dataset, "--data-dir", str(data), "--cache-dir", str(cache), "--no-download"]


def readers(epochs: int, repeats: int, tmp: Path) -> None:
    from tests.datagen import write_image_tree, write_mnist, write_shards

    mnist = write_mnist(tmp / "mnist", train_size=4000, test_size=1000, gz=True)
    sources = {"mnist": mnist, "folder": write_image_tree(read_mnist(mnist), tmp / "folder")}
    sources["shards"] = write_shards(sources["folder"], tmp / "shards", shard_mb=1.0)
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    for seed in range(repeats):
        for reader, data in sources.items():
            cache = tmp / f"cache-{reader}-{seed}"
            for temperature in ("cold", "warm"):
                with tempfile.TemporaryDirectory() as run_tmp:
                    result = one_run(ROOT, "train_ddp.py", data_flags(reader, data, cache), epochs, seed, Path(run_tmp))
                rows.setdefault((reader, temperature), []).append(result)
    print(f"train_ddp.py, W=2, convnet, global batch 64, {epochs} epochs, 4,000 / 1,000 MNIST-format images, "
          f"{repeats} seed(s)\n")
    print("| reader | run | wall s (mean) | wall / MNIST reader's | final test acc (mean) | acc - MNIST reader's |\n"
          "|---|---|---|---|---|---|")
    for (reader, temperature), results in rows.items():
        base = rows[("mnist", temperature)]
        wall = statistics.mean(r["wall"] for r in results)
        acc = statistics.mean(r["acc"] for r in results)
        print(f"| {reader} | {temperature} | {wall:.1f} | {wall / statistics.mean(r['wall'] for r in base):.2f} | "
              f"{acc:.2f}% | {acc - statistics.mean(r['acc'] for r in base):+.2f} |")


def jpeg_share(images: int, steps: int, tmp: Path) -> None:
    from tests.datagen import write_photos

    folder = write_photos(tmp / "photos", train_size=images, test_size=64)
    flags = ["--dataset", "imagefolder", "--data-dir", str(folder), "--cache-dir", str(tmp / "cache"),
             "--image-size", "224", "--cache-gb", "0", "--model", "resnet18", "--batch-size", "64", "--epochs", "1",
             "--max-steps", str(steps), "--log-every", "1", "--eval-batch-size", "64"]
    t = timing(run(["train_ddp.py"], flags, world=2))
    print(f"\nResNet-18, 224-px JPEGs (about 500 x 375), 32 per rank, W=2, streamed by the default workers, "
          f"{steps} steps (the first dropped)\n")
    print("| step ms | data ms | data share |\n|---|---|---|")
    print(f"| {t.step_ms:.0f} | {t.data_ms:.1f} | {t.data_ms / t.step_ms:.1%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("readers", "jpeg"), default=None)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--images", type=int, default=512, help="training JPEGs for the data share (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="steps of the data-share run (default: %(default)s)")
    a = p.parse_args()
    print(f"python {sys.version.split()[0]}, torch {__import__('torch').__version__}, CPU, gloo\n")
    with tempfile.TemporaryDirectory() as tmp:
        if a.only in (None, "readers"):
            readers(a.epochs, a.repeats, Path(tmp))
        if a.only in (None, "jpeg"):
            jpeg_share(a.images, a.steps, Path(tmp))


if __name__ == "__main__":
    main()
