"""predict.py: each image's most likely classes and their probabilities, the image prepared as the
training run prepared its test images (the decoder of common/data/decoding.py: 16-bit and float
images scaled, converted to L or RGB, resized and centre-cropped where the run used --image-size,
normalized by the run's mean and std).

    python predict.py --checkpoint FILE IMAGE_OR_FOLDER... [--top-k K] [--output preds.csv|preds.json]

A folder is searched recursively for images (the extensions ImageFolder reads; other files are left
alone). A file that cannot be predicted (not an image, unreadable, or of another size where the
model takes images as they are) is named in one line on stderr and the others are predicted; the
exit status is then 1. One process, batched, in float32, on the GPU when there is one.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from common import shards as layout
from common.data.decoding import broken_message, decode, header
from common.data.loader import Normalizer
from common.use.program import check_storage, check_writable, make_parser, run_program
from common.use.source import Preprocessing, Saved

OUTPUT_FORMATS = (".csv", ".json")


@dataclass(frozen=True)
class Prediction:
    file: str
    top: list[tuple[str, int, float]]  # (class name, class index, probability), most likely first


def parse_flags(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = make_parser("predict.py", __doc__.split("\n\n")[0])
    add = p.add_argument
    add("images", nargs="+", metavar="IMAGE_OR_FOLDER", help="image files, or folders searched for images")
    add("--top-k", type=int, default=5, metavar="K", help="classes shown per image (default: %(default)s)")
    add("--output", default=None, metavar="FILE.csv|FILE.json",
        help="write the predictions to a CSV or JSON file instead of the console")
    add("--batch-size", type=int, default=64, help="images per forward (default: %(default)s)")
    add("--device", default="auto", choices=("auto", "cpu", "cuda"),
        help="auto: the GPU when there is one (default: %(default)s)")
    a = p.parse_args(argv)
    if a.top_k < 1 or a.batch_size < 1:
        p.error(f"--top-k and --batch-size must be >= 1 (got {a.top_k}, {a.batch_size})")
    if a.output and Path(a.output).suffix.lower() not in OUTPUT_FORMATS:
        p.error(f"--output {a.output}: name a .csv or a .json file")
    if a.output:
        check_writable(p, "--output", Path(a.output))
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no usable GPU; use --device cpu or auto")
    check_storage(p, a)
    return a


def main(argv: Sequence[str] | None = None) -> None:
    run_program(lambda: parse_flags(argv), predict_with)


def predict_with(flags: argparse.Namespace, saved: Saved) -> None:
    preprocessing = saved.preprocessing()
    device = torch.device(flags.device if flags.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    model = saved.model(flags.ema).to(device)
    failed = []
    predictions = list(predict(model, preprocessing, image_files(flags.images, failed), flags.top_k,
                               flags.batch_size, device, failed))
    write(predictions, flags.output)
    if failed:
        sys.exit(1)  # each failure has had its line


def image_files(paths: Sequence[str], failed: list[str]) -> Iterator[Path]:
    """The files named, and the images in the folders named (sorted, recursively); a path that is
    neither, or a folder without an image, is said in one line and added to `failed`."""
    for given in map(Path, paths):
        if given.is_dir():
            found = [f for f in layout.walk_files(given) if f.suffix.lower() in layout.FOLDER_EXTENSIONS
                     and f.is_file()]  # not a FIFO or a device: reading one would wait for ever
            if not found:
                fail(failed, f"{given} holds no image ({', '.join(layout.FOLDER_EXTENSIONS)})")
            yield from found
        elif given.is_file():
            yield given
        elif given.exists():
            fail(failed, f"{given}: not a regular file (a FIFO, a socket or a device is never read)")
        else:
            fail(failed, f"{given}: no such file or folder")


def fail(failed: list[str], message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    failed.append(message)


@torch.no_grad()
def predict(model: torch.nn.Module, p: Preprocessing, files: Iterator[Path], top_k: int, batch: int,
            device: torch.device, failed: list[str]) -> Iterator[Prediction]:
    """Predictions of the files that decode, `batch` at a time; the others go to `failed`."""
    normalize = Normalizer(p.spec, device, torch.contiguous_format)
    k = min(top_k, len(p.classes))
    for chunk in batches(decoded(files, p, failed), batch):
        names, images = zip(*chunk)
        probabilities = torch.softmax(model(normalize(torch.stack(images).to(device))).float(), dim=1)
        values, indices = probabilities.topk(k, dim=1)
        for name, row_values, row_indices in zip(names, values.tolist(), indices.tolist()):
            yield Prediction(name, [(p.classes[i], i, v) for i, v in zip(row_indices, row_values)])


def decoded(files: Iterator[Path], p: Preprocessing, failed: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each file's name and image, decoded as the training run decoded its test images."""
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as e:
            fail(failed, f"{path}: {e.strerror or e}; check that it is readable")
            continue
        try:
            (width, height), _ = header(data)
            if not p.resize and (width, height) != (p.size, p.size):
                fail(failed, f"{path} is {width}x{height}; the model takes {p.size}x{p.size} images as they are "
                             "(its run trained without --image-size)")
                continue
            image = decode(data, p.stored, p.channels)
        except Exception as e:  # noqa: BLE001 - any decoder failure is this file's problem, said in one line
            fail(failed, broken_message(str(path), e, skip_hint=False))
            continue
        yield str(path), image


def batches(items: Iterator, size: int) -> Iterator[list]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def write(predictions: list[Prediction], output: str | None) -> None:
    """On the console (one line per image), or to --output as CSV or JSON."""
    if output is None:
        for pred in predictions:
            print(f"{pred.file}  " + "  ".join(f"{name} {prob:.4f}" for name, _, prob in pred.top), flush=True)
        return
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    (write_json if path.suffix.lower() == ".json" else write_csv)(predictions, path)
    print(f"wrote {len(predictions)} prediction(s) to {path}", flush=True)


def write_json(predictions: list[Prediction], path: Path) -> None:
    rows = [{"file": pred.file, "top": [{"class": name, "index": index, "probability": prob}
                                        for name, index, prob in pred.top]} for pred in predictions]
    path.write_text(json.dumps(rows, indent=1) + "\n")


def write_csv(predictions: list[Prediction], path: Path) -> None:
    """file, class_1, probability_1, ..., class_k, probability_k: a row per image."""
    k = max((len(pred.top) for pred in predictions), default=0)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["file", *[column for i in range(1, k + 1) for column in (f"class_{i}", f"probability_{i}")]])
        writer.writerows([pred.file, *[value for name, _, prob in pred.top for value in (name, f"{prob:.6f}")]]
                         for pred in predictions)
