"""Exact evaluation: every rank scores its unpadded shard of the test set, one all-reduce combines
them. Used by the training loop after each epoch and by evaluate.py, which needs none of the loop."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.data.loader import Dataset, eval_batches, eval_shard
from common.parallel.context import DistContext
from common.train.precision import Precision
from common.train.preemption import StopRequest

# Evaluation counts a confusion matrix of (classes x classes) float64 values on the device: 134 MB
# at this many classes (8 MB for ImageNet's 1000); above it, none is kept.
CONFUSION_MAX_CLASSES = 4096
TOP_K = 5  # top-5 accuracy


@dataclass(frozen=True)
class Metrics:
    loss: float
    acc: float
    samples: int
    acc_top5: float = math.nan  # evaluation's: the label among the 5 highest logits; NaN (not shown) with <= 5 classes
    # evaluation's: int64 (classes, classes) counts, row the label, column the prediction (up to CONFUSION_MAX_CLASSES)
    confusion: torch.Tensor | None = None


class EvaluationStopped(Exception):
    """Every rank agreed, during evaluation, to stop (a signal) or to end (SAVE_FAILED)."""

    def __init__(self, verdict: int, done: int, batches: int) -> None:
        super().__init__(verdict)
        self.verdict, self.done, self.batches = verdict, done, batches


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, ctx: DistContext, batch: int, precision: Precision,
             memory_format: torch.memory_format, equal_counts: bool = False,
             stop: StopRequest | None = None) -> Metrics:
    """Every rank scores its unpadded shard; one all-reduce of (loss sum, top-1 and top-5 correct,
    count, the confusion matrix's counts) combines them: counts in float64 are exact, so top-1,
    top-5 and the matrix are the same at any world size (the loss up to summation order).
    equal_counts: every rank runs as many forwards (empty batches at the end of a shorter shard),
    for models whose forward is itself a collective (FSDP). stop: checked over the batches every
    rank runs (the last shard may be a batch shorter); raises EvaluationStopped when agreed on."""
    model.eval()
    classes = data.spec.classes
    cells = classes * classes if classes <= CONFUSION_MAX_CLASSES else 0
    totals = torch.zeros(4 + cells, dtype=torch.float64, device=ctx.device)
    confusion = totals[4:]  # a view: one tensor, one all-reduce, however many classes
    checked = shard_batches(len(data.test), ctx.world_size - 1, ctx.world_size, batch) if stop else 0  # the smallest
    batches = eval_batches(data.test, data.spec, ctx.rank, ctx.world_size, batch, ctx.device, memory_format,
                           equal_counts)
    for index, (images, labels) in enumerate(batches):
        if index < checked:
            stop.begin_step(index)
        with precision.autocast():
            logits = model(images)
        predicted = logits.argmax(1)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (predicted == labels).sum()
        totals[2] += (logits.topk(min(TOP_K, classes), 1).indices == labels[:, None]).any(1).sum()
        totals[3] += len(labels)
        if cells:
            confusion.put_(labels * classes + predicted, confusion.new_ones(labels.shape),
                           accumulate=True)
        if index < checked and (verdict := stop.agreed_signal(index)):
            raise EvaluationStopped(verdict, index + 1, shard_batches(len(data.test), ctx.rank, ctx.world_size, batch))
    reduced = ctx.all_reduce_sum(totals).cpu()
    loss_sum, correct, top5, count = reduced[:4].tolist()
    if int(count) != len(data.test):
        raise RuntimeError(f"evaluation counted {int(count)} samples, the test set has {len(data.test)}")
    # With 5 classes or fewer every label is among the 5 highest: a top-5 of 100% that says nothing.
    return Metrics(loss_sum / count, correct / count, int(count), top5 / count if classes > TOP_K else math.nan,
                   reduced[4:].round().long().view(classes, classes) if cells else None)


def shard_batches(size: int, rank: int, world_size: int, batch: int) -> int:
    """How many evaluation batches the rank's shard makes (without equal_counts' padding)."""
    return -(-len(eval_shard(size, rank, world_size)) // batch)
