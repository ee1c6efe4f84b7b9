"""How close each strategy's step comes to the floor: a plain PyTorch loop in one process, one
thread, on the same per-rank batch, model and memory format. Every row runs as fresh processes,
rows interleaved over --repeats rounds. With --items, each item of a step timed alone instead.

    python -m bench steps                              # convnet, 32 images per rank, W=1 and 2
    python -m bench steps --models convnet resnet18 --repeats 5
    python -m bench steps --items                      # convnet, 32 images, one thread; then W=2

Ratio = the strategy's step time (the suite's own clock: data + compute + sync) / the floor's,
with the floor measured right before each row: this shared VM's speed drifts by 10-20% within
minutes, so a floor from another minute (or the fastest of several) pairs unlike with unlike. Per
row: the median ratio over the rounds, and the range. A second floor, two plain loops running at
once (one per core), shows what W=2 costs before any communication: the cores' shared caches and
memory, and the machine's other tenants.

--items: the memory format and SGD kernel of the plain step, per-step reseeding, a host read of the
tallies, and the round trips (gloo, and the shared-memory transport) that a stop flag, step metrics
and the gradients cost at W=2 (the collectives run as 2 torchrun processes of this module).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from bench.strategies import MODELS, run, synthetic, timing
from common.data.loader import make_synthetic
from common.models import build_model

ROOT = Path(__file__).resolve().parent.parent

STRATEGIES = [  # label, script and flags
    ("no sync (the suite's loop, nothing sent)", ["-m", "bench.references", "nosync"]),
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
from common.data.loader import make_synthetic
from common.models import build_model
torch.set_num_threads(1)
data = make_synthetic({shape!r})
model = build_model({model!r}, data.spec.channels, data.spec.size, 10, 0).to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
x = torch.randn({batch}, data.spec.channels, data.spec.size, data.spec.size)
x = x.contiguous(memory_format=torch.channels_last)
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
    code = FLOOR.format(shape=shape, model=model, batch=batch, steps=steps, warmup=max(2, steps // 6))
    loops = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, text=True) for _ in range(copies)]
    outputs = [loop.communicate()[0] for loop in loops]
    if any(loop.returncode for loop in loops):
        raise SystemExit("the plain loop failed")
    return statistics.fmean(float(out.split()[-1]) for out in outputs)


def strategy_ms(script: list[str], model: str, per_rank: int, world: int) -> float:
    _, steps, every = MODELS[model]
    return timing(run(script, synthetic(model, per_rank * world, steps, every), world)).step_ms


def ms_per_call(f: Callable[[], object], calls: int = 200, warmup: int = 20) -> float:
    for _ in range(warmup):
        f()
    start = time.perf_counter()
    for _ in range(calls):
        f()
    return 1000 * (time.perf_counter() - start) / calls


def plain_step_ms(memory_format: torch.memory_format, foreach: bool) -> float:
    data = make_synthetic("mnist")
    model = build_model("convnet", data.spec.channels, data.spec.size, 10, 0).to(memory_format=memory_format)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4, foreach=foreach)
    x = torch.randn(32, 1, 28, 28).contiguous(memory_format=memory_format)
    y = torch.randint(0, 10, (32,))

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return ms_per_call(step, 150)


def items_one_process() -> None:
    torch.set_num_threads(1)
    print("| item | ms |\n|---|---|")
    print(f"| plain step, contiguous, for-loop SGD | {plain_step_ms(torch.contiguous_format, False):.2f} |")
    print(f"| plain step, contiguous, foreach SGD | {plain_step_ms(torch.contiguous_format, True):.2f} |")
    print(f"| plain step, channels_last, foreach SGD | {plain_step_ms(torch.channels_last, True):.2f} |")
    print(f"| `torch.manual_seed` (a reseed per step) | {ms_per_call(lambda: torch.manual_seed(12345)):.3f} |")
    tally = torch.zeros(2)
    print("| a host read of the loss/accuracy tally (`.item()`) | "
          f"{ms_per_call(lambda: (tally + 1).sum().item()):.3f} |")


def items_collectives() -> None:
    import torch.distributed as dist

    from common.parallel.context import DistContext, open_transport

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    shm, _ = open_transport(DistContext(rank, world, rank, world, torch.device("cpu"), "gloo"), "shm", 60)
    flag, metrics = torch.zeros(1, dtype=torch.int32), torch.zeros(6, dtype=torch.float64)
    grads = torch.zeros(sum(p.numel() for p in build_model("convnet", 1, 28, 10, 0).parameters()))
    rows = [("a 1-int all_reduce (the stop flag)", flag), ("a 6-double all_reduce (one step's metrics)", metrics),
            (f"the gradients' all_reduce ({grads.numel() * 4 / 1000:.0f} KB)", grads)]
    for label, tensor in rows:
        for wire, all_reduce in (("gloo", dist.all_reduce), ("shm", lambda t: shm.all_reduce(t).wait())):
            dist.barrier()
            ms = ms_per_call(lambda reduce=all_reduce, t=tensor: reduce(t), 300, 30)
            if rank == 0:
                print(f"| W=2, {wire}: {label} | {ms:.3f} |")
    dist.destroy_process_group()


def items() -> None:
    """--items: the one-process items here, then the collectives at W=2 in two torchrun processes."""
    if "RANK" in os.environ:
        items_collectives()
        return
    items_one_process()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    "-m", "bench.steps", "--items"], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["convnet"], choices=list(MODELS))
    p.add_argument("--per-rank", type=int, default=32, help="images per rank and step (default: %(default)s)")
    p.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--repeats", type=int, default=3, help="rounds over every row (default: %(default)s)")
    p.add_argument("--items", action="store_true", help="time each item of a step alone instead (convnet)")
    a = p.parse_args()
    if a.items:
        items()
        return
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
