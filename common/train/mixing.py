"""--mixup and --cutmix, drawn per GLOBAL batch, so the same command trains the same weights at any
world size (torchvision's and timm's draw per rank, so their results change with it).

Everything random is a function of (seed, epoch, step): the choice between mixup and cutmix, the
weight lambda and cutmix's box. The pairs come from the positions: g is mixed with g + B/2 (mod B)
of the global batch B. A rank of W holds its places in two halves (common/data/loader.py,
rank_places): its i-th row is place g, its (b/2 + i)-th g + B/2, so g's partner lies on the same
rank, b/2 rows further on (b = B/W, even): a roll of the rank's batch by b/2, with no
communication. The global batch is a fresh random sample every step, so the pairs are random pairs
(of shards and row groups, read in lanes, mostly pairs of one shard: random pairs of a set written
shuffled).
"""
from __future__ import annotations

import argparse
import math
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from common.config import Config
from common.data.augment import draw_seed

SWITCH = 0.5  # with both flags, the share of global batches that use cutmix (timm's switch_prob)


def add_mixing_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flags of Mixing."""
    add = group.add_argument
    add("--mixup", type=float, default=0.0, metavar="ALPHA",
        help="blend pairs of images and their labels by a Beta(ALPHA, ALPHA) weight, drawn per global batch "
             "(0: off; with --cutmix, one of the two per global batch)")
    add("--cutmix", type=float, default=0.0, metavar="ALPHA",
        help="paste a box of a paired image, labels weighted by its area, Beta(ALPHA, ALPHA) (0: off)")


def check_mixing_flags(p: argparse.ArgumentParser, a: argparse.Namespace, world_size: int) -> None:
    if not (0 <= a.mixup < math.inf and 0 <= a.cutmix < math.inf):
        p.error(f"--mixup and --cutmix take a Beta distribution's ALPHA > 0, or 0 for off (got {a.mixup:g}, "
                f"{a.cutmix:g})")
    per_rank = a.batch_size // world_size
    if (a.mixup or a.cutmix) and per_rank % 2:
        p.error(f"--mixup/--cutmix pair position g of each global batch with g + B/2, which stays on one rank only "
                f"when each rank's batch is even (--batch-size {a.batch_size} / {world_size} rank(s) = {per_rank}); "
                f"use a --batch-size that is a multiple of {2 * world_size}")


class Mixing:
    def __init__(self, cfg: Config, classes: int) -> None:
        self.mixup, self.cutmix, self.seed, self.classes = cfg.mixup, cfg.cutmix, cfg.seed, classes

    @property
    def on(self) -> bool:
        return bool(self.mixup or self.cutmix)

    def batches(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], epoch: int, first_step: int,
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(images, labels) -> (mixed images, class probabilities), step by step; unchanged when off."""
        for step, (images, labels) in enumerate(batches, start=first_step):
            yield self(images, labels, epoch, step) if self.on else (images, labels)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, epoch: int, step: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng(draw_seed("mix", self.seed, epoch, step, bits=64))
        use_cutmix = self.cutmix and (not self.mixup or rng.random() < SWITCH)
        lam = float(rng.beta(*(2 * [self.cutmix if use_cutmix else self.mixup])))
        half = len(images) // 2
        partner_images, partner_labels = images.roll(half, 0), labels.roll(half, 0)
        if use_cutmix:
            images, lam = self._paste(images, partner_images, lam, rng)
        else:
            images = images * lam + partner_images * (1 - lam)
        one_hot = F.one_hot(labels, self.classes).to(images.dtype)
        partner = F.one_hot(partner_labels, self.classes).to(images.dtype)
        return images, one_hot * lam + partner * (1 - lam)

    @staticmethod
    def _paste(images: torch.Tensor, partners: torch.Tensor, lam: float, rng: np.random.Generator,
               ) -> tuple[torch.Tensor, float]:
        """torchvision's RandomCutmix box: centre uniform, sides sqrt(1 - lam) of the image's, clipped
        at the edges; lambda becomes the share of the image left unpasted."""
        h, w = images.shape[-2:]
        cy, cx = int(rng.integers(h)), int(rng.integers(w))
        rh, rw = int(h * np.sqrt(1 - lam) / 2), int(w * np.sqrt(1 - lam) / 2)
        y0, y1, x0, x1 = max(cy - rh, 0), min(cy + rh, h), max(cx - rw, 0), min(cx + rw, w)
        pasted = images.clone()
        pasted[..., y0:y1, x0:x1] = partners[..., y0:y1, x0:x1]
        return pasted, 1 - (y1 - y0) * (x1 - x0) / (h * w)
