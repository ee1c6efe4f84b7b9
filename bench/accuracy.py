"""Accuracy on real photos: our ImageFolder run beside torchvision's reference train.py (the same
model, epochs, global batch, optimizer and lr schedule), then ours from shards converted with
--max-side N beside ours from the original photos: top-1 per seed and their mean, the runs' CPU
seconds, and the input path's images per CPU-second on each set.

The task: one class per real photo (scikit-image's and scikit-learn's 11 colour photos, or
--photos DIR), each photo cut in two halves across its long side; the training images are drawn
from the first half only, the validation images from the second (bench pipeline's derivation: a
random crop of 60-100% of the half's largest crop of an ImageNet shape, rescaled to it, 70% at
500x375 or 375x500, mirrored half the time, JPEG quality 90). No validation pixel was ever seen in
training: the model has to recognise a scene from another part of it.

torchvision's reference scripts are not in its wheel, and not copied here: --reference names a
folder holding pytorch/vision's references/classification (train.py, presets.py, transforms.py,
utils.py; docs/benchmarks.md names the version measured). Each of its runs is a temporary copy of
that folder run as `python train.py` in one process (--device cpu), torch seeded first (the
script has no seed flag of its own). Ours: `python train_ddp.py`, one process, streamed
(--cache-gb 0); both with one DataLoader worker and one thread (OMP_NUM_THREADS=1).

    python -m bench accuracy --reference ~/vision/references/classification
    python -m bench accuracy --reference DIR --seeds 3 --epochs 12 --image-size 128 --max-side 183
    python -m bench accuracy --reference DIR --seeds 5 --jobs 15     # every run at once, on 15+ cores
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from PIL import Image

from bench.pipeline import derive, installed_photos, measure, our_data, our_path, photo_size, reference, training_files
from bench.wall import EPOCH, ROOT
from common.data.geometry import eval_short
from common.shards import Reencode, convert

T = TypeVar("T")

REFERENCE_FILES = ("train.py", "presets.py", "transforms.py", "utils.py")
THEIR_TOP1 = re.compile(r"Test: +Acc@1 ([\d.]+)")
# Runs torchvision's train.py as `python train.py ARGS` would, torch seeded first: argv is SEED DIR ARGS.
THEIRS = ("import runpy, sys, torch; seed, folder = int(sys.argv[1]), sys.argv[2]; torch.manual_seed(seed); "
          "sys.path.insert(0, folder); sys.argv = [folder + '/train.py', *sys.argv[3:]]; "
          "runpy.run_path(sys.argv[0], run_name='__main__')")


# ---------------------------------------------------------------- the task

def halves(photo: Image.Image) -> tuple[Image.Image, Image.Image]:
    """The photo cut in two across its long side: (training half, validation half)."""
    width, height = photo.size
    if width >= height:
        return photo.crop((0, 0, width // 2, height)), photo.crop((width // 2, 0, width, height))
    return photo.crop((0, 0, width, height // 2)), photo.crop((0, height // 2, width, height))


def write_task(root: Path, sources: list[Path], train_per_class: int, val_per_class: int, seed: int = 0) -> Path:
    """An ImageFolder tree, one class per source photo: train/ drawn from its first half, val/ from its second."""
    rng = random.Random(seed)
    for source in sources:
        train_half, val_half = halves(Image.open(source).convert("RGB"))
        for split, half, count in (("train", train_half, train_per_class), ("val", val_half, val_per_class)):
            folder = root / split / source.stem
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                derive(half, photo_size(rng), rng).save(folder / f"{i:05d}.jpg", quality=90)
    return root


# ---------------------------------------------------------------- the runs

@dataclass(frozen=True)
class Recipe:
    """What both scripts train with."""
    model: str  # a torchvision classification model's name
    image_size: int
    epochs: int
    batch: int  # global
    lr: float
    milestone: int  # the epoch after which the lr is multiplied by 0.1
    weight_decay: float = 1e-4

    @property
    def eval_resize(self) -> int:
        """The short side evaluation resizes to before its centre crop: ours', given to theirs."""
        return eval_short(self.image_size)


def our_command(recipe: Recipe, dataset: str, data: Path, seed: int, tmp: Path) -> list[str]:
    return [sys.executable, str(ROOT / "train_ddp.py"), "--dataset", dataset, "--data-dir", str(data),
            "--cache-dir", str(tmp / "cache"), "--cache-gb", "0", "--workers", "1", "--image-size",
            str(recipe.image_size), "--model", f"torchvision:{recipe.model}", "--epochs", str(recipe.epochs),
            "--batch-size", str(recipe.batch), "--seed", str(seed), "--optimizer", "sgd", "--lr", str(recipe.lr),
            "--momentum", "0.9", "--weight-decay", str(recipe.weight_decay), "--decay-norm-and-bias",
            "--schedule", "step", "--milestones", str(recipe.milestone), "--gamma", "0.1",
            "--log-dir", str(tmp / f"tb-{dataset}-{seed}"), "--checkpoint-dir", str(tmp / f"ck-{dataset}-{seed}"),
            "--resume", "none"]


def their_command(recipe: Recipe, reference: Path, data: Path, seed: int) -> list[str]:
    """torchvision's train.py with the same recipe: SGD with Nesterov momentum (ours' sgd), weight decay
    on every parameter (ours' --decay-norm-and-bias), StepLR at the milestone."""
    return [sys.executable, "-c", THEIRS, str(seed), str(reference), "--data-path", str(data), "--device", "cpu",
            "--model", recipe.model, "-b", str(recipe.batch), "--epochs", str(recipe.epochs), "-j", "1",
            "--opt", "sgd_nesterov", "--lr", str(recipe.lr), "--momentum", "0.9", "--wd", str(recipe.weight_decay),
            "--lr-scheduler", "steplr", "--lr-step-size", str(recipe.milestone), "--lr-gamma", "0.1",
            "--train-crop-size", str(recipe.image_size), "--val-crop-size", str(recipe.image_size),
            "--val-resize-size", str(recipe.eval_resize), "--output-dir", "", "--print-freq", "1000"]


@dataclass(frozen=True)
class Run:
    top1: float  # % on the validation photos after the last epoch
    cpu_s: float  # the run's processes together (its workers included)
    wall_s: float


class SideBySide:
    """Training runs, `jobs` at a time. The first that fails, or a Ctrl-C, ends those under way and
    starts no more: its line comes at once, not after every run still planned (an executor's shutdown
    runs its queue to the end, and a Ctrl-C reaches only the runs already started)."""

    def __init__(self, jobs: int) -> None:
        self.jobs, self.running, self.stopped, self.lock = jobs, set[subprocess.Popen](), False, threading.Lock()

    def map(self, run: Callable[..., T], planned: list[tuple]) -> list[T]:
        """run(*each of planned), in planned's order."""
        with ThreadPoolExecutor(self.jobs) as pool:
            futures = [pool.submit(run, *arguments) for arguments in planned]
            try:
                for future in as_completed(futures):
                    future.result()
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                self.stop()
                raise
        return [future.result() for future in futures]

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            for process in self.running:
                process.terminate()

    def start(self, command: list[str], **popen: Any) -> subprocess.Popen:
        with self.lock:
            if self.stopped:  # a run between its thread's start and here
                raise SystemExit("error: stopped before it started")
            process = subprocess.Popen(command, **popen)
            self.running.add(process)
            return process

    def train(self, command: list[str], top1: re.Pattern[str], timeout_s: float) -> Run:
        """One training run to its end: its last top-1 (`top1`'s first group, on stdout) and its cost,
        the CPU seconds of its own processes alone (wait4's usage: runs side by side do not count each
        other's)."""
        started = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            process, late = self.start(command, cwd=ROOT, env=env, stdout=out, stderr=err, text=True), threading.Event()
            timer = threading.Timer(timeout_s, lambda: (late.set(), process.kill()))
            timer.start()
            try:
                _, status, usage = os.wait4(process.pid, 0)
            finally:
                timer.cancel()
                with self.lock:
                    self.running.discard(process)
            process.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0), err.seek(0)
            stdout, stderr = out.read(), err.read()
        what = " ".join(command[:3])
        if process.returncode:
            killed = f", killed at --timeout-s {timeout_s:g}" if late.is_set() else ""
            raise SystemExit(f"error: {what} ... failed (exit {process.returncode}{killed}):\n{stderr[-3000:]}")
        found = top1.findall(stdout)
        if not found:
            raise SystemExit(f"error: no top-1 in the output of {what} ...:\n{stdout[-2000:]}")
        last = found[-1]
        return Run(float(last[1] if isinstance(last, tuple) else last), usage.ru_utime + usage.ru_stime,
                   time.perf_counter() - started)


# ---------------------------------------------------------------- the report

def input_rates(tree: Path, shards: Path, size: int, cache: Path) -> dict[str, float]:
    """Images per CPU-second, one thread: our whole training input path (worker + rank, basic
    augmentation) on the original photos and on the --max-side shards, and torchvision's reference
    train transform on the original photos (bench pipeline's rows)."""
    torch.set_num_threads(1)
    rows = [measure(name, our_path(our_data(kind, data, cache, size), "basic"))
            for name, kind, data in (("original", "imagefolder", tree), ("max-side", "shards", shards))]
    rows.append(measure("reference", reference(training_files(tree), size, None)))
    return {row.name: row.rate for row in rows}


def table(results: dict[str, list[Run]]) -> str:
    first = next(iter(results.values()))
    lines = ["| run | top-1 per seed (%) | mean | mean - the first row's | CPU s per run (mean) |",
             "|---|---|---|---|---|"]
    base = statistics.mean(run.top1 for run in first)
    for name, runs in results.items():
        mean = statistics.mean(run.top1 for run in runs)
        per_seed = ", ".join(f"{run.top1:.2f}" for run in runs)
        lines.append(f"| {name} | {per_seed} | {mean:.2f} | {mean - base:+.2f} | "
                     f"{statistics.mean(run.cpu_s for run in runs):.0f} |")
    return "\n".join(lines)


def copy_reference(reference: Path, into: Path) -> Path:
    into.mkdir(parents=True)
    for name in REFERENCE_FILES:
        shutil.copy2(reference / name, into / name)
    return into


def run_all(a: argparse.Namespace, recipe: Recipe, tmp: Path) -> None:
    sources = installed_photos() if a.photos is None else sorted(
        p for p in a.photos.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    if len(sources) < 2:
        raise SystemExit("error: fewer than 2 real photos: pip install scikit-image scikit-learn, or pass --photos DIR")
    tree = write_task(tmp / "photos", sources, a.train_per_class, a.val_per_class)
    shards = tmp / f"max-side-{a.max_side}"
    convert(tree, str(shards), reencode=Reencode(max_side=a.max_side))
    their_folder = copy_reference(a.reference, tmp / "reference")
    names = ("ours, original photos", "torchvision reference train.py, original photos",
             f"ours, --max-side {a.max_side} shards")
    planned = [(name, seed, command, top1) for seed in range(a.seeds)
               for name, command, top1 in zip(names, (our_command(recipe, "imagefolder", tree, seed, tmp),
                                                      their_command(recipe, their_folder, tree, seed),
                                                      our_command(recipe, "shards", shards, seed, tmp)),
                                              (EPOCH, THEIR_TOP1, EPOCH))]

    runs = SideBySide(a.jobs)

    def run(name: str, seed: int, command: list[str], top1: re.Pattern[str]) -> Run:
        done = runs.train(command, top1, a.timeout_s)
        print(f"  {name}, seed {seed}: top-1 {done.top1:.2f}%, {done.cpu_s:.0f} CPU s", file=sys.stderr, flush=True)
        return done

    finished = runs.map(run, planned)
    results: dict[str, list[Run]] = {name: [] for name in names}
    for (name, *_), done in zip(planned, finished):
        results[name].append(done)
    rates = input_rates(tree, shards, recipe.image_size, tmp / "rates")
    print(f"{len(sources)} classes ({', '.join(p.stem for p in sources)}); {a.train_per_class} training and "
          f"{a.val_per_class} validation photos per class from disjoint halves; torchvision:{recipe.model} from "
          f"scratch at {recipe.image_size} px, {recipe.epochs} epochs, global batch {recipe.batch}, SGD Nesterov "
          f"lr {recipe.lr} x0.1 after epoch {recipe.milestone}, weight decay {recipe.weight_decay}; one process, "
          f"one thread, one loader worker each; torch {torch.__version__}\n")
    print(table(results))
    print(f"\nimages per CPU-second at {recipe.image_size} px: our input path (worker + rank) {rates['original']:.0f} "
          f"from the original photos, {rates['max-side']:.0f} from the --max-side {a.max_side} shards "
          f"({rates['max-side'] / rates['original']:.2f}x); torchvision's reference transform {rates['reference']:.0f} "
          f"on the original photos")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", type=Path, required=True,
                   help="pytorch/vision's references/classification folder (git clone https://github.com/pytorch/vision)")
    p.add_argument("--photos", type=Path, default=None,
                   help="a folder of real photos, one class each (default: scikit-image's and scikit-learn's)")
    p.add_argument("--seeds", type=int, default=3, help="runs of each, seeds 0..N-1 (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=12, help="(default: %(default)s)")
    p.add_argument("--milestone", type=int, default=8, help="the lr is x0.1 after this epoch (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=112, help="(default: %(default)s)")
    p.add_argument("--model", default="shufflenet_v2_x0_5", help="a torchvision model (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (default: %(default)s)")
    p.add_argument("--lr", type=float, default=0.05, help="(default: %(default)s)")
    p.add_argument("--max-side", type=int, default=160,
                   help="the shards' --max-side (default: %(default)s: at --image-size 112, what 320 is at 224)")
    p.add_argument("--train-per-class", type=int, default=96, help="(default: %(default)s)")
    p.add_argument("--val-per-class", type=int, default=40, help="(default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=1800, help="the most one training run may take")
    p.add_argument("--jobs", type=int, default=1,
                   help="training runs at once, one core each (default: %(default)s; on a machine with cores to spare, "
                        "up to 3 x --seeds); the CPU seconds are each run's own")
    a = p.parse_args()
    missing = [name for name in REFERENCE_FILES if not (a.reference / name).is_file()]
    if missing:
        p.error(f"--reference {a.reference} lacks {', '.join(missing)}: pass pytorch/vision's "
                "references/classification folder")
    if a.jobs < 1:
        p.error(f"--jobs {a.jobs}: give 1 or more (training runs at once)")
    if a.photos is not None and not a.photos.is_dir():
        p.error(f"--photos {a.photos} is not a folder")
    recipe = Recipe(a.model, a.image_size, a.epochs, a.batch_size, a.lr, a.milestone)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            run_all(a, recipe, Path(tmp))
        except KeyboardInterrupt:
            raise SystemExit("bench accuracy: interrupted; the training runs under way were stopped") from None


if __name__ == "__main__":
    main()
