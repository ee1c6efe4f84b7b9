"""--dataset imagefolder | shards | hf: your own images, prepared once per node by its local rank 0.

Preparing: index the set (cached by its files' names, sizes and dates, or its objects' ETags),
choose the geometry, measure the normalization statistics on STATS_SAMPLES training images, then
either decode the whole set once into the node's cache (when it fits --cache-gb: every later run
and every rank of the node maps it, and it trains at the speed of the built-in sets) or leave it
to be streamed: DataLoader workers decode each batch, shards from a URL through a bounded shard cache.
Both ways give the same batches: the same order, the same boxes and draws, the same pixels wherever an
image is within the decoded copy's bound (reading.bounded: a long side of at most 2 S / 0.875).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from common import hfsets
from common import shards as layout
from common.config import INTERPOLATIONS, OWN_DATASETS, SHUFFLE_WINDOW
from common.data import hf, jpegcrop
from common.data.cache import (
    META,
    cache_error,
    cache_folder,
    default_cache_dir,
    file_lock,
    hold_shared,
    lock_of,
    map_tensors,
    read_meta,
    sweep_staging,
    unused,
    use_lock_of,
    write_atomically,
    write_tensors,
)
from common.data.device_decode import choose_decode
from common.data.geometry import Geometry, Resampling, Stored, choose_geometry, stored_bytes
from common.data.index import INDEX_FORMAT, SetIndex, TableWriter, map_index, publish, shapes_of, staging_for
from common.data.indexing import ShardSamples, Survey, check_classes, index_folder, index_shards
from common.data.loader import Dataset, DataSpec, Expected, Split
from common.data.reading import Ragged, Reader, Request, Streamed, batches_of
from common.data.shardcache import ShardCache
from common.data.shardformat import read_shard
from common.errors import UserError
from common.storage import StorageError, is_url, storage_for

Say = Callable[[str], None]
DECODE_FORMAT = 3  # in each decoded set's key: what decoding produces (3: decode_jpeg, whole training images)
STATS_SAMPLES = 2048  # training images the normalization statistics are measured on (evenly spaced)
# --shard-lanes' bound: two windows of row groups are open in every process (HFReader), under the
# usual limit of 1,024 open files, and a batch mixes at most this many shards.
MAX_LANES = 256
DECODE_CHUNK = 256  # images per worker task while decoding into the cache
STATS_CHUNK = 32  # images per worker task while measuring the statistics
STATS_SHARDS = 8  # shards the statistics are measured on


@dataclass(frozen=True)
class OwnData:
    kind: str  # imagefolder | shards | hf
    data_dir: str
    cache_dir: str
    storage_options: dict[str, Any]
    image_size: int
    workers: int  # per rank, while training from a stream
    prepare_workers: int  # on the node's local rank 0, while indexing and decoding
    skip_broken: bool
    cache_gb: float
    shard_cache_gb: float
    verify_data: bool = False  # fingerprint the files by their bytes, not their sizes and dates
    decode: str = "cpu"  # --decode: where a streamed set's training JPEGs are decoded (cpu | gpu | auto)
    device: str = "cpu"  # the rank's device, where --decode gpu decodes
    image_key: str = "image"  # hf: the columns of the images and of their classes
    label_key: str = "label"
    lanes: int = SHUFFLE_WINDOW  # --shard-lanes: shards (row groups) a window of the epoch deals; two at once held
    resampling: Resampling = Resampling()  # --image-size's crop fraction and filter (--crop-pct, --interpolation)
    # evaluate.py: the model the set is scored by. Only the test split is decoded: no statistics are
    # measured on the training split (the checkpoint's normalization is used), no decoded copy of the
    # set is made (one training left is used), and a set of other classes or image shape is refused
    # once it is indexed, before any image is decoded.
    evaluated: Expected | None = None

    @property
    def cache_root(self) -> Path:
        return Path(self.cache_dir or default_cache_dir())

    def shard_cache(self, versions: dict[str, str]) -> ShardCache | None:
        if not is_url(self.data_dir) or self.kind == "hf":
            return None
        return ShardCache(self.data_dir, self.storage_options, cache_folder(self.cache_dir, self.data_dir) / "shards",
                          int(self.shard_cache_gb * 2**30), versions, self.lanes)

    def stream_cache(self, index: SetIndex) -> ShardCache | None:
        """What a streamed set is read through on the node: shards from a URL, or (hf) copies of a
        parquet set's row groups, each decompressed once per node."""
        if self.kind == "hf":
            return hf.row_group_cache(index, self.cache_root / "rowgroups", self.storage_options,
                                      int(self.shard_cache_gb * 2**30), self.image_key, self.lanes)
        return self.shard_cache(index.versions)


def add_own_data_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flags of OwnData: how your own images are read, decoded and resized."""
    add = group.add_argument
    add("--image-size", type=int, default=0, metavar="S",
        help="train at S x S: random-resized crops + flips for training, resize + centre crop for "
             "evaluation; needed when the images differ in size (default: their common size)")
    add("--workers", type=int, default=None, metavar="N",
        help="DataLoader worker processes per rank decoding a streamed set (default: the node's cores "
             "/ ranks per node - 1, at least 1)")
    add("--decode", default="cpu", choices=("cpu", "gpu", "auto"),
        help="where a streamed set's JPEGs are decoded for training: cpu (the workers decode, crop and "
             "augment), gpu (the workers read the bytes; each CUDA rank decodes its batch with nvJPEG and "
             "crops it on its device, the same crops), auto (gpu on CUDA ranks for an all-JPEG set) "
             "(default: %(default)s)")
    add("--skip-broken", action="store_true",
        help="train without images that do not decode (each replaced by the next sample; counted and "
             "named in the log) instead of stopping at the first")
    add("--cache-gb", type=float, default=20.0, metavar="GB",
        help="decode a set that fits in this many GB once per node into --cache-dir, else stream it "
             "(default: %(default)s)")
    add("--shard-cache-gb", type=float, default=10.0, metavar="GB",
        help="the most a node keeps of shards from a --data-dir URL, or of a parquet set's row groups "
             "(--dataset hf), while streaming; the least recently used are deleted beyond it "
             "(default: %(default)s)")
    add("--shard-lanes", type=int, default=None, metavar="K",
        help="--dataset shards or hf: each epoch shuffles the shards (row groups) and deals them K at a time "
             "into K lanes, so every batch mixes K of them; with K a multiple of the node count that divides "
             "the global batch, each node reads only its own shards (else several nodes read each; the run "
             f"says so); the node's shard cache must hold 2K (default: {SHUFFLE_WINDOW}; at most {MAX_LANES})"),
    add("--verify-data", action="store_true",
        help="tell the set's files apart by their bytes, not their names, sizes and dates (which "
             "cp -p and rsync -a keep): reads the whole set at every start")
    add("--hf-image-key", default=None, metavar="COLUMN",
        help="--dataset hf: the column of the images (default: image)")
    add("--hf-label-key", default=None, metavar="COLUMN",
        help="--dataset hf: the column of the class indices, a ClassLabel names them (default: label)")
    add("--crop-pct", type=float, default=None, metavar="F",
        help="with --image-size S, evaluate on the centre S of the short side resized to floor(S / F), "
             "as timm does (default: the pretrained config's that came with --weights, as timm evaluates "
             "them; else S / 0.875, 256 for 224)")
    add("--interpolation", default=None, choices=INTERPOLATIONS,
        help="with --image-size, the antialiased filter of the evaluation's resize and the training's "
             "random-resized crops (default: the pretrained config's that came with --weights; else "
             "bilinear)")


def check_own_data_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The rules of add_own_data_flags' flags and --data-dir for your own images. A local folder given
    as file:// is read as one, and the hf column names get their defaults."""
    own = a.dataset in OWN_DATASETS
    if own and a.data_dir.startswith("file://"):
        a.data_dir = a.data_dir.removeprefix("file://")  # a local folder, read as one (the converter takes both)
    if a.image_size and not own:
        p.error(f"--image-size applies to --dataset {' or '.join(OWN_DATASETS)}; the built-in sets have one size")
    if own and a.data_dir == "./data":
        p.error(f"--dataset {a.dataset} needs --data-dir: the folder (or, for shards and hf, the URL) of your images")
    keys = [flag for flag, value in (("--hf-image-key", a.hf_image_key), ("--hf-label-key", a.hf_label_key)) if value]
    if keys and a.dataset != "hf":
        p.error(f"{' and '.join(keys)} {'apply' if len(keys) > 1 else 'applies'} to --dataset hf (the columns of a "
                "Hugging Face data set)")
    a.hf_image_key, a.hf_label_key = a.hf_image_key or "image", a.hf_label_key or "label"
    if own and a.dataset == "imagefolder" and "://" in a.data_dir:
        p.error("--dataset imagefolder reads a local folder; for a store, convert it to shards "
                "(python -m common.shards FOLDER URL) and pass --dataset shards")
    chosen = [flag for flag, value in (("--crop-pct", a.crop_pct), ("--interpolation", a.interpolation))
              if value is not None]
    if chosen and not (own and a.image_size):
        p.error(f"{' and '.join(chosen)} choose{'s' if len(chosen) == 1 else ''} how --image-size S resizes your own "
                "images (--dataset imagefolder, shards or hf); without it the images train and evaluate as stored: "
                "drop it or give --image-size S")
    if a.crop_pct is not None and not 0 < a.crop_pct <= 1:
        p.error(f"--crop-pct must be in (0, 1]: the fraction of the resized short side the centre crop keeps "
                f"(got {a.crop_pct:g})")
    if a.shard_lanes is not None and a.dataset not in ("shards", "hf"):
        p.error(f"--shard-lanes applies to --dataset shards or hf (sets read by shards or row groups); drop it for "
                f"--dataset {a.dataset}")
    if a.shard_lanes is not None and not 1 <= a.shard_lanes <= MAX_LANES:
        p.error(f"--shard-lanes must be 1 to {MAX_LANES}: the shards (row groups) each window of an epoch deals, two "
                f"windows of them open at once in every process (got {a.shard_lanes})")
    a.shard_lanes = a.shard_lanes or SHUFFLE_WINDOW
    if a.image_size < 0 or (a.workers is not None and a.workers < 0) or not 0 <= a.cache_gb < math.inf \
            or not 0 < a.shard_cache_gb < math.inf:
        p.error("--image-size, --workers and --cache-gb must be >= 0 and --shard-cache-gb > 0 (finite: for no bound, "
                "give more than the disk holds)")


# ---------------------------------------------------------------- on the node's local rank 0

def prepare(opts: OwnData, say: Say) -> dict[str, Any]:
    """Index, geometry, statistics; then the decoded cache, or the index to stream from."""
    # evaluate.py (opts.evaluated) indexes the training split too, on purpose: the set's classes are the
    # training split's (train/'s class folders, the training shards' labels, the hf ClassLabel), its
    # geometry (channels, one common size) is both splits', and its index is one cache entry per node
    # that the run which trained on it built already (an evaluation there maps it: no header read).
    # Only a node that never indexed the set pays the training split's headers: measured with a
    # 4,000-image training split beside a 40-image val split (100x), 0.21 ms of CPU per training
    # image when cold (1.38 s against 0.03 s of prepare(), 0.88 s of CPU), 0.03 ms warm (the
    # fingerprint's stat of each file: 0.19 s against 0.01 s); evaluate.py end to end, 8.0 against
    # 7.0 CPU-s cold. No training image is ever decoded (no statistics, no decoded copy).
    index = load_index(opts, say)
    check_not_empty(index)
    geometry = choose_geometry(index, opts.image_size, opts.resampling)
    evaluated = opts.evaluated
    if evaluated and (problem := evaluated.misfit(f"{opts.kind} {opts.data_dir}", geometry.channels, geometry.size,
                                                  index.class_names)):
        raise UserError(problem)
    decoded = stored_bytes(index, geometry) <= opts.cache_gb * 2**30 and \
        (not evaluated or (decoded_folder(index, geometry, opts) / META).is_file())
    cache = opts.stream_cache(index)
    if cache:  # every run: a budget lowered since the set was indexed holds, and trims the cache now
        if not decoded:  # read once in order to be decoded, the set needs no window of shards held
            cache.check_budget()
        cache.evict()
    mean, std = (evaluated.spec.mean, evaluated.spec.std) if evaluated else statistics(index, geometry, opts)
    spec = DataSpec(geometry.channels, geometry.size, index.classes, mean, std, geometry.augment)
    report = {"index": str(index.folder), "geometry": asdict(geometry), "spec": asdict(spec),
              "class_names": index.class_names}
    if decoded:
        report["decoded"] = str(decode_into_cache(index, geometry, spec, opts, say))
    else:  # streamed: the workers decode each crop's rows and columns (built here once, for them)
        jpegcrop.announce(say)
    return report


def load_index(opts: OwnData, say: Say) -> SetIndex:
    """The set's index: mapped from the node's cache when one was built for the files as they are
    now (the folder is named by their fingerprint), else built there."""
    try:
        fingerprint, listing = fingerprint_of(opts)
    except OSError as e:  # a folder or file of the set that cannot be listed or read
        raise UserError(f"{e.filename or opts.data_dir}: {e.strerror or e}; check that --data-dir is readable "
                        "(and mounted)") from None
    # one index per set, however named
    where = opts.data_dir if is_url(opts.data_dir) else os.path.abspath(opts.data_dir)
    columns = [opts.image_key, opts.label_key] if opts.kind == "hf" else []
    key = hashlib.sha256(json.dumps([INDEX_FORMAT, opts.kind, where, opts.skip_broken, opts.verify_data, *columns]
                                    ).encode()).hexdigest()
    folder = opts.cache_root / "index" / f"{opts.kind}-{key[:16]}-{fingerprint[:16]}"
    in_use(folder, lambda: build_index(opts, folder, listing, fingerprint, say), say)
    for superseded in folder.parent.glob(f"{opts.kind}-{key[:16]}-*"):  # the set's earlier content
        with unused(use_lock_of(superseded)) as free:
            if free and superseded != folder:
                shutil.rmtree(superseded, ignore_errors=True)
    return map_index(folder)


def in_use(folder: Path, build: Callable[[], None], say: Say) -> None:
    """A cache folder, built by `build` if missing, and held in use by this process from then on
    (hold_shared: no eviction deletes it under a job that maps it)."""
    while True:
        if not (folder / META).is_file():
            with writing_cache(folder.parent, folder, say):
                if not (folder / META).is_file():
                    build()
        hold_shared(use_lock_of(folder))
        if (folder / META).is_file():  # else evicted between the check and the hold: build it again
            return


@contextmanager
def writing_cache(parent: Path, target: Path, say: Say) -> Iterator[None]:
    """Holding the lock of `target` in a cache folder: the leftovers of builds that were killed
    (a staging folder whose lock no process holds) are deleted first; a full disk or a read-only
    cache is one line naming --cache-dir."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with file_lock(lock_of(target), say):
            sweep_staging(parent, target)
            yield
    except OSError as e:
        # Reading the data, not making or writing the cache (or a folder above it):
        if e.filename and not (str(e.filename).startswith(str(parent)) or parent.is_relative_to(e.filename)):
            raise UserError(f"{e.filename}: {e.strerror or e}; check that it is readable and that the data does not "
                            "change while it is indexed") from None
        raise cache_error(parent, e) from None


def build_index(opts: OwnData, folder: Path, listing: dict[str, str] | hfsets.Source, fingerprint: str,
                say: Say) -> None:
    say(f"indexing {opts.data_dir} ...")
    staging = staging_for(folder)
    root, versions = opts.data_dir, {}
    try:
        if isinstance(listing, hfsets.Source):  # a Hub name's root is its snapshot in the Hugging Face cache
            root = listing.root
            classes, survey = hf.index_into(listing, staging, opts.storage_options, opts.image_key, opts.label_key,
                                            opts.prepare_workers, opts.skip_broken)
        elif opts.kind == "imagefolder":
            classes, survey = index_folder(Path(opts.data_dir), staging, opts.prepare_workers, opts.skip_broken)
        else:
            classes, survey, versions = index_shards_into(opts, staging, listing)  # classes: their names
        publish(staging, folder, {"format": INDEX_FORMAT, "kind": opts.kind, "root": root, "classes": classes,
                                  "fingerprint": fingerprint, "versions": versions, **survey.meta(),
                                  "tensors": shapes_of(staging)})
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for what, count, names in (("skipped", survey.skipped_count, survey.skipped),
                               ("ignored", survey.ignored_count, survey.ignored)):
        if count:
            say(f"{opts.data_dir}: {what} {count} {REASONS[what]} ({', '.join(names[:5])}{', ...' * (count > 5)})")


REASONS = {"skipped": "unreadable file(s)",
           "ignored": f"file(s) that are not images the suite reads ({', '.join(layout.FOLDER_EXTENSIONS)}) in a "
                      "class folder"}


def check_not_empty(index: SetIndex) -> None:
    """A split without a sample is refused before training: an empty val/ would otherwise train a
    whole epoch and then divide by zero in the first evaluation."""
    for split, table in (("train", index.train), ("val", index.test)):
        if not len(table):
            skipped = f" ({index.skipped_count} unreadable file(s) skipped)" if index.skipped_count else ""
            where = {"imagefolder": f"{index.root}/{split}/<class>/", "shards": f"{index.root}/{split}-*.tar",
                     "hf": f"its {'train' if split == 'train' else 'validation (or test)'} split"}[index.kind]
            raise UserError(f"--data-dir {index.root}: its {split} split holds no image{skipped}; add images in "
                            f"{where} (a set is trained on train and evaluated on val)")
    check_no_class_skipped_away(index)


def check_no_class_skipped_away(index: SetIndex) -> None:
    """--skip-broken never leaves a class without a training image: it would train a model that can
    never learn that class, silently (an empty class folder is refused by the layout's check)."""
    if not index.skipped_count:
        return
    present = torch.bincount(torch.as_tensor(index.train.labels), minlength=index.classes).tolist()
    empty = [name for name, count in zip(index.class_names, present) if not count]
    if empty:
        raise UserError(f"--data-dir {index.root}: --skip-broken left class(es) {', '.join(empty[:5])}"
                        f"{', ...' * (len(empty) > 5)} without a readable training image ({index.skipped_count} "
                        f"unreadable file(s) skipped: {', '.join(index.skipped[:5])}); repair or add their images, or "
                        "remove the class")


def fingerprint_of(opts: OwnData) -> tuple[str, dict[str, str] | hfsets.Source]:
    """What identifies the set's content: each file's name, size and date (each object's ETag), or
    with --verify-data its bytes' hash; and, for shards, the listing (name -> version) of the folder,
    for hf the files of its splits."""
    if opts.kind == "imagefolder":
        return folder_fingerprint(Path(opts.data_dir), opts.verify_data), {}
    if opts.kind == "hf":
        source = hfsets.resolve(opts.data_dir, opts.storage_options, lambda path: file_version(path, opts.verify_data))
        return source.fingerprint(), source
    listing = shard_listing(opts)
    return hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest(), listing


def folder_fingerprint(root: Path, contents: bool) -> str:
    """Every file under train/ and val/, through symlinked folders too (what the index reads),
    hashed one by one: memory does not grow with the set."""
    layout.folder_classes(root)  # a tree without train/ or its class folders: that, in one line
    digest = hashlib.sha256()
    for split in (layout.TRAIN, layout.VAL):
        for path in layout.walk_files(root / split) if (root / split).is_dir() else ():
            digest.update(os.fsencode(f"{path.relative_to(root)}\0{file_version(path, contents)}\0"))
    return digest.hexdigest()


def file_version(path: Path, contents: bool) -> str:
    """size-mtime, or size-hash of the bytes: a file replaced by cp -p or rsync -a keeps its size
    and date, and only its bytes tell."""
    stat = path.stat()
    if not contents:
        return f"{stat.st_size}-{stat.st_mtime_ns}"
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return f"{stat.st_size}-{digest.hexdigest()}"


def shard_listing(opts: OwnData) -> dict[str, str]:
    """The shards, classes.txt and manifest of the folder or store: name -> version."""
    wanted = lambda name: name in (layout.CLASSES_FILE, layout.MANIFEST) or any(  # noqa: E731
        name.startswith(f"{split}-") and name.endswith(".tar") for split in (layout.TRAIN, layout.VAL))
    if not is_url(opts.data_dir):
        root = Path(opts.data_dir)
        if not root.is_dir():
            raise UserError(f"--data-dir {root} is not a folder; give the folder (or URL) that holds the "
                            "train-*.tar and val-*.tar shards")
        return {p.name: file_version(p, opts.verify_data) for p in sorted(root.iterdir()) if wanted(p.name)}
    try:
        return {name: version for name, version in storage_for(opts.data_dir, opts.storage_options).versions().items()
                if wanted(name)}
    except StorageError as e:
        raise UserError(f"--data-dir {e}; check the URL and the credentials") from None


def read_from_data_dir(opts: OwnData, name: str) -> bytes:
    if is_url(opts.data_dir):
        return storage_for(opts.data_dir, opts.storage_options).read(name)
    return (Path(opts.data_dir) / name).read_bytes()


def index_shards_into(opts: OwnData, folder: Path, listing: dict[str, str],
                      ) -> tuple[list[str], Survey, dict[str, str]]:
    """Both splits' shards indexed into `folder`: the classes' names, what the pass saw, and the
    versions of the shards read (a streamed set's shard cache names its copies by them)."""
    shard_set = layout.resolve(listing, lambda name: read_from_data_dir(opts, name), opts.data_dir)
    names = {layout.TRAIN: shard_set.train, layout.VAL: shard_set.val}
    versions = {name: listing[name] for split_names in names.values() for name in split_names}
    cache = opts.shard_cache(versions)
    root = opts.data_dir.rstrip("/")
    survey, tops = Survey(), {}
    for split, split_names in names.items():
        if not split_names:
            raise UserError(f"--data-dir {opts.data_dir} holds no {layout.shard_pattern(split)}; write the shards "
                            "with python -m common.shards IMAGEFOLDER DEST")
    if cache:  # indexing reads every shard through the cache
        cache.check_budget()
    for split, split_names in names.items():
        def read(name: str) -> ShardSamples:
            opened = cache.open(name) if cache else open(Path(root) / name, "rb")
            return read_shard(opened, f"{root}/{name}", opts.skip_broken, shard_set.samples.get(name))
        writer = TableWriter(folder, "train" if split == layout.TRAIN else "test", sharded=True)
        tops[split] = index_shards(split_names, read, writer, opts.prepare_workers, survey)
    classes = class_names(opts, shard_set, listing, tops[layout.TRAIN][0])
    where = "in the manifest" if shard_set.manifest else \
        f"in {layout.CLASSES_FILE}" if layout.CLASSES_FILE in listing else "of train-*.tar"
    for top in tops.values():
        check_classes(top, len(classes), where)
    return classes, survey, versions


def class_names(opts: OwnData, shard_set: layout.ShardSet, listing: dict[str, str], top_train: int) -> list[str]:
    """The manifest's classes; else classes.txt's lines; else the indices up to the largest
    training class. Read once, when the set is indexed: the index keeps them."""
    if shard_set.classes is not None:
        return [str(name) for name in shard_set.classes]
    if layout.CLASSES_FILE not in listing:
        return [str(i) for i in range(top_train + 1)]
    text = read_from_data_dir(opts, layout.CLASSES_FILE).decode()
    return [line.strip() for line in text.splitlines() if line.strip()]


def reader(index: SetIndex, split: str, geometry: Geometry, opts: OwnData, store: Ragged | None = None) -> Reader:
    table = index.train if split == "train" else index.test
    stored = geometry.train if split == "train" else geometry.test
    cache = opts.stream_cache(index)
    if opts.kind == "hf":
        return hf.HFReader(table, index.root, stored, geometry.channels, opts.skip_broken,
                           geometry.augment if split == "train" else "none", store, opts.image_key,
                           opts.storage_options, cache)
    return Reader(table, index.root, stored, geometry.channels, opts.skip_broken, cache,
                  geometry.augment if split == "train" else "none", store)


def statistics(index: SetIndex, geometry: Geometry, opts: OwnData) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of the pixels (in [0, 1]) of STATS_SAMPLES training images, evenly
    spaced over the set: measured once per set and geometry, then kept in its index's folder.
    Summed exactly in integers, STATS_CHUNK images per worker task: memory and each task's time
    stay those of a small batch, whatever the image size."""
    path = index.folder / f"stats-{geometry_key(geometry)}.json"
    try:
        mean, std = json.loads(path.read_text())
        return tuple(mean), tuple(std)
    except (FileNotFoundError, ValueError):
        pass  # not measured yet (or by a run killed mid-write before writes were atomic)
    picks = stats_picks(index.train)
    chunks = [picks[i:i + STATS_CHUNK] for i in range(0, len(picks), STATS_CHUNK)]
    sums = squares = torch.zeros(geometry.channels, dtype=torch.int64)
    count = 0
    for batch in batches_of(reader(index, "train", geometry, opts), chunks, opts.prepare_workers):
        if batch.error:
            raise UserError(batch.error)
        images = batch.images
        histogram = pixel_histogram(images)
        sums = sums + histogram @ LEVELS
        squares = squares + histogram @ LEVELS.square()
        count += images[:, 0].numel()
    mean = [s / count / 255 for s in sums.tolist()]
    std = [max(math.sqrt(max(q - s * s / count, 0) / max(count - 1, 1)) / 255, 1e-3)
           for s, q in zip(sums.tolist(), squares.tolist())]
    try:
        write_atomically(path, json.dumps([mean, std]))
    except OSError as e:
        raise cache_error(path.parent, e) from None
    return tuple(mean), tuple(std)


LEVELS = torch.arange(256, dtype=torch.int64)


def pixel_histogram(images: torch.Tensor) -> torch.Tensor:
    """(channels, 256) counts of each uint8 value per channel: the sums and sums of squares follow
    exactly, at a tenth of the cost of summing the pixels (and their squares) directly."""
    return torch.stack([torch.bincount(images[:, c].flatten(), minlength=256) for c in range(images.shape[1])])


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


def decode_into_cache(index: SetIndex, geometry: Geometry, spec: DataSpec, opts: OwnData, say: Say) -> Path:
    """Every image decoded once at its stored geometry into raw uint8 files, named after the set's
    fingerprint, the geometry, the decoder's version and --skip-broken: found again by later runs,
    shared by every rank of the node. The decoded folders together stay within --cache-gb: the
    least recently used are deleted beyond it."""
    folder = decoded_folder(index, geometry, opts)
    in_use(folder, lambda: decode_all(index, geometry, spec, opts, folder, say), say)
    os.utime(folder / META)  # when it was last used: what eviction goes by
    evict_decoded(folder.parent, int(opts.cache_gb * 2**30))
    return folder


def decoded_folder(index: SetIndex, geometry: Geometry, opts: OwnData) -> Path:
    key = hashlib.sha256(json.dumps([DECODE_FORMAT, asdict(geometry), opts.skip_broken]).encode()).hexdigest()[:12]
    return opts.cache_root / "decoded" / f"{opts.kind}-{index.fingerprint[:16]}-{key}"


def decode_all(index: SetIndex, geometry: Geometry, spec: DataSpec, opts: OwnData, folder: Path, say: Say) -> None:
    staging = staging_for(folder)
    try:
        skipped = Survey()
        for split in ("train", "test"):
            skipped.merge(decode_split(reader(index, split, geometry, opts), staging, split, opts, say))
        if index.train.group is not None:
            index.train.group.numpy().tofile(staging / "train_groups")
        write_tensors(staging, {}, {"spec": asdict(spec), "skipped": skipped.skipped,
                                    "skipped_count": skipped.skipped_count,
                                    "tensors": tensor_shapes(index, geometry, staging)})
        os.rename(staging, folder)
    except OSError as e:
        raise UserError(f"--cache-dir {folder.parent}: {e.strerror or e}; pass a --cache-dir with room for "
                        f"{stored_bytes(index, geometry) / 2**30:.3g} GB, or a smaller --cache-gb to stream "
                        "the set instead") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def evict_decoded(parent: Path, budget: int) -> None:
    """The least recently used decoded sets deleted until the rest fit `budget`; one a process
    maps (this one's included) is never deleted, so the bound can be exceeded while jobs use them."""
    with file_lock(parent / ".evict.lock"):
        folders = sorted((p for p in parent.iterdir() if p.is_dir() and (p / META).is_file()),
                         key=lambda p: (p / META).stat().st_mtime)
        sizes = {p: sum(f.stat().st_size for f in p.iterdir()) for p in folders}
        total = sum(sizes.values())
        for folder in folders:
            if total <= budget:
                break
            with unused(use_lock_of(folder)) as free:
                if free:
                    shutil.rmtree(folder, ignore_errors=True)
                    total -= sizes[folder]


def decode_split(source: Reader, folder: Path, split: str, opts: OwnData, say: Say) -> Survey:
    """Decode a split in order into folder/<split>_images and <split>_labels (a split trained on
    crops of the whole image: its whole images end to end, and <split>_dims); the files skipped."""
    whole = source.view.whole
    chunks = [Request(list(range(i, min(i + DECODE_CHUNK, len(source)))), whole=whole)
              for i in range(0, len(source), DECODE_CHUNK)]
    skipped = Survey()
    with open(folder / f"{split}_images", "wb") as images, open(folder / f"{split}_labels", "wb") as labels, \
            open(folder / f"{split}_dims", "wb") if whole else nullcontext() as dims:
        for batch in batches_of(source, chunks, opts.prepare_workers):
            if batch.error:
                raise UserError(batch.error)
            images.write(batch.images.numpy().tobytes())
            labels.write(batch.labels.numpy().tobytes())
            if whole:
                dims.write(batch.dims.numpy().tobytes())
            skipped.skip(batch.skipped)
    say(f"decoded {len(source)} {split} images into {folder.name.removeprefix('.').split('.tmp')[0]}"
        + (f" ({skipped.skipped_count} unreadable, replaced by their next sample)" if skipped.skipped_count else ""))
    return skipped


def tensor_shapes(index: SetIndex, geometry: Geometry, folder: Path) -> dict[str, dict]:
    c, shapes = geometry.channels, {}
    for split, table, stored in (("train", index.train, geometry.train), ("test", index.test, geometry.test)):
        if stored.whole:  # ragged: the pixels end to end, and per image its stored and original sizes
            shapes[f"{split}_images"] = {"shape": [(folder / f"{split}_images").stat().st_size], "dtype": "uint8"}
            shapes[f"{split}_dims"] = {"shape": [len(table), 4], "dtype": "int64"}
        else:
            shapes[f"{split}_images"] = {"shape": [len(table), c, stored.side, stored.side], "dtype": "uint8"}
        shapes[f"{split}_labels"] = {"shape": [len(table)], "dtype": "int64"}
    if index.train.group is not None:
        shapes["train_groups"] = {"shape": [len(index.train)], "dtype": "int64"}
    return shapes


# ---------------------------------------------------------------- on every rank

def open_prepared(report: dict[str, Any], opts: OwnData) -> Dataset:
    name = f"{opts.kind} {opts.data_dir}"
    hold_shared(use_lock_of(Path(report["index"])))
    index = map_index(Path(report["index"]))
    geometry = Geometry(report["geometry"]["channels"], Stored(**report["geometry"]["train"]),
                        Stored(**report["geometry"]["test"]), report["geometry"]["size"], report["geometry"]["augment"])
    if "decoded" in report:
        folder = Path(report["decoded"])
        hold_shared(use_lock_of(folder))
        tensors, meta = map_tensors(folder), read_meta(folder)
        spec = DataSpec(**{**meta["spec"], "mean": tuple(meta["spec"]["mean"]), "std": tuple(meta["spec"]["std"])})
        held = f"decoded once into the node's cache {folder} ({sum(t.nbytes for t in tensors.values()) / 2**20:.0f} MB)"
        if meta["skipped_count"]:
            held += f"; {meta['skipped_count']} unreadable file(s) replaced by their next sample: " + \
                ", ".join(meta["skipped"][:5]) + (", ..." if meta["skipped_count"] > 5 else "")
        if geometry.train.whole:  # whole images: cropped by the workers, as a streamed set
            store = Ragged(tensors["train_images"], tensors["train_dims"], tensors["train_labels"], geometry.channels)
            train = Streamed(reader(index, "train", geometry, opts, store), opts.workers)
            held += f"; {opts.workers} DataLoader worker(s) per rank crop each batch"
        else:
            train = Split(tensors["train_images"], tensors["train_labels"], tensors.get("train_groups"))
        if choose_decode(opts.decode, torch.device(opts.device), index.jpeg_only) == "gpu" and opts.decode == "gpu":
            held += "; nothing is left to decode (--decode gpu decodes a streamed set; --cache-gb 0 streams it)"
        return Dataset(name, spec, train, Split(tensors["test_images"], tensors["test_labels"]), held,
                       tuple(report["class_names"]), index.content)
    spec = DataSpec(**{**report["spec"], "mean": tuple(report["spec"]["mean"]), "std": tuple(report["spec"]["std"])})
    on_gpu = decodes_on_gpu(opts, index, geometry)
    train = Streamed(reader(index, "train", geometry, opts), opts.workers, gpu_decode=on_gpu)
    test = Streamed(reader(index, "test", geometry, opts), opts.workers)
    cache = train.source.cache
    where = f", through the node's {cache.WHAT} cache {cache.folder} (at most {opts.shard_cache_gb:g} GB)" \
        if cache else ""
    decoded = f"read each batch's JPEGs{where}; the rank decodes (nvJPEG), crops and flips them on {opts.device} " \
        "(--decode gpu)" if on_gpu else f"decode each batch{where}"
    why = "evaluated once: no decoded copy is made" if opts.evaluated else \
        f"decoded it would take {stored_bytes(index, geometry) / 2**30:.3g} GB, above --cache-gb {opts.cache_gb:g}"
    held = f"streamed: {opts.workers} DataLoader worker(s) per rank {decoded} ({why})"
    return Dataset(name, spec, train, test, held, tuple(report["class_names"]), index.content)


def decodes_on_gpu(opts: OwnData, index: SetIndex, geometry: Geometry) -> bool:
    """--decode: whether the rank decodes the streamed training batches on its GPU. Only training
    crops of the whole image (--image-size) are made there; evaluation's centre crops stay with the
    workers (a fraction of the images, once an epoch)."""
    on_gpu = choose_decode(opts.decode, torch.device(opts.device), index.jpeg_only) == "gpu"
    if on_gpu and geometry.augment != "resized-crop-flip":
        if opts.decode == "auto":
            return False
        raise UserError(f"--decode gpu makes the training crops of --image-size S on the GPU, and {opts.data_dir} "
                        f"trains as stored ({geometry.describe()}); pass --image-size S, or --decode cpu")
    return on_gpu
