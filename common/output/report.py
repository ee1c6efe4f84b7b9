"""Compare training runs from their TensorBoard event files: a markdown table and PNG plots.

    python -m common.output.report RUN_DIR [RUN_DIR ...] [--out report]

A RUN_DIR is one run's --log-dir, or a parent holding several (every folder with event files
below it counts). Writes OUT/report.md (one row per run), OUT/curves.png (test accuracy and train
loss against wall time and against step) and OUT/time_split.png (data / compute / sync per step);
for the runs that finished, OUT/per_class.md (each run's per-class test accuracy) and
OUT/confusion-RUN.png (its confusion matrix), from its last evaluation.
"""
from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams import plugin_data_pb2  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402

from common.output import confusion  # noqa: E402

TIME_TAGS = ("time/data_ms", "time/compute_ms", "time/sync_ms")


@dataclass(frozen=True)
class Point:
    step: int
    seconds: float  # since the run's first event
    value: float


@dataclass(frozen=True)
class Run:
    path: Path
    hparams: dict[str, object]
    scalars: dict[str, list[Point]]
    confusion: tuple[list[list[int]], list[str]] | None = None  # the last evaluation's (counts, class names)

    @property
    def world(self) -> str:
        """TensorBoard stores every hparam number as a float: 2.0 back to 2."""
        world = self.hparams.get("world_size")
        return "?" if world is None else str(int(world))

    @property
    def label(self) -> str:
        return f"{self.hparams.get('strategy', self.path.name)} w{self.world}"

    def last(self, tag: str) -> float:
        return self.scalars[tag][-1].value if self.scalars.get(tag) else float("nan")

    def mean(self, tag: str) -> float:
        values = [p.value for p in self.scalars.get(tag, [])]
        return statistics.fmean(values) if values else float("nan")


def find_runs(paths: Sequence[Path]) -> list[Path]:
    found = {f.parent for p in paths for f in Path(p).rglob("events.out.tfevents.*")}
    return sorted(found)


def _hparams(acc: EventAccumulator) -> dict[str, object]:
    """The run's hparams (strategy, world size, ...); empty for a run cut before it finished."""
    try:
        content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    except KeyError:
        return {}
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {name: getattr(value, value.WhichOneof("kind")) for name, value in info.hparams.items()}


def load_run(path: Path) -> Run:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    events = {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}
    start = min((e.wall_time for series in events.values() for e in series), default=0.0)
    scalars = {tag: [Point(e.step, e.wall_time - start, e.value) for e in series] for tag, series in events.items()}
    return Run(path, _hparams(acc), scalars, _confusion(acc))


def _confusion(acc: EventAccumulator) -> tuple[list[list[int]], list[str]] | None:
    """The counts and class names the run wrote when it finished; None for a run cut before that."""
    tag = f"{confusion.JSON_TAG}/text_summary"  # where TensorBoard files a text summary
    if tag not in acc.Tags()["tensors"]:
        return None
    (text,) = tensor_util.make_ndarray(acc.Tensors(tag)[-1].tensor_proto).flatten()
    return confusion.from_json(text.decode())


def sync_share(run: Run) -> float:
    """Share of the mean step time spent in exposed gradient synchronization."""
    data, compute, sync = (run.mean(tag) for tag in TIME_TAGS)
    return sync / (data + compute + sync)


def percent_or_dash(value: float) -> str:
    """A share as a percentage; '-' where the run has none (top-5 of a set of 5 classes or fewer)."""
    return f"{100 * value:.2f}%" if math.isfinite(value) else "-"


def markdown_table(runs: Sequence[Run]) -> str:
    header = ("| run | strategy | world | final test acc | final top-5 | best test acc | wall time s | images/s | "
              "sync share |\n|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r.path.name} | {r.hparams.get('strategy', '?')} | {r.world} | "
            f"{100 * r.last('summary/final_test_acc'):.2f}% | {percent_or_dash(r.last('test/acc_top5'))} | "
            f"{100 * r.last('summary/best_test_acc'):.2f}% | "
            f"{r.last('summary/wall_time_s'):.1f} | {r.last('summary/mean_images_per_s'):,.0f} | "
            f"{100 * sync_share(r):.1f}% |" for r in runs]
    return "\n".join([header, *rows]) + "\n"


def plot_curves(runs: Sequence[Run], out: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    panels = [("test/acc", "seconds", "test accuracy vs wall time"), ("test/acc", "step", "test accuracy vs step"),
              ("train/loss", "seconds", "train loss vs wall time"), ("train/loss", "step", "train loss vs step")]
    for ax, (tag, x, title) in zip(axes.flat, panels):
        for run in runs:
            points = run.scalars.get(tag, [])
            ax.plot([getattr(p, x) for p in points], [p.value for p in points], marker=".", label=run.label)
        ax.set_title(title)
        ax.set_xlabel("wall time (s)" if x == "seconds" else "optimizer step")
        ax.set_ylabel(tag)
        ax.grid(alpha=0.3)
        ax.legend()
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_time_split(runs: Sequence[Run], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(runs)), constrained_layout=True)
    labels = [r.label for r in runs]
    left = [0.0] * len(runs)
    for tag, color in zip(TIME_TAGS, ("tab:gray", "tab:blue", "tab:red")):
        widths = [r.mean(tag) for r in runs]
        ax.barh(labels, widths, left=left, color=color, label=tag.split("/")[1].replace("_ms", ""))
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("mean ms per step (averaged over ranks)")
    ax.set_title("where a step's time goes")
    ax.invert_yaxis()
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    path = out / "time_split.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_classes(runs: Sequence[Run], out: Path) -> list[Path]:
    """per_class.md, a section per finished run, and each one's confusion matrix as a PNG."""
    finished = [r for r in runs if r.confusion]
    if not finished:
        return []
    sections, written = [], []
    for run in finished:
        counts, names = run.confusion
        path = out / f"confusion-{run.path.name}.png"
        path.write_bytes(confusion.png(counts, names, f"{run.path.name} ({run.label})"))
        sections.append(f"## {run.path.name} ({run.label})\n\n{confusion.markdown(confusion.per_class(counts, names))}")
        written.append(path)
    (out / "per_class.md").write_text("# Per-class test accuracy, last evaluation\n\n" + "\n".join(sections))
    return [out / "per_class.md", *written]


def write_report(paths: Sequence[Path], out: Path) -> list[Path]:
    runs = [load_run(p) for p in find_runs(paths)]
    if not runs:
        raise SystemExit(f"no TensorBoard event files under {', '.join(map(str, paths))}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown_table(runs))
    return [out / "report.md", plot_curves(runs, out), plot_time_split(runs, out), *write_classes(runs, out)]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories, or parents of several")
    p.add_argument("--out", type=Path, default=Path("report"), help="output folder (default: %(default)s)")
    a = p.parse_args(argv)
    for path in write_report(a.runs, a.out):
        print(f"wrote {path}")
    print((a.out / "report.md").read_text(), end="")


if __name__ == "__main__":
    main()
