"""--dataset imagefolder | shards: your own images, prepared once per node by its local rank 0.

Preparing: index the set (cached by its files' names, sizes and dates, or its objects' ETags),
choose the geometry, measure the normalization statistics on STATS_SAMPLES training images, then
either decode the whole set once into the node's cache (when it fits --cache-gb: every later run
and every rank of the node maps it, and it trains at the speed of the built-in sets) or leave it
to be streamed: DataLoader workers decode each batch, shards from a URL through a bounded shard cache.
Both ways give the same batches: the same order, the same decoded pixels, the same augmentation.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from common import shards as layout
from common.data.cache import META, cache_folder, default_cache_dir, file_lock, map_tensors, read_meta, write_tensors
from common.data.images import (STATS_SAMPLES, Geometry, Reader, SetIndex, Stored, as_is, check_classes,
                                ShardSamples, choose_geometry, index_folder, parallel, read_shard, shard_table, stored_bytes)
from common.data.loader import DataSpec, Dataset, Split, to_device
from common.data.shardcache import Prefetcher, ShardCache, check_budget
from common.errors import UserError
from common.storage import StorageError, is_url, storage_for

Say = Callable[[str], None]
INDEX_FORMAT = 1  # in each index's key: a later index layout is never read as an earlier one
DECODE_CHUNK = 256  # images per worker task while decoding into the cache
STATS_SHARDS = 8  # shards the statistics are measured on
LOADER_TIMEOUT_S = 600.0  # a worker may fetch a shard (bounded by the store's own timeouts) and decode a batch


@dataclass(frozen=True)
class OwnData:
    kind: str  # imagefolder | shards
    data_dir: str
    cache_dir: str
    storage_options: dict[str, Any]
    image_size: int
    workers: int  # per rank, while training from a stream
    prepare_workers: int  # on the node's local rank 0, while indexing and decoding
    skip_broken: bool
    cache_gb: float
    shard_cache_gb: float

    @property
    def cache_root(self) -> Path:
        return Path(self.cache_dir or default_cache_dir())

    def shard_cache(self, versions: dict[str, str]) -> ShardCache | None:
        if not is_url(self.data_dir):
            return None
        return ShardCache(self.data_dir, self.storage_options, cache_folder(self.cache_dir, self.data_dir) / "shards",
                          int(self.shard_cache_gb * 2**30), versions)


# ---------------------------------------------------------------- on the node's local rank 0

def prepare(opts: OwnData, say: Say) -> dict[str, Any]:
    """Index, geometry, statistics; then the decoded cache, or the index to stream from."""
    index, index_path = load_index(opts, say)
    geometry = choose_geometry(index, opts.image_size)
    mean, std = statistics(index, geometry, opts)
    spec = DataSpec(geometry.channels, geometry.size, index.classes, mean, std, geometry.augment)
    report = {"index": str(index_path), "geometry": asdict(geometry), "spec": asdict(spec)}
    if stored_bytes(index, geometry) <= opts.cache_gb * 2**30:
        report["decoded"] = str(decode_into_cache(index, geometry, spec, opts, say))
    return report


def load_index(opts: OwnData, say: Say) -> tuple[SetIndex, Path]:
    """The set's index: from the cache when its fingerprint still matches the files, else built."""
    fingerprint, versions = fingerprint_of(opts)
    key = hashlib.sha256(json.dumps([INDEX_FORMAT, opts.kind, opts.data_dir, opts.skip_broken]).encode()).hexdigest()
    path = opts.cache_root / "index" / f"{opts.kind}-{key[:16]}.pt"
    if path.is_file():
        state = torch.load(path, weights_only=True)
        if state["fingerprint"] == fingerprint:
            return SetIndex.from_state(state), path
    say(f"indexing {opts.data_dir} ...")
    index = index_folder(Path(opts.data_dir), opts.prepare_workers, opts.skip_broken) \
        if opts.kind == "imagefolder" else index_shards(opts, versions)
    index.fingerprint = fingerprint
    if index.skipped:
        say(f"{opts.data_dir}: skipped {len(index.skipped)} unreadable file(s) ({', '.join(index.skipped[:5])}"
            f"{', ...' if len(index.skipped) > 5 else ''})")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(index.state(), path.with_suffix(f".tmp-{os.getpid()}"))
    os.replace(path.with_suffix(f".tmp-{os.getpid()}"), path)
    return index, path


def fingerprint_of(opts: OwnData) -> tuple[str, dict[str, str]]:
    """What identifies the set's content: each file's name, size and date (each object's ETag);
    and, for shards, each shard's version."""
    if opts.kind == "imagefolder":
        root = Path(opts.data_dir)
        entries = {str(p.relative_to(root)): f"{p.stat().st_size}-{p.stat().st_mtime_ns}"
                   for split in (layout.TRAIN, layout.VAL) for p in sorted((root / split).rglob("*")) if p.is_file()}
    else:
        entries = shard_versions(opts)
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest(), entries


def shard_versions(opts: OwnData) -> dict[str, str]:
    """Shard (and classes.txt) name -> version, from the folder or the store's listing."""
    wanted = lambda name: name == layout.CLASSES_FILE or any(  # noqa: E731
        name.startswith(f"{split}-") and name.endswith(".tar") for split in (layout.TRAIN, layout.VAL))
    if not is_url(opts.data_dir):
        root = Path(opts.data_dir)
        if not root.is_dir():
            raise UserError(f"--data-dir {root} is not a folder; give the folder (or URL) that holds the "
                            "train-*.tar and val-*.tar shards")
        return {p.name: f"{p.stat().st_size}-{p.stat().st_mtime_ns}" for p in sorted(root.iterdir()) if wanted(p.name)}
    try:
        return {name: version for name, version in storage_for(opts.data_dir, opts.storage_options).versions().items()
                if wanted(name)}
    except StorageError as e:
        raise UserError(f"--data-dir {e}; check the URL and the credentials") from None


def index_shards(opts: OwnData, versions: dict[str, str]) -> SetIndex:
    cache = opts.shard_cache(versions)
    tables, dims, modes, skipped = {}, {}, set(), []
    for split in (layout.TRAIN, layout.VAL):
        names = sorted(n for n in versions if n.startswith(f"{split}-") and n.endswith(".tar"))
        if not names:
            raise UserError(f"--data-dir {opts.data_dir} holds no {layout.shard_pattern(split)}; write the shards "
                            "with python -m common.shards IMAGEFOLDER DEST")
        if cache:
            check_budget(cache.budget, max(int(versions[n].split("-")[0]) for n in names), "--shard-cache-gb")
        root = opts.data_dir.rstrip("/")
        def read(name: str) -> ShardSamples:
            opened = cache.open(name) if cache else open(Path(root) / name, "rb")
            return read_shard(opened, f"{root}/{name}", opts.skip_broken)
        found = list(parallel(names, read, opts.prepare_workers))
        for shard in found:
            dims.update({k: v for k, v in shard.dims.items() if k not in dims})
            modes |= shard.modes
            skipped += shard.skipped
        tables[split] = shard_table(names, found)
    classes = class_count(opts, versions, tables[layout.TRAIN])
    for split, where in ((layout.TRAIN, "of train-*.tar"), (layout.VAL, "of train-*.tar")):
        check_classes(opts.data_dir, tables[split], classes, split,
                      f"in {layout.CLASSES_FILE}" if layout.CLASSES_FILE in versions else where)
    return SetIndex("shards", opts.data_dir, classes, tables[layout.TRAIN], tables[layout.VAL], dims,
                    sorted(modes), "", skipped)


def class_count(opts: OwnData, versions: dict[str, str], train) -> int:
    """classes.txt's line count where the set has one, else the largest training class + 1."""
    if layout.CLASSES_FILE not in versions:
        return int(train.labels.max()) + 1 if len(train) else 0
    if is_url(opts.data_dir):
        text = storage_for(opts.data_dir, opts.storage_options).read(layout.CLASSES_FILE).decode()
    else:
        text = (Path(opts.data_dir) / layout.CLASSES_FILE).read_text()
    return len([line for line in text.splitlines() if line.strip()])


def reader(index: SetIndex, split: str, geometry: Geometry, opts: OwnData, versions: dict[str, str] | None = None,
           ) -> Reader:
    table = index.train if split == "train" else index.test
    stored = geometry.train if split == "train" else geometry.test
    cache = opts.shard_cache(versions or fingerprint_of(opts)[1]) if table.sharded else None
    return Reader(table, index.root, stored, geometry.channels, opts.skip_broken, cache)


def statistics(index: SetIndex, geometry: Geometry, opts: OwnData) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of the pixels (in [0, 1]) of STATS_SAMPLES training images, evenly
    spaced over the set: measured once per set and geometry, then kept beside its index."""
    path = opts.cache_root / "index" / f"stats-{index.fingerprint[:16]}-{geometry_key(geometry)}.json"
    if path.is_file():
        mean, std = json.loads(path.read_text())
        return tuple(mean), tuple(std)
    picks = stats_picks(index.train)
    images, _, _, _, _, error = next(batches_of(reader(index, "train", geometry, opts), [picks], opts.prepare_workers))
    if error:
        raise UserError(error)
    images = images.double() / 255
    mean, std = images.mean(dim=(0, 2, 3)).tolist(), images.std(dim=(0, 2, 3)).clamp(min=1e-3).tolist()
    path.write_text(json.dumps([mean, std]))
    return tuple(mean), tuple(std)


def stats_picks(train) -> list[int]:
    """STATS_SAMPLES training samples, evenly spaced; in a sharded set, over STATS_SHARDS shards
    evenly spaced (the converter shuffles before sharding): a set streamed from a store is not
    read whole for its statistics."""
    candidates = torch.arange(len(train))
    if train.sharded:
        shards = torch.linspace(0, len(train.names) - 1, min(STATS_SHARDS, len(train.names))).long().unique()
        candidates = torch.isin(train.group, shards).nonzero().flatten()
    spaced = torch.linspace(0, len(candidates) - 1, min(STATS_SAMPLES, len(candidates))).long().unique()
    return candidates[spaced].tolist()


def geometry_key(geometry: Geometry) -> str:
    return hashlib.sha256(json.dumps(asdict(geometry)).encode()).hexdigest()[:12]


def batches_of(source: Reader, indices: list[list[int]], workers: int, pin: bool = False) -> Iterator:
    """The reader's collated batches of `indices`, in order, decoded by `workers` processes. A
    worker that delivers nothing for LOADER_TIMEOUT_S (a hung file system) ends the rank."""
    loader = torch.utils.data.DataLoader(source, batch_sampler=indices, num_workers=workers, collate_fn=as_is,
                                         pin_memory=pin, prefetch_factor=4 if workers else None,
                                         timeout=LOADER_TIMEOUT_S if workers else 0)
    try:
        yield from loader
    except RuntimeError as e:
        if "timed out" not in str(e):
            raise
        raise UserError(f"a DataLoader worker delivered no batch of {source.root} in {LOADER_TIMEOUT_S:g} s: its "
                        "files or store hang; check them (a streamed set is read during training)") from None


def decode_into_cache(index: SetIndex, geometry: Geometry, spec: DataSpec, opts: OwnData, say: Say) -> Path:
    """Every image decoded once at its stored geometry into raw uint8 files, named after the set's
    fingerprint and the geometry: found again by later runs, shared by every rank of the node."""
    folder = opts.cache_root / "decoded" / f"{opts.kind}-{index.fingerprint[:16]}-{geometry_key(geometry)}"
    if (folder / META).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(folder.parent / f".{folder.name}.lock", say):
        if (folder / META).is_file():
            return folder
        staging = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
        staging.mkdir(exist_ok=True)
        try:
            skipped = {split: decode_split(reader(index, split, geometry, opts), staging, split, opts, say)
                       for split in ("train", "test")}
            if index.train.group is not None:
                index.train.group.numpy().tofile(staging / "train_groups")
            write_tensors(staging, {}, {"spec": asdict(spec), "skipped": skipped["train"] + skipped["test"],
                                        "tensors": tensor_shapes(staging, index, geometry)})
            os.replace(staging, folder)
        except OSError as e:
            raise UserError(f"--cache-dir {folder.parent}: {e.strerror or e}; pass a --cache-dir with room for "
                            f"{stored_bytes(index, geometry) / 2**30:.2f} GB, or a smaller --cache-gb to stream "
                            "the set instead") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def decode_split(source: Reader, folder: Path, split: str, opts: OwnData, say: Say) -> list[str]:
    """Decode a split in order into folder/<split>_images and <split>_labels; the skipped files."""
    chunks = [list(range(i, min(i + DECODE_CHUNK, len(source)))) for i in range(0, len(source), DECODE_CHUNK)]
    skipped = []
    with open(folder / f"{split}_images", "wb") as images, open(folder / f"{split}_labels", "wb") as labels:
        for batch, batch_labels, missed, _, _, error in batches_of(source, chunks, opts.prepare_workers):
            if error:
                raise UserError(error)
            images.write(batch.numpy().tobytes())
            labels.write(batch_labels.numpy().tobytes())
            skipped += missed
    say(f"decoded {len(source)} {split} images into {folder.name.removeprefix('.').split('.tmp')[0]}"
        + (f" ({len(skipped)} unreadable, replaced by their next sample)" if skipped else ""))
    return skipped


def tensor_shapes(folder: Path, index: SetIndex, geometry: Geometry) -> dict[str, dict]:
    c, shapes = geometry.channels, {}
    for split, table, stored in (("train", index.train, geometry.train), ("test", index.test, geometry.test)):
        shapes[f"{split}_images"] = {"shape": [len(table), c, stored.side, stored.side], "dtype": "uint8"}
        shapes[f"{split}_labels"] = {"shape": [len(table)], "dtype": "int64"}
    if index.train.group is not None:
        shapes["train_groups"] = {"shape": [len(index.train)], "dtype": "int64"}
    return shapes


# ---------------------------------------------------------------- on every rank

def open_prepared(report: dict[str, Any], opts: OwnData) -> Dataset:
    name = f"{opts.kind} {opts.data_dir}"
    if "decoded" in report:
        folder = Path(report["decoded"])
        tensors, meta = map_tensors(folder), read_meta(folder)
        spec = DataSpec(**{**meta["spec"], "mean": tuple(meta["spec"]["mean"]), "std": tuple(meta["spec"]["std"])})
        held = f"decoded once into the node's cache {folder} ({sum(t.nbytes for t in tensors.values()) / 2**20:.0f} MB)"
        if meta["skipped"]:
            held += f"; {len(meta['skipped'])} unreadable file(s) replaced by their next sample: " + \
                ", ".join(meta["skipped"][:5]) + (", ..." if len(meta["skipped"]) > 5 else "")
        return Dataset(name, spec, Split(tensors["train_images"], tensors["train_labels"], tensors.get("train_groups")),
                       Split(tensors["test_images"], tensors["test_labels"]), held)
    index = SetIndex.from_state(torch.load(report["index"], weights_only=True))
    geometry = Geometry(report["geometry"]["channels"], Stored(**report["geometry"]["train"]),
                        Stored(**report["geometry"]["test"]), report["geometry"]["size"], report["geometry"]["augment"])
    spec = DataSpec(**{**report["spec"], "mean": tuple(report["spec"]["mean"]), "std": tuple(report["spec"]["std"])})
    versions = fingerprint_of(opts)[1] if index.train.sharded else None
    train, test = (Streamed(reader(index, split, geometry, opts, versions), opts.workers) for split in ("train", "test"))
    where = f", through the shard cache {train.source.cache.folder} (at most {opts.shard_cache_gb:g} GB)" \
        if train.source.cache else ""
    held = (f"streamed: {opts.workers} DataLoader worker(s) per rank decode each batch{where} "
            f"(decoded it would take {stored_bytes(index, geometry) / 2**30:.2f} GB, above --cache-gb {opts.cache_gb:g})")
    return Dataset(name, spec, train, test, held)


class Streamed:
    """A split decoded batch by batch by DataLoader workers; the same interface as Split.
    Counts what the loader met: shard cache hits and misses, and skipped files."""

    def __init__(self, source: Reader, workers: int) -> None:
        self.source, self.workers = source, workers
        self.groups = source.table.group
        self.hits = self.misses = 0
        self.skipped: list[str] = []

    def __len__(self) -> int:
        return len(self.source)

    @property
    def labels(self) -> torch.Tensor:
        return self.source.table.labels

    def batches(self, indices: list[torch.Tensor], device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        plan = [index.tolist() for index in indices]
        if not plan:
            return
        prefetch, reached = self.prefetch(indices)
        try:
            batches = batches_of(self.source, plan, self.workers, pin=device.type == "cuda")
            for step, (images, labels, skipped, hits, misses, error) in enumerate(batches):
                if error:
                    raise UserError(error)
                if prefetch:
                    prefetch.reached(reached[step])
                self.hits, self.misses = self.hits + hits, self.misses + misses
                self.skipped += skipped
                yield to_device(images, device), to_device(labels, device)
        finally:
            if prefetch:
                prefetch.close()

    def prefetch(self, indices: list[torch.Tensor]) -> tuple[Prefetcher | None, list[int]]:
        """For shards from a URL: a prefetcher of the shards in the order the batches first need
        them, and per batch the furthest position in that order it reads."""
        cache = self.source.cache
        if cache is None:
            return None, []
        first_use: dict[int, int] = {}
        reached = []
        for index in indices:
            for shard in self.groups[index].tolist():
                first_use.setdefault(shard, len(first_use))
            reached.append(max((first_use[s] for s in set(self.groups[index].tolist())), default=0))
        names = [self.source.table.names[shard] for shard in first_use]
        return Prefetcher(cache, names, cache.ahead()), reached

    def take_counts(self) -> tuple[dict[str, float], list[str]]:
        counts = {"shard_cache_hits": self.hits, "shard_cache_misses": self.misses, "skipped_files": len(self.skipped)}
        skipped, self.skipped, self.hits, self.misses = self.skipped, [], 0, 0
        return counts, skipped
