"""The training loop and exact evaluation, written once for every strategy."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.checkpoint import CheckpointWriter
from common.config import Config
from common.data import Dataset, TrainLoader, eval_batches
from common.distributed import DistContext
from common.logger import EpochResult, NullLogger
from common.strategy import Strategy


@dataclass(frozen=True)
class Metrics:
    loss: float
    acc: float
    samples: int


class Tally:
    """Loss sum, correct count and sample count, kept on the device (no sync per batch) and summed
    over ranks once at the end, so the figures cover every rank's samples."""

    def __init__(self, device: torch.device) -> None:
        self.totals = torch.zeros(3, dtype=torch.float64, device=device)

    def add(self, logits: torch.Tensor, labels: torch.Tensor, loss_sum: torch.Tensor) -> None:
        self.totals[0] += loss_sum.detach()
        self.totals[1] += (logits.argmax(1) == labels).sum()
        self.totals[2] += len(labels)

    def all_ranks(self, ctx: DistContext) -> Metrics:
        loss_sum, correct, count = ctx.all_reduce_sum(self.totals).tolist()
        return Metrics(loss_sum / count, correct / count, int(count))


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, ctx: DistContext, batch: int) -> Metrics:
    """Every rank scores its unpadded shard; one all-reduce of (correct, loss sum, count) combines them."""
    model.eval()
    tally = Tally(ctx.device)
    for images, labels in eval_batches(data.test, data.spec, ctx.rank, ctx.world_size, batch, ctx.device):
        logits = model(images)
        tally.add(logits, labels, F.cross_entropy(logits, labels, reduction="sum"))
    result = tally.all_ranks(ctx)
    if result.samples != len(data.test):
        raise RuntimeError(f"evaluation counted {result.samples} samples, the test set has {len(data.test)}")
    return result


@dataclass
class Trainer:
    cfg: Config
    ctx: DistContext
    strategy: Strategy
    model: nn.Module  # as wrapped by the strategy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: Dataset
    loader: TrainLoader
    log: NullLogger
    checkpoints: CheckpointWriter

    def fit(self, start_epoch: int) -> EpochResult | None:
        result = None
        for epoch in range(start_epoch, self.cfg.epochs):
            result = self.run_epoch(epoch)
            self.log.epoch(result, self.cfg.epochs)
            self.save(epoch + 1)
        return result

    def run_epoch(self, epoch: int) -> EpochResult:
        start = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        train = self.train_epoch(epoch)
        train_s = time.perf_counter() - start
        test = evaluate(self.strategy.unwrap(self.model), self.data, self.ctx, self.cfg.eval_batch_size)
        return EpochResult(epoch + 1, train.loss, train.acc, test.loss, test.acc, test.samples, lr,
                           train.samples / train_s, time.perf_counter() - start)

    def train_epoch(self, epoch: int) -> Metrics:
        """Loss and accuracy over all ranks' training samples (as seen before each step)."""
        self.model.train()
        tally = Tally(self.ctx.device)
        batches = self.log.progress(self.loader.epoch(epoch), self.loader.steps_per_epoch, f"epoch {epoch + 1}")
        for images, labels in batches:
            logits = self.model(images)
            loss = F.cross_entropy(logits, labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.strategy.after_backward(self.model)
            self.strategy.step(self.optimizer)
            self.scheduler.step()
            tally.add(logits, labels, loss * len(labels))
        return tally.all_ranks(self.ctx)

    def save(self, epochs_done: int) -> None:
        self.checkpoints.save({
            "model": self.strategy.unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "epoch": epochs_done,
            "config": self.cfg.as_plain_dict(),
        })
        self.log.flush()
        self.ctx.barrier()  # nobody races ahead (or exits) while rank 0 is still writing
