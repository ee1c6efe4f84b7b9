"""Every rank-0-only side effect that is output: the console and TensorBoard.

Rank 0 gets a Logger; every other rank gets a NullLogger with the same methods doing nothing (or,
with --log-all-ranks, a RankEcho that prints its console lines), so the training loop never asks
which rank it is on. Figures arrive already combined over ranks: losses averaged, images/s summed.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar

from common.config import Config
from common.errors import UserError, first_line
from common.output import confusion
from common.storage import describe_store_error, export_s3_endpoint, is_url, os_cause

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def add_logging_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flags of this module: where TensorBoard logs go, how often, which ranks print."""
    add = group.add_argument
    add("--log-dir", default="", help="TensorBoard directory, or an s3:// (or other fsspec) URL (default: the "
                                      "resumed run's, or runs/<script>-<dataset>-<model>-w<world>-<time>)")
    add("--log-every", type=int, default=None, help="steps between step-level TensorBoard points (default: enough for "
                                                   "at least 10 points per epoch, at most every 50 steps)")
    add("--log-all-ranks", action="store_true", help="every rank prints its console lines, tagged [rank N]")

# TensorBoard's custom-scalars dashboard: one chart per question people ask of a run.
LAYOUT = {
    "Loss and accuracy": {
        "loss": ["Multiline", ["train/loss", "test/loss"]],
        "accuracy": ["Multiline", ["train/acc", "test/acc", "test/acc_top5"]],
    },
    "Where a step's time goes": {
        "data / compute / sync (ms per step)": ["Multiline", ["time/data_ms", "time/compute_ms", "time/sync_ms"]],
    },
    "Throughput": {
        "images/s (all ranks)": ["Multiline", ["train/images_per_s"]],
        "epoch seconds": ["Multiline", ["time/epoch_s"]],
    },
}
SUMMARY_METRICS = ("summary/final_test_acc", "summary/best_test_acc", "summary/wall_time_s",
                   "summary/mean_images_per_s")


@dataclass(frozen=True)
class StepTimes:
    """Mean ms per step, averaged over ranks."""

    data_ms: float
    compute_ms: float  # forward, backward and the optimizer update
    sync_ms: float  # gradient synchronization not hidden behind backward

    @property
    def step_ms(self) -> float:
        return self.data_ms + self.compute_ms + self.sync_ms

    @property
    def sync_share(self) -> float:
        return self.sync_ms / max(self.step_ms, 1e-9)


@dataclass(frozen=True)
class StepRecord:
    """One logging interval, combined over ranks."""

    loss: float
    acc: float
    lr: float
    images_per_s: float
    times: StepTimes
    grad_norm: float
    rss_mb: float  # the largest peak resident memory of any rank
    state_mb: float  # the largest training state (parameters, gradients, optimizer) any rank holds
    cuda_max_alloc_mb: float | None
    walltime: float  # when the interval ended (time.time()): points are written in batches, later


@dataclass(frozen=True)
class EpochResult:
    epoch: int  # 1-based, as printed
    global_step: int  # the x axis of every TensorBoard point
    train_loss: float
    train_acc: float
    test_loss: float
    test_acc: float  # fraction 0..1
    test_samples: int
    images_per_s: float
    epoch_s: float
    times: StepTimes
    test_acc_ema: float | None = None  # --ema: the moving average's test accuracy
    test_acc_top5: float = math.nan  # the label among the model's 5 highest scores
    confusion: torch.Tensor | None = None  # (classes, classes) test counts, row the label, column the prediction
    class_names: tuple[str, ...] = ()  # the confusion matrix's labels
    train_samples: int = 0  # what this run trained of the epoch (0: all of it before a resume)


def trained(r: EpochResult) -> bool:
    """False for an epoch whose steps all ran before a resume: this run only evaluated it (its
    loss may be NaN for another reason: weights that diverged)."""
    return r.train_samples > 0


class NullLogger:
    """What ranks != 0 hold: accepts every call, writes nothing."""

    def info(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        pass

    def progress(self, items: Iterable[T], total: int, desc: str) -> Iterator[T]:
        return iter(items)

    def step(self, step: int, record: StepRecord) -> None:
        pass

    def epoch(self, result: EpochResult, epochs: int) -> None:
        pass

    def saved(self, path: str, step: int, seconds: float) -> None:
        pass

    def loader(self, step: int, counts: dict[str, float], skipped: list[str]) -> None:
        pass

    def save_stall(self, step: int, seconds: float) -> None:
        pass

    def startup(self, seconds: float, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, final: EpochResult | None) -> None:
        pass


class RankEcho(NullLogger):
    """--log-all-ranks on a rank != 0: its console lines, tagged with the rank; never TensorBoard."""

    def __init__(self, rank: int) -> None:
        self.tag = f"[rank {rank}] "

    def info(self, message: str) -> None:
        print(self.tag + message, flush=True)

    def warn(self, message: str) -> None:
        print(self.tag + message, file=sys.stderr, flush=True)

    def epoch(self, r: EpochResult, epochs: int) -> None:
        self.info(_epoch_line(r, epochs))
        if trained(r) and not math.isfinite(r.train_loss):
            self.warn(f"warning: epoch {r.epoch}'s training loss is {r.train_loss}: the weights diverged, and "
                      "training on will not bring them back; stop the run and start a new one with a lower --lr (or "
                      "a longer --warmup, or --clip-grad-norm)")


def _epoch_line(r: EpochResult, epochs: int) -> str:
    ema = "" if r.test_acc_ema is None else f", EMA {100 * r.test_acc_ema:.2f}%"
    top5 = f"  top-5 {100 * r.test_acc_top5:.2f}%" if math.isfinite(r.test_acc_top5) else ""  # NaN: <= 5 classes
    test = f"test acc {100 * r.test_acc:.2f}%{ema} ({r.test_samples} images){top5}"
    if not trained(r):
        return f"epoch {r.epoch}/{epochs}  (trained before the resume)  test loss {r.test_loss:.4f}  {test}"
    return (f"epoch {r.epoch}/{epochs}  train loss {r.train_loss:.4f}  test loss {r.test_loss:.4f}  {test}  "
            f"{r.images_per_s:,.0f} img/s  {r.epoch_s:.1f} s  per step: data {r.times.data_ms:.1f} / compute "
            f"{r.times.compute_ms:.1f} / sync {r.times.sync_ms:.1f} ms ({100 * r.times.sync_share:.0f}% sync)")


class Logger(RankEcho):
    """Rank 0: console lines, a tqdm bar on a terminal, and one TensorBoard run."""

    def __init__(self, cfg: Config, run: dict[str, Any], purge_step: int | None) -> None:
        """run: the hparams (strategy, world, nodes, ...). purge_step: on resume, TensorBoard
        drops the cut run's points from this step on, so curves neither repeat nor cross."""
        export_s3_endpoint(cfg.storage_options)  # before TensorBoard's s3 support reads it, at import
        from torch.utils.tensorboard import SummaryWriter

        self.tag = ""
        self.cfg = cfg
        self.run = run
        self.writer = open_writer(SummaryWriter, cfg.log_dir, purge_step)
        self.writer.add_text("config", _markdown_table(cfg.as_plain_dict()))
        self.writer.add_custom_scalars(LAYOUT)
        self.started = time.perf_counter()
        self.best_acc = 0.0
        self.images_per_s: list[float] = []

    def progress(self, items: Iterable[T], total: int, desc: str) -> Iterator[T]:
        if not sys.stderr.isatty():  # CI logs and redirected output stay one line per epoch
            return iter(items)
        from tqdm import tqdm

        return iter(tqdm(items, total=total, desc=desc, leave=False, dynamic_ncols=True))

    def step(self, step: int, r: StepRecord) -> None:
        scalars = {
            "train/loss": r.loss, "train/acc": r.acc, "lr": r.lr, "train/images_per_s": r.images_per_s,
            "time/data_ms": r.times.data_ms, "time/compute_ms": r.times.compute_ms, "time/sync_ms": r.times.sync_ms,
            "train/grad_norm": r.grad_norm, "mem/rss_mb": r.rss_mb, "mem/state_mb": r.state_mb,
        }
        if r.cuda_max_alloc_mb is not None:
            scalars["mem/cuda_max_alloc_mb"] = r.cuda_max_alloc_mb
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step, walltime=r.walltime)

    def epoch(self, r: EpochResult, epochs: int) -> None:
        super().epoch(r, epochs)
        self.best_acc = max(self.best_acc, r.test_acc)
        scalars = {"test/loss": r.test_loss, "test/acc": r.test_acc, "test/samples": r.test_samples}
        if math.isfinite(r.test_acc_top5):  # NaN with 5 classes or fewer, where top-5 says nothing
            scalars["test/acc_top5"] = r.test_acc_top5
        if r.test_acc_ema is not None:
            scalars["test/acc_ema"] = r.test_acc_ema
        if trained(r):  # an epoch only evaluated here says nothing of its speed
            self.images_per_s.append(r.images_per_s)
            scalars["time/epoch_s"] = r.epoch_s
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, r.global_step)

    def loader(self, step: int, counts: dict[str, float], skipped: list[str]) -> None:
        """A streamed set's epoch, over all ranks: shard cache hits and misses, skipped files (named)."""
        for key, value in counts.items():
            self.writer.add_scalar(f"data/{key}", value, step)
        if skipped:
            self.warn(f"skipped {len(skipped)} unreadable image(s) this epoch, each replaced by its next sample: "
                      f"{', '.join(skipped[:10])}{', ...' if len(skipped) > 10 else ''}")

    def startup(self, seconds: float, step: int) -> None:
        self.info(f"start-up: {seconds:.1f} s from process start to the first step")
        self.writer.add_scalar("time/startup_s", seconds, step)

    def saved(self, path: str, step: int, seconds: float) -> None:
        """Called from the checkpoint writer's thread, once the checkpoint is committed."""
        self.info(f"saved {path} in {seconds:.2f} s")
        self.writer.add_scalar("time/checkpoint_s", seconds, step)

    def save_stall(self, step: int, seconds: float) -> None:
        self.writer.add_scalar("time/checkpoint_stall_s", seconds, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, final: EpochResult | None) -> None:
        if final is not None:
            self._write_summary(final)
            self._write_classes(final)
        self.writer.close()

    def _write_summary(self, final: EpochResult) -> None:
        """hparams in this run's own event file (SummaryWriter.add_hparams would open a second run),
        with metrics that are scalars of this run, so runs under one --log-dir parent compare in
        TensorBoard's hparams table."""
        from torch.utils.tensorboard.summary import hparams

        values = (final.test_acc, self.best_acc, time.perf_counter() - self.started,
                  sum(self.images_per_s) / len(self.images_per_s) if self.images_per_s else math.nan)
        for tag, value in zip(SUMMARY_METRICS, values):
            self.writer.add_scalar(tag, value, final.global_step)
        for summary in hparams(self.run, {tag: 0.0 for tag in SUMMARY_METRICS}):
            self.writer.file_writer.add_summary(summary)

    def _write_classes(self, final: EpochResult) -> None:
        """The last evaluation's per-class accuracy (a table) and confusion matrix (an image), and
        its counts as JSON, which the report reads back."""
        if final.confusion is None:
            return
        counts = final.confusion.tolist()
        names = list(final.class_names)
        step = final.global_step
        self.writer.add_text(confusion.PER_CLASS_TAG, confusion.markdown(confusion.per_class(counts, names)), step)
        self.writer.add_image(confusion.IMAGE_TAG, confusion.rgb(counts, names, f"test set after step {step}"), step,
                              dataformats="HWC")
        self.writer.add_text(confusion.JSON_TAG, confusion.to_json(counts, names), step)


def _markdown_table(values: dict[str, object]) -> str:
    rows = "\n".join(f"| {key} | {value} |" for key, value in values.items())
    return f"| flag | value |\n|---|---|\n{rows}"


def node_console(ctx) -> Callable[[str], None]:
    """Before the logger exists (data preparation), each node's local rank 0 reports on its own
    console: every node prepares its own copy of the data."""
    if ctx.is_node_primary:
        return lambda message: print(message, file=sys.stderr, flush=True)
    return lambda message: None


def open_writer(writer_class: Callable[..., Any], log_dir: str, purge_step: int | None) -> Any:
    """TensorBoard's writer, which makes the folder at once: one that cannot be made, or a store without
    credentials, is the user's to fix, in one line naming --log-dir (it was a traceback)."""
    try:
        return writer_class(log_dir, purge_step=purge_step)
    except Exception as error:
        if is_url(log_dir):
            raise UserError(f"--log-dir {log_dir}: TensorBoard cannot write there ({describe_store_error(error)}); "
                            "check the URL and the store, or pass a local --log-dir") from None
        why = os_cause(error) if isinstance(error, OSError) else first_line(error, with_type=True)
        raise UserError(f"--log-dir {log_dir}: TensorBoard cannot write there ({why}); pass a --log-dir this user "
                        "can write to") from None


def make_logger(cfg: Config, rank: int, run: dict[str, Any], purge_step: int | None = None) -> NullLogger:
    if rank == 0:
        return Logger(cfg, run, purge_step)
    return RankEcho(rank) if cfg.log_all_ranks else NullLogger()
