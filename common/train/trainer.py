"""The training loop, written once for every strategy."""
from __future__ import annotations

import math
import os
import resource
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from common.data.reading import cores_per_rank
from common.output.logger import EpochResult, NullLogger, StepRecord, StepTimes
from common.output.profiling import NoProfiler, StepProfiler
from common.output.warnings_relay import WarningRelay
from common.parallel.context import DistContext
from common.parallel.replicas import check_replicas
from common.train.checkpoint import Checkpoints
from common.train.evaluation import EvaluationStopped, Metrics, evaluate
from common.train.preemption import SAVE_FAILED, Preempted, StopRequest
from common.train.run import Position, Run
from common.train.step import DATA, SYNC, StepClock, StepRecipe, reseed, train_step, uses_randomness

DATA_WAIT_SHARE = 0.10  # a step waiting for data longer than this share of it is said once a run
FLUSH_STEPS = 50  # step-level points are combined over ranks in one collective about this often

@dataclass
class StepLog:
    """Step-level figures without a collective per logging interval: each rank keeps a row per
    interval (loss sum and correct count on the device, times on the host) and the ranks combine
    all pending rows in one all-reduce, every FLUSH_STEPS steps or so and at each epoch end."""

    ctx: DistContext
    rows: list[tuple[int, float, float, torch.Tensor, list[float], float]] = field(default_factory=list)
    epoch_totals: list[float] = field(default_factory=lambda: [0.0] * 7)
    data_wait_said: bool = False

    def add(self, step: int, lr: float, grad_norm: float, stats: torch.Tensor, host: list[float]) -> None:
        """host: samples, data s, compute s, sync s, steps."""
        self.rows.append((step, lr, grad_norm, stats, host, time.time()))

    def discard_pending(self) -> None:
        """Forget the rows not yet combined: steps this rank trained that its run left behind (a
        replica group that healed to another step). Every rank of the job discards the same rows."""
        self.rows.clear()

    def pending_steps(self) -> int:
        return int(sum(row[4][4] for row in self.rows))

    def flush(self, log: NullLogger, run: Run) -> None:
        """A collective: every rank calls it at the same step."""
        if not self.rows:
            return
        values = torch.tensor([[*row[3].tolist(), *row[4]] for row in self.rows], dtype=torch.float64)
        values = self.ctx.all_reduce_sum(values).cpu().tolist()
        rss_mb, state_mb, cuda_mb = memory_mb(run)
        batch_size = run.cfg.batch_size
        for (step, lr, norm, _, _, at), (loss_sum, correct, samples, data_s, compute_s, sync_s, steps) in \
                zip(self.rows, values):
            if not samples:  # these ranks trained none of the interval's samples (a replica group beyond the plan)
                continue
            times = StepTimes(*(1000 * t / steps for t in (data_s, compute_s, sync_s)))
            self.check_data_wait(times, (step - steps) % run.steps_per_epoch == 0, run, log)
            log.step(step, StepRecord(loss_sum / samples, correct / samples, lr, batch_size / (times.step_ms / 1000),
                                      times, norm, rss_mb, state_mb, cuda_mb, at))
        self.epoch_totals = [sum(column) for column in zip(self.epoch_totals, *values)]
        self.rows.clear()

    def check_data_wait(self, times: StepTimes, epoch_start: bool, run: Run, log: NullLogger) -> None:
        """Once a run: a set fed by DataLoader workers whose steps wait for data more than
        DATA_WAIT_SHARE of their time (an interval that starts an epoch waits for the workers'
        start, and does not count)."""
        if self.data_wait_said or epoch_start or not run.data.train.augments or \
                times.data_ms <= DATA_WAIT_SHARE * times.step_ms:
            return
        self.data_wait_said = True
        train = run.data.train
        cores = cores_per_rank(run.ctx.local_world_size)
        ways = [f"give each rank more --workers (now {train.workers})" if train.workers < cores else
                f"give each rank more cores (its {train.workers} --workers share {cores})"]
        if train.decodes and run.ctx.device.type == "cuda" and not train.gpu_decode:
            ways.append("decode on the GPU (--decode gpu)")
        if train.decodes:  # a set held decoded in the cache decodes nothing: smaller stored images would not help
            ways.append("store the images smaller with python -m common.shards --max-side N (they decode faster)")
        log.warn(f"the input pipeline holds training up: {times.data_ms:.0f} ms of each {times.step_ms:.0f} ms step "
                 f"wait for data ({times.data_ms / times.step_ms:.0%}); {', '.join(ways[:-1])}"
                 f"{', or ' if len(ways) > 1 else ''}{ways[-1]}")

    def take_epoch(self) -> tuple[Metrics, StepTimes]:
        """NaN loss and accuracy for an epoch whose steps all ran before a resume (a run stopped
        during its evaluation): this run trained none of it."""
        loss_sum, correct, samples, data_s, compute_s, sync_s, steps = self.epoch_totals
        self.epoch_totals = [0.0] * 7
        times = StepTimes(*(1000 * t / max(steps, 1) for t in (data_s, compute_s, sync_s)))
        if not samples:
            return Metrics(math.nan, math.nan, 0), times
        return Metrics(loss_sum / samples, correct / samples, int(samples)), times


@dataclass
class Trainer:
    run: Run
    log: NullLogger
    checkpoints: Checkpoints
    stop: StopRequest
    relay: WarningRelay
    profiler: StepProfiler | NoProfiler

    def __post_init__(self) -> None:
        self.steps = StepLog(self.run.ctx)
        self.random = uses_randomness(self.run.plain)
        self.recipe = StepRecipe.of(self.run.cfg, self.run.class_weights)
        self.stop_signal = 0  # agreed on, waiting for a synchronized step
        self.save_due = False

    def fit(self, start: Position) -> EpochResult | None:
        result = None
        for epoch in range(start.epoch, self.run.cfg.last_epoch):
            result = self.run_epoch(epoch, start.step if epoch == start.epoch else 0)
            self.log.epoch(result, self.run.cfg.last_epoch)
            self.relay.flush(self.run.ctx, self.log)
            last = epoch + 1 == self.run.cfg.last_epoch
            self.save(Position(epoch + 1, 0), wait=last, check_stop=not last)  # the last: the run is done anyway
        return result

    def run_epoch(self, epoch: int, first_step: int) -> EpochResult:
        run = self.run
        start = time.perf_counter()
        train, times = self.train_epoch(epoch, first_step)
        train_s = time.perf_counter() - start
        self.log_loader(Position(epoch + 1, 0))
        run.strategy.consolidate(run.model)  # rank 0's BatchNorm statistics everywhere before they are read
        try:
            test = self.evaluate()
            test_ema = self.evaluate_ema()
        except EvaluationStopped as stopped:  # saved before the evaluation: a resume runs all of it first
            self.stop_at(Position(epoch, run.steps_per_epoch), stopped.verdict, during=(
                f", during the epoch's evaluation ({stopped.done} of {stopped.batches} batches scored; a resume "
                "scores them again)"))
        return EpochResult(epoch + 1, run.global_step(Position(epoch + 1, 0)), train.loss, train.acc, test.loss,
                           test.acc, test.samples, train.samples / train_s, time.perf_counter() - start, times,
                           test_ema and test_ema.acc, test_acc_top5=test.acc_top5, confusion=test.confusion,
                           class_names=tuple(run.data.names()), train_samples=train.samples)

    def evaluate(self) -> Metrics:
        run = self.run
        return evaluate(run.plain, run.data, run.ctx, run.eval_batch_size, run.precision, run.memory_format,
                        run.strategy.collective_forward, self.stop)

    def evaluate_ema(self) -> Metrics | None:
        """--ema: the same evaluation of the average, swapped into the model (rank 0's buffers)."""
        if not self.run.ema:
            return None
        with self.run.ema.swapped():
            self.run.strategy.consolidate(self.run.model)
            return self.evaluate()

    def train_epoch(self, epoch: int, first_step: int) -> tuple[Metrics, StepTimes]:
        """Loss and accuracy over all ranks' training samples (as seen before each step), and the
        epoch's mean step-time split."""
        run = self.run
        run.model.train()
        clock = StepClock(run.ctx.device)
        interval = torch.zeros(2, device=run.ctx.device)  # loss sum, correct: summed on the device, no host sync
        remaining = run.steps_per_epoch - first_step
        batches = self.log.progress(self.step_batches(epoch, first_step), remaining, f"epoch {epoch + 1}")
        for step, batch in enumerate(_timed(batches, clock), start=first_step):
            global_step = run.global_step(Position(epoch, step))
            self.stop.begin_step(global_step)
            lr = run.optimizer.param_groups[0]["lr"]
            stats, norm, samples = self.one_step(batch, Position(epoch, step), clock)
            interval += stats
            done = Position(epoch, step + 1)
            run.strategy.end_of_step(run.model, run.global_step(done), done.step == run.steps_per_epoch)
            if run.ema and run.strategy.synchronized(run.global_step(done), done.step == run.steps_per_epoch):
                run.ema.update(run.global_step(done))
            clock.lap(SYNC)  # what a strategy does after its update (ZeRO-1's all-gather, local SGD's averaging)
            clock.end_step()
            self.profiler.step()
            if run.global_step(done) % run.log_every == 0 or done.step == run.steps_per_epoch:
                data_s, compute_s, sync_s, steps = clock.take_interval()
                norm = run.strategy.grad_norm(run.model) if norm is None else norm  # clipping's: before it
                self.steps.add(run.global_step(done), lr, norm, interval,
                               [samples * steps, data_s, compute_s, sync_s, steps])
                interval = torch.zeros_like(interval)
            self.after_step(done)
            clock.restart()  # logging, checks and saves are no step's data, compute or sync
        self.steps.flush(self.log, run)
        return self.steps.take_epoch()

    def step_batches(self, epoch: int, first_step: int) -> Iterator[Any]:
        """What one_step() gets for each step of the epoch from first_step on: this rank's batch."""
        run = self.run
        return run.mixing.batches(run.loader.epoch(epoch, first_step), epoch, first_step)

    def one_step(self, batch: Any, at: Position, clock: StepClock) -> tuple[torch.Tensor, float | None, int]:
        """One optimizer step: (loss sum and correct count on the device, the gradient's norm before
        clipping or None, the samples this rank trained)."""
        run = self.run
        images, labels = batch
        if self.random:
            reseed(run.cfg.seed, run.ctx.rank, run.global_step(at))
        scale = run.loader.label_scale(run.class_weights, at.epoch, at.step)
        stats, norm = train_step(run.step_model, run.strategy, run.optimizer, run.scheduler, run.precision, images,
                                 labels, self.recipe, clock, scale)
        return stats, norm, len(labels)

    def log_loader(self, at: Position) -> None:
        """What the loader met this epoch, summed over ranks (a collective, on every rank)."""
        counts, skipped = self.run.data.train.take_counts()
        if not counts:  # the same on every rank: the set is held whole
            return
        totals = self.run.ctx.all_reduce_sum(torch.tensor(list(counts.values()), dtype=torch.float64,
                                                          device=self.run.ctx.comm_device))
        names = sorted({name for names in self.run.ctx.all_gather_json(skipped) for name in names})
        self.log.loader(self.run.global_step(at), dict(zip(counts, totals.tolist())), names)

    def after_step(self, done: Position) -> None:
        """Every rank runs the same collectives here, in the same order. A stop, a mid-epoch save or
        a replica check that falls between two synchronizations of a strategy that synchronizes
        on its own schedule waits for the next one."""
        run = self.run
        step, mid_epoch = run.global_step(done), done.step < run.steps_per_epoch
        synced = run.strategy.synchronized(step, not mid_epoch)
        if self.steps.pending_steps() >= FLUSH_STEPS:
            self.steps.flush(self.log, run)
        if run.cfg.check_replicas and step % run.cfg.check_replicas == 0 and synced:
            run.strategy.consolidate(run.model)
            check_replicas(run.strategy.replicated(run.model), run.ctx, step)
        self.stop_signal = self.stop.agreed_signal(step - 1) or self.stop_signal
        if self.stop_signal == SAVE_FAILED or (self.stop_signal and synced):
            self.stop_at(done, self.stop_signal)
        self.save_due = self.save_due or bool(run.cfg.save_every_steps and step % run.cfg.save_every_steps == 0)
        if self.save_due and synced and mid_epoch:
            self.save(done, wait=False)

    def save(self, at: Position, wait: bool, check_stop: bool = True) -> str:
        """Training pauses while the state is gathered and copied (and, with wait, written): that
        pause is the stall a save costs. Any save, the epoch end's included, is the one a due
        --save-every-steps save waited for. check_stop: a save can take long (rank 0 may first
        wait for the save before it), so a stop requested meanwhile is honoured here, with this
        checkpoint, rather than after more steps and a second save."""
        self.save_due = False
        step = self.run.global_step(at)
        started = time.perf_counter()
        self.steps.flush(self.log, self.run)  # the points up to here, before the checkpoint
        self.run.strategy.consolidate(self.run.model)
        path = self.checkpoints.save(self.run, at, wait, lambda saved, seconds: self.log.saved(saved, step, seconds))
        self.log.save_stall(step, time.perf_counter() - started)
        self.log.flush()
        if check_stop and (verdict := self.stop.agree_now()):
            self.stop_at(at, verdict, saved=path)
        return path

    def stop_at(self, at: Position, verdict: int, saved: str | None = None, during: str = "") -> None:
        """End every rank, at a point where the replicas are equal: with the failed save's one-line
        error (SAVE_FAILED), else after a checkpoint at `at` (saved: the one just started there,
        waited for here) with the stop line."""
        if verdict == SAVE_FAILED or saved:
            self.checkpoints.finish()  # ends every rank with a failed save's error; else it is committed
        path = saved or self.save(at, wait=True, check_stop=False)
        if membership_change(verdict):
            message = (f"membership change (a node joined or left the elastic job): saved after step "
                       f"{self.run.global_step(at)} ({where(at)}){during}; checkpoint {path}; the workers restart "
                       "from it at the new world size")
        else:
            message = (f"stopped by {signal.Signals(verdict).name} after step {self.run.global_step(at)} ({where(at)})"
                       f"{during}; checkpoint {path}; run the same command again to resume")
        raise Preempted(message, verdict, printing=self.run.ctx.is_primary)


def membership_change(verdict: int) -> bool:
    """A SIGTERM that torchrun's agent sent to restart the workers of an elastic job at a new world
    size, not a stop: launch/elastic.sh names in LEAVING_MARKER a file it creates before it passes
    on a stop of its own, so no file there means the agent stopped the workers by itself."""
    marker = os.environ.get(LEAVING_MARKER)
    return verdict == signal.SIGTERM and bool(marker) and not os.path.exists(marker)


LEAVING_MARKER = "DP_SUITE_LEAVING_MARKER"  # set by launch/elastic.sh (membership_change)


def where(at: Position) -> str:
    return f"epoch {at.epoch + 1}, step {at.step}" if at.step else f"the end of epoch {at.epoch}"


def memory_mb(run: Run) -> tuple[float, float, float | None]:
    """The largest, over ranks: peak resident memory, the training state this rank holds
    (parameters, gradients, optimizer state: each storage once, a shard where sharded) and, on a
    GPU, the peak of CUDA allocations."""
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    cuda = torch.cuda.max_memory_allocated(run.ctx.device) / 2**20 if run.ctx.device.type == "cuda" else 0.0
    peaks = torch.tensor([rss_kb / 1024, state_bytes(run) / 2**20, cuda], dtype=torch.float64,
                         device=run.ctx.comm_device)
    torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    rss, state, cuda = peaks.tolist()
    return rss, state, cuda if run.ctx.device.type == "cuda" else None


def state_bytes(run: Run) -> int:
    params = [*run.model.parameters(), *(p for g in run.optimizer.param_groups for p in g["params"])]
    tensors = [*params, *(p.grad for p in params if p.grad is not None),
               *(t for state in run.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))]
    storages = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _timed(batches: Iterator, clock: StepClock) -> Iterator:
    """Charge the time spent producing each batch to the data phase."""
    clock.restart()
    for batch in batches:
        clock.lap(DATA)
        yield batch
