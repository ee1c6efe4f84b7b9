"""How close each strategy's step comes to the floor: a plain PyTorch loop in one process, one
thread, on the same per-rank batch, model and memory format. Every row runs as fresh processes,
rows interleaved over --repeats rounds.

    python bench/steps.py                              # convnet, 32 images per rank, W=1 and 2
    python bench/steps.py --models convnet resnet18 --repeats 5

Ratio = the strategy's step time (the suite's own clock: data + compute + sync) / the floor's,
with the floor measured right before each row: this shared VM's speed drifts by 10-20% within
minutes, so a floor from another minute (or the fastest of several) pairs unlike with unlike. Per
row: the median ratio over the rounds, and the range. A second floor, two plain loops running at
once (one per core), shows what W=2 costs before any communication: the cores' shared caches and
memory, and the machine's other tenants.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.strategies import MODELS, run, synthetic, timing  # noqa: E402

STRATEGIES = [  # label, script and flags
    ("no sync (the suite's loop, nothing sent)", ["bench/nosync.py"]),
    ("ddp", ["train_ddp.py"]),
    ("ddp --transport gloo", ["train_ddp.py", "--transport", "gloo"]),
    ("allreduce", ["train_allreduce.py"]),
    ("allreduce --transport gloo", ["train_allreduce.py", "--transport", "gloo"]),
    ("allreduce --allreduce gather", ["train_allreduce.py", "--allreduce", "gather"]),
    ("master", ["train_master.py"]),
    ("master --master-update", ["train_master.py", "--master-update"]),
]

FLOOR = """
import sys, time, torch, torch.nn.functional as F
sys.path.insert(0, {root!r})
from common.data import make_synthetic
from common.models import build_model
torch.set_num_threads(1)
data = make_synthetic({shape!r})
model = build_model({model!r}, data.spec.channels, data.spec.size, 10, 0).to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
x = torch.randn({batch}, data.spec.channels, data.spec.size, data.spec.size).contiguous(memory_format=torch.channels_last)
y = torch.randint(0, 10, ({batch},))
def step():
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
for _ in range({warmup}):
    step()
start = time.perf_counter()
for _ in range({steps}):
    step()
print(1000 * (time.perf_counter() - start) / {steps})
"""


def floor_ms(model: str, batch: int, copies: int = 1) -> float:
    """The plain loop's ms per step; with copies > 1, that many loops at once, their mean."""
    shape, steps, _ = MODELS[model]
    code = FLOOR.format(root=str(ROOT), shape=shape, model=model, batch=batch, steps=steps, warmup=max(2, steps // 6))
    loops = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, text=True) for _ in range(copies)]
    outputs = [loop.communicate()[0] for loop in loops]
    if any(loop.returncode for loop in loops):
        raise SystemExit("the plain loop failed")
    return statistics.fmean(float(out.split()[-1]) for out in outputs)


def strategy_ms(script: list[str], model: str, per_rank: int, world: int) -> float:
    _, steps, every = MODELS[model]
    return timing(run(script, synthetic(model, per_rank * world, steps, every), world)).step_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["convnet"], choices=list(MODELS))
    p.add_argument("--per-rank", type=int, default=32, help="images per rank and step (default: %(default)s)")
    p.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--repeats", type=int, default=3, help="rounds over every row (default: %(default)s)")
    a = p.parse_args()
    print(f"{os.cpu_count()} cores; one thread per rank; gloo; {a.per_rank} images per rank; channels_last")
    for model in a.models:
        rows: dict[str, list[tuple[float, float]]] = {}  # row -> (its ms per step, the floor's just before)
        pairs = []
        for _ in range(a.repeats):  # interleaved, so drifting load hits every row alike
            pairs.append(floor_ms(model, a.per_rank, copies=2))
            for world in a.worlds:
                for label, script in STRATEGIES:
                    floor = floor_ms(model, a.per_rank)
                    rows.setdefault(f"{label}, W={world}", []).append(
                        (strategy_ms(script, model, a.per_rank, world), floor))
        floors = [floor for measured in rows.values() for _, floor in measured]
        pair = statistics.median(pairs)
        print(f"\n{model}: plain loop, one process: {statistics.median(floors):.1f} ms per step (median; "
              f"{min(floors):.1f}-{max(floors):.1f}); two plain loops at once: {pair:.1f} ms (median)\n")
        print("| strategy | ms per step (median) | / floor just before: median (range) "
              "| median / two loops at once (median) |\n|---|---|---|---|")
        for label, measured in rows.items():
            ms = statistics.median(row for row, _ in measured)
            ratios = [row / floor for row, floor in measured]
            print(f"| {label} | {ms:.1f} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                  f"{ms / pair:.2f} |")


if __name__ == "__main__":
    main()
