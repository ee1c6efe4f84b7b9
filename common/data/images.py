"""Your own images (common/shards.py defines the layouts): indexed once per node, decoded to uint8
at one geometry by DataLoader workers.

An index lists each split's samples (where the encoded bytes are, and the class) and surveys the
images' sizes and modes, which fix the geometry: a set whose images share one square size trains
at that size (colour: pad-crop + flip, as CIFAR-10); --image-size S resizes (the torchvision reference
recipe: random-resized crop + flip for training, resize + centre crop for evaluation). Grayscale
sets train with one channel, all others as RGB. Same-size grayscale sets train unaugmented, as MNIST.
"""
from __future__ import annotations

import functools
import io
import os
import re
import tarfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, NamedTuple

import numpy as np
import torch

from common import shards as layout
from common.data.augment import Draws, Policy, policy_generator
from common.data.geometry import EVAL_CROP, Box, eval_box, resized_crop, scaled, train_box
from common.data.index import SAMPLES_NAMED, SetIndex, Table, TableWriter
from common.data.loader import crop_and_flip, pad_crop_draws
from common.data.shardcache import ShardCache
from common.errors import UserError

WHOLE_SIDE = 2  # a cached training image keeps its long side within this many times the evaluation's short side
GRAY_MODES = ("1", "L", "I", "F")  # modes (and I;16 and its kin) whose images train with one channel
STATS_SAMPLES = 2048  # training images the normalization statistics are measured on (evenly spaced)
SKIP_FLAG = "--skip-broken"


@dataclass(frozen=True)
class Stored:
    """A fixed view of an image: `side` x `side` pixels, after resizing its short side to `short`
    and centre-cropping (short 0: as it is, and it must be side x side). `whole` > 0: the split
    trains on random-resized crops of the whole image, and a cached copy keeps the whole image
    with its long side at most `whole` (the view then serves only its statistics)."""

    side: int
    short: int = 0
    whole: int = 0


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
        return (f"model input {self.size}: training on random-resized crops of the whole image (cached with its "
                f"long side at most {self.train.whole} px), evaluation on the centre {self.size} of the short side "
                f"resized to {self.test.short}")


# ---------------------------------------------------------------- geometry

def choose_geometry(index: SetIndex, image_size: int) -> Geometry:
    channels = 1 if all(mode.split(";")[0] in GRAY_MODES for mode in index.modes) else 3
    if image_size:
        short = round(image_size / EVAL_CROP)
        return Geometry(channels, Stored(image_size, short, WHOLE_SIDE * short), Stored(image_size, short), image_size,
                        "resized-crop-flip")
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
    c, train = geometry.channels, geometry.train
    if train.whole:
        height, width = index.train.height.double(), index.train.width.double()
        scale = (train.whole / torch.maximum(height, width)).clamp(max=1)
        train_bytes = int((c * (height * scale).round().clamp(min=1) * (width * scale).round().clamp(min=1)).sum())
    else:
        train_bytes = len(index.train) * c * train.side ** 2
    return train_bytes + len(index.test) * c * geometry.test.side ** 2


# ---------------------------------------------------------------- decoding

class Undecodable(Exception):
    """An image that did not decode (its file named in the message)."""


# torchvision 0.29 announces on every decode_jpeg call that its decoders will move to TorchCodec:
# said once in docs/data.md, not once per image into every worker's stderr.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)
JPEG_MAGIC = b"\xff\xd8\xff"
DRAFT_SCALES = (8, 4, 2)  # the reduced sizes libjpeg decodes to directly (its DCT does the downscaling)


def is_jpeg(data: bytes) -> bool:
    return data[:3] == JPEG_MAGIC


def decode_whole(data: bytes, channels: int, reduce: int = 1) -> torch.Tensor:
    """Encoded bytes -> the whole image as uint8 (channels, height, width). A JPEG decodes with
    torchvision.io.decode_jpeg (libjpeg-turbo straight into a tensor, no PIL object), or with
    reduce 2, 4 or 8 with PIL's DCT-scaled draft decode at about 1/reduce of its size; any other
    format through PIL (16-bit and float images scaled to 8 bits: to_8_bits). An image above
    layout.MAX_PIXELS is refused before its pixels are read (the index refused it already; this
    holds if the file changed since)."""
    if is_jpeg(data) and reduce == 1:
        from torchvision.io import ImageReadMode, decode_jpeg
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                           mode=ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB)
    from PIL import Image

    with warnings.catch_warnings():  # PIL's path only: e.g. its "truncated" or EXIF warnings, the error says it
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as image:
            if problem := layout.pixels_problem(*image.size):
                raise ValueError(problem)
            if reduce > 1:
                image.draft("L" if channels == 1 else "RGB", (image.size[0] // reduce, image.size[1] // reduce))
            image = to_8_bits(image).convert("L" if channels == 1 else "RGB")
            pixels = torch.from_numpy(np.asarray(image))
    return pixels[None] if channels == 1 else pixels.permute(2, 0, 1)  # HWC viewed as CHW: no copy


def draft_scale(data: bytes, box: Box, size: int) -> int:
    """The reduced JPEG decode that keeps at least `size` source pixels across the drawn box (1: none)."""
    if not is_jpeg(data):
        return 1
    return next((k for k in DRAFT_SCALES if min(box.height, box.width) >= k * size), 1)


def decode(data: bytes, stored: Stored, channels: int) -> torch.Tensor:
    """Encoded bytes -> uint8 (channels, side, side): the evaluation's view (the centre of the
    short side resized to stored.short: geometry.eval_box, resized in one antialiased step), or
    with short 0 the image as it is, which must be side x side. Memory is bounded: the resize
    produces only the stored square (a 4000x1 image is not first made 1,024,000 x 256)."""
    image = decode_whole(data, channels)
    height, width = image.shape[-2:]
    if stored.short:
        return resized_crop(image, eval_box(height, width, stored.side, stored.short), stored.side)
    if (width, height) != (stored.side, stored.side):
        raise ValueError(f"it is {width}x{height}, the set's images are {stored.side}x{stored.side}")
    return image.contiguous()


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


# ---------------------------------------------------------------- reading batches

class Request(NamedTuple):
    """One batch a DataLoader worker makes: the samples; for a training batch, each row's place in
    the global batch and the draws (crop, flip, policy), for the ragged cache the whole images
    (long side bounded to `whole`). A plain list of indices asks for the reader's fixed view."""

    indices: list[int]
    positions: tuple[int, ...] = ()
    draws: Draws | None = None
    whole: int = 0


class Batch(NamedTuple):
    """What a worker hands the rank: uint8 images (B, C, S, S) and int64 labels; the files skipped
    (replaced by their next decodable sample); shard cache hits and misses; "" or one line
    naming the file that failed (a worker's exception would reach the rank as a traceback).
    Whole images (Request.whole): `images` is their pixels end to end, CHW each, and `dims` per
    image (stored height, stored width, original height, original width)."""

    images: torch.Tensor
    labels: torch.Tensor
    skipped: list[str]
    hits: int
    misses: int
    error: str
    dims: torch.Tensor | None = None


class Reader(torch.utils.data.Dataset):
    """A split's samples made into batches by DataLoader workers (picklable: a worker opens its own
    files and its own store client), from the encoded bytes or, for a cached set, from the ragged
    store of whole decoded images (`store`).

    `view` is the fixed geometry of a plain request (evaluation: the centre crop; a same-size set:
    as stored). A training request (Request.draws) crops each sample in the worker, on uint8:
    geometry.train_box on the whole image (a JPEG decoded at a reduced scale where the box keeps
    at least `size` pixels across), flip, then --augment's policy, every draw from the sample's
    global position. With skip, a sample that does not decode is replaced by the next one that
    does, in index order: the batch keeps its size and its content depends on the index alone
    (not on the world size or the workers), and the skipped file is named to the caller."""

    def __init__(self, table: Table, root: str, view: Stored, channels: int, skip: bool,
                 cache: ShardCache | None = None, augment: str = "none", store: "Ragged | None" = None) -> None:
        self.table, self.root, self.view, self.channels, self.skip = table, root, view, channels, skip
        self.cache, self.augment, self.store = cache, augment, store
        self.after: dict[int, int] = {}  # an undecodable sample -> where the search for a decodable one goes on
        self._policies: dict[str, Policy] = {}

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

    def dims(self, i: int) -> tuple[int, int]:
        """Sample i's (height, width) as indexed: what its training crop is drawn on."""
        if self.store is not None:
            return self.store.original(i)
        return int(self.table.height[i]), int(self.table.width[i])

    def pixels(self, i: int, box: Box | None, size: int) -> torch.Tensor:
        """Sample i's whole image, uint8 (C, H, W): from the store, or decoded (reduced where `box`
        keeps `size` pixels across after it); Undecodable naming its file."""
        if self.store is not None:
            return self.store.image(i)
        data = self.read(i)  # a missing file or an unreadable store is not the image's fault
        try:
            return decode_whole(data, self.channels, draft_scale(data, box, size) if box else 1)
        except Exception as e:  # noqa: BLE001 - any decoder failure is this file's problem, said in one line
            raise Undecodable(broken_message(self.name(i), e, not self.skip)) from None

    def render(self, i: int, out: torch.Tensor, box_of: Callable[[int, int], Box] | None) -> None:
        """Sample i into `out` (C, S, S): the box box_of(height, width) of its whole image resized
        to S, or (box_of None) the image as it is, which must be S x S."""
        box = box_of(*self.dims(i)) if box_of else None
        image = self.pixels(i, box, out.shape[-1])
        height, width = image.shape[-2:]
        if box is not None:
            resized_crop(image, scaled(box, height, width, *self.dims(i)), out.shape[-1], out=out)
        elif tuple(image.shape) == tuple(out.shape):
            out.copy_(image)
        else:
            raise Undecodable(broken_message(self.name(i), ValueError(
                f"it is {width}x{height}, the set's images are {out.shape[-1]}x{out.shape[-1]}"), not self.skip))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        batch = self.__getitems__([i])
        if batch.error:
            raise UserError(batch.error)
        return batch.images[0], int(batch.labels[0])

    def __getitems__(self, request: Request | list[int]) -> Batch:
        """The batch, with its error as a value: "" or one line naming the file."""
        if not isinstance(request, Request):
            request = Request(list(request))
        hits, misses = (self.cache.hits, self.cache.misses) if self.cache else (0, 0)
        skipped: list[str] = []
        try:
            images, labels, dims = self.whole(request, skipped) if request.whole else (*self.made(request, skipped), None)
            error = ""
        except UserError as e:
            images, labels, dims, error = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int64), None, str(e)
        except OSError as e:  # a file gone or unreadable since the set was indexed
            images, labels, dims = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int64), None
            error = f"{self.root}: {e.strerror or e}; the data changed while it was read: restore it and run again"
        counts = (self.cache.hits - hits, self.cache.misses - misses) if self.cache else (0, 0)
        return Batch(images, labels, skipped, *counts, error, dims)

    def made(self, request: Request, skipped: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's images written into one preallocated uint8 tensor, and their labels."""
        draws, side = request.draws, self.view.side
        train_crops = draws is not None and self.augment == "resized-crop-flip"
        out = torch.empty(len(request.indices), self.channels, side, side, dtype=torch.uint8)
        labels = torch.empty(len(request.indices), dtype=torch.int64)
        for k, i in enumerate(request.indices):
            if train_crops:
                box_of = functools.partial(train_box, draws.seed, draws.epoch, draws.step, request.positions[k])
            else:
                box_of = functools.partial(_view_box, self.view) if self.view.short else None
            labels[k] = self.label(self.decodable_from(i, skipped, out[k], box_of))
        if draws is not None:
            self.augmented(out, request)
        return out, labels

    def augmented(self, out: torch.Tensor, request: Request) -> None:
        """A same-size colour set's pad-crop + flip (drawn for the global batch, as the in-memory
        sets draw it), then --augment's policy on each row, from its global position."""
        draws = request.draws
        if self.augment == "pad-crop-flip":
            shifts, flips = pad_crop_draws(draws.seed, draws.epoch, draws.step, draws.global_batch)
            rows = list(request.positions)
            out.copy_(crop_and_flip(out, shifts[rows], flips[rows]))
        policy = self._policies.setdefault(draws.augment, Policy(draws.augment))
        if policy:
            for k, position in enumerate(request.positions):
                out[k] = policy(out[k], policy_generator(draws.seed, draws.epoch, draws.step, position))

    def whole(self, request: Request, skipped: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Whole images for the ragged cache, each with its long side at most request.whole."""
        images, labels, dims = [], [], []
        for i in request.indices:
            holder: list[torch.Tensor] = []
            j = self.decodable_from(i, skipped, holder, None)
            image = bounded(holder[0], request.whole)
            images.append(image.flatten())
            labels.append(self.label(j))
            dims.append([*image.shape[-2:], *self.dims(j)])
        return torch.cat(images), torch.tensor(labels, dtype=torch.int64), torch.tensor(dims, dtype=torch.int64)

    def label(self, i: int) -> int:
        return self.store.label(i) if self.store is not None else int(self.table.labels[i])

    def decodable_from(self, i: int, skipped: list[str], out: torch.Tensor | list,
                       box_of: Callable[[int, int], Box] | None) -> int:
        """Sample i made into `out` (a list: its whole image appended); with skip, if i does not
        decode (it is named in `skipped`), the first sample after it (in index order, wrapping
        around) that does; the sample used is returned. The undecodable samples passed over are
        named when they are asked for themselves: each counts once an epoch. Each is remembered
        with where the search went on, so a run of k of them costs k decodes, not k^2/2."""
        if self.try_image(i, out, box_of):
            return i
        skipped.append(self.name(i))
        passed, j = [i], self.after[i]
        while not self.try_image(j, out, box_of):
            if j == i:
                raise UserError(f"no image of {self.root} decodes")
            passed.append(j)
            j = self.after[j]
        self.after.update((k, j) for k in passed)  # the next search from any of them jumps straight to j
        return j

    def try_image(self, i: int, out: torch.Tensor | list, box_of: Callable[[int, int], Box] | None) -> bool:
        """Sample i made into `out`; False if it is known or found not to decode (with skip: else one line)."""
        if i in self.after:
            return False
        try:
            if isinstance(out, list):
                out.append(self.pixels(i, None, 0))
            else:
                self.render(i, out, box_of)
            return True
        except Undecodable as e:
            if not self.skip:
                raise UserError(str(e)) from None
            self.after[i] = (i + 1) % len(self)
            return False


def _view_box(view: Stored, height: int, width: int) -> Box:
    return eval_box(height, width, view.side, view.short)


def bounded(image: torch.Tensor, longest: int) -> torch.Tensor:
    """The whole image with its long side at most `longest` (aspect kept, antialiased): what the
    ragged cache holds of a large photo."""
    height, width = image.shape[-2:]
    if max(height, width) <= longest:
        return image.contiguous()
    scale = longest / max(height, width)
    size = (max(1, round(height * scale)), max(1, round(width * scale)))
    return torch.nn.functional.interpolate(image[None], size=size, mode="bilinear", align_corners=False,
                                           antialias=True)[0].contiguous()


class Ragged:
    """A cached split's whole images of varying size, end to end in one uint8 file (CHW each), with
    each image's start, stored and original (as indexed) height and width, and its label: the
    training crops are drawn on the original size and cut from the stored copy, so a cached set
    trains the crops a streamed one does."""

    def __init__(self, pixels: torch.Tensor, dims: torch.Tensor, labels: torch.Tensor, channels: int) -> None:
        self.pixels, self.labels, self.channels = pixels, labels, channels
        self._dims = dims.numpy()
        self._starts = np.concatenate([[0], np.cumsum(channels * self._dims[:, 0] * self._dims[:, 1])])

    def image(self, i: int) -> torch.Tensor:
        height, width = int(self._dims[i, 0]), int(self._dims[i, 1])
        start = int(self._starts[i])
        return self.pixels[start:start + self.channels * height * width].view(self.channels, height, width)

    def original(self, i: int) -> tuple[int, int]:
        return int(self._dims[i, 2]), int(self._dims[i, 3])

    def label(self, i: int) -> int:
        return int(self.labels[i])


def as_is(batch: object) -> object:
    """The DataLoader's collate: Reader.__getitems__ already made the batch (a Batch)."""
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
    own process, at least one (decoding never blocks the step). Not capped: a GPU rank eats
    what all of its cores decode (a ResNet-50 on an H100 takes ~3,000 images/s, ~10 cores' worth)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(local_world_size, 1) - 1)


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
                kept = [(rel, seen[0]) for rel, seen in found if seen is not None]
                writer.add_images([rel for rel, _ in kept], [label] * len(kept), [dims for _, dims in kept])
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
    dims: list[tuple[int, int]] = field(default_factory=list)  # (width, height)
    survey: Survey = field(default_factory=Survey)


def index_shards(names: list[str], read: Callable[[str], ShardSamples], writer: TableWriter, workers: int,
                 survey: Survey) -> tuple[int, str]:
    """Each shard's samples, read by `workers` processes, appended to the split's table in order;
    the largest class met, and where (-1 and "" for no sample)."""
    top = (-1, "")
    for group, (name, found) in enumerate(zip(names, parallel(names, read, workers))):
        writer.add_shard(name, group, found.offsets, found.sizes, found.keys, found.labels, found.dims)
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
        out.dims.append((w, h))
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
