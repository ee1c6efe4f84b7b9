"""--augment randaugment | trivialaugment | autoaugment and --random-erase P: torchvision's own
transforms, applied one sample at a time with each sample's draws seeded from (seed, epoch, step,
its position in the global batch).

torchvision's transforms draw from torch's global CPU generator. Seeding that generator per sample
from the sample's global position, not from the rank, makes every sample augmented the same at any
world size and on resume; the global state is restored afterwards, so dropout's reseeding
(common/train/step.py) sees what it would without augmentation.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import torch

ERASE_SCALE = (0.02, 0.33)  # torchvision's RandomErasing defaults: area fraction and aspect ratio of the box
ERASE_RATIO = (0.3, 3.3)


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


def make_eraser(probability: float) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torchvision's RandomErasing writing 0 (the mean, on a normalized image) into the image in
    place; None for 0."""
    if not probability:
        return None
    from torchvision.transforms import v2
    return v2.RandomErasing(p=probability, scale=ERASE_SCALE, ratio=ERASE_RATIO, value=0, inplace=True)


class SampleAugment:
    """A policy on uint8 images and random erasing on normalized ones, each sample's draws a
    function of (seed, epoch, step, global position)."""

    def __init__(self, augment: str, random_erase: float) -> None:
        self.policy = make_policy(augment)
        self.eraser = make_eraser(random_erase)

    def apply_policy(self, images: torch.Tensor, seed: int, epoch: int, step: int,
                     positions: Sequence[int]) -> torch.Tensor:
        """The policy on each image of the batch, as uint8 (row i is global position positions[i])."""
        if self.policy is None:
            return images
        seeds = [sample_seed(seed, epoch, step, p, "policy") for p in positions]
        return torch.stack(_each_seeded(self.policy, as_uint8(images), seeds))

    def erase(self, images: torch.Tensor, seed: int, epoch: int, step: int, positions: Sequence[int]) -> torch.Tensor:
        """Random erasing, in place, on each normalized image of the batch (each row a view: the
        eraser writes where it lies, whatever the batch's memory format)."""
        if self.eraser is not None:
            _each_seeded(self.eraser, images, [sample_seed(seed, epoch, step, p, "erase") for p in positions])
        return images


def as_uint8(images: torch.Tensor) -> torch.Tensor:
    """Resized crops come out as float pixel values; the policies work on uint8 images, as the
    references' do (on crops of PIL images)."""
    return images if images.dtype == torch.uint8 else images.round().clamp_(0, 255).to(torch.uint8)


def _each_seeded(transform: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor,
                 seeds: list[int]) -> list[torch.Tensor]:
    """`transform` on each image alone, torch's CPU generator seeded with the image's seed first
    (only the CPU one: torch.manual_seed would reseed the GPUs' too, which fork_rng(devices=[])
    does not restore); the generator's state is restored after."""
    with torch.random.fork_rng(devices=[]):
        out = []
        for image, seed in zip(images, seeds):
            torch.default_generator.manual_seed(seed)
            out.append(transform(image))
        return out
