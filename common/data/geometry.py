"""Where a training or evaluation crop of an own image lies, and the crop itself, on uint8 tensors.

One home for the reference recipe's geometry (torchvision's references/classification): training
takes a RandomResizedCrop of the WHOLE image (area fraction U(0.08, 1), log aspect ratio
U(log 3/4, log 4/3), ten tries, then a centre crop clamped to the ratio range) and mirrors it
with probability 1/2; evaluation resizes the short side to S / 0.875 and takes the centre S x S.
--crop-pct and --interpolation (or the pretrained config that came with timm's weights) change
the evaluation's fraction (timm's rule then: the short side to floor(S / crop_pct)) and the filter
of both crops (bicubic instead of bilinear, as torchvision's reference and timm's train.py apply
--interpolation to the training's RandomResizedCrop too): Resampling.

Every draw of a sample comes from its own torch.Generator seeded by (seed, epoch, step, global
position in the batch): the same sample gets the same crop at any world size, worker count, or
on resume, and whichever path (CPU workers, or the rank decoding on a GPU) draws it. The box is a
Box in the source image's pixels; `resized_crop` makes the model's S x S input of it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

import torch

from common.config import INTERPOLATIONS
from common.data.augment import sample_seed
from common.data.index import SetIndex
from common.errors import UserError

SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop defaults: area fraction of the image
RATIO = (3 / 4, 4 / 3)  # ... and aspect ratio (width / height) of the box
EVAL_CROP = 0.875  # evaluation: resize the short side to S / 0.875, centre-crop S (224 of 256)
TRIES = 10
# torch's antialiased uint8 kernels (a CPU's), called with out= to write into a batch's row where it
# lies: F.interpolate has no out, and its result would be copied once more (the private names are
# those interpolate itself calls, unchanged since torch 1.11).
UINT8_RESIZE = {"bilinear": torch._C._nn._upsample_bilinear2d_aa, "bicubic": torch._C._nn._upsample_bicubic2d_aa}
# torchvision's float32 log-ratio bounds, as Python floats (exact): uniform_ takes its bounds as
# doubles, and a float made once costs nothing per sample where a 0-d tensor is converted per draw.
LOG_RATIO = tuple(torch.log(torch.tensor(RATIO)).tolist())


class Box(NamedTuple):
    """A crop of the source image in integer pixels (torchvision's (i, j, h, w) order), and
    whether the crop is mirrored left-right."""

    top: int
    left: int
    height: int
    width: int
    flip: bool = False


def sample_generator(seed: int, epoch: int, step: int, position: int) -> torch.Generator:
    """The generator of one sample's geometric draws (its box, then its flip): a function of the
    run's seed and the sample's place in the epoch's global sample stream only."""
    return torch.Generator().manual_seed(sample_seed(seed, epoch, step, position, "crop"))


def random_resized_box(g: torch.Generator, height: int, width: int, scale: tuple[float, float] = SCALE,
                       ratio: tuple[float, float] = RATIO) -> Box:
    """torchvision's `RandomResizedCrop.get_params` for a height x width image, drawn from `g`:
    from the same generator state it returns the same box, draw for draw (its float32 log-ratio
    bounds, its rounding, its ten tries, then its centre fallback clamped to the ratio range)."""
    area = height * width
    log_ratio = LOG_RATIO if ratio == RATIO else tuple(torch.log(torch.tensor(ratio)).tolist())
    draw = torch.empty(1)  # one scalar drawn into over and over: a tensor made per draw costs a microsecond each
    for _ in range(TRIES):
        target_area = area * draw.uniform_(scale[0], scale[1], generator=g).item()
        aspect = draw.uniform_(log_ratio[0], log_ratio[1], generator=g).exp_().item()
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=g).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=g).item())
            return Box(top, left, h, w)
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return Box((height - h) // 2, (width - w) // 2, h, w)


def train_box(seed: int, epoch: int, step: int, position: int, height: int, width: int) -> Box:
    """THE training crop of the sample at global `position` of step `step` of `epoch`, on its
    height x width source image: torchvision's RandomResizedCrop box, then a flip with
    probability 1/2 (the reference's RandomHorizontalFlip), both from the sample's own generator.
    Every path that trains own images (CPU workers, a GPU decoding rank) asks this function."""
    g = sample_generator(seed, epoch, step, position)
    box = random_resized_box(g, height, width)
    return box._replace(flip=bool(torch.rand(1, generator=g).item() < 0.5))


def eval_short(size: int, crop_pct: float | None = None) -> int:
    """The short side the evaluation resizes to: torchvision's reference's size / EVAL_CROP rounded
    (256 for 224) without a crop fraction; with one, timm's floor(size / crop_pct) (235 for 224 at 0.95)."""
    return round(size / EVAL_CROP) if crop_pct is None else math.floor(size / crop_pct)


def eval_box(height: int, width: int, size: int, short: int = 0) -> Box:
    """The evaluation crop: what resizing the short side to `short` (default eval_short(size),
    256 for 224) and centre-cropping size x size keeps, as a box of the source (rounded to whole
    source pixels, then resized once: one resampling instead of torchvision's two)."""
    short = short or eval_short(size)
    extent = min(height, width, max(1, round(size * min(height, width) / short)))
    return Box((height - extent) // 2, (width - extent) // 2, extent, extent)


def scaled(box: Box, height: int, width: int, source_height: int, source_width: int) -> Box:
    """A box drawn on a source_height x source_width image, on the same image held at height x
    width (a reduced JPEG decode, a cached copy bounded in size): the same region, rounded to
    whole pixels of the smaller image."""
    if (height, width) == (source_height, source_width):
        return box
    sy, sx = height / source_height, width / source_width
    top, left = min(round(box.top * sy), height - 1), min(round(box.left * sx), width - 1)
    return Box(top, left, max(1, min(round(box.height * sy), height - top)),
               max(1, min(round(box.width * sx), width - left)), box.flip)


def resized_crop(image: torch.Tensor, box: Box, size: int, out: torch.Tensor | None = None,
                 interpolation: str = "bilinear") -> torch.Tensor:
    """The box of a uint8 (C, H, W) image resized to (C, size, size) with torch's antialiased
    uint8 kernel of `interpolation` (torchvision's `v2.functional.resized_crop(..., antialias=True)`
    on the same box), mirrored if box.flip; written into `out` (a row of a preallocated batch,
    channels-last for speed: any layout is written right) if given, else a new contiguous tensor."""
    crop = image[None, :, box.top:box.top + box.height, box.left:box.left + box.width]
    if crop.device.type != "cpu":  # torch's uint8 kernels are a CPU's: float32 here, as torchvision's v2 resize
        if crop.shape[-2:] != (size, size):
            crop = to_uint8(torch.nn.functional.interpolate(crop.float(), size=(size, size), mode=interpolation,
                                                            align_corners=False, antialias=True))
        crop = crop[0].flip(-1) if box.flip else crop[0]
        return crop.contiguous() if out is None else out.copy_(crop)
    # Mirrored before the resize, in the one copy that makes the crop channels-last (the layout
    # torch's uint8 kernel reads fast; a crop of a decoded image, HWC viewed as CHW, is neither
    # layout): the kernel's taps are symmetric, so this gives the bits of a resize mirrored after
    # (torchvision's order; tests/test_geometry compares the two).
    source = (crop.flip(-1) if box.flip else crop).contiguous(memory_format=torch.channels_last)
    target = out[None] if out is not None else \
        torch.empty(1, source.shape[1], size, size, dtype=torch.uint8, memory_format=torch.channels_last)
    if source.shape[-2:] == (size, size):
        target.copy_(source)
    else:  # straight into the batch's row: no copy of the result
        UINT8_RESIZE[interpolation](source, (size, size), False, None, None, out=target)
    return target[0].contiguous() if out is None else out


def resized_crops(images: Sequence[torch.Tensor], boxes: Sequence[Box], size: int,
                  interpolation: str = "bilinear") -> torch.Tensor:
    """resized_crop of each (image, box) of a batch, one after the other: uint8 (N, C, size, size),
    channels-last (the layout the kernel writes and the rank's Normalizer reads fastest)."""
    out = torch.empty(len(images), images[0].shape[0], size, size, dtype=torch.uint8, device=images[0].device,
                      memory_format=torch.channels_last)
    for image, box, row in zip(images, boxes, out):
        resized_crop(image, box, size, row, interpolation)
    return out


def to_uint8(resized: torch.Tensor) -> torch.Tensor:
    """A float resize back to uint8 as torchvision's v2 resize does on a GPU: clamped (bicubic
    overshoots), then rounded."""
    return resized.clamp_(0, 255).round_().to(torch.uint8)


# ---------------------------------------------------------------- the batched crop (--decode gpu)

# torch's antialiased filters (UpSampleKernel.cpp, aa_filter): their reach at scale 1 (interp_size / 2),
# and the bicubic's a: PIL's -0.5 (torch's plain, not antialiased, bicubic takes -0.75)
FILTER_RADIUS = {"bilinear": 1.0, "bicubic": 2.0}
BICUBIC_A = -0.5
# A chunk's zero-padded crops hold at most this many elements: 128 MiB as float32, beside 256 MiB of
# int64 gather indices and 32 MiB of bytes (a single box beyond it is a chunk of its own; the resized
# batch, N x C x S x S float32, comes on top). A batch of 128 training crops takes two chunks on
# 500 x 375 photos, three on ImageNet's mix (30% of them up to 1024 px).
CHUNK_ELEMENTS = 2 ** 25


def batched_resized_crop(images: Sequence[torch.Tensor], boxes: Sequence[Box], size: int,
                         interpolation: str = "bilinear", chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """resized_crop of each (image, box) of a batch of uint8 (C, H_i, W_i) images, in kernels whose
    count does not grow with the batch (a GPU's crop per sample is bound by its launches): the
    chunks of resized_chunks, clamped and rounded as `resized_crop` rounds on a GPU. uint8
    (N, C, size, size) on the images' device, within a grey level of the float kernel's."""
    out = torch.empty(len(images), images[0].shape[0], size, size, dtype=torch.uint8, device=images[0].device)
    with torch.autocast(out.device.type, enabled=False):  # float32 matmuls: in bf16 a pixel is grey levels off
        for places, resized in resized_chunks(images, boxes, size, interpolation, chunk_elements):
            out.index_copy_(0, places, to_uint8(resized))
    return out


def resized_chunks(images: Sequence[torch.Tensor], boxes: Sequence[Box], size: int, interpolation: str,
                   chunk_elements: int = CHUNK_ELEMENTS) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batch's crops resized, in float32, chunk by chunk (crop_chunks): the samples' places in
    the batch and their (n, C, size, size) crops. The images are laid end to end in one buffer;
    a chunk's boxes are gathered zero-padded by one index and resized by two batched matmuls with
    the weights of torch's antialiased float kernel (filter_weights), the flip folded into the
    horizontal ones."""
    channels, device = images[0].shape[0], images[0].device
    flat = torch.cat([image.reshape(-1) for image in images] + [images[0].new_zeros(1)])  # its last byte pads
    starts = list(itertools.accumulate((image.numel() for image in images), initial=0))
    groups = crop_chunks(boxes, channels, chunk_elements)
    # one row per sample, in chunk order: its place in the batch, where it starts in `flat`, its
    # image's height and width, its box (top, left, height, width, flip)
    table = torch.tensor([[i, starts[i], *images[i].shape[-2:], *boxes[i]] for group in groups for i in group],
                         dtype=torch.int64, device=device)
    first = 0
    for group in groups:
        rows, first = table[first:first + len(group)], first + len(group)
        height, width = max(boxes[i].height for i in group), max(boxes[i].width for i in group)
        weights = filter_weights(rows[:, 6:8].T.reshape(-1), size, max(height, width), interpolation)  # both at once
        wy, wx = weights[:len(group), :, :height], weights[len(group):, :, :width]
        wx = torch.where(rows[:, 8, None, None].bool(), wx.flip(1), wx)
        yield rows[:, 0], wy[:, None] @ padded_crops(flat, rows, channels, height, width) @ wx.transpose(1, 2)[:, None]


def crop_chunks(boxes: Sequence[Box], channels: int, limit: int) -> list[list[int]]:
    """The batch's samples (their places) in groups whose zero-padded crops, channels x the group's
    tallest box x its widest, hold at most `limit` elements; largest boxes first, so that a group
    pads its boxes to sizes like their own."""
    groups: list[list[int]] = []
    height = width = 0
    for i in sorted(range(len(boxes)), key=lambda k: -boxes[k].height * boxes[k].width):
        height, width = max(height, boxes[i].height), max(width, boxes[i].width)
        if not groups or (len(groups[-1]) + 1) * channels * height * width > limit:
            groups.append([])
            height, width = boxes[i].height, boxes[i].width
        groups[-1].append(i)
    return groups


def padded_crops(flat: torch.Tensor, rows: torch.Tensor, channels: int, height: int, width: int) -> torch.Tensor:
    """Each row's box as float32 (n, channels, height, width), zero beyond the box: one gather from
    the images laid end to end in `flat` (its last element a zero)."""
    _, start, image_height, image_width, top, left, box_height, box_width, _ = rows.T[:, :, None, None, None]
    y = torch.arange(height, device=flat.device)[:, None]
    x = torch.arange(width, device=flat.device)
    c = torch.arange(channels, device=flat.device)[:, None, None]
    index = start + c * (image_height * image_width) + (top + y) * image_width + (left + x)
    return flat.take(index.masked_fill_((y >= box_height) | (x >= box_width), flat.numel() - 1)).float()


def filter_weights(lengths: torch.Tensor, size: int, taps: int, interpolation: str) -> torch.Tensor:
    """(n, size, taps) float32: row i of sample k holds the weights by which torch's antialiased
    float kernel makes output pixel i of size from a line of lengths[k] pixels (UpSampleKernel.cpp,
    _compute_weights_aa: the support widened by the downscale factor, cut at the line's ends, the
    weights normalised per output pixel); taps beyond the line weigh 0. The scale and the centres
    are torch's float32 ones (they decide which taps count), the weights computed from them in
    float64 and rounded once: torch's float32 weights are within 5e-7 of them."""
    length = lengths.float()[:, None, None]
    scale = length / size
    center = (scale * (torch.arange(size, dtype=torch.float32, device=lengths.device)[:, None] + 0.5)).double()
    stretch = scale.double().clamp(min=1)  # antialiasing: a downscale widens the filter by its factor
    support = FILTER_RADIUS[interpolation] * stretch
    j = torch.arange(taps, dtype=torch.float64, device=lengths.device)
    inside = (j >= (center - support + 0.5).floor()) & (j < torch.minimum((center + support + 0.5).floor(), length))
    weights = aa_filter((j - center + 0.5) / stretch, interpolation) * inside
    return (weights / weights.sum(-1, keepdim=True)).float()


def aa_filter(x: torch.Tensor, interpolation: str) -> torch.Tensor:
    """torch's antialiased filter of `interpolation` at distances x (in the filter's units)."""
    x = x.abs()
    if interpolation == "bilinear":
        return (1 - x).clamp_(min=0)
    a = BICUBIC_A
    return torch.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                       torch.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


# ---------------------------------------------------------------- a set's geometry

WHOLE_SIDE = 2  # a cached training image keeps its long side within this many times the evaluation's short side
GRAY_MODES = ("1", "L", "I", "F")  # modes (and I;16 and its kin) whose images train with one channel


@dataclass(frozen=True)
class Resampling:
    """How own images become the model's input at --image-size S: the evaluation's crop fraction
    (None: torchvision's reference's S / 0.875, rounded) and the filter of both crops, and why
    (the banner's words)."""

    crop_pct: float | None = None
    interpolation: str = "bilinear"
    why: str = "torchvision's reference recipe (--crop-pct, --interpolation choose otherwise)"

    def short(self, size: int) -> int:
        return eval_short(size, self.crop_pct)

    def describe(self, size: int) -> str:
        fraction = f"crop fraction {self.crop_pct:g}" if self.crop_pct is not None else f"{size} / {EVAL_CROP}"
        return (f"evaluation on the centre {size} of the short side resized to {self.short(size)} ({fraction}), "
                f"{self.interpolation} for it and for the training crops: {self.why}")


def choose_resampling(crop_pct: float | None, interpolation: str | None, pretrained: dict[str, Any] | None,
                      ) -> Resampling:
    """--crop-pct and --interpolation where given; else what the pretrained config that came with
    --weights says (timm's: as timm evaluates those weights, as --normalization auto takes their
    mean and std); else torchvision's reference. A pretrained config this suite cannot follow
    (timm's squash or border crop, a fraction above 1, another filter) stops with the flags that
    choose instead."""
    flags = {"crop_pct": crop_pct, "interpolation": interpolation}
    taken = {key: value for key, value in (pretrained or {}).items() if key in flags and flags[key] is None
             and value is not None}
    source = (pretrained or {}).get("source", "the weights' pretrained config")
    mode = (pretrained or {}).get("crop_mode", "center")
    if "crop_pct" in taken and (mode != "center" or not 0 < taken["crop_pct"] <= 1):
        raise UserError(f"--weights: {source} evaluates with crop_pct {taken['crop_pct']}, crop_mode {mode}, and this "
                        "suite takes the centre of the short side resized (crop_mode center, a fraction up to 1): "
                        "pass --crop-pct F to evaluate that way (e.g. --crop-pct 1)")
    if taken.get("interpolation", "bilinear") not in INTERPOLATIONS:
        raise UserError(f"--weights: {source} resizes with {taken['interpolation']!r}; pass --interpolation "
                        f"{' or '.join(INTERPOLATIONS)}")
    reasons = [f"--{key.replace('_', '-')} {value}" for key, value in flags.items() if value is not None]
    if taken:
        reasons.append(f"{', '.join(f'{key} {value}' for key, value in taken.items())} from {source}, as timm "
                       "evaluates those weights")
    chosen = {**flags, **taken}
    return Resampling(chosen["crop_pct"], chosen["interpolation"] or "bilinear",
                      "; ".join(reasons) + " (--crop-pct, --interpolation choose otherwise)" if reasons
                      else Resampling.why)


@dataclass(frozen=True)
class Stored:
    """A fixed view of an image: `side` x `side` pixels, after resizing its short side to `short`
    and centre-cropping (short 0: as it is, and it must be side x side). `whole` > 0: the split
    trains on random-resized crops of the whole image, and a cached copy keeps the whole image
    with its long side at most `whole` (the view then serves only its statistics). Both crops
    resize with `interpolation`."""

    side: int
    short: int = 0
    whole: int = 0
    interpolation: str = "bilinear"


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
                f"resized to {self.test.short}, {self.test.interpolation}")


# ---------------------------------------------------------------- geometry

def choose_geometry(index: SetIndex, image_size: int, resampling: Resampling | None = None) -> Geometry:
    channels = 1 if all(mode.split(";")[0] in GRAY_MODES for mode in index.modes) else 3
    if image_size:
        resampling = resampling or Resampling()
        short, interpolation = resampling.short(image_size), resampling.interpolation
        return Geometry(channels, Stored(image_size, short, WHOLE_SIDE * short, interpolation),
                        Stored(image_size, short, 0, interpolation), image_size, "resized-crop-flip")
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
