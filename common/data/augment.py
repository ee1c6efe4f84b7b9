"""--augment randaugment | trivialaugment | autoaugment and --random-erase P: torchvision's own
transforms, applied one sample at a time with each sample's draws seeded from (seed, epoch, step,
its position in the global batch), so every sample is augmented the same at any world size, any
worker count and on resume.

The policies draw their ops and magnitudes from a per-sample torch.Generator (Policy) and apply
torchvision's ops; random erasing draws its box from one too (Eraser) and fills it in place. No
global random state is touched, so dropout's reseeding (common/train/step.py) sees what it would
without them.
"""
from __future__ import annotations

import argparse
import hashlib
import math
from typing import Any, Callable, NamedTuple, Sequence

import torch

AUGMENTS = ("basic", "randaugment", "trivialaugment", "autoaugment")  # --augment
ERASE_SCALE = (0.02, 0.33)  # torchvision's RandomErasing defaults: area fraction and aspect ratio of the box
ERASE_RATIO = (0.3, 3.3)
PIL_MODES = {1: "L", 3: "RGB"}  # channels -> the PIL mode the policy's ops run in on the CPU


class Draws(NamedTuple):
    """What a training batch's random draws are a function of (never the rank or the worker); the
    step is the first batch's where a run of batches is asked for."""

    seed: int
    epoch: int
    step: int
    global_batch: int
    augment: str  # --augment: basic | randaugment | trivialaugment | autoaugment


def add_augment_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flags of this module: the policy and the erased boxes."""
    add = group.add_argument
    add("--augment", default="basic", choices=AUGMENTS,
        help="training augmentation: basic (the data set's crop and flip), or that plus randaugment, "
             "trivialaugment or autoaugment (ImageNet policy), drawn per sample of the global batch "
             "(default: %(default)s)")
    add("--random-erase", type=float, default=0.0, metavar="P",
        help="erase a random box of each training image with probability P (default: %(default)s)")


def draw_seed(*parts: object, bits: int = 63) -> int:
    """A seed that is a function of `parts` only (the run's seed, epoch, step, ...): what every draw
    of the training stream is seeded from, so it is the same at any world size and on resume.
    bits: 63 for torch's generators; numpy's take all 64."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << bits) - 1)


def sample_seed(seed: int, epoch: int, step: int, position: int, stream: str) -> int:
    """The seed of one sample's draws in one stream ("policy", "erase"): separate streams keep the
    erased box of a sample the same whether or not a policy runs before it."""
    return draw_seed(seed, epoch, step, position, stream)


def make_policy(augment: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torchvision's policy for --augment, at the references' settings; None for basic. Imported
    here: torchvision's transforms add about a second to every rank's start-up, paid only when used."""
    if augment == "basic":
        return None
    from torchvision.transforms import v2
    policies: dict[str, Callable[[], Any]] = {
        "randaugment": lambda: v2.RandAugment(num_ops=2, magnitude=9),
        "trivialaugment": v2.TrivialAugmentWide,
        "autoaugment": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
    }
    return policies[augment]()


class Eraser:
    """torchvision's v2.RandomErasing(p, ERASE_SCALE, ERASE_RATIO, value=0): from the same generator
    state it draws what torchvision's forward draws from the global one (whether to erase, then up
    to ten tries at a box that fits), and the box is filled with 0 (the mean, on a normalized
    image) in place; a rank spends a few scalar draws per sample on it, no transform call."""

    TRIES = 10

    def __init__(self, probability: float) -> None:
        self.probability = probability
        self.log_ratio = torch.log(torch.tensor(ERASE_RATIO))  # float32, as torchvision computes it

    def box(self, g: torch.Generator, height: int, width: int) -> tuple[int, int, int, int] | None:
        """(top, left, height, width) of the erased box, or None where the image is left alone."""
        if torch.rand(1, generator=g) >= self.probability:
            return None
        for _ in range(self.TRIES):
            area = height * width * torch.empty(1).uniform_(ERASE_SCALE[0], ERASE_SCALE[1], generator=g).item()
            aspect = torch.exp(torch.empty(1).uniform_(self.log_ratio[0], self.log_ratio[1], generator=g)).item()
            h, w = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
            if h < height and w < width:
                top = int(torch.randint(0, height - h + 1, size=(1,), generator=g).item())
                left = int(torch.randint(0, width - w + 1, size=(1,), generator=g).item())
                return top, left, h, w
        return None


class Policy:
    """torchvision's policy for --augment with every draw taken from a generator the caller gives
    (one per sample, seeded from its global position), in torchvision's order: from the same
    generator state it picks the ops and magnitudes torchvision's forward picks from the global
    one, and applies them with torchvision's own ops. No global state is touched, so nothing needs
    saving and restoring around each sample."""

    def __init__(self, augment: str) -> None:
        self.transform = make_policy(augment)

    def __bool__(self) -> bool:
        return self.transform is not None

    def __call__(self, image: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """The policy on one uint8 (C, H, W) image: on the CPU through PIL, as torchvision's
        reference applies it (its ops there cost 2-5x less than the tensor ones: an affine warp
        0.2-0.4 ms against 1-2 ms at 224 px); on a GPU with torchvision's tensor ops: the same ops
        and magnitudes, not quite the same pixels (Color, Contrast and Rotate round otherwise)."""
        ops = [(op, magnitude) for op, magnitude in self.draw(g, *image.shape[-2:]) if op != "Identity"]
        if not ops:
            return image
        if image.device.type == "cpu" and image.shape[0] in PIL_MODES:
            return self._through_pil(image, ops)
        return self.apply(image, ops)

    def apply(self, image: Any, ops: list[tuple[str, float]]) -> Any:
        """torchvision's ops on a PIL image (the CPU's kernels) or a tensor (a GPU's), in order."""
        t = self.transform
        for op, magnitude in ops:
            image = t._apply_image_or_video_transform(image, op, magnitude, interpolation=t.interpolation, fill=t._fill)
        return image

    def _through_pil(self, image: torch.Tensor, ops: list[tuple[str, float]]) -> torch.Tensor:
        """One copy into a PIL image (no transpose from a channels-last row, the workers'), the
        ops, one copy out as a (C, H, W) view of the result."""
        import numpy as np
        from PIL import Image

        channels = image.shape[0]
        array = image.permute(1, 2, 0).contiguous().numpy()
        pil = Image.fromarray(array[..., 0] if channels == 1 else array, PIL_MODES[channels])
        out = torch.from_numpy(np.array(self.apply(pil, ops)))
        return out.reshape(*out.shape[:2], channels).permute(2, 0, 1)

    def draw(self, g: torch.Generator, height: int, width: int) -> list[tuple[str, float]]:
        """The (op, magnitude) pairs the policy applies, drawn as torchvision's forward draws them."""
        from torchvision.transforms import v2
        t = self.transform
        if isinstance(t, v2.AutoAugment):
            policy = t._policies[int(torch.randint(len(t._policies), (), generator=g))]
            ops = []
            for op, probability, bin_ in policy:
                if torch.rand((), generator=g) <= probability:
                    ops.append(_signed(t, op, lambda magnitudes, b=bin_: magnitudes[b], 10, height, width, g))
            return ops
        keys = tuple(t._AUGMENTATION_SPACE)
        if isinstance(t, v2.RandAugment):
            return [_signed(t, keys[int(torch.randint(len(keys), (), generator=g))], lambda m: m[t.magnitude],
                            t.num_magnitude_bins, height, width, g) for _ in range(t.num_ops)]
        op = keys[int(torch.randint(len(keys), (), generator=g))]  # TrivialAugmentWide
        return [_signed(t, op, lambda m: m[int(torch.randint(t.num_magnitude_bins, (), generator=g))],
                        t.num_magnitude_bins, height, width, g)]


def _signed(t: Any, op: str, pick: Callable[[torch.Tensor], torch.Tensor], bins: int, height: int, width: int,
            g: torch.Generator) -> tuple[str, float]:
    """op with its magnitude picked from torchvision's table, negated with probability 1/2 where
    the op is signed (drawn only then, as torchvision draws it)."""
    magnitudes_fn, signed = t._AUGMENTATION_SPACE[op]
    magnitudes = magnitudes_fn(bins, height, width)
    if magnitudes is None:
        return op, 0.0
    magnitude = float(pick(magnitudes))
    if signed and torch.rand((), generator=g) <= 0.5:
        magnitude *= -1
    return op, magnitude


def policy_generator(seed: int, epoch: int, step: int, position: int) -> torch.Generator:
    """The generator of one sample's policy draws: a function of its global position only."""
    return torch.Generator().manual_seed(sample_seed(seed, epoch, step, position, "policy"))


class SampleAugment:
    """A policy on uint8 images and random erasing on normalized ones, each sample's draws a
    function of (seed, epoch, step, global position)."""

    def __init__(self, augment: str, random_erase: float) -> None:
        self.policy = Policy(augment)
        self.eraser = Eraser(random_erase) if random_erase else None

    def apply_policy(self, images: torch.Tensor, seed: int, epoch: int, step: int,
                     positions: Sequence[int]) -> torch.Tensor:
        """The policy on each uint8 image of the batch, in place (row i is global position positions[i])."""
        if self.policy:
            for i, p in enumerate(positions):
                images[i] = self.policy(images[i], policy_generator(seed, epoch, step, p))
        return images

    def erase(self, images: torch.Tensor, seed: int, epoch: int, step: int, positions: Sequence[int]) -> torch.Tensor:
        """Random erasing, in place, on each normalized image of the batch (a slice of its row: it
        is filled where it lies, whatever the batch's memory format)."""
        if self.eraser is None:
            return images
        height, width = images.shape[-2:]
        for row, p in zip(images, positions):
            g = torch.Generator().manual_seed(sample_seed(seed, epoch, step, p, "erase"))
            box = self.eraser.box(g, height, width)
            if box is not None:
                top, left, h, w = box
                row[:, top:top + h, left:left + w] = 0
        return images
