"""Per-class accuracy and the confusion matrix, in the forms people read them: a markdown or CSV
table, a PNG, and JSON (what TensorBoard keeps for the report and evaluate.py writes beside it).

A confusion matrix here is a (classes, classes) table of counts: row the true class, column the
predicted one, so a row sums to the class's test images and its diagonal entry to those scored right.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from typing import Sequence

import numpy as np

Counts = Sequence[Sequence[int]]
# Where a training run's TensorBoard keeps them (common/output/logger.py), for people and for the report.
PER_CLASS_TAG = "test/per_class_accuracy"  # text: the markdown table
IMAGE_TAG = "test/confusion_matrix"  # image
JSON_TAG = "summary/confusion_matrix"  # text: to_json's, what the report reads back
ANNOTATED = 20  # up to this many classes each cell shows its count
LABELLED = 60  # up to this many classes each row and column shows its class name


@dataclass(frozen=True)
class ClassScore:
    name: str
    images: int
    correct: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.images if self.images else float("nan")


def per_class(counts: Counts, names: Sequence[str]) -> list[ClassScore]:
    matrix = np.asarray(counts, dtype=np.int64)
    return [ClassScore(name, int(matrix[i].sum()), int(matrix[i, i])) for i, name in enumerate(names)]


def markdown(scores: Sequence[ClassScore]) -> str:
    rows = [f"| {s.name} | {s.images} | {s.correct} | {_percent(s.accuracy)} |" for s in scores]
    return "\n".join(["| class | test images | correct | accuracy |", "|---|---|---|---|", *rows]) + "\n"


def csv_text(scores: Sequence[ClassScore]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["class", "images", "correct", "accuracy"])
    writer.writerows([s.name, s.images, s.correct, f"{s.accuracy:.6f}"] for s in scores)
    return out.getvalue()


def _percent(value: float) -> str:
    return "-" if value != value else f"{100 * value:.2f}%"  # a class without a test image: no accuracy


def to_json(counts: Counts, names: Sequence[str]) -> str:
    return json.dumps({"classes": list(names), "counts": np.asarray(counts, dtype=np.int64).tolist()})


def from_json(text: str) -> tuple[list[list[int]], list[str]]:
    """(counts, names) of to_json's text."""
    value = json.loads(text)
    return value["counts"], value["classes"]


def png(counts: Counts, names: Sequence[str], title: str) -> bytes:
    """The matrix as a PNG: each row coloured by the share of the class's images (so small classes
    show as clearly as large ones), with the counts written in when there are few classes."""
    out = io.BytesIO()
    _figure(counts, names, title).savefig(out, format="png", dpi=100)
    return out.getvalue()


def rgb(counts: Counts, names: Sequence[str], title: str) -> np.ndarray:
    """The same picture as png(), as a (height, width, 3) uint8 array (a TensorBoard image)."""
    figure = _figure(counts, names, title)
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[:, :, :3].copy()


def _figure(counts: Counts, names: Sequence[str], title: str):  # a matplotlib Figure, imported where it is used
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no display, no global state
    from matplotlib.figure import Figure

    matrix = np.asarray(counts, dtype=np.int64)
    classes = len(matrix)
    shares = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1)
    side = min(max(6.4, 0.4 * classes), 20.0)
    figure = Figure(figsize=(side + 1.5, side), constrained_layout=True)
    FigureCanvasAgg(figure)  # attaches itself as figure.canvas
    ax = figure.add_subplot()
    image = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    figure.colorbar(image, ax=ax, label="share of the true class's images")
    ax.set_title(title)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    if classes <= LABELLED:
        ax.set_xticks(range(classes), names, rotation=90)
        ax.set_yticks(range(classes), names)
    if classes <= ANNOTATED:
        for (row, column), count in np.ndenumerate(matrix):
            ax.text(column, row, str(count), ha="center", va="center", fontsize=8,
                    color="white" if shares[row, column] > 0.5 else "black")
    return figure
