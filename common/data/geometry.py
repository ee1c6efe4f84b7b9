"""Where a training or evaluation crop of an own image lies, and the crop itself, on uint8 tensors.

One home for the reference recipe's geometry (torchvision's references/classification): training
takes a RandomResizedCrop of the WHOLE image (area fraction U(0.08, 1), log aspect ratio
U(log 3/4, log 4/3), ten tries, then a centre crop clamped to the ratio range) and mirrors it
with probability 1/2; evaluation resizes the short side to S / 0.875 and takes the centre S x S.

Every draw of a sample comes from its own torch.Generator seeded by (seed, epoch, step, global
position in the batch): the same sample gets the same crop at any world size, worker count, or
on resume, and whichever path (CPU workers, or the rank decoding on a GPU) draws it. The box is a
Box in the source image's pixels; `resized_crop` makes the model's S x S input of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from common.data.augment import sample_seed
from common.data.index import SetIndex
from common.errors import UserError

SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop defaults: area fraction of the image
RATIO = (3 / 4, 4 / 3)  # ... and aspect ratio (width / height) of the box
EVAL_CROP = 0.875  # evaluation: resize the short side to S / 0.875, centre-crop S (224 of 256)
TRIES = 10
LOG_RATIO = torch.log(torch.tensor(RATIO))  # float32, as torchvision computes it (made once, not per sample)


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
    log_ratio = LOG_RATIO if ratio == RATIO else torch.log(torch.tensor(ratio))
    for _ in range(TRIES):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=g).item()
        aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=g)).item()
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


def eval_box(height: int, width: int, size: int, short: int = 0) -> Box:
    """The evaluation crop: what resizing the short side to `short` (default size / EVAL_CROP,
    256 for 224) and centre-cropping size x size keeps, as a box of the source (rounded to whole
    source pixels, then resized once: one resampling instead of torchvision's two)."""
    short = short or round(size / EVAL_CROP)
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


def resized_crop(image: torch.Tensor, box: Box, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The box of a uint8 (C, H, W) image resized to (C, size, size) with torch's antialiased
    bilinear uint8 kernel (torchvision's `v2.functional.resized_crop(..., antialias=True)` on the
    same box), mirrored if box.flip; written into `out` (a row of a preallocated batch) if given."""
    crop = image[None, :, box.top:box.top + box.height, box.left:box.left + box.width]
    if crop.shape[-2:] != (size, size):
        crop = antialiased(crop, size)
    crop = crop[0].flip(-1) if box.flip else crop[0]
    if out is None:
        return crop.contiguous()
    out.copy_(crop)
    return out


def antialiased(crop: torch.Tensor, size: int) -> torch.Tensor:
    """A uint8 (1, C, h, w) crop resized to size x size, antialiased bilinear. The uint8 kernel is
    the CPU's alone; on a GPU the crop goes through float32 and is rounded back, as torchvision's v2
    resize does there (a grey level off the CPU's at most)."""
    if crop.device.type == "cpu":
        return torch.nn.functional.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False,
                                               antialias=True)
    resized = torch.nn.functional.interpolate(crop.float(), size=(size, size), mode="bilinear", align_corners=False,
                                              antialias=True)
    return resized.round_().clamp_(0, 255).to(torch.uint8)


# ---------------------------------------------------------------- a set's geometry

WHOLE_SIDE = 2  # a cached training image keeps its long side within this many times the evaluation's short side
GRAY_MODES = ("1", "L", "I", "F")  # modes (and I;16 and its kin) whose images train with one channel


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
