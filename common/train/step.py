"""One optimizer step, written once for every strategy and recipe: micro-batches, mixed precision
(common/train/precision.py), the strategy's synchronization and the update; the clock that splits the
step's time."""
from __future__ import annotations

import argparse
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.config import Config
from common.errors import UserError
from common.train.precision import Precision
from common.train.strategy import Strategy

DATA, COMPUTE, SYNC = range(3)


def add_step_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flag of how a step splits its batch (StepRecipe's micro-batches)."""
    group.add_argument("--accumulate", type=int, default=1, metavar="N",
                       help="micro-batches per optimizer step, gradients synchronized once per step; the global "
                            "batch stays --batch-size (default: %(default)s)")


def check_step_flags(p: argparse.ArgumentParser, a: argparse.Namespace, world_size: int) -> None:
    per_rank = a.batch_size // world_size
    if a.accumulate < 1:
        p.error(f"--accumulate must be >= 1 (got {a.accumulate})")
    if per_rank % a.accumulate:
        p.error(f"--accumulate {a.accumulate}: each rank's batch (--batch-size {a.batch_size} / {world_size} rank(s) = "
                f"{per_rank}) does not split into {a.accumulate} equal micro-batches; use a divisor of {per_rank} "
                "or another --batch-size")


def add_loss_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flags of the loss and the update (cross_entropy, clip_gradients)."""
    add = group.add_argument
    add("--label-smoothing", type=float, default=0.0, metavar="X",
        help="cross-entropy against (1 - X) on the label and X spread over every class (default: %(default)s)")
    add("--class-weights", default="", metavar="balanced|FILE",
        help="weight the loss by class, for an imbalanced set: balanced (the inverse class frequency of the training "
             "split, n / (classes x count), as scikit-learn's), or FILE of one weight per line in class order (also "
             "W1,W2,... inline); the weighted mean over the global batch, as CrossEntropyLoss(weight=...) at any "
             "world size (default: none)")
    add("--clip-grad-norm", type=float, default=None, metavar="MAX",
        help="scale the synchronized gradient down to this global L2 norm when above it")


def check_loss_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--class-weights FILE or W1,W2,... becomes the numbers themselves (read_class_weights)."""
    if a.class_weights not in ("", "balanced"):
        a.class_weights = read_class_weights(p, a.class_weights)
    if a.clip_grad_norm is not None and not 0 < a.clip_grad_norm < math.inf:
        p.error(f"--clip-grad-norm must be > 0 (got {a.clip_grad_norm:g}); leave it out for no clipping")


def read_class_weights(p: argparse.ArgumentParser, flag: str) -> str:
    """--class-weights FILE (one weight per line) or W1,W2,...: the weights as W1,W2,... (what the
    run's identity and checkpoint keep: a changed file is another run). Each > 0 and finite."""
    text = flag
    if os.path.isfile(flag):
        try:
            text = ",".join(line.strip() for line in open(flag).read().splitlines() if line.strip())
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"--class-weights {flag}: reading it failed ({e}); give a text file of one weight per line")
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        p.error(f"--class-weights {flag}: neither balanced, nor a file, nor numbers W1,W2,...; give balanced or a "
                "FILE of one weight per line in class order")
    if not all(0 < w < math.inf for w in weights):
        p.error(f"--class-weights {flag}: every weight must be > 0 and finite (got {','.join(map(str, weights))})")
    return ",".join(map(repr, weights))


class StepClock:
    """Splits each step into data, compute (forward, backward, update) and exposed sync time. On
    CUDA it records events and reads them only when the figures are taken (at log intervals and
    epoch ends): synchronizing at every phase would serialize the CPU and the GPU and hide exactly
    the overlap the strategies exist for."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.interval = [0.0, 0.0, 0.0, 0]  # seconds per phase, steps
        self.pending: list[tuple[int, Any, Any]] = []  # CUDA: (phase, start event, end event)
        self.restart()

    def restart(self) -> None:
        self.last = self._mark()

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self, phase: int) -> None:
        now = self._mark()
        if self.cuda:
            self.pending.append((phase, self.last, now))
        else:
            self._add(phase, now - self.last)
        self.last = now

    def _add(self, phase: int, seconds: float) -> None:
        self.interval[phase] += seconds

    def end_step(self) -> None:
        self.interval[3] += 1

    def settle(self) -> None:
        """Read the recorded CUDA events (waits for the GPU)."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for phase, start, end in self.pending:
                self._add(phase, start.elapsed_time(end) / 1000)
            self.pending.clear()

    def take_interval(self) -> list[float]:
        self.settle()
        totals, self.interval = self.interval, [0.0, 0.0, 0.0, 0]
        return totals


@dataclass(frozen=True)
class StepRecipe:
    """What one optimizer step does besides the strategy's synchronization: micro-batches, the loss's
    label smoothing and class weights, and clipping of the synchronized gradient."""

    accumulate: int = 1
    label_smoothing: float = 0.0
    clip_grad_norm: float | None = None
    class_weights: torch.Tensor | None = None  # --class-weights, on the rank's device

    @classmethod
    def of(cls, cfg: Config, class_weights: torch.Tensor | None = None) -> StepRecipe:
        return cls(cfg.accumulate, cfg.label_smoothing, cfg.clip_grad_norm, class_weights)


def class_weights(choice: str, labels: torch.Tensor, classes: int) -> torch.Tensor | None:
    """--class-weights as one float64 weight per class (None without it): balanced, sklearn's
    inverse class frequency of the training split, n / (classes x count); or the flag's numbers."""
    if not choice:
        return None
    if choice != "balanced":
        weights = torch.tensor([float(w) for w in choice.split(",")], dtype=torch.float64)
        if len(weights) != classes:
            raise UserError(f"--class-weights gives {len(weights)} weight(s) and the data set has {classes} classes; "
                            "give one per class, in class order")
        return weights
    counts = torch.bincount(torch.as_tensor(labels, dtype=torch.int64).cpu(), minlength=classes).double()
    if missing := (counts == 0).nonzero().flatten().tolist():
        raise UserError(f"--class-weights balanced: class(es) {', '.join(map(str, missing[:5]))} have no training "
                        "images, so their frequency cannot be inverted; give a FILE of one weight per class")
    return counts.sum() / (classes * counts)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, recipe: StepRecipe, label_scale: float) -> torch.Tensor:
    """The micro-batch's loss, as a mean over its rows that the step's averaging over micro-batches and
    ranks turns into the global batch's loss. With class weights and class indices, torch's weighted
    mean divides by the batch's total weight, not the row count: here the rows' weighted sum times
    label_scale (the global batch's size over its total weight, TrainLoader.label_scale) over the
    row count, so the whole step is torch's CrossEntropyLoss(weight=...) of the global batch at any
    world size. With class probabilities (mixup, cutmix) torch's weighted mean is over the rows."""
    weight, smoothing = recipe.class_weights, recipe.label_smoothing
    weight = None if weight is None else weight.float()  # what cross_entropy computes in, autocast or not
    if weight is None or targets.ndim > 1:
        return F.cross_entropy(logits, targets, weight=weight, label_smoothing=smoothing)
    total = F.cross_entropy(logits, targets, weight=weight, label_smoothing=smoothing, reduction="sum")
    return total * (label_scale / len(targets))


def train_step(model: nn.Module, strategy: Strategy, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, precision: Precision, images: torch.Tensor,
               targets: torch.Tensor, recipe: StepRecipe = StepRecipe(), clock: StepClock | None = None,
               label_scale: float = 1.0) -> tuple[torch.Tensor, float | None]:
    """One optimizer step on this rank's share of the global batch, in `accumulate` micro-batches
    whose gradients are synchronized once, after the last. Each micro-batch's mean loss is divided
    by `accumulate`, so W ranks x N micro-batches give the gradient of the mean over the global
    batch, as one process with one batch would. targets: class indices, or class probabilities
    (mixup/cutmix). Returns (loss sum, correct) over the batch; with mixed targets a prediction is
    correct when it is the class with the most weight. And with clipping, the gradient's norm before
    it (what the logs show: how often clipping bites). label_scale: cross_entropy's, for class weights."""
    strategy.zero_grad(model, optimizer)
    stats = backward(model, strategy, precision, images, targets, recipe, recipe.accumulate, label_scale)
    if clock:
        clock.lap(COMPUTE)
    strategy.after_backward(model)
    if clock:
        clock.lap(SYNC)
    norm = update(model, strategy, optimizer, scheduler, precision, recipe)
    if clock:
        clock.lap(COMPUTE)
    return stats, norm


def backward(model: nn.Module, strategy: Strategy, precision: Precision, images: torch.Tensor,
             targets: torch.Tensor, recipe: StepRecipe, divisor: int, label_scale: float = 1.0) -> torch.Tensor:
    """Forward and backward of `accumulate` micro-batches, each mean loss divided by `divisor`, the
    gradients summed into .grad; the strategy may communicate on the last one, not before. Returns
    (loss sum, correct) over the rows."""
    stats = torch.zeros(2, device=images.device)
    micro = recipe.accumulate
    for i, (x, y) in enumerate(zip(images.chunk(micro), targets.chunk(micro))):
        with strategy.no_sync(model) if i < micro - 1 else nullcontext():
            with precision.autocast():
                logits = model(x)
                loss = cross_entropy(logits, y, recipe, label_scale)
            precision.backward(loss / divisor)
        with torch.no_grad():
            classes = y if y.ndim == 1 else y.argmax(1)
            stats += torch.stack([loss.float() * len(y), (logits.argmax(1) == classes).sum().float()])
    return stats


def update(model: nn.Module, strategy: Strategy, optimizer: torch.optim.Optimizer,
           scheduler: torch.optim.lr_scheduler.LRScheduler, precision: Precision, recipe: StepRecipe,
           ) -> float | None:
    """The step with the synchronized gradients: clipping, the optimizer, the schedule. Returns the
    norm before clipping (None without it)."""
    norm = clip_gradients(model, strategy, optimizer, precision, recipe.clip_grad_norm) \
        if recipe.clip_grad_norm else None
    strategy.step(optimizer, precision)
    scheduler.step()
    return norm


def clip_gradients(model: nn.Module, strategy: Strategy, optimizer: torch.optim.Optimizer, precision: Precision,
                   max_norm: float) -> float:
    """torch's clip_grad_norm_ on the synchronized gradient: its global norm over every shard (the
    strategy's grad_norm, a collective where sharded), after fp16's unscaling, applied to the
    gradients the optimizer steps with."""
    precision.unscale(optimizer)
    norm = strategy.grad_norm(model)
    coefficient = min(1.0, max_norm / (norm + 1e-6))
    if coefficient < 1.0:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(coefficient)
    return norm


def uses_randomness(model: nn.Module) -> bool:
    """Whether forward draws random numbers (dropout, timm's stochastic depth: a module with a
    drop_prob above 0): only then must each step be reseeded."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) or getattr(m, "drop_prob", 0) for m in model.modules())


def reseed(seed: int, rank: int, global_step: int) -> None:
    """Dropout and any other torch randomness become a function of (seed, rank, step): a resumed
    run draws exactly what the uninterrupted one drew, with no RNG state to save."""
    torch.manual_seed((seed * 1_000_003 + rank) * 1_000_000_007 + global_step)
