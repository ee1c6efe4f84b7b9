"""Reading own images while training and evaluating: the Reader a DataLoader worker makes each
batch with (decode or cached pixels, crop, flip, policy, on uint8; or, for --decode gpu, only the
encoded bytes), the batches' types (Request, Batch), the ragged store of whole decoded images, the
epoch's batch sampler (Plan) and the split the rank iterates (Streamed), and the workers' count.
"""
from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence, TypeVar

import numpy as np
import torch

from common.data.augment import Draws, Policy, policy_generator
from common.data.decoding import Undecodable, broken_message, decode_crop, decode_whole, header, is_jpeg
from common.data.device_decode import DecodeAhead, EncodedBatch, decode_and_crop, train_boxes
from common.data.geometry import Box, Stored, eval_box, resized_crop, scaled, train_box
from common.data.index import Table
from common.data.indexing import Survey, as_is
from common.data.loader import crop_and_flip, pad_crop_draws, to_device
from common.data.shardcache import Prefetcher, ShardCache
from common.errors import UserError

RATE_SAMPLES = 16  # samples the banner's loader rate is measured on
LOADER_TIMEOUT_S = 600.0  # a worker may fetch a shard (bounded by the store's own timeouts) and decode a batch
DECODE_MARGIN_S = 60.0  # --decode gpu: the rank's own decode of a batch, beyond the worker's wait
T = TypeVar("T")


class Request(NamedTuple):
    """One batch a DataLoader worker makes: the samples; for a training batch, each row's place in
    the global batch and the draws (crop, flip, policy), for the ragged cache the whole images
    (long side bounded to `whole`); `encoded`: the JPEGs' bytes alone, for a rank that decodes on
    its GPU (--decode gpu). A plain list of indices asks for the reader's fixed view."""

    indices: list[int]
    positions: tuple[int, ...] = ()
    draws: Draws | None = None
    whole: int = 0
    encoded: bool = False


class Batch(NamedTuple):
    """What a worker hands the rank: uint8 images (B, C, S, S) and int64 labels; the files skipped
    (replaced by their next decodable sample); shard cache hits and misses; "" or one line
    naming the file that failed (a worker's exception would reach the rank as a traceback).
    Whole images (Request.whole): `images` is their pixels end to end, CHW each, and `dims` per
    image (stored height, stored width, original height, original width). Encoded (Request.encoded):
    `images` is the JPEGs' bytes end to end, `dims` per image (bytes, height, width) from its header,
    `names` its file (nvJPEG's errors name none)."""

    images: torch.Tensor
    labels: torch.Tensor
    skipped: list[str]
    hits: int
    misses: int
    error: str
    dims: torch.Tensor | None = None
    names: tuple[str, ...] = ()


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
            # Unbuffered: readall reads to the end of the file straight into its bytes, half the CPU
            # of Path.read_bytes (no buffer object, fewer system calls) for a photo read once.
            with open(os.path.join(self.root, t.names[i]), "rb", buffering=0) as f:
                return f.read()
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

    def pixels(self, i: int) -> torch.Tensor:
        """Sample i's whole image, uint8 (C, H, W): from the store, or decoded; Undecodable naming its file."""
        if self.store is not None:
            return self.store.image(i)
        return self.decoded(i, lambda data: decode_whole(data, self.channels))

    def cropped(self, i: int, box_of: Callable[[int, int], Box], size: int) -> tuple[torch.Tensor, Box]:
        """Pixels of sample i that hold its box box_of(height, width) (drawn on its indexed dims),
        and the box on them: the stored image, or what decoding.decode_crop decodes for a crop
        resized to `size`."""
        dims = self.dims(i)
        box = box_of(*dims)
        if self.store is not None:
            image = self.store.image(i)
            return image, scaled(box, *image.shape[-2:], *dims)
        return self.decoded(i, lambda data: decode_crop(data, self.channels, box, *dims, size))

    def decoded(self, i: int, decode: Callable[[bytes], T]) -> T:
        data = self.read(i)  # a missing file or an unreadable store is not the image's fault
        try:
            return decode(data)
        except Exception as e:  # noqa: BLE001 - any decoder failure is this file's problem, said in one line
            raise Undecodable(broken_message(self.name(i), e, not self.skip)) from None

    def render(self, i: int, out: torch.Tensor, box_of: Callable[[int, int], Box] | None) -> None:
        """Sample i into `out` (C, S, S): the box box_of(height, width) of its whole image resized
        to S, or (box_of None) the image as it is, which must be S x S."""
        if box_of is not None:
            image, box = self.cropped(i, box_of, out.shape[-1])
            resized_crop(image, box, out.shape[-1], out, self.view.interpolation)
            return
        image = self.pixels(i)
        height, width = image.shape[-2:]
        if tuple(image.shape) == tuple(out.shape):
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
        names: tuple[str, ...] = ()
        try:
            if request.whole:
                images, labels, dims = self.whole(request, skipped)
            elif request.encoded:
                images, labels, dims, names = self.encoded(request, skipped)
            else:
                images, labels, dims = (*self.made(request, skipped), None)
            error = ""
        except UserError as e:
            images, labels, dims = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int64), None
            error = str(e)
        except OSError as e:  # a file gone or unreadable since the set was indexed
            images, labels, dims = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int64), None
            error = (f"{e.filename or self.root}: {e.strerror or e}; the data changed while it was read: restore it "
                     "and run again")
        counts = (self.cache.hits - hits, self.cache.misses - misses) if self.cache else (0, 0)
        return Batch(images, labels, skipped, *counts, error, dims, names)

    def made(self, request: Request, skipped: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's images written into one preallocated uint8 tensor, and their labels."""
        draws, side = request.draws, self.view.side
        train_crops = draws is not None and self.augment == "resized-crop-flip"
        # Channels-last: the resize writes each row where it lies, and the rank's Normalizer reads
        # the batch in the model's default layout (0.4 ms an image less there than from CHW).
        out = torch.empty(len(request.indices), self.channels, side, side, dtype=torch.uint8,
                          memory_format=torch.channels_last)
        labels = []
        for k, i in enumerate(request.indices):
            if train_crops:
                box_of = functools.partial(train_box, draws.seed, draws.epoch, draws.step, request.positions[k])
            else:
                box_of = functools.partial(_view_box, self.view) if self.view.short else None
            labels.append(self.label(self.decodable_from(i, skipped, out[k], box_of)))
        if draws is not None:
            self.augmented(out, request)
        return out, torch.tensor(labels, dtype=torch.int64)

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
            j = self.decodable_from(i, skipped, lambda k, kept=holder: kept.append(self.pixels(k)), None)
            image = bounded(holder[0], request.whole)
            images.append(image.flatten())
            labels.append(self.label(j))
            dims.append([*image.shape[-2:], *self.dims(j)])
        return torch.cat(images), torch.tensor(labels, dtype=torch.int64), torch.tensor(dims, dtype=torch.int64)

    def encoded(self, request: Request, skipped: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       tuple[str, ...]]:
        """--decode gpu's share: each sample's JPEG bytes, end to end, with its (bytes, height,
        width) from its header; nothing is decoded here. A sample whose header does not read is
        passed over as one that does not decode (with skip: the next one that does)."""
        files: list[tuple[bytes, tuple[int, int]]] = []
        used = [self.decodable_from(i, skipped, lambda k: files.append(self.jpeg(k)), None) for i in request.indices]
        dims = torch.tensor([[len(data), height, width] for data, (height, width) in files], dtype=torch.int64)
        images = torch.frombuffer(bytearray(b"".join(data for data, _ in files)), dtype=torch.uint8)
        return images, torch.tensor([self.label(j) for j in used], dtype=torch.int64), dims, \
            tuple(self.name(j) for j in used)

    def jpeg(self, i: int) -> tuple[bytes, tuple[int, int]]:
        """Sample i's bytes and (height, width); Undecodable where its header does not read."""
        data = self.read(i)
        if not is_jpeg(data):  # the index said every image is a JPEG: the file changed since
            raise UserError(f"{self.name(i)} is not a JPEG, and --decode gpu decodes JPEGs only (nvJPEG); pass "
                            "--decode cpu, or convert the set to JPEG shards (python -m common.shards SRC DEST)")
        try:
            (width, height), *_ = header(data)
        except Exception as e:  # noqa: BLE001 - any header failure is this file's problem, said in one line
            raise Undecodable(broken_message(self.name(i), e, not self.skip)) from None
        return data, (height, width)

    def label(self, i: int) -> int:
        return self.store.label(i) if self.store is not None else int(self.table.labels[i])

    def decodable_from(self, i: int, skipped: list[str], out: torch.Tensor | Callable[[int], None],
                       box_of: Callable[[int, int], Box] | None) -> int:
        """Sample i made into `out` (a callable: out(i) makes and keeps it); with skip, if i does not
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

    def try_image(self, i: int, out: torch.Tensor | Callable[[int], None],
                  box_of: Callable[[int, int], Box] | None) -> bool:
        """Sample i made into `out`; False if it is known or found not to decode (with skip: else one line)."""
        if i in self.after:
            return False
        try:
            if callable(out):
                out(i)
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


def cores_per_rank(local_world_size: int) -> int:
    """The cores this process may run on, shared by the node's ranks: at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(local_world_size, 1))


def default_workers(local_world_size: int) -> int:
    """DataLoader workers per rank: the node's cores shared by its ranks, one kept for the rank's
    own process, at least one (decoding never blocks the step). Not capped: a GPU rank eats
    what all of its cores decode (a ResNet-50 on an H100 takes ~3,000 images/s, ~10 cores' worth)."""
    return max(1, cores_per_rank(local_world_size) - 1)


def batches_of(source: Reader, indices: Iterable[list[int]], workers: int, pin: bool = False) -> Iterator:
    """The reader's collated batches of `indices`, in order, decoded by `workers` processes, forked
    now (before the caller starts a thread that could hold a lock at the fork). A worker that
    delivers nothing for LOADER_TIMEOUT_S (a hung file system) ends the rank."""
    loader = torch.utils.data.DataLoader(source, batch_sampler=indices, num_workers=workers, collate_fn=as_is,
                                         pin_memory=pin, prefetch_factor=4 if workers else None,
                                         timeout=LOADER_TIMEOUT_S if workers else 0)
    return _deadlined(iter(loader), source.root)


def _deadlined(batches: Iterator, root: str) -> Iterator:
    try:
        yield from batches
    except RuntimeError as e:
        if "timed out" not in str(e):
            raise
        _kill_workers(batches)
        raise UserError(f"a DataLoader worker delivered no batch of {root} in {LOADER_TIMEOUT_S:g} s: its "
                        "files or store hang; check them (a streamed set is read during training)") from None


def _kill_workers(batches: Iterator) -> None:
    """SIGKILL a timed-out loader's workers. One stuck in native code (a lock another thread held when
    it was forked) takes no SIGTERM, the rank's own handler, inherited, running only between
    bytecodes; and the rank's exit would wait for it forever (multiprocessing joins its children)."""
    if getattr(batches, "_worker_pids_set", False):  # else torch's SIGCHLD handler raises for the kill
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(batches))
        batches._worker_pids_set = False
    for worker in getattr(batches, "_workers", []):  # torch's worker processes; none without workers
        if worker.is_alive():
            worker.kill()


class Plan:
    """The batch sampler of an epoch: each batch's Request when the loader asks for it (a whole
    epoch as Python ints would cost ~36 bytes per sample in the rank); a training epoch's with its
    draws, batch k's step being draws.step + k."""

    def __init__(self, indices: list[torch.Tensor], draws: Draws | None = None, positions: Sequence[int] = (),
                 encoded: bool = False) -> None:
        self.indices, self.draws, self.positions, self.encoded = indices, draws, tuple(positions), encoded

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[Request]:
        for k in range(len(self.indices)):
            yield self[k]

    def __getitem__(self, k: int) -> Request:
        draws = self.draws._replace(step=self.draws.step + k) if self.draws else None
        return Request(self.indices[k].tolist(), self.positions, draws, encoded=self.encoded)


class Streamed:
    """A split decoded batch by batch by DataLoader workers; the same interface as Split.
    Counts what the loader met: shard cache hits and misses, and skipped files. With gpu_decode
    its training batches come from the workers as JPEG bytes, and the rank decodes, crops, flips
    and augments them on its device, drawing what the workers would (device_decode)."""

    augments = True  # its training batches come cropped, flipped and augmented from the workers (or the GPU)

    def __init__(self, source: Reader, workers: int, gpu_decode: bool = False) -> None:
        self.source, self.workers, self.gpu_decode = source, workers, gpu_decode
        self.groups = source.table.group
        self.hits = self.misses = 0
        self.skipped = Survey()  # this epoch's files that did not decode: counted, the first ones named

    def __len__(self) -> int:
        return len(self.source)

    @property
    def reads_shards(self) -> bool:
        """Training reads the set's shards (row groups), not the node's decoded copy."""
        return self.source.store is None

    @property
    def labels(self) -> torch.Tensor:
        return self.source.table.labels

    @property
    def decodes(self) -> bool:
        """Whether its workers decode each image (streamed), not read it decoded (a cached set)."""
        return self.source.store is None

    def batches(self, indices: list[torch.Tensor], device: torch.device, draws: Draws | None = None,
                positions: Sequence[int] = ()) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """uint8 images and labels of each index batch, on `device`; with draws (training), each
        row cropped and augmented by the workers as the sample at global `positions[row]`."""
        if not indices:
            return
        # The workers fork first: a fork while the prefetch thread holds a lock (fsspec's event-loop
        # lock, mid-fetch) leaves the worker's copy of that lock held forever.
        plan = Plan(indices, draws, positions, encoded=self.gpu_decode and draws is not None)
        batches = batches_of(self.source, plan, self.workers, pin=device.type == "cuda")
        prefetch, reached = self.prefetch(indices)
        ahead = DecodeAhead(batches, lambda k, batch: self.decoded(batch, plan[k], device), device,
                            LOADER_TIMEOUT_S + DECODE_MARGIN_S) if plan.encoded else None
        try:
            for step, (batch, images) in enumerate(ahead or ((batch, None) for batch in batches)):
                if batch.error:
                    raise UserError(batch.error)
                if prefetch:
                    prefetch.reached(reached[step])
                self.hits, self.misses = self.hits + batch.hits, self.misses + batch.misses
                self.skipped.skip(batch.skipped)
                yield images if ahead else to_device(batch.images, device), to_device(batch.labels, device)
        finally:
            if ahead:
                ahead.close()
            if prefetch:
                prefetch.close()

    def decoded(self, batch: Batch, request: Request, device: torch.device) -> torch.Tensor:
        """--decode gpu: the batch's JPEGs decoded on `device` in one call, each cropped and flipped
        by its global position, then --augment's policy: what the workers make of the same samples."""
        lengths, sizes = batch.dims[:, 0].tolist(), [(h, w) for h, w in batch.dims[:, 1:].tolist()]
        encoded = EncodedBatch(list(batch.images.split(lengths)), sizes, batch.labels, batch.names)
        draws = request.draws
        boxes = train_boxes(sizes, draws.seed, draws.epoch, draws.step, request.positions)
        images = decode_and_crop(encoded, boxes, self.source.view.side, self.source.channels, device,
                                 self.source.view.interpolation)
        self.source.augmented(images, request)
        return images

    def rate_per_worker(self, draws: Draws) -> float:
        """Training images one worker makes per CPU-second of this split (read, decode, crop, flip,
        policy; with gpu_decode, read the bytes and the header), measured here on RATE_SAMPLES samples
        spread over the set (not one class's), the second time they are made: the first pays each
        decoder's imports, which the samples' formats decide. At most one global batch of them: the
        draws are per position in it."""
        n = min(RATE_SAMPLES, len(self), draws.global_batch)
        request = Request([i * len(self) // n for i in range(n)], tuple(range(n)), draws, encoded=self.gpu_decode)
        self.source.__getitems__(request)
        start = time.process_time()
        batch = self.source.__getitems__(request)
        return n / max(time.process_time() - start, 1e-9) if not batch.error else math.nan

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
        counts = {"shard_cache_hits": self.hits, "shard_cache_misses": self.misses,
                  "skipped_files": self.skipped.skipped_count}
        skipped, self.skipped, self.hits, self.misses = self.skipped.skipped, Survey(), 0, 0
        return counts, skipped
