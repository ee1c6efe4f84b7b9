"""The GPU paths in one command: on a machine with CUDA, every strategy on every visible GPU over
nccl (fp32, bf16, --compile), the equivalence check on CUDA (every strategy, and the recipes it
covers), DataParallel over all GPUs, `--device cpu,cuda` ranks over gloo, FSDP2 and ZeRO-1, and a
kill-and-resume; then one table: images/s, max |dw|, peak CUDA memory per rank, pass/fail.

    python -m bench gpu                          # every row (several minutes)
    python -m bench gpu --only equivalence       # the rows whose label contains these words

Every figure is one the scripts report themselves: images/s from the step clock's TensorBoard
scalars (as `python -m bench strategies` reads them), max |dw| from the `equivalence: max |dw| =
...` line, memory from `mem/cuda_max_alloc_mb` (the largest of any rank). Exits 1 if a row failed;
where there is no CUDA device, says so in one line and exits 1.
"""
from __future__ import annotations

import argparse
import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.strategies import Finished, synthetic, timing, train

STRATEGIES = {  # label -> script and flags
    "ddp": ["train_ddp.py"],
    "allreduce": ["train_allreduce.py"],
    "allreduce --allreduce ring": ["train_allreduce.py", "--allreduce", "ring"],
    "master": ["train_master.py"],
    "master --master-update": ["train_master.py", "--master-update"],
    "fsdp --shard full (FSDP2)": ["train_fsdp.py", "--shard", "full"],
    "fsdp --shard optimizer (ZeRO-1)": ["train_fsdp.py", "--shard", "optimizer"],
    "localsgd": ["train_localsgd.py"],
}
EQUIVALENT = {**STRATEGIES, "localsgd": ["train_localsgd.py", "--sync-every", "1"]}  # H=1 equals averaging
MIXED = ["ddp", "allreduce", "master"]  # the strategies that take --device cpu,cuda
RECIPES = {"fp32": [], "bf16": ["--precision", "bf16"], "compile": ["--compile"]}
EQUIVALENT_RECIPES = {  # the recipe rows of docs/recipes.md's equivalence table, on DDP
    "--accumulate 2": ["--accumulate", "2"],
    "bf16, bf16 wire, --accumulate 2": ["--precision", "bf16", "--grad-compression", "bf16", "--accumulate", "2"],
    "fp16 (GradScaler), fp16 wire": ["--precision", "fp16", "--grad-compression", "fp16"],
    "--compile": ["--compile"],
}
NCCL = ["--device", "cuda", "--backend", "nccl"]
MAX_DW = re.compile(r"equivalence: max \|dw\| = (\S+) after")
KILL_AND_RESUME = "kill-and-resume: ddp, nccl"
RESUME_TOLERANCE = 1e-5  # cuDNN may pick other kernels after the restart: not bit-exact as on the CPU


@dataclass(frozen=True)
class Check:
    label: str
    script: list[str]
    flags: list[str]
    world: int
    images: int = 0  # global batch of a throughput row; 0 for an equivalence row


@dataclass
class Row:
    label: str
    world: int
    passed: bool
    images_per_s: float | None = None
    max_dw: float | None = None
    cuda_mb: float | None = None
    why: str = field(default="")  # a failed row's error line


def plan(gpus: int, model: str, per_rank: int) -> list[Check]:
    """Every row but the kill-and-resume, in the table's order."""
    batch = per_rank * gpus
    steps = min(40, 10000 // batch)  # within one epoch of the 10,000 synthetic images
    training = synthetic(model, batch, steps, max(1, steps // 5))
    small = synthetic("convnet", 64, 40, 8)  # mixed ranks: the CPU rank sets the pace
    equal = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--check-equivalence", "4",
             "--batch-size", str(48 if 48 % gpus == 0 else 12 * gpus)]  # the tests' check: lenet, batch 48, 4 steps
    return [
        *(Check(f"{name}, {recipe}, nccl", script, [*training, *flags, *NCCL], gpus, batch)
          for name, script in STRATEGIES.items() for recipe, flags in RECIPES.items()),
        *(Check(f"dp over {gpus} GPU(s), {recipe}", ["train_dp.py"], [*training, *flags], 1, batch)
          for recipe, flags in RECIPES.items()),
        *(Check(f"{name}, --device cpu,cuda, gloo", STRATEGIES[name], [*small, "--device", "cpu,cuda"], 2, 64)
          for name in MIXED),
        *(Check(f"equivalence: {name}, nccl", script, [*equal, *NCCL], gpus) for name, script in EQUIVALENT.items()),
        Check(f"equivalence: dp over {gpus} GPU(s)", ["train_dp.py"], equal, 1),
        *(Check(f"equivalence: ddp {name}, nccl", ["train_ddp.py"], [*equal, *flags, *NCCL], gpus)
          for name, flags in EQUIVALENT_RECIPES.items()),
    ]


def row(label: str, world: int, done: Finished, images: int = 0, passed: bool | None = None,
        max_dw: float | None = None) -> Row:
    """A row from a finished run, with the figures it reported; passed: its exit status unless given."""
    scalars, found = done.scalars, MAX_DW.search(done.stdout)
    timed = images and len(scalars.get("time/data_ms", [])) > 1  # the first interval is warm-up
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    why = next((line for line in lines if line.startswith("error:")), lines[-1] if lines else "no output")
    passed = done.returncode == 0 if passed is None else passed
    return Row(label, world, passed, 1000 * images / timing(scalars).step_ms if timed else None,
               float(found.group(1)) if found else max_dw,
               scalars["mem/cuda_max_alloc_mb"][-1] if scalars.get("mem/cuda_max_alloc_mb") else None,
               "" if passed else why)


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The model in the checkpoint that the one run under this --checkpoint-dir saved last."""
    pointer = json.loads(next(folder.glob("*/latest.json")).read_text())
    return torch.load(folder / pointer["checkpoint"], map_location="cpu", weights_only=True)["model"]


def kill_and_resume(gpus: int) -> Row:
    """DDP over nccl cut after step 5 and resumed from its checkpoint, against an uninterrupted run.
    With 2+ GPUs rank 1 is SIGKILLed and torchrun restarts the job (--max-restarts=1); with one GPU
    (rank 0 alone) the run is stopped by SIGTERM and the same command run again."""
    fault = "sigkill" if gpus >= 2 else "sigterm"
    flags = [*synthetic("resnet18", 64 * gpus, 16, 4), "--save-every-steps", "3", *NCCL]
    faulty = lambda fault_: ["tests/faults.py", "ddp", fault_, "5"]  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        whole, cut = ["--checkpoint-dir", f"{tmp}/whole"], ["--checkpoint-dir", f"{tmp}/cut"]
        done = train(faulty("none"), [*flags, *whole], gpus)
        if done.returncode == 0:
            done = train(faulty(fault), [*flags, *cut], gpus, torchrun=["--max-restarts=1"])
        if fault == "sigterm" and any(Path(tmp, "cut").glob("*/latest.json")):  # it saved: the same command resumes
            done = train(faulty("none"), [*flags, *cut], gpus)
        if done.returncode:
            return row(KILL_AND_RESUME, gpus, done)
        before, after = final_weights(Path(tmp, "whole")), final_weights(Path(tmp, "cut"))
    max_dw = max((before[k].double() - after[k].double()).abs().max().item() for k in before)
    return row(KILL_AND_RESUME, gpus, done, passed=max_dw <= RESUME_TOLERANCE, max_dw=max_dw)


def print_table(rows: list[Row]) -> None:
    figure = lambda value, form: "" if value is None else format(value, form)  # noqa: E731
    print("\n| check | world | images/s | max \\|dw\\| | CUDA MB per rank (max) | result |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.label} | {r.world} | {figure(r.images_per_s, ',.0f')} | {figure(r.max_dw, '.3g')} | "
              f"{figure(r.cuda_mb, ',.0f')} | {'pass' if r.passed else 'FAIL'} |")
    for r in rows:
        if not r.passed:
            print(f"FAIL {r.label}: {r.why}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", default=[], help="run only the rows whose label contains one of these")
    p.add_argument("--model", default="resnet18", help="model of the throughput rows (default: %(default)s)")
    p.add_argument("--per-rank", type=int, default=64, help="images per GPU and step (default: %(default)s)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"error: no CUDA device here (torch {torch.__version__}, CUDA build "
                         f"{torch.version.cuda or 'none'}): python -m bench gpu needs a machine with a GPU")
    gpus = torch.cuda.device_count()
    print(f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    wanted = lambda label: not a.only or any(word in label for word in a.only)  # noqa: E731
    rows = []
    for check in (c for c in plan(gpus, a.model, a.per_rank) if wanted(c.label)):
        rows.append(row(check.label, check.world, train(check.script, check.flags, check.world), check.images))
        print(f"{'pass' if rows[-1].passed else 'FAIL'}  {check.label}", flush=True)
    if wanted(KILL_AND_RESUME):
        rows.append(kill_and_resume(gpus))
    print_table(rows)
    if not all(r.passed for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
