"""predict.py: each image's most likely classes and their probabilities, the image prepared as the
training run prepared its test images (the decoder of common/data/decoding.py: 16-bit and float
images scaled, converted to L or RGB, resized and centre-cropped where the run used --image-size,
normalized by the run's mean and std).

    python predict.py --checkpoint FILE IMAGE_OR_FOLDER... [--top-k K] [--output preds.csv|preds.json]

A folder is searched recursively for images (the extensions ImageFolder reads); the other files in
it are left alone, counted and named in one line. A file that cannot be predicted (not an image,
unreadable, or of another size where the model takes images as they are) is named in one line on
stderr and the others are predicted and written. Exit status: 0 every file predicted (with
--skip-broken: every file that could be), 3 some predicted and written and others not, 1 none
predicted (--output left as it was) or the checkpoint unusable, 2 a bad flag, 130 a Ctrl-C (one
line; the --output file is written whole or not at all). One process, batched, in float32, on the
GPU when there is one.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from common import shards as layout
from common.data.decoding import broken_message, decode, header
from common.data.loader import Normalizer
from common.use.program import check_storage, check_writable, make_parser, run_program, staged
from common.use.source import Preprocessing, Saved

OUTPUT_FORMATS = (".csv", ".json")
SOME_NOT_PREDICTED = 3  # the exit status when some files were predicted (and written) and others not
NONE_PREDICTED = 1
LISTED = 5  # of the files a folder holds that are not images: named, the rest counted


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
    add("--skip-broken", action="store_true",
        help=f"a file that cannot be predicted is named as skipped and the exit status stays 0 (default: it is "
             f"named as an error and the exit status is {SOME_NOT_PREDICTED}, or {NONE_PREDICTED} when no file "
             "was predicted)")
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


def predict_with(flags: argparse.Namespace, saved: Saved) -> int:
    preprocessing = saved.preprocessing()
    device = torch.device(flags.device if flags.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    model = saved.model(flags.ema).to(device)
    failed = Failures(flags.skip_broken)
    predictions = list(predict(model, preprocessing, image_files(flags.images, failed), flags.top_k,
                               flags.batch_size, device, failed))
    status = exit_status(len(predictions), failed)
    if status != NONE_PREDICTED:  # a run that predicted nothing (a mistyped path) leaves the --output there as it was
        write(predictions, flags.output)
    return status


def exit_status(predicted: int, failed: Failures) -> int:
    """0: nothing refused (or refusals skipped as asked); 3: some predicted, some refused; 1: none
    predicted. Each refusal has had its line."""
    if not predicted and failed.files:
        return NONE_PREDICTED
    return SOME_NOT_PREDICTED if failed.files and not failed.skip else 0


class Failures:
    """The files that could not be predicted, each said in one line as it is met: an error, or with
    --skip-broken a skipped file."""

    def __init__(self, skip: bool) -> None:
        self.skip, self.files = skip, []

    def add(self, message: str) -> None:
        print(f"{'skipped' if self.skip else 'error'}: {message}", file=sys.stderr, flush=True)
        self.files.append(message)


def image_files(paths: Sequence[str], failed: Failures) -> Iterator[Path]:
    """The files named, and the images in the folders named (sorted, recursively); a path that is
    neither, or a folder without an image, is said in one line and added to `failed`; the other
    files of a folder are named in a note."""
    for given in map(Path, paths):
        if given.is_dir():
            files = list(layout.walk_files(given))
            found = [f for f in files if f.suffix.lower() in layout.FOLDER_EXTENSIONS
                     and f.is_file()]  # not a FIFO or a device: reading one would wait for ever
            if not found:
                failed.add(f"{given} holds no image ({', '.join(layout.FOLDER_EXTENSIONS)})")
            elif others := sorted(set(files) - set(found), key=files.index):
                note_left_alone(given, others)
            yield from found
        elif given.is_file():
            yield given
        elif given.exists():
            failed.add(f"{given}: not a regular file (a FIFO, a socket or a device is never read)")
        else:
            failed.add(f"{given}: no such file or folder")


def note_left_alone(folder: Path, others: list[Path]) -> None:
    """One line naming the files of `folder` that are not images (the first few, and how many)."""
    names = ", ".join(str(f.relative_to(folder)) for f in others[:LISTED])
    more = f" and {len(others) - LISTED} more" if len(others) > LISTED else ""
    print(f"note: {folder}: {len(others)} file(s) not predicted, not being images "
          f"({', '.join(layout.FOLDER_EXTENSIONS)}): {names}{more}", file=sys.stderr, flush=True)


@torch.no_grad()
def predict(model: torch.nn.Module, p: Preprocessing, files: Iterator[Path], top_k: int, batch: int,
            device: torch.device, failed: Failures) -> Iterator[Prediction]:
    """Predictions of the files that decode, `batch` at a time; the others go to `failed`."""
    normalize = Normalizer(p.spec, device, torch.contiguous_format)
    k = min(top_k, len(p.classes))
    for chunk in batches(decoded(files, p, failed), batch):
        names, images = zip(*chunk)
        probabilities = torch.softmax(model(normalize(torch.stack(images).to(device))).float(), dim=1)
        values, indices = probabilities.topk(k, dim=1)
        for name, row_values, row_indices in zip(names, values.tolist(), indices.tolist()):
            yield Prediction(name, [(p.classes[i], i, v) for i, v in zip(row_indices, row_values)])


def decoded(files: Iterator[Path], p: Preprocessing, failed: Failures) -> Iterator[tuple[str, torch.Tensor]]:
    """Each file's name and image, decoded as the training run decoded its test images."""
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as e:
            failed.add(f"{path}: {e.strerror or e}; check that it is readable")
            continue
        try:
            (width, height), *_ = header(data)
            if not p.resize and (width, height) != (p.size, p.size):
                failed.add(f"{path} is {width}x{height}; the model takes {p.size}x{p.size} images as they are "
                             "(its run trained without --image-size)")
                continue
            image = decode(data, p.stored, p.channels)
        except Exception as e:  # noqa: BLE001 - any decoder failure is this file's problem, said in one line
            failed.add(broken_message(str(path), e, skip_hint=False))
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
        try:
            for pred in predictions:
                print(f"{pred.file}  " + "  ".join(f"{name} {prob:.4f}" for name, _, prob in pred.top), flush=True)
        except BrokenPipeError:  # stdout's reader stopped reading (| head -1): it has the lines it wanted
            # the line still buffered goes nowhere, not into a traceback at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    with staged(path.parent, [path.name]) as staging:
        (write_json if path.suffix.lower() == ".json" else write_csv)(predictions, staging / path.name)
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
