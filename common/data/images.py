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
import re
import tarfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np
import torch

from common import shards as layout
from common.data.index import SAMPLES_NAMED, SetIndex, Table, TableWriter
from common.data.shardcache import ShardCache
from common.errors import UserError

EVAL_CROP = 0.875  # evaluation: resize the short side to S / 0.875, centre-crop S (224 of 256)
GRAY_MODES = ("1", "L", "I", "F")  # modes (and I;16 and its kin) whose images train with one channel
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


# ---------------------------------------------------------------- geometry

def choose_geometry(index: SetIndex, image_size: int) -> Geometry:
    channels = 1 if all(mode.split(";")[0] in GRAY_MODES for mode in index.modes) else 3
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
    resize would discard the detail anyway (PIL's draft mode: the DCT does the downscaling).
    Memory is bounded: an image above layout.MAX_PIXELS is refused before its pixels are read,
    and the resize produces only the stored square (a 4000x1 image is not first made 1,024,000 x 256)."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. PIL's "truncated" or EXIF warnings: the error below says it
        with Image.open(io.BytesIO(data)) as image:
            if stored.short and image.format == "JPEG":
                image.draft("L" if channels == 1 else "RGB", (stored.short, stored.short))
            if problem := layout.pixels_problem(*image.size):
                raise ValueError(problem)
            image = to_8_bits(image).convert("L" if channels == 1 else "RGB")
            if stored.short:
                image = _resize_and_crop(image, stored)
    if image.size != (stored.side, stored.side):
        raise ValueError(f"it is {image.size[0]}x{image.size[1]}, the set's images are {stored.side}x{stored.side}")
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.view(stored.side, stored.side, channels).permute(2, 0, 1).contiguous()


def to_8_bits(image):  # a PIL image: PIL is imported where it is used
    """16-bit grayscale (I;16*, and I: integer images are read as 16-bit) scaled from 0..65535, and
    float (F) from 0..1, to 0..255: PIL's convert clips them instead (a 16-bit scan turns white).
    Values outside those ranges are refused, not clipped."""
    from PIL import Image

    if image.mode == "F":
        values = np.asarray(image, dtype=np.float32)
        low, high = float(values.min(initial=0.0)), float(values.max(initial=0.0))
        if not (0 <= low and high <= 1):  # NaN too
            raise ValueError(f"it is a float image with values from {low:g} to {high:g}; float images are read as "
                             "0..1: rescale it, or save it as 8- or 16-bit")
        return Image.fromarray((values * 255).round().astype(np.uint8), "L")
    if image.mode.startswith("I"):
        values = np.asarray(image)
        if values.size and not 0 <= values.min() <= values.max() <= 65535:
            raise ValueError(f"it is a 32-bit image with values from {values.min()} to {values.max()}; integer "
                             "images are read as 16-bit (0..65535): rescale it")
        values = values.astype(np.uint32)  # 65535 * 255 fits: 4 bytes a pixel
        return Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8), "L")
    return image


def _resize_and_crop(image, stored: Stored):
    """Short side to stored.short, centre square of stored.side: only the source box that becomes
    that square is resampled (PIL's resize box), so the output is side x side whatever the shape."""
    from PIL import Image

    width, height = image.size
    extent = stored.side * min(width, height) / stored.short  # the source pixels that become the side
    left, top = (width - extent) / 2, (height - extent) / 2
    return image.resize((stored.side, stored.side), Image.BILINEAR, box=(left, top, left + extent, top + extent),
                        reducing_gap=None)


def header(data_or_path: bytes | Path) -> tuple[tuple[int, int], str]:
    """(width, height) and PIL mode, from the header alone; an image above layout.MAX_PIXELS is
    refused here, at indexing, before any run decodes it."""
    from PIL import Image

    source = io.BytesIO(data_or_path) if isinstance(data_or_path, bytes) else data_or_path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(source) as image:
            if problem := layout.pixels_problem(*image.size):
                raise ValueError(problem)
            return image.size, image.mode


def broken_message(name: str, error: BaseException, skip_hint: bool = True) -> str:
    detail = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-f]+>", "", " ".join(str(error).split()))[:160] \
        or type(error).__name__  # PIL names the in-memory buffer; the file is named before
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
        self.after: dict[int, int] = {}  # an undecodable sample -> where the search for a decodable one goes on

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
        shard, offset, size = t.names[int(t.group[i])], int(t.offset[i]), int(t.size[i])
        if self.cache:
            return self.cache.read(shard, offset, size)
        with open(Path(self.root) / shard, "rb") as f:
            f.seek(offset)
            return f.read(size)

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
        """Sample i and its image; with skip, if i does not decode (it is named in `skipped`), the
        first sample after it (in index order, wrapping around) that does. The undecodable samples
        passed over are named when they are asked for themselves: each counts once an epoch. Each
        is remembered with where the search went on, so a run of k of them costs k decodes, not k^2/2."""
        image = self.try_image(i)
        if image is not None:
            return i, image
        skipped.append(self.name(i))
        passed, j = [i], self.after[i]
        while (image := self.try_image(j)) is None:
            if j == i:
                raise UserError(f"no image of {self.root} decodes")
            passed.append(j)
            j = self.after[j]
        self.after.update((k, j) for k in passed)  # the next search from any of them jumps straight to j
        return j, image

    def try_image(self, i: int) -> torch.Tensor | None:
        """Sample i's image; None if it is known or found not to decode (with skip: else one line)."""
        if i in self.after:
            return None
        try:
            return self.image(i)
        except Undecodable as e:
            if not self.skip:
                raise UserError(str(e)) from None
            self.after[i] = (i + 1) % len(self)
            return None


def as_is(batch: object) -> object:
    """The DataLoader's collate: Reader.__getitems__ already made the batch."""
    return batch


def parallel(items: list, work: Callable, workers: int) -> Iterator:
    """work(item) for each item, in order, on `workers` DataLoader processes (0: here). A worker's
    UserError or OSError comes back as a value and is raised here, as one line (the loader would
    re-raise it with the worker's traceback in its message)."""
    loader = torch.utils.data.DataLoader(_Calls(items, work), batch_size=None, num_workers=workers,
                                         collate_fn=as_is, prefetch_factor=2 if workers else None)
    for result in loader:
        if isinstance(result, _Failed):
            raise UserError(result.message)
        yield result


@dataclass(frozen=True)
class _Failed:
    message: str


class _Calls(torch.utils.data.Dataset):
    def __init__(self, items: list, work: Callable) -> None:
        self.items, self.work = items, work

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> object:
        try:
            return self.work(self.items[i])
        except UserError as e:
            return _Failed(str(e))
        except OSError as e:  # a file gone or unreadable since it was listed
            return _Failed(f"{e.filename or self.items[i]}: {e.strerror or e}; check that it is readable and that "
                           "the data does not change while it is indexed")


def default_workers(local_world_size: int) -> int:
    """DataLoader workers per rank: the node's cores shared by its ranks, one kept for the rank's
    own process, at least one (decoding never blocks the step) and at most 8 (beyond that,
    workers rarely help and each holds its own prefetched batches)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores // max(local_world_size, 1) - 1))


# ---------------------------------------------------------------- what indexing finds

@dataclass
class Survey:
    """What an index pass saw besides the samples: image sizes and modes (they fix the geometry),
    and the files left out: skipped (the header did not read, --skip-broken) and ignored (not an
    image the suite reads). Bounded: names are kept for the first SAMPLES_NAMED of each."""

    sizes: dict[str, str] = field(default_factory=dict)
    modes: set[str] = field(default_factory=set)
    skipped: list[str] = field(default_factory=list)
    skipped_count: int = 0
    ignored: list[str] = field(default_factory=list)
    ignored_count: int = 0

    def saw(self, dims: str, example: str, mode: str) -> None:
        if len(self.sizes) < 2:  # two sizes are enough to say the set is mixed, and to name both
            self.sizes.setdefault(dims, example)
        self.modes.add(mode)

    def skip(self, names: list[str], count: int | None = None) -> None:
        self.skipped += names[:SAMPLES_NAMED - len(self.skipped)]
        self.skipped_count += len(names) if count is None else count

    def ignore(self, names: list[str], count: int | None = None) -> None:
        self.ignored += names[:SAMPLES_NAMED - len(self.ignored)]
        self.ignored_count += len(names) if count is None else count

    def merge(self, other: "Survey") -> None:
        for dims, example in other.sizes.items():
            if len(self.sizes) < 2:
                self.sizes.setdefault(dims, example)
        self.modes |= other.modes
        self.skip(other.skipped, other.skipped_count)
        self.ignore(other.ignored, other.ignored_count)

    def meta(self) -> dict:
        return {"sizes": self.sizes, "modes": sorted(self.modes), "skipped": self.skipped,
                "skipped_count": self.skipped_count, "ignored": self.ignored, "ignored_count": self.ignored_count}


# ---------------------------------------------------------------- indexing an ImageFolder tree

HEADER_CHUNK = 256  # images per worker task while reading headers
HEADER_GROUP = 65536  # images listed at a time: the listing's memory is bounded, not the set's size


def index_folder(root: Path, folder: Path, workers: int, skip: bool) -> tuple[list[str], Survey]:
    """Writes the tree's tables into `folder`; its classes' names and what the pass saw."""
    classes = layout.folder_classes(root)
    survey = Survey()
    for split in (layout.TRAIN, layout.VAL):
        writer = TableWriter(folder, "train" if split == layout.TRAIN else "test", sharded=False)
        for group in _groups(layout.class_images(root, split, classes, survey.ignore)):
            chunks = [(label, paths[i:i + HEADER_CHUNK]) for label, paths in group
                      for i in range(0, len(paths), HEADER_CHUNK)]
            for label, found in parallel(chunks, lambda chunk: _folder_headers(root, *chunk, skip), workers):
                kept = [rel for rel, seen in found if seen is not None]
                writer.add_images(kept, [label] * len(kept))
                survey.skip([str(root / rel) for rel, seen in found if seen is None])
                for rel, seen in found:
                    if seen is not None:
                        (w, h), mode = seen
                        survey.saw(f"{w}x{h}", str(root / rel), mode)
        writer.close()
    return classes, survey


def _groups(classes: Iterator[tuple[int, list[str]]]) -> Iterator[list[tuple[int, list[str]]]]:
    """Classes gathered into groups of about HEADER_GROUP images."""
    group, count = [], 0
    for label, paths in classes:
        group.append((label, paths))
        count += len(paths)
        if count >= HEADER_GROUP:
            yield group
            group, count = [], 0
    if group:
        yield group


def _folder_headers(root: Path, label: int, paths: list[str], skip: bool) -> tuple[int, list[tuple[str, tuple | None]]]:
    return label, [(rel, _folder_header(root, rel, skip)) for rel in paths]


def _folder_header(root: Path, rel: str, skip: bool) -> tuple | None:
    try:
        return header(root / rel)
    except Exception as e:  # noqa: BLE001 - one line naming the file
        if skip:
            return None
        raise UserError(broken_message(str(root / rel), e)) from None


# ---------------------------------------------------------------- indexing shards

@dataclass
class ShardSamples:
    """What one shard holds: per sample its image member's (offset, size), key and class."""

    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    survey: Survey = field(default_factory=Survey)


def index_shards(names: list[str], read: Callable[[str], ShardSamples], writer: TableWriter, workers: int,
                 survey: Survey) -> tuple[int, str]:
    """Each shard's samples, read by `workers` processes, appended to the split's table in order;
    the largest class met, and where (-1 and "" for no sample)."""
    top = (-1, "")
    for group, (name, found) in enumerate(zip(names, parallel(names, read, workers))):
        writer.add_shard(name, group, found.offsets, found.sizes, found.keys, found.labels)
        survey.merge(found.survey)
        if found.labels and max(found.labels) > top[0]:
            top = (max(found.labels), f"{name}: {found.keys[found.labels.index(max(found.labels))]}")
    writer.close()
    return top


def read_shard(opened: BinaryIO, name: str, skip: bool, expected: int | None) -> ShardSamples:
    """One pass over an open tar shard: each KEY.<image> with its KEY.cls. Opened once: a cache
    short of room may delete the file meanwhile, and an open file stays readable. `expected`: the
    sample count the converter's manifest gives the shard."""
    with opened as f:
        images, labels = _members(f, name)
        if expected is not None and len(images) != expected:
            raise UserError(f"{name} holds {len(images)} samples, the manifest says {expected}: it was cut or changed "
                        "since it was written; copy it again, or rerun python -m common.shards")
        return _samples(f, name, images, labels, skip)


def _members(f, name: str) -> tuple[dict[str, tuple[int, int, str]], dict[str, str]]:
    """key -> (offset, size, member name) of each image; key -> the text of each .cls. A shard must
    end with tar's end-of-archive blocks: one cut at a member boundary would otherwise pass for a
    shorter shard."""
    images: dict[str, tuple[int, int, str]] = {}
    labels: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = split_member(member.name)
                if ext == "cls" or ext in layout.SHARD_EXTENSIONS:
                    if key in (labels if ext == "cls" else images):  # else silently one sample, the last label
                        raise UserError(f"{name}: sample {key} has two {'.cls' if ext == 'cls' else 'image'} members "
                                        f"({member.name}); each key must be one sample: rewrite the shard")
                if ext == "cls":
                    labels[key] = tar.extractfile(member).read(64).decode("utf-8", "replace").strip()
                elif ext in layout.SHARD_EXTENSIONS:
                    images[key] = (member.offset_data, member.size, member.name)
            end = tar.offset
        f.seek(end)
        if f.read(tarfile.BLOCKSIZE) != bytes(tarfile.BLOCKSIZE):
            raise UserError(f"{name} ends without tar's end-of-archive blocks: it was cut (a partial copy or "
                            "download); copy it again")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UserError(f"{name} is not a readable tar shard ({first_words(e)}); replace it, or rewrite the shards "
                        "with python -m common.shards") from None
    orphans = sorted(set(labels) - set(images))
    if orphans:
        raise UserError(f"{name}: sample {orphans[0]} has {orphans[0]}.cls but no image member ("
                        f"{', '.join(layout.SHARD_EXTENSIONS)}); add it, or remove the sample")
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
            out.survey.skip([f"{name}:{member}"])
            continue
        out.offsets.append(offset)
        out.sizes.append(size)
        out.keys.append(member)
        out.labels.append(_class_index(labels[key], name, key))
        out.survey.saw(f"{w}x{h}", f"{name}:{member}", mode)
    return out


def split_member(name: str) -> tuple[str, str]:
    """WebDataset's rule: a member's key is its path up to the first dot of its file name, the
    rest (lowercased) its extension: a/b.seg.png -> (a/b, seg.png)."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


MAX_CLASS = 2**31 - 1


def _class_index(text: str, shard: str, key: str) -> int:
    if not text.isdigit() or int(text) > MAX_CLASS:
        raise UserError(f"{shard}: {key}.cls holds {text[:20]!r}, not a class index (a whole number from 0 to "
                        f"{MAX_CLASS}); fix the shard, or rewrite the shards with python -m common.shards")
    return int(text)


def first_words(error: BaseException) -> str:
    return " ".join(str(error).split())[:160] or type(error).__name__


def check_classes(top: tuple[int, str], classes: int, where: str) -> None:
    if top[0] >= classes:
        raise UserError(f"{top[1]} has class {top[0]}, outside the {classes} classes {where}; fix its .cls")
