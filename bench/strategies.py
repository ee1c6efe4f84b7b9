"""Every strategy side by side: same model, global batch, world size and threads per rank, each
run as real torchrun processes on synthetic data, timed by the suite's own step clock.

    python -m bench strategies                 # convnet (MNIST shape) and resnet18 (CIFAR shape)
    python -m bench strategies --models convnet --repeats 3

Per row: images/s, ms per step, ms of exposed sync (step time minus the no-sync row's, which
counts sync hidden inside backward too, e.g. DDP's), and the ratio of images/s to DDP's.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent

ROWS = [  # label, script and flags
    ("no sync (floor)", ["-m", "bench.references", "nosync"]),
    ("per-param all_reduce (tutorials)", ["train_allreduce.py", "--allreduce", "per-param"]),
    ("ddp", ["train_ddp.py"]),
    ("allreduce (buckets)", ["train_allreduce.py"]),
    ("allreduce --allreduce ring", ["train_allreduce.py", "--allreduce", "ring"]),
    ("master (reduce+broadcast)", ["train_master.py"]),
    ("master --master-update", ["train_master.py", "--master-update"]),
    ("dp (one process, all threads)", ["train_dp.py"]),
]

MODELS = {  # model -> (synthetic shape, steps timed, steps per logging interval)
    "convnet": ("mnist", 120, 20),
    "resnet18": ("cifar", 24, 4),
}


@dataclass
class Timing:
    data_ms: float
    compute_ms: float
    sync_ms: float

    @property
    def step_ms(self) -> float:
        return self.data_ms + self.compute_ms + self.sync_ms


ONE_PROCESS = {"train_dp.py"}  # nn.DataParallel: one process, given every rank's threads


def launcher(script: str, world: int, threads: int) -> tuple[list[str], dict[str, str]]:
    """torchrun for the distributed scripts; train_dp.py is one process, given every rank's threads.
    The checkout is on PYTHONPATH: a script outside its root (tests/faults.py) imports `common` too."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if script in ONE_PROCESS:
        return [sys.executable], {**env, "OMP_NUM_THREADS": str(threads * world)}
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"],
            {**env, "OMP_NUM_THREADS": str(threads)})


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    scalars: dict[str, list[float]]  # every TensorBoard scalar by tag


def train(script: list[str], flags: list[str], world: int, threads: int = 1, torchrun: Sequence[str] = ()) -> Finished:
    """Train with these flags in fresh temp folders (flags may name their own --checkpoint-dir);
    torchrun: more torchrun options (not for train_dp.py, which runs as one plain process)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as tmp:
        command, env = launcher(script[0], world, threads)
        done = subprocess.run([*command, *torchrun, *script, "--log-dir", f"{tmp}/tb",
                               "--checkpoint-dir", f"{tmp}/ckpt", *flags],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        if not os.path.isdir(f"{tmp}/tb"):  # a run that failed before its logger started
            return Finished(done.returncode, done.stdout, done.stderr, {})
        acc = EventAccumulator(f"{tmp}/tb", size_guidance={"scalars": 0})
        acc.Reload()
        scalars = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
        return Finished(done.returncode, done.stdout, done.stderr, scalars)


def run(script: list[str], flags: list[str], world: int, threads: int = 1) -> dict[str, list[float]]:
    """Train with these flags (fresh temp folders) and return every TensorBoard scalar by tag."""
    done = train(script, flags, world, threads)
    if done.returncode:
        raise SystemExit(f"{' '.join(script + flags)} failed:\n{done.stderr[-3000:]}")
    return done.scalars


def synthetic(model: str, batch: int, steps: int, every: int) -> list[str]:
    return ["--dataset", "synthetic", "--synthetic-shape", MODELS[model][0], "--model", model, "--batch-size",
            str(batch), "--epochs", "1", "--max-steps", str(steps), "--log-every", str(every)]


def timing(scalars: dict[str, list[float]]) -> Timing:
    """Mean of the logging intervals after the first (warm-up: allocator, first buckets, caches)."""
    def mean(tag: str) -> float:
        return statistics.fmean(scalars[tag][1:])
    return Timing(mean("time/data_ms"), mean("time/compute_ms"), mean("time/sync_ms"))


def run_row(script: list[str], model: str, batch: int, world: int, threads: int) -> Timing:
    _, steps, every = MODELS[model]
    return timing(run(script, synthetic(model, batch, steps, every), world, threads))


def best(timings: list[Timing]) -> Timing:
    """Fastest repeat: noise on a shared machine only ever adds time."""
    return min(timings, key=lambda t: t.step_ms)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batch-size", type=int, default=128, help="global batch (default: %(default)s)")
    p.add_argument("--world", type=int, default=2, help="processes (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="threads per rank (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="runs per row, fastest kept (default: %(default)s)")
    a = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; world {a.world}, "
          f"{a.threads} thread(s)/rank, gloo, global batch {a.batch_size}")
    for model in a.models:
        results = {}
        for _ in range(a.repeats):  # rows interleaved, so drift in machine load hits all of them
            for label, script in ROWS:
                results.setdefault(label, []).append(run_row(script, model, a.batch_size, a.world, a.threads))
        print_table(model, a.batch_size, {label: best(t) for label, t in results.items()})


def print_table(model: str, batch: int, rows: dict[str, Timing]) -> None:
    floor, ddp = rows["no sync (floor)"].step_ms, rows["ddp"].step_ms
    baseline = rows["per-param all_reduce (tutorials)"].step_ms
    print(f"\n{model} ({MODELS[model][0]} shape)\n")
    print("| strategy | images/s | ms/step | data / compute / sync ms | exposed sync ms | vs DDP | vs per-param |")
    print("|---|---|---|---|---|---|---|")
    for label, t in rows.items():
        print(f"| {label} | {1000 * batch / t.step_ms:,.0f} | {t.step_ms:.1f} | "
              f"{t.data_ms:.1f} / {t.compute_ms:.1f} / {t.sync_ms:.1f} | {t.step_ms - floor:.1f} | "
              f"{ddp / t.step_ms:.2f}x | {baseline / t.step_ms:.2f}x |")


if __name__ == "__main__":
    main()
