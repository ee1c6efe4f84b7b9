"""The training loop and exact evaluation, written once for every strategy."""
from __future__ import annotations

import resource
import signal
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from common.checkpoint import Checkpoints
from common.data import Dataset, eval_batches
from common.distributed import DistContext
from common.logger import EpochResult, NullLogger, StepRecord, StepTimes
from common.preemption import Preempted, StopRequest
from common.replicas import check_replicas
from common.run import Position, Run
from common.strategy import Strategy
from common.warnings_relay import WarningRelay


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


DATA, COMPUTE, SYNC, STEPS = range(4)


class StepClock:
    """Splits each step into data, compute (forward + backward + update) and exposed sync time,
    per logging interval and per epoch. On CUDA it synchronizes the device at each boundary, or
    queued kernels would be charged to the wrong phase."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.interval = torch.zeros(4, dtype=torch.float64)  # data, compute, sync seconds; steps
        self.epoch = torch.zeros(4, dtype=torch.float64)
        self.last = time.perf_counter()

    def lap(self, phase: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.interval[phase] += now - self.last
        self.epoch[phase] += now - self.last
        self.last = now

    def end_step(self) -> None:
        self.interval[STEPS] += 1
        self.epoch[STEPS] += 1

    def take_interval(self, ctx: DistContext) -> StepTimes:
        times = _mean_ms(self.interval, ctx)
        self.interval.zero_()
        return times

    def epoch_mean(self, ctx: DistContext) -> StepTimes:
        return _mean_ms(self.epoch, ctx)


def _mean_ms(totals: torch.Tensor, ctx: DistContext) -> StepTimes:
    """ms per step averaged over ranks: a collective, so every rank calls it at the same step."""
    summed = ctx.all_reduce_sum(totals).cpu()
    return StepTimes(*(1000 * summed[:STEPS] / max(float(summed[STEPS]), 1.0)).tolist())


def train_step(model: nn.Module, strategy: Strategy, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, images: torch.Tensor, labels: torch.Tensor,
               clock: StepClock | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on this rank's share of the global batch; returns (logits, mean loss)."""
    logits = model(images)
    loss = F.cross_entropy(logits, labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clock:
        clock.lap(COMPUTE)
    strategy.after_backward(model)
    if clock:
        clock.lap(SYNC)
    strategy.step(optimizer)
    scheduler.step()
    if clock:
        clock.lap(COMPUTE)
    return logits, loss


def reseed(seed: int, rank: int, global_step: int) -> None:
    """Dropout and any other torch randomness become a function of (seed, rank, step): a resumed
    run draws exactly what the uninterrupted one drew, with no RNG state to save."""
    torch.manual_seed((seed * 1_000_003 + rank) * 1_000_000_007 + global_step)


@dataclass
class Trainer:
    run: Run
    log: NullLogger
    checkpoints: Checkpoints
    stop: StopRequest
    relay: WarningRelay

    def fit(self, start: Position) -> EpochResult | None:
        result = None
        for epoch in range(start.epoch, self.run.cfg.epochs):
            result = self.run_epoch(epoch, start.step if epoch == start.epoch else 0)
            self.log.epoch(result, self.run.cfg.epochs)
            self.relay.flush(self.run.ctx, self.log)
            self.save(Position(epoch + 1, 0))
        return result

    def run_epoch(self, epoch: int, first_step: int) -> EpochResult:
        run = self.run
        start = time.perf_counter()
        train, times = self.train_epoch(epoch, first_step)
        train_s = time.perf_counter() - start
        test = evaluate(run.plain, run.data, run.ctx, run.cfg.eval_batch_size)
        return EpochResult(epoch + 1, run.global_step(Position(epoch + 1, 0)), train.loss, train.acc, test.loss,
                           test.acc, test.samples, train.samples / train_s, time.perf_counter() - start, times)

    def train_epoch(self, epoch: int, first_step: int) -> tuple[Metrics, StepTimes]:
        """Loss and accuracy over all ranks' training samples (as seen before each step), and the
        epoch's mean step-time split."""
        run = self.run
        run.model.train()
        epoch_tally, interval_tally, clock = Tally(run.ctx.device), Tally(run.ctx.device), StepClock(run.ctx.device)
        remaining = run.steps_per_epoch - first_step
        batches = self.log.progress(run.loader.epoch(epoch, first_step), remaining, f"epoch {epoch + 1}")
        for step, (images, labels) in enumerate(_timed(batches, clock), start=first_step):
            reseed(run.cfg.seed, run.ctx.rank, run.global_step(Position(epoch, step)))
            self.stop.begin_step()
            lr = run.optimizer.param_groups[0]["lr"]
            logits, loss = train_step(run.model, run.strategy, run.optimizer, run.scheduler, images, labels, clock)
            clock.end_step()
            for tally in (epoch_tally, interval_tally):
                tally.add(logits, labels, loss * len(labels))
            done = Position(epoch, step + 1)
            if run.global_step(done) % run.cfg.log_every == 0:
                self.log_interval(run.global_step(done), lr, interval_tally, clock)
                interval_tally = Tally(run.ctx.device)
            self.after_step(done)
        return epoch_tally.all_ranks(run.ctx), clock.epoch_mean(run.ctx)

    def log_interval(self, step: int, lr: float, tally: Tally, clock: StepClock) -> None:
        """Step-level figures over all ranks (collectives: every rank calls this at the same step)."""
        run = self.run
        train, times = tally.all_ranks(run.ctx), clock.take_interval(run.ctx)
        rss_mb, cuda_mb = peak_memory_mb(run.ctx)
        self.log.step(step, StepRecord(train.loss, train.acc, lr, run.cfg.batch_size / (times.step_ms / 1000),
                                       times, grad_norm(run.plain), rss_mb, cuda_mb))

    def after_step(self, done: Position) -> None:
        """Every rank runs the same collectives here, in the same order."""
        run = self.run
        step = run.global_step(done)
        if run.cfg.check_replicas and step % run.cfg.check_replicas == 0:
            check_replicas(run.plain, run.ctx, step)
        signum = self.stop.agreed_signal()
        if signum:
            path = self.save(done)
            run.ctx.fail_together_with(Preempted(
                f"stopped by {signal.Signals(signum).name} after step {step} (epoch {done.epoch + 1}, step "
                f"{done.step}); checkpoint {path}; run the same command again to resume", signum))
        mid_epoch = done.step < run.steps_per_epoch
        if run.cfg.save_every_steps and step % run.cfg.save_every_steps == 0 and mid_epoch:
            self.save(done)

    def save(self, at: Position) -> str:
        """Every rank waits for rank 0's write: the time it takes is the stall a save costs."""
        started = time.perf_counter()
        path = self.checkpoints.save(self.run, at)
        self.log.saved(path, self.run.global_step(at), time.perf_counter() - started)
        self.log.flush()
        return path


def grad_norm(model: nn.Module) -> float:
    """L2 norm of the synchronized gradients (equal on every rank)."""
    norms = [p.grad.detach().norm() for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0


def peak_memory_mb(ctx: DistContext) -> tuple[float, float | None]:
    """The largest peak resident memory of any rank, and of CUDA allocations when on a GPU."""
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    cuda = torch.cuda.max_memory_allocated(ctx.device) / 2**20 if ctx.device.type == "cuda" else 0.0
    peaks = torch.tensor([rss_kb / 1024, cuda], dtype=torch.float64, device=ctx.comm_device)
    torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    return peaks[0].item(), peaks[1].item() if ctx.device.type == "cuda" else None


def _timed(batches: Iterator, clock: StepClock) -> Iterator:
    """Charge the time spent producing each batch to the data phase."""
    clock.last = time.perf_counter()
    for batch in batches:
        clock.lap(DATA)
        yield batch
