"""Data sets as in-memory uint8 tensors, per-batch normalization and augmentation, sharding.

Images stay uint8 until a batch is on its device, where it is cropped, flipped and normalized with
tensor ops (no per-sample PIL work). common/data/formats.py reads the on-disk formats, common/data/fetch.py
gets the files onto each node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from common.config import SHUFFLE_WINDOW
from common.data.augment import Draws, SampleAugment, draw_seed
from common.errors import UserError


@dataclass(frozen=True)
class DataSpec:
    channels: int
    size: int
    classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: str  # none | pad-crop-flip (random 4-px-padded crop) | resized-crop-flip (random-resized crop)


@dataclass(frozen=True)
class Expected:
    """What a trained model takes (evaluate.py: its checkpoint's): images of spec's channels and
    size, normalized by spec's mean and std, in these classes."""

    checkpoint: str
    spec: DataSpec
    classes: tuple[str, ...]

    def misfit(self, name: str, channels: int, size: int, classes: Sequence[str]) -> str | None:
        """One line saying how the set `name` differs from what the model takes; None if it fits."""
        classes = tuple(classes)
        if (channels, size, classes) == (self.spec.channels, self.spec.size, self.classes):
            return None
        mine, theirs = self.spec.channels, self.spec.size
        return (f"{name} does not fit checkpoint {self.checkpoint}: its images are {channels}x{size}x{size} in "
                f"{len(classes)} classes ({listed(classes)}), the model's {mine}x{theirs}x{theirs} in "
                f"{len(self.classes)} ({listed(self.classes)}); give a set of the same classes and shape")


def listed(names: Sequence[str]) -> str:
    return f"{', '.join(names[:5])}{', ...' * (len(names) > 5)}"


CIFAR_SPEC = DataSpec(3, 32, 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), augment="pad-crop-flip")
MNIST_SPEC = DataSpec(1, 28, 10, (0.1307,), (0.3081,), augment="none")
# The order of shards' samples (global_order), in checkpoints: 1 windows shuffled whole, 2 lanes. A
# checkpoint written mid-epoch under another continues its epoch on other samples (common/train/state.py).
ORDER_VERSION = 2


@dataclass(frozen=True)
class Split:
    images: torch.Tensor  # uint8, (N, C, H, W)
    labels: torch.Tensor  # int64, (N,)
    groups: torch.Tensor | None = None  # int64 shard of each sample, for sets read from shards

    def __len__(self) -> int:
        return len(self.labels)

    augments = False  # its training batches are cropped and augmented by TrainLoader, on the rank
    reads_shards = False  # in memory: training reads no shard (row group)

    def batches(self, indices: list[torch.Tensor], device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """uint8 images and labels of each index batch, on `device`."""
        for index in indices:
            index = index.to(self.images.device)
            yield to_device(self.images[index], device), to_device(self.labels[index], device)

    def take_counts(self) -> tuple[dict[str, float], list[str]]:
        """What the loader met since the last call (a streamed split counts shard cache hits and
        skipped files): nothing here, the set is held whole."""
        return {}, []


@dataclass(frozen=True)
class Dataset:
    name: str
    spec: DataSpec
    train: Split
    test: Split
    held: str = "in memory"  # how the banner describes where the images are kept
    class_names: tuple[str, ...] = ()  # in class-index order; none: the indices are the names
    content: str = ""  # your own data's samples (its index's hash): a run is resumed on the same; "": a built-in set

    def names(self) -> list[str]:
        """The classes' names for people (checkpoints, the confusion matrix, predict.py)."""
        if len(self.class_names) == self.spec.classes:
            return list(self.class_names)
        return [str(i) for i in range(self.spec.classes)]


# ---------------------------------------------------------------- synthetic

SHIFTS = range(-3, 4)  # pixels a synthetic image is shifted by, per axis


def make_synthetic(shape: str, train_size: int = 10000, test_size: int = 2000, seed: int = 1234,
                   noise: float = 0.35) -> Dataset:
    """Deterministic, learnable images: one smooth random template per class, randomly shifted,
    scaled in contrast and covered in noise (its standard deviation, on a 0..1 scale), so a net
    must learn shapes, not single pixels."""
    spec = CIFAR_SPEC if shape == "cifar" else MNIST_SPEC
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(spec.classes, spec.channels, 4, 4, generator=g)
    templates = torch.nn.functional.interpolate(coarse, size=spec.size, mode="bilinear", align_corners=False)

    # every template at every shift, once: an image is then one row of this table (every rank
    # builds the set at start-up, so it is computed in whole-tensor, in-place passes)
    shifted = torch.stack([templates.roll((dy, dx), dims=(2, 3)) for dy in SHIFTS for dx in SHIFTS])

    def split(n: int) -> Split:
        labels = torch.randint(0, spec.classes, (n,), generator=g)
        shifts = torch.randint(SHIFTS[0], SHIFTS[-1] + 1, (n, 2), generator=g) - SHIFTS[0]
        images = shifted[shifts[:, 0] * len(SHIFTS) + shifts[:, 1], labels]
        contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=g)
        grain = torch.randn(images.shape, generator=g).mul_(noise)
        noisy = images.sub_(0.5).mul_(0.3).mul_(contrast).add_(0.5).add_(grain)  # 0.5 + 0.3 (x - 0.5) c + noise
        return Split(noisy.clamp_(0, 1).mul_(255).round_().to(torch.uint8), labels)

    return Dataset(f"synthetic-{shape}", spec, split(train_size), split(test_size))


# ---------------------------------------------------------------- batches on the device

def _batch_generator(seed: int, epoch: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(draw_seed(seed, epoch, step))


def pad_crop_draws(seed: int, epoch: int, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch's pad-crop shifts (0..8 per axis) and flips, drawn from (seed, epoch, step):
    row p is the sample at global position p, whichever rank or worker crops it."""
    g = _batch_generator(seed, epoch, step)
    return torch.randint(0, 9, (global_batch, 2), generator=g), torch.rand(global_batch, generator=g) < 0.5


def crop_and_flip(images: torch.Tensor, shifts: torch.Tensor, flips: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """Random-crop from a zero-padded image (shift in 0..2*pad per axis) and mirror, for a whole batch."""
    n, c, h, w = images.shape
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    rows = (shifts[:, 0, None] + torch.arange(h, device=images.device))[:, None, :, None]
    cols = shifts[:, 1, None] + torch.arange(w, device=images.device)
    cols = torch.where(flips[:, None], cols.flip(1), cols)[:, None, None, :]
    batch = torch.arange(n, device=images.device)[:, None, None, None]
    chans = torch.arange(c, device=images.device)[None, :, None, None]
    return padded[batch, chans, rows, cols]


def on_device(split: Split, device: torch.device) -> Split:
    """The split where its batches are used. On a GPU a set that takes at most a quarter of its free
    memory (uint8: 47 MB for MNIST, 150 MB for CIFAR-10) is copied over once, from pinned memory
    without blocking, so no batch crosses the bus; a larger one, and every set on the CPU, stays
    where it is (a node's cache maps it) and each batch is copied."""
    if device.type != "cuda" or not isinstance(split, Split) or \
            split.images.nbytes > torch.cuda.mem_get_info(device)[0] // 4:
        return split
    return Split(split.images.pin_memory().to(device, non_blocking=True),
                 split.labels.pin_memory().to(device, non_blocking=True), split.groups)


def global_order(size: int, seed: int, epoch: int, groups: torch.Tensor | None = None,
                 lanes: int = SHUFFLE_WINDOW) -> torch.Tensor:
    """The epoch's order of all samples, the same at every world size: DistributedSampler's
    permutation; for shards (and row groups), the shards shuffled and taken `lanes` (K) at a time,
    so a bounded cache of shards serves the reads. A window's shards are dealt into K lanes: the
    sample at place i of the epoch is from lane i mod K, lane k holding the window's k-th shard, its
    samples shuffled; so every batch mixes the window's shards evenly, and (K dividing the global
    batch) the places of a node (rank_places: those equal to n mod N) read only the lanes equal to
    n mod gcd(N, K), at every step: its ranks fetch and decompress those shards, no others."""
    g = torch.Generator().manual_seed(seed + epoch)  # DistributedSampler's seeding
    if groups is None:
        return torch.randperm(size, generator=g)
    by_group = torch.argsort(groups, stable=True).split(torch.bincount(groups).tolist())
    shards = torch.randperm(len(by_group), generator=g).tolist()
    windows, start = [], 0
    for w in range(0, len(shards), lanes):
        window = [by_group[s] for s in shards[w:w + lanes]]
        windows.append(dealt_into_lanes(window, start, g, lanes))
        start += len(windows[-1])
    return torch.cat(windows)


def dealt_into_lanes(window: list[torch.Tensor], start: int, g: torch.Generator, lanes: int) -> torch.Tensor:
    """A window's samples in the epoch's order from its place `start` on: place i holds a sample of
    lane i mod `lanes`, lane k the window's k-th shard's samples, shuffled. Shards of unequal sizes
    (and a last window of fewer) fill their lanes' places unevenly: a lane's samples beyond its
    places fill the places other lanes lack (a shard read there too, for those samples)."""
    size = sum(len(shard) for shard in window)
    # min: a window of fewer samples than lanes (a last shard of 1) leaves a lane no place
    places = [torch.arange(min((lane - start) % lanes, size), size, lanes) for lane in range(lanes)]
    shuffled = [shard[torch.randperm(len(shard), generator=g)] for shard in window]
    dealt = shuffled + [torch.zeros(0, dtype=torch.int64)] * (lanes - len(window))
    spare = torch.cat([lane[len(mine):] for lane, mine in zip(dealt, places)])
    order, lent = torch.empty(size, dtype=torch.int64), 0
    for lane, mine in zip(dealt, places):
        short = max(0, len(mine) - len(lane))
        order[mine] = torch.cat([lane[:len(mine)], spare[lent:lent + short]])
        lent += short
    return order


def nodes_per_shard(nodes: int, lanes: int, global_batch: int) -> int:
    """How many of N nodes read each shard (row group) of an epoch, lent samples aside (global_order):
    N / gcd(N, K) where K lanes divide the global batch (a place keeps its lane from step to step),
    else every node."""
    return nodes // math.gcd(nodes, lanes) if global_batch % lanes == 0 else nodes


def shared_reads_notice(nodes: int, lanes: int, global_batch: int) -> str:
    """A line for a run on shards or row groups whose nodes read each other's (nodes_per_shard > 1),
    naming a lane count that would give each node its own; "" where each node reads its own."""
    readers = nodes_per_shard(nodes, lanes, global_batch)
    if readers == 1:
        return ""
    # N divides the global batch (whole ranks per node, whole samples per rank), so N itself fits;
    # a multiple of at least the default keeps each batch mixing as many shards.
    fits = [k for k in range(nodes, 8 * nodes + 1, nodes) if global_batch % k == 0]
    lanes_for_nodes = next((k for k in fits if k >= SHUFFLE_WINDOW), fits[0])
    return (f"each shard (row group) is read by {readers} of the {nodes} nodes (--shard-lanes {lanes}): "
            f"--shard-lanes {lanes_for_nodes} (a multiple of the node count that divides the global batch "
            f"{global_batch}) would have each node read only its own, each batch mixing {lanes_for_nodes} of them; "
            "it changes the sample order, and a checkpoint cut mid-epoch resumes only with the lanes it was "
            "written with")


def rank_places(rank: int, world_size: int, nodes: int, global_batch: int) -> tuple[int, ...]:
    """This rank's places in each global batch (its rows' positions), the ranks' places one partition.
    Node n of N takes the places n mod N: where K lanes divide the global batch, a node's places read
    K / gcd(N, K) of a window's K lanes (global_order), so its ranks fetch and decompress only those
    shards or row groups. Its L ranks take consecutive runs of the node's places, which cycle through
    the node's lanes (a rank's batch mixes every shard its node reads); in two halves where a rank's
    share is even, so place g and its mixing partner g + B/2 stay on one rank (common/train/mixing.py)."""
    nodes = nodes if nodes > 1 and world_size % nodes == 0 else 1
    node, local = divmod(rank, world_size // nodes)
    mine, share = range(node, global_batch, nodes), global_batch // world_size
    if share % 2:
        return tuple(mine[local * share:(local + 1) * share])
    half, middle = share // 2, len(mine) // 2
    return (*mine[local * half:(local + 1) * half], *mine[middle + local * half:middle + (local + 1) * half])


class Normalizer:
    """uint8 images -> normalized float, in the layout the model wants (channels_last for conv nets):
    (x / 255 - mean) / std as x * scale + shift, in place on one float copy, not a float copy per
    arithmetic step."""

    def __init__(self, spec: DataSpec, device: torch.device, memory_format: torch.memory_format) -> None:
        std = torch.tensor(spec.std, dtype=torch.float64)
        self.scale = (1 / (255 * std)).float().to(device).view(1, -1, 1, 1)
        self.shift = (-torch.tensor(spec.mean, dtype=torch.float64) / std).float().to(device).view(1, -1, 1, 1)
        self.memory_format = memory_format

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        # In the batch's own layout (a broadcast multiply-add is twice as fast there on a CPU as into
        # channels_last, and torch's uint8 * float addcmul slower still), then the model's layout.
        out = images.to(torch.float32, copy=True)  # copy: never the caller's tensor, even a float one
        return out.mul_(self.scale).add_(self.shift).contiguous(memory_format=self.memory_format)


class TrainLoader:
    """This rank's share of each global batch, in DistributedSampler order.

    Each rank of W takes B/W places of every global batch (rank_places: the ranks' places one
    partition), so its batches make global batch k exactly perm[k*B:(k+1)*B] at every W.
    Augmentation is drawn for the whole global batch from (seed, epoch, step) and sliced the same
    way, so every sample is cropped and flipped the same whatever the world size: training is one
    sample stream, independent of W. --augment's policies and --random-erase draw per sample from
    its global position (common/data/augment.py), so they too.
    A split that makes its training batches itself (own images: DataLoader workers crop, flip and
    apply the policy on uint8, with the same draws) is handed the draws; the rank then only
    normalizes and erases.
    """

    def __init__(self, split: Split, spec: DataSpec, global_batch: int, rank: int, world_size: int,
                 seed: int, device: torch.device, max_steps: int = 0,
                 memory_format: torch.memory_format = torch.contiguous_format, augment: str = "basic",
                 random_erase: float = 0.0, nodes: int = 1, lanes: int = SHUFFLE_WINDOW) -> None:
        full_steps = len(split) // global_batch
        if full_steps == 0:
            raise UserError(f"--batch-size {global_batch} is larger than the training set ({len(split)} images)")
        self.split, self.spec, self.device = on_device(split, device), spec, device
        self.global_batch, self.seed = global_batch, seed
        self.steps_per_epoch = min(full_steps, max_steps) if max_steps else full_steps
        self.normalize = Normalizer(spec, device, memory_format)
        self.per_sample = SampleAugment(augment, random_erase)
        self.augment = augment
        self.positions = rank_places(rank, world_size, nodes, global_batch)  # its rows' places in a global batch
        self.lanes = lanes  # a set of shards: how many of them each window of the epoch deals (global_order)
        self.places = torch.tensor(self.positions, dtype=torch.int64)
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its global order), for label_scale

    def order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, global_order(len(self.split), self.seed, epoch, self.split.groups, self.lanes))
        return self._order[1]

    def label_scale(self, weights: torch.Tensor | None, epoch: int, step: int) -> float:
        """The global batch's size over its total class weight (--class-weights; 1 without): what
        every rank scales its weighted loss sum by, from the set's labels as indexed (no
        communication: each rank knows the whole global batch's indices). A sample --skip-broken
        replaces keeps its own label's weight here, at every world size alike."""
        if weights is None:
            return 1.0
        b = self.global_batch
        labels = torch.as_tensor(self.split.labels).cpu()[self.order(epoch)[step * b:(step + 1) * b]]
        return b / float(weights.cpu()[labels].sum())

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Global batch k is order[k*B:(k+1)*B]; this rank takes the samples at its places of it."""
        indices = self.indices(epoch, start_step)
        if self.split.augments:
            draws = Draws(self.seed, epoch, start_step, self.global_batch, self.augment)
            for step, (images, labels) in enumerate(self.split.batches(indices, self.device, draws, self.positions),
                                                    start=start_step):
                yield self.per_sample.erase(self.normalize(images), self.seed, epoch, step, self.positions), labels
            return
        for step, (images, labels) in enumerate(self.split.batches(indices, self.device), start=start_step):
            yield self._transform(images, epoch, step), labels

    def indices(self, epoch: int, start_step: int = 0) -> list[torch.Tensor]:
        """This rank's samples of each step of the epoch from start_step on: its places of each global batch."""
        order, b = self.order(epoch), self.global_batch
        return [order[step * b + self.places] for step in range(start_step, self.steps_per_epoch)]

    def _transform(self, images: torch.Tensor, epoch: int, step: int) -> torch.Tensor:
        """The data set's crop and flip, then --augment's policy on uint8 images, normalization and
        --random-erase: every draw a function of (seed, epoch, step, global position)."""
        cropped = self.per_sample.apply_policy(self._crop_and_flip(images, epoch, step), self.seed, epoch, step,
                                               self.positions)
        return self.per_sample.erase(self.normalize(cropped), self.seed, epoch, step, self.positions)

    def _crop_and_flip(self, images: torch.Tensor, epoch: int, step: int) -> torch.Tensor:
        """Augmentation drawn for the whole global batch from (seed, epoch, step), then this rank's rows."""
        if self.spec.augment == "none":
            return images
        if self.spec.augment != "pad-crop-flip":  # own images' crops are cut from the whole image, in workers
            raise ValueError(f"an in-memory split cannot be trained with {self.spec.augment}")
        shifts, flips = pad_crop_draws(self.seed, epoch, step, self.global_batch)
        return crop_and_flip(images, to_device(shifts[self.places], images.device),
                             to_device(flips[self.places], images.device))


def eval_shard(size: int, rank: int, world_size: int) -> torch.Tensor:
    """Contiguous, unpadded shard: every test sample belongs to exactly one rank
    (DistributedSampler would pad with duplicates and skew the accuracy)."""
    return torch.tensor_split(torch.arange(size), world_size)[rank]


def eval_batches(split: Split, spec: DataSpec, rank: int, world_size: int, batch: int, device: torch.device,
                 memory_format: torch.memory_format = torch.contiguous_format, equal_counts: bool = False,
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's shard in batches; with equal_counts, padded with empty batches to as many
    batches as the largest shard has (shards differ by at most one sample)."""
    normalize = Normalizer(spec, device, memory_format)
    indices = list(eval_shard(len(split), rank, world_size).split(batch))
    if equal_counts:
        most = -(-len(eval_shard(len(split), 0, world_size)) // batch)  # shard 0 is never the smaller one
        indices += [torch.zeros(0, dtype=torch.int64)] * (most - len(indices))
    for images, labels in split.batches(indices, device):
        yield normalize(images), labels


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device`; from the host to a GPU without waiting: from pageable memory a copy
    blocks until the GPU has caught up with everything queued before it, every step; from pinned
    memory it does not. One already on a GPU (a set held there: on_device) is not pinned: it cannot be."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
