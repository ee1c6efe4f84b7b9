"""Your own images at scale: the own-data issue's targets for large sets, measured in one run.

1. epoch: a streamed epoch's time per sample (--cache-gb 0, 28-px grayscale PNGs) at each of
   --sizes, --skip-broken off and on; target: the largest size within 1.2x of the smallest. The
   ImageFolder tree is hard links (1,000 class folders, plus 1,000 links in val/) to a few distinct
   PNGs, so it takes little disk and its bytes stay in the page cache: the figure is the loader's
   own cost per sample (path lookup, open, decode, collate), not the disk's. Each tree is indexed
   by own.prepare (timed; then prepared again: the listing and fingerprint, the index reused), and
   one whole epoch runs through TrainLoader (world 1, global batch 256, CPU, the default workers):
   its wall time, and its CPU time (rank + workers), which other work on the cores hardly moves.
2. memory: the index's memory per process at each of --memory-sizes: an ImageNet-like index
   (1,000 classes, names train/nXXXXXXXX/nXXXXXXXX_I.JPEG, 50,000 val) written directly as
   indexing writes it (10 M files are too many to create), then in a fresh interpreter mapped and
   every sample's name and label read once in the rank, then by 2 forked DataLoader workers
   reading an epoch in a random order. From /proc/self/smaps_rollup: Anonymous growth (what the
   index costs the process), Private_Dirty growth (in a worker: the pages it copied from the
   rank), Rss growth (mapped pages count there, held once per node in the page cache). Reference
   rows: the representation the index replaced, a list of str and an int64 tensor, read the same way.
4. hf-epoch: the same for a Hugging Face parquet set (--dataset hf): --hf-sizes rows of the same
   PNGs' bytes, 1,000 classes (a ClassLabel), row groups of 100 rows (what the Hub writes for image
   sets), 100,000 rows a file; streamed (--cache-gb 0), so each epoch reads its row groups. Target:
   the CPU time per sample at the largest size within 1.2x of the smallest.
5. hf-rows: a parquet set of --hf-groups row groups of 227 MB each (100 rows of 2.27 MB: a 16-px
   JPEG padded with random bytes, which compress to nothing), streamed at world 1, 2 and 4 with 2
   DataLoader workers per rank. Each rank's first epoch is read as its workers would read it (rank r
   takes every W-th sample of each global batch of 64; worker j the batches k = j mod 2), every rank
   in turn, each worker a forked process that reads its samples' bytes (Reader.read: no decode).
   Per rank: the bytes pyarrow decompressed (the row groups' image columns read whole, or written
   once per node into the row-group cache) and the bytes read back per sample, against the bytes
   of the samples used; CPU per sample (workers); each worker's peak RSS, and its peak anonymous
   memory (RssAnon: what is not shared page cache).
3. prepare: 2,300 photo-sized JPEGs (about 500 x 375) prepared at --image-size 224, each step in a
   fresh interpreter with the app's prepare workers (default_workers(1) + 1): the index, the
   statistics on 2,048 images, the decode into the cache. Wall time, and peak RSS (ru_maxrss) of
   the process and of its largest child (a DataLoader worker). Then every statistics task
   (own.STATS_CHUNK images) timed alone, in one process: the slowest is what the loader's
   own.LOADER_TIMEOUT_S deadline bounds.

    python -m bench scale                       # all three, about 15-20 minutes on 2 cores
    python -m bench scale --only epoch --sizes 10000,100000
    python -m bench scale --only memory --memory-sizes 1000000
    python -m bench scale --only prepare
    python -m bench scale --only hf-epoch --hf-sizes 10000,300000
    python -m bench scale --only hf-rows
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common.data import own
from common.data.geometry import choose_geometry
from common.data.index import INDEX_FORMAT, TableWriter, map_index, publish, shapes_of, staging_for
from common.data.indexing import Survey, as_is
from common.data.loader import Dataset, TrainLoader, make_synthetic
from common.data.reading import default_workers

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20
LINKS_PER_FILE = 30_000  # ext4 allows 65,000 links to one inode
CHUNK = 65_536  # names generated and written at a time


def quiet(line: str) -> None:
    pass


def in_fresh_process(call: str) -> dict:
    """`call`, an expression of this module, evaluated in a fresh interpreter (its memory starts
    from nothing this run allocated); its JSON result."""
    done = subprocess.run([sys.executable, "-c", f"import json, bench.scale as s; print(json.dumps(s.{call}))"],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{call} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) / MB


# ---------------------------------------------------------------- 1. a streamed epoch at 10 k and 1 M samples

def linked_tree(root: Path, train: int, val: int, classes: int = 1000) -> Path:
    """An ImageFolder tree of hard links to distinct 28x28 grayscale PNGs (MNIST-like synthetic
    digits): sample n in class n % classes. Links, not copies: the disk holds the few sources."""
    from PIL import Image

    sources = max(16, math.ceil((train + val) / LINKS_PER_FILE))
    pixels = make_synthetic("mnist", train_size=sources, test_size=1).train.images
    (root / "sources").mkdir(parents=True)
    files = [root / "sources" / f"{n}.png" for n in range(sources)]
    for path, image in zip(files, pixels):
        Image.fromarray(image[0].numpy(), "L").save(path)
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            (root / split / f"c{c:04d}").mkdir(parents=True)
        for n in range(count):
            os.link(files[n % sources], root / split / f"c{n % classes:04d}" / f"{n:07d}.png")
    return root


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (an epoch's workers end with it)."""
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                       resource.RUSAGE_CHILDREN)))


def timed_epoch(data: Dataset) -> tuple[float, float, int]:
    """Wall and CPU seconds (rank + workers) of one whole training epoch, the workers' start
    included, and its samples. The CPU time hardly moves when other work shares the cores."""
    loader = TrainLoader(data.train, data.spec, 256, 0, 1, 0, torch.device("cpu"))
    started, cpu = time.perf_counter(), cpu_seconds()
    samples = sum(len(labels) for _, labels in loader.epoch(0))
    return time.perf_counter() - started, cpu_seconds() - cpu, samples


def epochs(tmp: Path, sizes: list[int]) -> None:
    print(f"A streamed epoch (--cache-gb 0), 28-px grayscale PNGs (hard links), 1,000 classes, TrainLoader world 1, "
          f"global batch 256, CPU, {default_workers(1)} DataLoader worker(s); prepare with "
          f"{default_workers(1) + 1} workers\n")
    print("| train samples | --skip-broken | tree: s (links) | prepare: s (index + statistics) | prepare again: s "
          "(listing, index reused) | index on disk: MB | epoch: s | µs / sample | vs the smallest (target: 1.2x "
          "at most) | CPU µs / sample (rank + workers) | vs the smallest |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    per_sample: dict[bool, tuple[float, float]] = {}
    for size in sizes:
        started = time.perf_counter()
        tree = linked_tree(tmp / f"tree-{size}", size, 1000)
        made = time.perf_counter() - started
        for skip in (False, True):
            opts = own.OwnData("imagefolder", str(tree), str(tmp / "cache"), {}, 0, default_workers(1),
                               default_workers(1) + 1, skip, 0.0, 1.0)
            started = time.perf_counter()
            own.prepare(opts, quiet)
            first = time.perf_counter() - started
            started = time.perf_counter()
            report = own.prepare(opts, quiet)
            again = time.perf_counter() - started
            data = own.open_prepared(report, opts)
            seconds, cpu, samples = timed_epoch(data)
            us, cpu_us = seconds / samples * 1e6, cpu / samples * 1e6
            wall_ref, cpu_ref = per_sample.setdefault(skip, (us, cpu_us))  # the first (smallest) size's
            print(f"| {size:,} | {'on' if skip else 'off'} | {made:.1f} | {first:.1f} | {again:.1f} | "
                  f"{folder_mb(Path(report['index'])):.1f} | {seconds:.1f} | {us:.0f} | {us / wall_ref:.2f}x | "
                  f"{cpu_us:.0f} | {cpu_us / cpu_ref:.2f}x |", flush=True)
        shutil.rmtree(tree)


def parquet_set(root: Path, train: int, val: int, classes: int = 1000, rows_per_group: int = 100,
                rows_per_file: int = 100_000) -> Path:
    """A Hugging Face parquet set in the Hub's layout: the distinct PNGs of linked_tree, row n of a
    split's file k holding PNG n % distinct in class (n + k) % classes (so that no two files hold
    the same rows: --dataset hf refuses copies); an Image and a ClassLabel column."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    sources = max(16, math.ceil((train + val) / LINKS_PER_FILE))
    encoded = []
    for image in make_synthetic("mnist", train_size=sources, test_size=1).train.images:
        out = io.BytesIO()
        Image.fromarray(image[0].numpy(), "L").save(out, "PNG")
        encoded.append(out.getvalue())
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": [f"c{c:04d}" for c in
                                                                                          range(classes)]}}
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("label", pa.int64())],
                       metadata={"huggingface": json.dumps({"info": {"features": features}})})
    (root / "data").mkdir(parents=True)
    for split, count in (("train", train), ("validation", val)):
        files = math.ceil(count / rows_per_file)
        for k in range(files):
            rows = range(k * rows_per_file, min(count, (k + 1) * rows_per_file))
            table = pa.table({"image": [{"bytes": encoded[n % sources], "path": None} for n in rows],
                              "label": [(n + k) % classes for n in rows]}, schema=schema)
            name = f"{split}-{k:05d}-of-{files:05d}.parquet"
            pq.write_table(table, root / "data" / name, row_group_size=rows_per_group)
    return root


def hf_epochs(tmp: Path, sizes: list[int]) -> None:
    print(f"\nA streamed epoch (--cache-gb 0) of a Hugging Face parquet set: the same 28-px grayscale PNGs' bytes, "
          f"1,000 classes, row groups of 100 rows; TrainLoader world 1, global batch 256, CPU, {default_workers(1)} "
          "DataLoader worker(s)\n")
    print("| train rows | parquet: MB | prepare: s (index + statistics) | epoch: s | µs / sample | vs the smallest | "
          "CPU µs / sample (rank + workers) | vs the smallest (target: 1.2x at most) |\n"
          "|---|---|---|---|---|---|---|---|")
    reference: tuple[float, float] | None = None
    for size in sizes:
        source = parquet_set(tmp / f"hf-{size}", size, 1000)
        opts = own.OwnData("hf", str(source), str(tmp / "cache"), {}, 0, default_workers(1), default_workers(1) + 1,
                           False, 0.0, 1.0)
        started = time.perf_counter()
        data = own.open_prepared(own.prepare(opts, quiet), opts)
        prepared = time.perf_counter() - started
        seconds, cpu, samples = timed_epoch(data)
        us, cpu_us = seconds / samples * 1e6, cpu / samples * 1e6
        wall_ref, cpu_ref = reference = reference or (us, cpu_us)
        print(f"| {size:,} | {folder_mb(source / 'data'):.1f} | {prepared:.1f} | {seconds:.1f} | {us:.0f} | "
              f"{us / wall_ref:.2f}x | {cpu_us:.0f} | {cpu_us / cpu_ref:.2f}x |", flush=True)
        shutil.rmtree(source)


# ---------------------------------------------------------------- 5. parquet row groups larger than a rank's share

ROW_GROUP_ROWS, ROW_BYTES = 100, 2_270_000  # row groups of 227 MB


def large_row_groups(root: Path, groups: int) -> Path:
    """A parquet set in the Hub's layout whose training file holds `groups` row groups of
    ROW_GROUP_ROWS rows of ROW_BYTES: a 16-px JPEG padded with random bytes (incompressible), a
    random class of 10; its validation file one small row group."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 120, 200)).save(out, "JPEG")
    jpeg = out.getvalue()
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("label", pa.int64())])
    (root / "data").mkdir(parents=True)
    for split, count, rows in (("train", groups, ROW_GROUP_ROWS), ("validation", 1, 20)):
        with pq.ParquetWriter(root / "data" / f"{split}-00000-of-00001.parquet", schema) as writer:
            for _ in range(count):  # one write_table, one row group
                images = [{"bytes": jpeg + rng.bytes(ROW_BYTES - len(jpeg)), "path": None} for _ in range(rows)]
                writer.write_table(pa.table({"image": images, "label": rng.integers(0, 10, rows)}, schema=schema))
    return root


def proc_status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return math.nan


def counted_reads(reader, batches: list[list[int]]) -> dict:
    """One worker's reads of its batches' samples: the bytes pyarrow decompressed for it (an image
    column read whole by Files.columns, or streamed by Files.column_batches into the row-group
    cache), the bytes of the samples, CPU seconds, peak RSS and peak anonymous memory (MB)."""
    import pyarrow.compute as pc

    from common import hfsets

    decompressed = [0]

    def counting(method):
        def counted(*args, **kwargs):
            out = method(*args, **kwargs)
            items = out if isinstance(out, list) else None
            if items is None:  # a generator of arrays: counted as they come
                def passing():
                    for array in out:
                        decompressed[0] += int(pc.sum(pc.binary_length(hfsets.image_bytes(array))).as_py() or 0)
                        yield array
                return passing()
            decompressed[0] += sum(int(pc.sum(pc.binary_length(hfsets.image_bytes(a))).as_py() or 0) for a in items[:1])
            return out
        return counted

    hfsets.Files.columns = counting(hfsets.Files.columns)
    if hasattr(hfsets.Files, "column_batches"):
        hfsets.Files.column_batches = counting(hfsets.Files.column_batches)
    start_rss, start_anon, anon, used = proc_status_mb("VmRSS"), proc_status_mb("RssAnon"), 0.0, 0
    cpu = time.process_time()
    for batch in batches:
        used += sum(len(reader.read(i)) for i in batch)
        anon = max(anon, proc_status_mb("RssAnon"))
    return {"cpu": time.process_time() - cpu, "samples": sum(map(len, batches)), "used": used,
            "decompressed": decompressed[0], "start_rss": start_rss, "peak_rss": proc_status_mb("VmHWM"),
            "start_anon": start_anon, "peak_anon": anon}


def in_child(work, queue) -> None:
    queue.put(work())


def rank_reads(data_dir: str, cache_dir: str, world: int, workers: int = 2, batch: int = 64) -> list[list[dict]]:
    """Every rank's first epoch of the streamed set read by its `workers` forked processes, one rank
    after another (the ranks of one node): per rank, each worker's counted_reads."""
    import functools
    import multiprocessing

    from common.data.loader import global_order

    opts = own.OwnData("hf", data_dir, cache_dir, {}, 0, workers, 1, False, 0.0, 10.0)
    data = own.open_prepared(own.prepare(opts, quiet), opts)
    shutil.rmtree(opts.cache_root / "rowgroups", ignore_errors=True)  # the statistics' copies: the ranks make them
    reader = data.train.source
    order = global_order(len(reader), 0, 0, data.train.groups)
    context = multiprocessing.get_context("fork")
    ranks = []
    for rank in range(world):
        batches = [order[k * batch + rank:(k + 1) * batch:world].tolist() for k in range(len(order) // batch)]
        queue = context.SimpleQueue()
        children = [context.Process(target=in_child, args=(functools.partial(counted_reads, reader,
                                                                              batches[j::workers]), queue))
                    for j in range(workers)]
        for child in children:
            child.start()
        ranks.append([queue.get() for _ in children])
        for child in children:
            child.join()
    return ranks


def hf_row_groups(tmp: Path, groups: int) -> None:
    source = large_row_groups(tmp / "hf-rows", groups)
    print(f"\nA parquet set streamed (--cache-gb 0) from row groups of {ROW_GROUP_ROWS * ROW_BYTES / 1e6:.0f} MB "
          f"({ROW_GROUP_ROWS} rows of {ROW_BYTES / 1e6:.2f} MB), {groups} of them; 2 DataLoader workers per rank, "
          "global batch 64, each rank's first epoch read (no decode), the ranks of one node in turn\n")
    print("| world | per rank: MB decompressed | MB of its samples | decompressed / used | per node: MB decompressed | "
          "CPU ms / sample (workers) | a worker's peak RSS: MB (at its start) | peak anonymous memory: MB, a worker "
          "that decompressed | one that did not | a worker's anonymous memory at its start: MB (its parent's) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for world in (1, 2, 4):
        shutil.rmtree(tmp / "hf-rows-cache", ignore_errors=True)
        ranks = in_fresh_process(f"rank_reads({str(source)!r}, {str(tmp / 'hf-rows-cache')!r}, {world})")
        workers = [w for rank in ranks for w in rank]
        node = sum(w["decompressed"] for w in workers) / 1e6
        used = sum(w["used"] for w in workers) / 1e6
        cpu_ms = sum(w["cpu"] for w in workers) / sum(w["samples"] for w in workers) * 1e3
        peak = max(workers, key=lambda w: w["peak_rss"])
        anon = [max((w["peak_anon"] for w in workers if bool(w["decompressed"]) == did), default=math.nan)
                for did in (True, False)] + [max(w["start_anon"] for w in workers)]
        print(f"| {world} | {node / world:,.0f} | {used / world:,.0f} | {node / used:.2f} | {node:,.0f} | "
              f"{cpu_ms:.2f} | {peak['peak_rss']:,.0f} ({peak['start_rss']:,.0f}) | "
              + " | ".join(f"{mb:,.0f}" for mb in anon) + " |", flush=True)
    shutil.rmtree(source)


# ---------------------------------------------------------------- 2. the index's memory per process

def imagenet_names(split: str, start: int, stop: int, count: int, classes: int) -> tuple[list[str], list[int]]:
    """Names and labels of samples [start, stop) of an ImageNet-like split of `count`, class by
    class as index_folder lists a tree."""
    labels = [n * classes // count for n in range(start, stop)]
    folder = "train" if split == "train" else "val"
    return [f"{folder}/n{c:08d}/n{c:08d}_{n}.JPEG" for n, c in zip(range(start, stop), labels)], labels


def write_index(folder: Path, samples: int, val: int = 50_000, classes: int = 1000) -> Path:
    """The index indexing would publish for such a tree, written with its own TableWriter."""
    staging = staging_for(folder)
    for split, count in (("train", samples), ("test", val)):
        writer = TableWriter(staging, split, sharded=False)
        for start in range(0, count, CHUNK):
            names, labels = imagenet_names(split, start, min(start + CHUNK, count), count, classes)
            writer.add_images(names, labels, [(500, 375)] * len(names))
        writer.close()
    survey = Survey()
    survey.saw("500x375", "train/n00000000/n00000000_0.JPEG", "RGB", "JPEG")
    publish(staging, folder, {"format": INDEX_FORMAT, "kind": "imagefolder", "root": "/data/imagenet",
                              "classes": [str(i) for i in range(classes)], "fingerprint": f"bench-{samples}",
                              "versions": {}, **survey.meta(),
                              "tensors": shapes_of(staging)})
    for path in folder.iterdir():  # written back, as an index built long before: dirty page-cache pages
        with open(path, "rb") as f:  # would count as Private_Dirty in the process that maps them
            os.fsync(f.fileno())
    return folder


FIELDS = ("Anonymous", "Private_Dirty", "Rss")
_worker_start: dict[str, int] = {}


def smaps() -> dict[str, int]:
    """This process's memory (bytes) from /proc/self/smaps_rollup."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                fields[key] = int(rest.split()[0]) * 1024
    return fields


def growth(since: dict[str, int]) -> dict[str, int]:
    now = smaps()
    return {k: now[k] - since[k] for k in FIELDS}


class NameReader(torch.utils.data.Dataset):
    """What a worker reads of the index for each sample before opening its file (Reader's name and
    label); each batch answers with the worker's memory growth since it started."""

    def __init__(self, names, labels: torch.Tensor) -> None:
        self.names, self.labels = names, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: list[int]) -> tuple[int, dict[str, int]]:
        for i in indices:
            self.names[i], int(self.labels[i])
        return torch.utils.data.get_worker_info().id, growth(_worker_start)


def start_worker(worker_id: int) -> None:
    _worker_start.update(smaps())  # after the fork: what the worker shares with the rank is its baseline


def index_memory(folder: str, representation: str, workers: int = 2) -> dict:
    """In this (fresh) process: the memory growth of holding the split's names and labels, of
    reading each once, and in each forked worker of reading an epoch's samples in a random order."""
    before = smaps()
    if representation == "mapped":
        table = map_index(Path(folder)).train
        names, labels = table.names, table.labels
    else:  # the representation the index replaced: Python str objects
        samples = len(map_index(Path(folder)).train)
        names = []
        for start in range(0, samples, CHUNK):
            names += imagenet_names("train", start, min(start + CHUNK, samples), samples, 1000)[0]
        labels = torch.tensor([n * 1000 // samples for n in range(samples)])
    held = growth(before)
    started = time.perf_counter()
    for i in range(len(labels)):  # every sample once, as a rank decoding alone (0 workers) would
        names[i], int(labels[i])
    read_s = time.perf_counter() - started
    read = growth(before)
    plan = own.Plan(list(torch.randperm(len(labels)).split(4096)))
    loader = torch.utils.data.DataLoader(NameReader(names, labels), batch_sampler=plan, num_workers=workers,
                                         collate_fn=as_is, worker_init_fn=start_worker)
    per_worker: dict[int, dict[str, int]] = {}
    started = time.perf_counter()
    for worker, grown in loader:
        per_worker[worker] = {k: max(v, per_worker.get(worker, {}).get(k, v)) for k, v in grown.items()}
    return {"held": held, "read": read, "read_s": read_s, "workers": list(per_worker.values()),
            "workers_s": time.perf_counter() - started}


def memory(tmp: Path, sizes: list[int]) -> None:
    print("\nThe index's memory per process: an ImageNet-like index (1,000 classes, 50,000 val), in a fresh "
          "interpreter; growth from /proc/self/smaps_rollup, MB; workers: forked DataLoader workers reading an epoch "
          "in a random order (4,096 samples a batch), growth since each started, the larger of the 2; target: "
          "under 50 MB of Anonymous per process\n")
    print("| train samples | held as | process | Anonymous | Private_Dirty | Rss | index on disk: MB | read: s |\n"
          "|---|---|---|---|---|---|---|---|")
    for size in sizes:
        folder = write_index(tmp / f"index-{size}", size)
        for representation in ("mapped", "list of str"):
            m = in_fresh_process(f"index_memory({str(folder)!r}, {representation!r})")
            disk = f"{folder_mb(folder):.0f}" if representation == "mapped" else "-"
            rows = (("rank: held", m["held"], "-"), ("rank: every name read", m["read"], f"{m['read_s']:.1f}"),
                    ("each of 2 workers: an epoch read", {k: max(w[k] for w in m["workers"]) for k in FIELDS},
                     f"{m['workers_s']:.1f}"))
            for process, grown, seconds in rows:
                print(f"| {size:,} | {representation} | {process} | {grown['Anonymous'] / MB:,.0f} | "
                      f"{grown['Private_Dirty'] / MB:,.0f} | {grown['Rss'] / MB:,.0f} | {disk} | {seconds} |",
                      flush=True)
        shutil.rmtree(folder)


# ---------------------------------------------------------------- 3. the statistics and the decode at 224 px

def peaks() -> dict[str, float]:
    """Peak RSS so far, MB: this process's, and its largest finished child's."""
    return {"self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def prepare_step(step: str, data_dir: str, cache_dir: str) -> dict:
    """One step of the preparation in this (fresh) process; the index is built by the first."""
    opts = own.OwnData("imagefolder", data_dir, cache_dir, {}, 224, default_workers(1), default_workers(1) + 1,
                       False, 1.0 if step == "decode" else 0.0, 1.0)
    imported = peaks()["self"]
    started = time.perf_counter()
    if step == "index":
        own.load_index(opts, quiet)
    elif step == "statistics":
        index = own.load_index(opts, quiet)
        own.statistics(index, choose_geometry(index, opts.image_size, opts.resampling), opts)
    else:  # the index and the statistics are found in the cache: the decode alone
        if "decoded" not in own.prepare(opts, quiet):
            raise RuntimeError(f"{data_dir} was not decoded into the cache: raise its cache_gb")
    result = {"wall": time.perf_counter() - started, "imported": imported, **peaks()}
    if step == "statistics":
        result["tasks"] = stats_task_seconds(opts)
    return result


def stats_task_seconds(opts: own.OwnData) -> list[float]:
    """Each statistics task (STATS_CHUNK images, as own.statistics splits them) decoded alone."""
    index = own.load_index(opts, quiet)
    source = own.reader(index, "train", choose_geometry(index, opts.image_size, opts.resampling), opts)
    picks = own.stats_picks(index.train)
    seconds = []
    for i in range(0, len(picks), own.STATS_CHUNK):
        started = time.perf_counter()
        source.__getitems__(picks[i:i + own.STATS_CHUNK])
        seconds.append(time.perf_counter() - started)
    return seconds


def prepare_costs(tmp: Path, train: int, val: int) -> None:
    from tests.datagen import write_photos

    folder = write_photos(tmp / "photos", train_size=train, test_size=val, classes=10)
    cache = tmp / "prepare-cache"
    steps = {step: in_fresh_process(f"prepare_step({step!r}, {str(folder)!r}, {str(cache)!r})")
             for step in ("index", "statistics", "decode")}
    print(f"\nPreparing {train:,} / {val:,} photo-sized JPEGs (about 500 x 375) at --image-size 224, "
          f"{default_workers(1) + 1} prepare workers, each step in a fresh interpreter; peak RSS (ru_maxrss), MB\n")
    print("| step | wall: s | process peak (after imports) | largest worker's peak |\n|---|---|---|---|")
    for step, m in steps.items():
        print(f"| {step} | {m['wall']:.1f} | {m['self']:,.0f} ({m['imported']:,.0f}) | {m['children']:,.0f} |")
    tasks = steps["statistics"]["tasks"]
    print(f"\nStatistics tasks ({own.STATS_CHUNK} images each, {len(tasks)} tasks), each alone in one process: "
          f"slowest {max(tasks):.2f} s, mean {sum(tasks) / len(tasks):.2f} s; the loader's deadline "
          f"{own.LOADER_TIMEOUT_S:g} s is {own.LOADER_TIMEOUT_S / max(tasks):,.0f}x the slowest")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("epoch", "memory", "prepare", "hf-epoch", "hf-rows"), default=None)
    p.add_argument("--sizes", default="10000,1000000", help="epoch: training samples (default: %(default)s)")
    p.add_argument("--hf-sizes", default="10000,300000", help="hf-epoch: training rows (default: %(default)s)")
    p.add_argument("--hf-groups", type=int, default=4, help="hf-rows: the row groups of 227 MB (default: %(default)s)")
    p.add_argument("--memory-sizes", default="1000000,10000000",
                   help="memory: training samples (default: %(default)s)")
    p.add_argument("--tmp", type=Path, default=None,
                   help="a folder on the file system to use: the trees, indexes and caches go in a temporary "
                        "folder in it, removed at the end (default: under /tmp)")
    a = p.parse_args()
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CPU, {len(os.sched_getaffinity(0))} cores\n")
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        if a.only in (None, "epoch"):
            epochs(Path(tmp), [int(s) for s in a.sizes.split(",")])
        if a.only in (None, "memory"):
            memory(Path(tmp), [int(s) for s in a.memory_sizes.split(",")])
        if a.only in (None, "prepare"):
            prepare_costs(Path(tmp), 2200, 100)
        if a.only in (None, "hf-epoch"):
            hf_epochs(Path(tmp), [int(s) for s in a.hf_sizes.split(",")])
        if a.only in (None, "hf-rows"):
            hf_row_groups(Path(tmp), a.hf_groups)


if __name__ == "__main__":
    main()
