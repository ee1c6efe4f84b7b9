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
from PIL import Image, ImageDraw, ImageFont

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
    _picture(counts, names, title).save(out, format="PNG")
    return out.getvalue()


def rgb(counts: Counts, names: Sequence[str], title: str) -> np.ndarray:
    """The same picture as png(), as a (height, width, 3) uint8 array (a TensorBoard image)."""
    return np.asarray(_picture(counts, names, title))


# Matplotlib's "Blues" (ColorBrewer's nine steps), from a share of 0 to 1.
BLUES = np.array([[247, 251, 255], [222, 235, 247], [198, 219, 239], [158, 202, 225], [107, 174, 214],
                  [66, 146, 198], [33, 113, 181], [8, 81, 156], [8, 48, 107]], dtype=np.float64)
PAD, TEXT, BAR = 10, 13, 16  # pixels: the margins, a line of text, the colour bar's width


def _blues(shares: np.ndarray) -> np.ndarray:
    """uint8 RGB of each share in [0, 1]."""
    steps = np.linspace(0.0, 1.0, len(BLUES))
    return np.stack([np.interp(shares, steps, BLUES[:, c]) for c in range(3)], axis=-1).round().astype(np.uint8)


def _picture(counts: Counts, names: Sequence[str], title: str) -> Image.Image:
    """Drawn with PIL, not matplotlib: a run's end draws one, and matplotlib's import and layout cost
    about a CPU-second a run (PIL: milliseconds)."""
    matrix = np.asarray(counts, dtype=np.int64)
    classes = max(len(matrix), 1)
    shares = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1)
    cell = int(np.clip(640 // classes, 4, 48))
    font = ImageFont.load_default(size=TEXT - 1)
    labels = list(names) if classes <= LABELLED else []
    label = max((int(font.getlength(name)) for name in labels), default=0) + PAD // 2
    grid = classes * cell
    left, top = PAD + TEXT + label, PAD + 2 * TEXT
    picture = Image.new("RGB", (left + grid + 3 * PAD + BAR + 3 * TEXT + PAD, top + grid + label + TEXT + 2 * PAD),
                        "white")
    draw = ImageDraw.Draw(picture)
    draw.text((left + grid // 2, PAD), title, fill="black", font=font, anchor="mt")
    picture.paste(Image.fromarray(_blues(shares).repeat(cell, axis=0).repeat(cell, axis=1)), (left, top))
    for index, name in enumerate(labels):
        middle = index * cell + cell // 2
        draw.text((left - PAD // 2, top + middle), name, fill="black", font=font, anchor="rm")
        _vertical(picture, name, font, (left + middle, top + grid + PAD // 2), anchor="top")
    if classes <= ANNOTATED:
        small = ImageFont.load_default(size=max(min(cell // 3, TEXT - 1), 6))
        for (row, column), count in np.ndenumerate(matrix):
            draw.text((left + column * cell + cell // 2, top + row * cell + cell // 2), str(count), font=small,
                      fill="white" if shares[row, column] > 0.5 else "black", anchor="mm")
    draw.text((left + grid // 2, top + grid + label + PAD), "predicted class", fill="black", font=font, anchor="mt")
    _vertical(picture, "true class", font, (PAD, top + grid // 2), anchor="middle")
    _colour_bar(picture, font, (left + grid + 2 * PAD, top), grid)
    return picture


def _colour_bar(picture: Image.Image, font: ImageFont.FreeTypeFont, corner: tuple[int, int], height: int) -> None:
    """The scale beside the grid: share 1 at the top, 0 at the bottom, and what it measures."""
    x, y = corner
    ramp = _blues(np.linspace(1.0, 0.0, max(height, 2)))[:, None, :].repeat(BAR, axis=1)
    picture.paste(Image.fromarray(ramp), (x, y))
    draw = ImageDraw.Draw(picture)
    for share in (0.0, 0.5, 1.0):
        draw.text((x + BAR + 3, y + round((1 - share) * (height - 1))), f"{share:g}", fill="black", font=font,
                  anchor="lm")
    _vertical(picture, "share of the true class's images", font, (x + BAR + 2 * TEXT + PAD // 2, y + height // 2),
              anchor="middle")


def _vertical(picture: Image.Image, text: str, font: ImageFont.FreeTypeFont, at: tuple[int, int], anchor: str) -> None:
    """`text` turned a quarter left (read bottom to top), centred on `at` across; along, its top at `at`
    (anchor "top") or its middle (anchor "middle")."""
    width = max(int(font.getlength(text)), 1)
    mask = Image.new("L", (width, TEXT + 2))
    ImageDraw.Draw(mask).text((0, 0), text, fill=255, font=font)
    mask = mask.rotate(90, expand=True)
    x, y = at
    x -= mask.width // 2
    if anchor == "middle":
        y -= mask.height // 2
    picture.paste((0, 0, 0), (x, y), mask)
