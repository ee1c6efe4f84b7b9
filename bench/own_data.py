"""The own-data issue's targets, measured in one run.

1. Readers: the 10-epoch run of `python -m bench wall` (torchrun, 2 ranks, one thread each,
   convnet, global batch 64) on a generated 4,000 / 1,000-image MNIST-format set, read three ways:
   the built-in MNIST reader (IDX files), an ImageFolder copy of the same images (PNG and JPEG in
   turn), the shards the converter writes from that copy, and the same copy as a Hugging Face
   parquet set written by `datasets` (--dataset hf: row groups of 100 rows, training rows shuffled).
   Cold: a fresh --cache-dir (indexing and decoding included); warm: the same command again. Test
   accuracy and wall time, each against the first of --readers (the MNIST reader's by default).
2. The loader against the step: decoding per process, the streamed loader's images/s with 0 and the
   default workers, and the images/s a training step consumes (convnet at 28 px, ResNet-18 at 224).
3. The data share of a step: ResNet-18 on 224-pixel JPEGs (about 500 x 375, as photos), 32 images
   per rank, world 2, --image-size 224, streamed (--cache-gb 0) by the default workers: the
   `data` share of the step time (TensorBoard's time/data_ms over the step), after a warm-up.
4. The store: streamed shards from local disk and from the local S3 server, the first (cold) epoch
   against the second, with the GETs of shard objects counted on the server.

    python -m bench own_data                 # all four, 2 seeds for 1
    python -m bench own_data --only readers --repeats 3
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.strategies import run, timing
from bench.wall import ROOT, one_run
from common.data import own
from common.data.formats import read_mnist
from common.data.loader import global_order
from common.data.reading import default_workers
from common.models import build_model


def data_flags(reader: str, data: Path, cache: Path) -> list[str]:
    dataset = {"mnist": "mnist", "folder": "imagefolder", "shards": "shards", "hf": "hf"}[reader]
    return ["--dataset", dataset, "--data-dir", str(data), "--cache-dir", str(cache), "--no-download"]


def readers(epochs: int, repeats: int, tmp: Path, chosen: list[str]) -> None:
    from tests.datagen import write_hf, write_image_tree, write_mnist, write_shards

    mnist = write_mnist(tmp / "mnist", train_size=4000, test_size=1000, gz=True)
    sources = {"mnist": mnist, "folder": write_image_tree(read_mnist(mnist), tmp / "folder")}
    sources["shards"] = write_shards(sources["folder"], tmp / "shards", shard_mb=1.0)
    sources["hf"] = write_hf(sources["folder"], tmp / "hf", rows_per_group=100, files=1)
    sources = {reader: data for reader, data in sources.items() if reader in chosen}
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    for seed in range(repeats):
        for reader, data in sources.items():
            for temperature in ("cold", "warm") if seed == 0 else ("warm",):  # the cache does not depend on the seed
                with tempfile.TemporaryDirectory() as run_tmp:
                    result = one_run(ROOT, "train_ddp.py", data_flags(reader, data, tmp / f"cache-{reader}"), epochs,
                                     seed, Path(run_tmp))
                rows.setdefault((reader, temperature), []).append(result)
    print(f"train_ddp.py, W=2, convnet, global batch 64, {epochs} epochs, 4,000 / 1,000 MNIST-format images; cold: "
          f"seed 0, a fresh --cache-dir; warm: seeds 0-{repeats - 1}, the cache reused\n")
    print(f"| reader | run | wall s (mean) | wall / {chosen[0]}'s | test acc per seed | mean "
          f"| mean - {chosen[0]}'s |\n|---|---|---|---|---|---|---|")
    for (reader, temperature), results in rows.items():
        base = rows[(chosen[0], temperature)]
        wall = statistics.mean(r["wall"] for r in results)
        acc = statistics.mean(r["acc"] for r in results)
        print(f"| {reader} | {temperature} | {wall:.1f} | {wall / statistics.mean(r['wall'] for r in base):.2f} | "
              f"{per_seed(results)} | {acc:.2f}% | "
              f"{acc - statistics.mean(r['acc'] for r in base):+.2f} |")


def per_seed(results: list[dict[str, float]]) -> str:
    return ", ".join(f"{r['acc']:.2f}" for r in results)


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


def loader_rates(tmp: Path, images: int) -> None:
    """Decoding per worker process, and the loader's images/s against what a step consumes."""
    from tests.datagen import write_imagefolder, write_photos

    sets = {"28-px PNG/JPEG, convnet, batch 128": (write_imagefolder(tmp / "small", train_size=images * 4,
                                                                      test_size=20), 0, "convnet", 128),
            "224-px JPEG, resnet18, batch 32": (write_photos(tmp / "photos", train_size=images, test_size=8), 224,
                                                "resnet18", 32)}
    print("\nThe loader (streamed, --cache-gb 0) against a step's demand, one process per row; a step: "
          "forward, backward, SGD, 1 thread\n")
    print("| set | decode, 1 process: img/s | loader, 0 workers: img/s | loader, "
          f"{default_workers(1)} workers: img/s | step demand: img/s | data share, 0 / {default_workers(1)} workers |")
    print("|---|---|---|---|---|---|")
    for label, (folder, size, model, batch) in sets.items():
        opts = own.OwnData("imagefolder", str(folder), str(tmp / "cache"), {}, size, 0, 0, False, 0.0, 1.0)
        data = own.open_prepared(own.prepare(opts, lambda line: None), opts)
        source = data.train.source
        started = time.perf_counter()
        for i in range(min(len(source), 200)):
            source.image(i)
        decode = min(len(source), 200) / (time.perf_counter() - started)
        rates = [loader_rate(data.train, workers, batch) for workers in (0, default_workers(1))]
        demand = step_rate(model, data.spec.channels, data.spec.size, batch)
        shares = f"{data_share(rates[0], demand, overlapped=False):.0%} / {data_share(rates[1], demand, True):.0%}"
        print(f"| {label} | {decode:,.0f} | {rates[0]:,.0f} | {rates[1]:,.0f} | {demand:,.0f} | {shares} |")


def data_share(rate: float, demand: float, overlapped: bool) -> float:
    """The share of a step spent waiting for data: the whole decode time when the rank decodes
    (0 workers), only what the workers fall behind the step when they decode meanwhile."""
    wait = 1 / rate - (1 / demand if overlapped else 0.0)
    return max(wait, 0.0) / (1 / demand + max(wait, 0.0))


def loader_rate(split: own.Streamed, workers: int, batch: int) -> float:
    """Images/s the loader delivers, counted after its first batch (the workers' start)."""
    split.workers = workers
    plan = [torch.arange(i, i + batch) for i in range(0, len(split) - batch + 1, batch)]
    batches = split.batches(plan, torch.device("cpu"))
    next(batches)
    started = time.perf_counter()
    count = sum(len(labels) for _, labels in batches)
    return count / (time.perf_counter() - started)


def step_rate(model: str, channels: int, size: int, batch: int, steps: int = 3) -> float:
    net = build_model(model, channels, size, 10, 0).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, channels, size, size).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))
    for step in range(steps + 1):
        if step == 1:
            started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    return steps * batch / (time.perf_counter() - started)


def store_epochs(tmp: Path, images: int, workers: int) -> None:
    """Streamed shards read from local disk and from the local S3 server (moto, 127.0.0.1): the
    index (which reads every shard once), the first epoch and the second, in one process, with the
    GETs of shard objects counted on the server; the store once with a cache that holds the set and
    once with the least cache allowed (8 of the largest shard)."""
    from tests.conftest import free_port
    from tests.datagen import write_imagefolder, write_shards
    from tests.s3server import S3Server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request lines
    shards = write_shards(write_imagefolder(tmp / "store-set", train_size=images, test_size=20), tmp / "store-shards",
                          shard_mb=0.25)
    small_gb = 8 * max(p.stat().st_size for p in shards.glob("*.tar")) / 2**30
    server = S3Server(free_port())
    server.start()
    try:
        server.client().create_bucket(Bucket="bench")
        server.upload_tree("bench", "shards", shards)
        os.environ.update(server.env())  # the workers inherit them
        print(f"\nStreamed shards ({len(list(shards.glob('train-*.tar')))} of 0.25 MB, {images} 28-px images), "
              f"{workers} worker(s), batch 128, one process; in brackets the GETs of shard objects\n")
        print("| source | shard cache | index: s | epoch 1: img/s | epoch 2: img/s | epoch 2 / epoch 1 |\n"
              "|---|---|---|---|---|---|")
        rows = (("local disk", str(shards), 4.0, "-"), ("local S3 server", "s3://bench/shards", 4.0, "the set"),
                ("local S3 server", "s3://bench/shards", small_gb, f"8 shards, {small_gb * 2**20:,.0f} KiB"))
        for label, source, cache_gb, held in rows:
            opts = own.OwnData("shards", source, str(tmp / f"cache-{label}-{cache_gb}"), {}, 0, workers, 0, False,
                               0.0, cache_gb)
            server.log.clear()
            started = time.perf_counter()
            data = own.open_prepared(own.prepare(opts, lambda line: None), opts)
            index = f"{time.perf_counter() - started:.1f} ({server.log.gets('/bench/shards/')})"
            rates, gets = [], []
            for epoch in (1, 2):
                server.log.clear()
                rates.append(epoch_rate(data.train, epoch))
                gets.append(server.log.gets("/bench/shards/"))
            print(f"| {label} | {held} | {index} | {rates[0]:,.0f} ({gets[0]}) | {rates[1]:,.0f} ({gets[1]}) | "
                  f"{rates[1] / rates[0]:.2f} |")
    finally:
        server.stop()


def epoch_rate(split: own.Streamed, epoch: int, batch: int = 128) -> float:
    """Images/s of one epoch in the training order, the workers' start included."""
    order = global_order(len(split), 0, epoch, split.groups)
    started = time.perf_counter()
    count = sum(len(labels) for _, labels in split.batches(list(order.split(batch)), torch.device("cpu")))
    return count / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("readers", "loader", "store", "jpeg"), default=None)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--readers", default="mnist,folder,shards,hf",
                   help="readers: which, the first the reference (default: %(default)s)")
    p.add_argument("--images", type=int, default=512, help="training JPEGs for the data share (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="steps of the data-share run (default: %(default)s)")
    a = p.parse_args()
    print(f"python {sys.version.split()[0]}, torch {__import__('torch').__version__}, CPU, gloo\n")
    with tempfile.TemporaryDirectory() as tmp:
        if a.only in (None, "readers"):
            readers(a.epochs, a.repeats, Path(tmp), a.readers.split(","))
        if a.only in (None, "loader"):
            loader_rates(Path(tmp), a.images // 2)
        if a.only in (None, "store"):
            store_epochs(Path(tmp), a.images * 8, default_workers(1))
        if a.only in (None, "jpeg"):
            jpeg_share(a.images, a.steps, Path(tmp))


if __name__ == "__main__":
    main()
