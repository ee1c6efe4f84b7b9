"""Your own images (common/shards.py defines the layouts): indexed once per node, decoded to uint8
at one geometry by DataLoader workers.

An index lists each split's samples (where the encoded bytes are, and the class) and surveys the
images' sizes and modes, which fix the geometry: a set whose images share one square size trains
at that size (colour: pad-crop + flip, as CIFAR-10); --image-size S resizes (the torchvision reference
recipe: random-resized crop + flip for training, resize + centre crop for evaluation). Grayscale
sets train with one channel, all others as RGB. Same-size grayscale sets train unaugmented, as MNIST.
"""
from __future__ import annotations

import io
import os
import tarfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import torch

from common import shards as layout
from common.data.shardcache import ShardCache
from common.errors import UserError

EVAL_CROP = 0.875  # evaluation: resize the short side to S / 0.875, centre-crop S (224 of 256)
GRAY_MODES = ("1", "L", "I;16", "I")  # modes whose images train with one channel
STATS_SAMPLES = 2048  # training images the normalization statistics are measured on (evenly spaced)
SKIP_FLAG = "--skip-broken"


@dataclass(frozen=True)
class Stored:
    """How a decoded image is stored: `side` x `side` pixels, after resizing its short side to
    `short` and centre-cropping (short 0: stored as it is, and it must be side x side)."""

    side: int
    short: int = 0


@dataclass(frozen=True)
class Geometry:
    channels: int
    train: Stored
    test: Stored
    size: int  # the model's input side
    augment: str  # "pad-crop-flip" or "resized-crop-flip"

    def describe(self) -> str:
        if not self.train.short:
            return f"{self.size}x{self.size} as stored, {self.augment}"
        return (f"stored at {self.train.side} px (train) and {self.test.side} px (eval), model input {self.size}, "
                f"{self.augment}")


@dataclass
class Table:
    """One split's samples: where each image's bytes are and its class. ImageFolder: `names` are
    image paths relative to the data folder. Shards: `names` are the shard files, and each sample
    is bytes [offset, offset + size) of shard `group`."""

    labels: torch.Tensor  # int64
    names: list[str]
    keys: list[str] = field(default_factory=list)  # shards: each sample's image member, for messages
    group: torch.Tensor | None = None  # int64 shard of each sample
    offset: torch.Tensor | None = None  # int64
    size: torch.Tensor | None = None  # int64

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def sharded(self) -> bool:
        return self.group is not None

    def take(self, keep: torch.Tensor) -> "Table":
        """The samples at `keep` (a bool mask or indices), in order."""
        kept = keep.nonzero().flatten() if keep.dtype == torch.bool else keep
        ids = kept.tolist()
        if not self.sharded:
            return Table(self.labels[kept], [self.names[i] for i in ids])
        return Table(self.labels[kept], self.names, [self.keys[i] for i in ids], self.group[kept], self.offset[kept],
                     self.size[kept])

    def state(self) -> dict:
        return {"labels": self.labels, "names": self.names, "keys": self.keys, "group": self.group,
                "offset": self.offset, "size": self.size}


@dataclass
class SetIndex:
    kind: str  # imagefolder | shards
    root: str  # the data folder or URL
    classes: int
    train: Table
    test: Table
    sizes: dict[str, str]  # "WxH" -> an image of that size, for the message about mixed sizes
    modes: list[str]
    fingerprint: str
    skipped: list[str] = field(default_factory=list)  # files whose header did not read (with --skip-broken)

    def state(self) -> dict:
        return {"kind": self.kind, "root": self.root, "classes": self.classes, "train": self.train.state(),
                "test": self.test.state(), "sizes": self.sizes, "modes": self.modes,
                "fingerprint": self.fingerprint, "skipped": self.skipped}

    @staticmethod
    def from_state(state: dict) -> "SetIndex":
        return SetIndex(**{**state, "train": Table(**state["train"]), "test": Table(**state["test"])})


# ---------------------------------------------------------------- geometry

def choose_geometry(index: SetIndex, image_size: int) -> Geometry:
    channels = 1 if all(mode in GRAY_MODES for mode in index.modes) else 3
    if image_size:
        short = round(image_size / EVAL_CROP)
        return Geometry(channels, Stored(short, short), Stored(image_size, short), image_size, "resized-crop-flip")
    if len(index.sizes) > 1:
        (a, path_a), (b, path_b) = sorted(index.sizes.items())[:2]
        raise UserError(f"the images of --data-dir {index.root} differ in size ({path_a} is {a}, {path_b} is {b}); "
                        "pass --image-size S to train at S x S (random-resized crops)")
    ((dims, example),) = index.sizes.items()
    width, height = map(int, dims.split("x"))
    if width != height:
        raise UserError(f"the images of --data-dir {index.root} are {dims}, not square (e.g. {example}); pass "
                        f"--image-size S to train at S x S (random-resized crops)")
    # Today's recipes at that size: CIFAR-10's pad-crop + flip for colour images; none for grayscale
    # ones, as for MNIST (a mirrored digit or letter is another symbol).
    return Geometry(channels, Stored(width), Stored(width), width, "none" if channels == 1 else "pad-crop-flip")


def stored_bytes(index: SetIndex, geometry: Geometry) -> int:
    """The decoded set's size: what the node's cache needs."""
    c = geometry.channels
    return len(index.train) * c * geometry.train.side ** 2 + len(index.test) * c * geometry.test.side ** 2


# ---------------------------------------------------------------- decoding

class Undecodable(Exception):
    """An image that did not decode (its file named in the message)."""


def decode(data: bytes, stored: Stored, channels: int) -> torch.Tensor:
    """Encoded bytes -> uint8 (channels, side, side). JPEGs decode at a reduced scale where the
    resize would discard the detail anyway (PIL's draft mode: the DCT does the downscaling)."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. PIL's "truncated" or EXIF warnings: the error below says it
        with Image.open(io.BytesIO(data)) as image:
            if stored.short and image.format == "JPEG":
                image.draft("L" if channels == 1 else "RGB", (stored.short, stored.short))
            image = image.convert("L" if channels == 1 else "RGB")
            if stored.short:
                image = _resize_and_crop(image, stored)
    if image.size != (stored.side, stored.side):
        raise ValueError(f"it is {image.size[0]}x{image.size[1]}, the set's images are {stored.side}x{stored.side}")
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.view(stored.side, stored.side, channels).permute(2, 0, 1).contiguous()


def _resize_and_crop(image, stored: Stored):  # PIL images: PIL is imported where it is used
    from PIL import Image

    width, height = image.size
    scale = stored.short / min(width, height)
    size = (max(stored.side, round(width * scale)), max(stored.side, round(height * scale)))
    image = image.resize(size, Image.BILINEAR, reducing_gap=None)
    left, top = (size[0] - stored.side) // 2, (size[1] - stored.side) // 2
    return image.crop((left, top, left + stored.side, top + stored.side))


def header(data_or_path: bytes | Path) -> tuple[tuple[int, int], str]:
    """(width, height) and PIL mode, from the header alone."""
    from PIL import Image

    source = io.BytesIO(data_or_path) if isinstance(data_or_path, bytes) else data_or_path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(source) as image:
            return image.size, image.mode


def broken_message(name: str, error: BaseException, skip_hint: bool = True) -> str:
    detail = " ".join(str(error).split())[:160] or type(error).__name__
    return (f"{name} is not a readable image ({detail}); replace or delete it"
            + (f", or pass {SKIP_FLAG} to train without such files" if skip_hint else ""))


# ---------------------------------------------------------------- reading a sample's bytes

class Reader(torch.utils.data.Dataset):
    """A split's samples decoded at their stored geometry, for DataLoader workers (picklable: a
    worker opens its own files and its own store client).

    `__getitems__` returns a whole collated batch: (uint8 images, int64 labels, skipped names,
    shard cache hits, misses). With skip, a sample that does not decode is replaced by the next one
    that does, in index order: the batch keeps its size and its content depends on the index alone
    (not on the world size or the workers), and the skipped file is named to the caller."""

    def __init__(self, table: Table, root: str, stored: Stored, channels: int, skip: bool,
                 cache: ShardCache | None = None) -> None:
        self.table, self.root, self.stored, self.channels, self.skip = table, root, stored, channels, skip
        self.cache = cache

    def __len__(self) -> int:
        return len(self.table)

    def name(self, i: int) -> str:
        t = self.table
        return f"{self.root.rstrip('/')}/{t.names[int(t.group[i])]}:{t.keys[i]}" if t.sharded else \
            str(Path(self.root) / t.names[i])

    def read(self, i: int) -> bytes:
        t = self.table
        if not t.sharded:
            return (Path(self.root) / t.names[i]).read_bytes()
        shard = t.names[int(t.group[i])]
        with self.cache.open(shard) if self.cache else open(Path(self.root) / shard, "rb") as f:
            f.seek(int(t.offset[i]))
            return f.read(int(t.size[i]))

    def image(self, i: int) -> torch.Tensor:
        """The decoded image, or Undecodable naming its file."""
        data = self.read(i)  # a missing file or an unreachable store is not the image's fault
        try:
            return decode(data, self.stored, self.channels)
        except Exception as e:  # noqa: BLE001 - any decoder failure is this file's problem, said in one line
            raise Undecodable(broken_message(self.name(i), e, not self.skip)) from None

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.image(i), int(self.table.labels[i])

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[str], int, int, str]:
        """The batch, with its error as a value (a worker's exception would reach the rank as a
        multi-line traceback): "" or one line naming the file."""
        hits, misses = (self.cache.hits, self.cache.misses) if self.cache else (0, 0)
        images, labels, skipped, error = [], [], [], ""
        try:
            for i in indices:
                j, image = self.decodable_from(i, skipped)
                images.append(image)
                labels.append(int(self.table.labels[j]))
        except UserError as e:
            error = str(e)
        except OSError as e:  # a file gone or unreadable since the set was indexed
            error = f"{self.name(i)}: {e.strerror or e}; the data changed while it was read: restore it and run again"
        side = self.stored.side
        batch = torch.stack(images) if images and not error else \
            torch.empty(0, self.channels, side, side, dtype=torch.uint8)
        return (batch, torch.tensor(labels if not error else [], dtype=torch.int64), skipped,
                *((self.cache.hits - hits, self.cache.misses - misses) if self.cache else (0, 0)), error)

    def decodable_from(self, i: int, skipped: list[str]) -> tuple[int, torch.Tensor]:
        """Sample i and its image, or with skip the first sample from i on (in index order) that decodes."""
        for j in [*range(i, len(self)), *range(i)]:
            try:
                return j, self.image(j)
            except Undecodable as e:
                if not self.skip:
                    raise UserError(str(e)) from None
                skipped.append(self.name(j))
        raise UserError(f"no image of {self.root} decodes")


def as_is(batch: object) -> object:
    """The DataLoader's collate: Reader.__getitems__ already made the batch."""
    return batch


def parallel(items: list, work: Callable, workers: int) -> Iterator:
    """work(item) for each item, in order, on `workers` DataLoader processes (0: here)."""
    loader = torch.utils.data.DataLoader(_Calls(items, work), batch_size=None, num_workers=workers,
                                         collate_fn=as_is, prefetch_factor=2 if workers else None)
    return iter(loader)


class _Calls(torch.utils.data.Dataset):
    def __init__(self, items: list, work: Callable) -> None:
        self.items, self.work = items, work

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> object:
        return self.work(self.items[i])


def default_workers(local_world_size: int) -> int:
    """DataLoader workers per rank: the node's cores shared by its ranks, one kept for the rank's
    own process, at least one (decoding never blocks the step) and at most 8 (beyond that,
    workers rarely help and each holds its own prefetched batches)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores // max(local_world_size, 1) - 1))


# ---------------------------------------------------------------- indexing an ImageFolder tree

def index_folder(root: Path, workers: int, skip: bool) -> SetIndex:
    classes = layout.folder_classes(root)
    splits = {split: layout.folder_images(root, split, classes) for split in (layout.TRAIN, layout.VAL)}
    sizes: dict[str, str] = {}
    modes: set[str] = set()
    tables, skipped = {}, []
    for split, samples in splits.items():
        paths = [rel for rel, _ in samples]
        chunks = [paths[i:i + 256] for i in range(0, len(paths), 256)]
        keep = []
        for chunk_headers in parallel(chunks, lambda chunk: [_folder_header(root, rel, skip) for rel in chunk],
                                      workers):
            for rel, found in chunk_headers:
                keep.append(found is not None)
                if not found:
                    skipped.append(str(root / rel))
                else:
                    (w, h), mode = found
                    sizes.setdefault(f"{w}x{h}", str(root / rel))
                    modes.add(mode)
        table = Table(torch.tensor([label for _, label in samples], dtype=torch.int64), paths)
        tables[split] = table.take(torch.tensor(keep, dtype=torch.bool)) if not all(keep) else table
    return SetIndex("imagefolder", str(root), len(classes), tables[layout.TRAIN], tables[layout.VAL], sizes,
                    sorted(modes), "", skipped)


def _folder_header(root: Path, rel: str, skip: bool) -> tuple[str, tuple | None]:
    try:
        return rel, header(root / rel)
    except Exception as e:  # noqa: BLE001 - one line naming the file
        if skip:
            return rel, None
        raise UserError(broken_message(str(root / rel), e)) from None


# ---------------------------------------------------------------- indexing shards

@dataclass
class ShardSamples:
    """What one shard holds: per sample its image member's (offset, size), key and class."""

    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    dims: dict[str, str] = field(default_factory=dict)
    modes: set[str] = field(default_factory=set)
    skipped: list[str] = field(default_factory=list)


def read_shard(opened: BinaryIO, name: str, skip: bool) -> ShardSamples:
    """One pass over an open tar shard: each KEY.<image> with its KEY.cls. Opened once: a cache
    short of room may delete the file meanwhile, and an open file stays readable."""
    with opened as f:
        images, labels = _members(f, name)
        return _samples(f, name, images, labels, skip)


def _members(f, name: str) -> tuple[dict[str, tuple[int, int, str]], dict[str, str]]:
    """key -> (offset, size, member name) of each image; key -> the text of each .cls."""
    images: dict[str, tuple[int, int, str]] = {}
    labels: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = split_member(member.name)
                if ext == "cls":
                    labels[key] = tar.extractfile(member).read(64).decode("ascii", "replace").strip()
                elif ext in layout.SHARD_EXTENSIONS:
                    images[key] = (member.offset_data, member.size, member.name)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UserError(f"{name} is not a readable tar shard ({first_words(e)}); replace it, or rewrite the shards "
                        "with python -m common.shards") from None
    return images, labels


def _samples(f, name: str, images: dict[str, tuple[int, int, str]], labels: dict[str, str],
             skip: bool) -> ShardSamples:
    out = ShardSamples()
    for key, (offset, size, member) in images.items():
        if key not in labels:
            raise UserError(f"{name}: sample {key} has {member} but no {key}.cls; every image needs its class "
                            "index in KEY.cls (python -m common.shards writes both)")
        f.seek(offset)
        try:
            (w, h), mode = header(f.read(size))
        except Exception as e:  # noqa: BLE001
            if not skip:
                raise UserError(broken_message(f"{name}:{member}", e)) from None
            out.skipped.append(f"{name}:{member}")
            continue
        out.offsets.append(offset)
        out.sizes.append(size)
        out.keys.append(member)
        out.labels.append(_class_index(labels[key], name, key))
        out.dims.setdefault(f"{w}x{h}", f"{name}:{member}")
        out.modes.add(mode)
    return out


def split_member(name: str) -> tuple[str, str]:
    """WebDataset's rule: a member's key is its path up to the first dot of its file name, the
    rest (lowercased) its extension: a/b.seg.png -> (a/b, seg.png)."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def _class_index(text: str, shard: str, key: str) -> int:
    if not text.isdigit():
        raise UserError(f"{shard}: {key}.cls holds {text[:20]!r}, not a class index (a whole number from 0); "
                        "fix the shard, or rewrite the shards with python -m common.shards")
    return int(text)


def first_words(error: BaseException) -> str:
    return " ".join(str(error).split())[:160] or type(error).__name__


def shard_table(names: list[str], found: list[ShardSamples]) -> Table:
    group = [torch.full((len(s.offsets),), g, dtype=torch.int64) for g, s in enumerate(found)]
    return Table(torch.tensor([label for s in found for label in s.labels], dtype=torch.int64), names,
                 [key for s in found for key in s.keys], torch.cat(group) if group else torch.zeros(0, dtype=torch.int64),
                 torch.tensor([o for s in found for o in s.offsets], dtype=torch.int64),
                 torch.tensor([n for s in found for n in s.sizes], dtype=torch.int64))


def check_classes(index_root: str, table: Table, classes: int, split: str, where: str) -> None:
    if len(table) and int(table.labels.max()) >= classes:
        i = int(table.labels.argmax())
        raise UserError(f"{index_root.rstrip('/')}/{table.names[int(table.group[i])]}: {table.keys[i]} has class "
                        f"{int(table.labels[i])}, outside the {classes} classes {where}; fix its .cls")
