"""Every rank-0-only side effect that is output: the console and TensorBoard.

Rank 0 gets a Logger; every other rank gets a NullLogger with the same methods doing nothing,
so the training loop never asks which rank it is on.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable, Iterator, TypeVar

from common.config import Config

T = TypeVar("T")


@dataclass(frozen=True)
class StepTimes:
    """Mean ms per step, averaged over ranks."""

    data_ms: float
    compute_ms: float  # forward, backward and the optimizer update
    sync_ms: float  # gradient synchronization not hidden behind backward

    @property
    def sync_share(self) -> float:
        return self.sync_ms / max(self.data_ms + self.compute_ms + self.sync_ms, 1e-9)


@dataclass(frozen=True)
class EpochResult:
    epoch: int  # 1-based, as printed
    global_step: int  # the x axis of every TensorBoard point
    train_loss: float
    train_acc: float
    test_loss: float
    test_acc: float  # fraction 0..1
    test_samples: int
    lr: float
    images_per_s: float
    epoch_s: float
    times: StepTimes


class NullLogger:
    """What ranks != 0 hold: accepts every call, writes nothing."""

    def info(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        pass

    def progress(self, items: Iterable[T], total: int, desc: str) -> Iterator[T]:
        return iter(items)

    def epoch(self, result: EpochResult, epochs: int) -> None:
        pass

    def step_times(self, step: int, times: StepTimes) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, final: EpochResult | None) -> None:
        pass


class Logger(NullLogger):
    """Rank 0: console lines, a tqdm bar on a terminal, and one TensorBoard run."""

    def __init__(self, cfg: Config, purge_step: int | None) -> None:
        """purge_step: on resume, TensorBoard drops the cut run's points from this step on, so
        curves neither repeat nor cross."""
        from torch.utils.tensorboard import SummaryWriter

        self.cfg = cfg
        self.writer = SummaryWriter(cfg.log_dir, purge_step=purge_step)
        self.writer.add_text("config", _markdown_table(cfg.as_plain_dict()))

    def info(self, message: str) -> None:
        print(message, flush=True)

    def warn(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def progress(self, items: Iterable[T], total: int, desc: str) -> Iterator[T]:
        if not sys.stderr.isatty():  # CI logs and redirected output stay one line per epoch
            return iter(items)
        from tqdm import tqdm

        return iter(tqdm(items, total=total, desc=desc, leave=False, dynamic_ncols=True))

    def epoch(self, r: EpochResult, epochs: int) -> None:
        self.info(f"epoch {r.epoch}/{epochs}  train loss {r.train_loss:.4f}  test loss {r.test_loss:.4f}  "
                  f"test acc {100 * r.test_acc:.2f}% ({r.test_samples} images)  "
                  f"{r.images_per_s:,.0f} img/s  {r.epoch_s:.1f} s  per step: data {r.times.data_ms:.1f} / "
                  f"compute {r.times.compute_ms:.1f} / sync {r.times.sync_ms:.1f} ms ({100 * r.times.sync_share:.0f}% sync)")
        scalars = {
            "train/loss": r.train_loss, "train/acc": r.train_acc, "test/loss": r.test_loss,
            "test/acc": r.test_acc, "test/samples": r.test_samples, "lr": r.lr,
            "train/images_per_s": r.images_per_s, "time/epoch_s": r.epoch_s,
        }
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, r.global_step)

    def step_times(self, step: int, times: StepTimes) -> None:
        self.writer.add_scalar("time/data_ms", times.data_ms, step)
        self.writer.add_scalar("time/compute_ms", times.compute_ms, step)
        self.writer.add_scalar("time/sync_ms", times.sync_ms, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, final: EpochResult | None) -> None:
        if final is not None:
            self._write_hparams()
        self.writer.close()

    def _write_hparams(self) -> None:
        """hparams in this run's own event file; the metric names point at the existing test scalars,
        whose last values are the final metrics (SummaryWriter.add_hparams would open a second run)."""
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(self.cfg.as_plain_dict(), {"test/acc": 0.0, "test/loss": 0.0}):
            self.writer.file_writer.add_summary(summary)


def _markdown_table(values: dict[str, object]) -> str:
    rows = "\n".join(f"| {key} | {value} |" for key, value in values.items())
    return f"| flag | value |\n|---|---|\n{rows}"


def make_logger(cfg: Config, is_primary: bool, purge_step: int | None = None) -> NullLogger:
    return Logger(cfg, purge_step) if is_primary else NullLogger()
