"""`python -m bench forecast --calibrate`: what the cost model needs, measured on this machine, and
the model against the suite's own step times.

Measured: each collective the strategies use, over gloo and the shared-memory transport, at W=2 and
4 (torchrun processes of this module: a line a + b n fitted to the median time of each size, and the
ring's alpha and beta read from it); each strategy's step time (the suite's own clock: data +
compute + sync) at W=1, 2 and 4 as real torchrun runs of train_*.py; the no-sync reference at each
W, which is the model's compute (the ranks share the 2 cores: at W=4 two ranks per core). Rounds
interleave every row, so the machine's drifting load (other jobs share it) hits all of them alike;
medians are reported, with the range.

The model then puts each strategy's step together from those parts, as it does for a cluster, with
one difference: CPU ranks have no spare core, so nothing overlaps the backward.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench import costmodel as cm
from bench.strategies import run, synthetic, timing

ROOT = Path(__file__).resolve().parent.parent
MODEL, PER_RANK, STEPS, EVERY = "convnet", 16, 40, 10
SIZES = [1 << 12, 1 << 15, 1 << 17, 1 << 19, 1 << 21]  # bytes: the convnet's blocks up to 16x its gradients

ROWS: dict[str, tuple[list[str], str, str]] = {  # label -> (script and flags, the model's name, the wire)
    "ddp": (["train_ddp.py"], "ddp", "shm"),
    "allreduce": (["train_allreduce.py"], "allreduce", "shm"),
    "allreduce --allreduce ring": (["train_allreduce.py", "--allreduce", "ring"], "allreduce-ring", "ring"),
    "master": (["train_master.py"], "master", "shm"),
    "dp": (["train_dp.py"], "dp", "none"),
    "fsdp --shard optimizer": (["train_fsdp.py", "--shard", "optimizer"], "zero1", "gloo"),
    "fsdp --shard full": (["train_fsdp.py", "--shard", "full"], "fsdp2", "gloo"),
    "localsgd --sync-every 4": (["train_localsgd.py", "--sync-every", "4"], "localsgd", "gloo"),
}
NOSYNC = ["-m", "bench.references", "nosync"]


# --- in each torchrun process -------------------------------------------------------------------------


def median_ms(f: Callable[[], object], calls: int) -> float:
    """Median of `calls` timed calls, after a few untimed ones."""
    for _ in range(3):
        f()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def probe() -> None:
    """Time every collective at every size; rank 0 prints one JSON line: wire -> op -> [ms per size]."""
    import torch
    import torch.distributed as dist

    from common.parallel.comm import ring_all_reduce
    from common.parallel.context import DistContext, open_transport

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    shm, _ = open_transport(DistContext(rank, world, rank, world, torch.device("cpu"), "gloo"), "shm", 60)

    def shm_reduce_broadcast(t: torch.Tensor) -> None:
        shm.reduce(t).wait()
        shm.broadcast(t).wait()

    ops: dict[str, dict[str, Callable[[torch.Tensor], object]]] = {
        "shm": {"all_reduce": lambda t: shm.all_reduce(t).wait(), "reduce_broadcast": shm_reduce_broadcast},
        "gloo": {"all_reduce": dist.all_reduce,
                 "reduce_scatter": lambda t: dist.reduce_scatter_tensor(t[:t.numel() // world], t),
                 "all_gather": lambda t: dist.all_gather_into_tensor(t, t[:t.numel() // world].clone())},
        "ring": {"all_reduce": ring_all_reduce},
    }
    found: dict[str, dict[str, list[float]]] = {}
    for wire, table in ops.items():
        for op, call in table.items():
            for size in SIZES:
                tensor = torch.zeros(size // 4)
                dist.barrier()
                found.setdefault(wire, {}).setdefault(op, []).append(
                    median_ms(lambda call=call, tensor=tensor: call(tensor), max(8, 60 >> SIZES.index(size))))
    found["step"] = suite_steps(shm, rank, world)
    if rank == 0:
        print("PROBE " + json.dumps(found), flush=True)
    dist.destroy_process_group()


def suite_steps(shm: object, rank: int, world: int) -> dict[str, list[float]]:
    """The convnet's step in this process, without any sync and with the suite's hand-written
    buckets over the shared-memory transport (train_allreduce.py's sync), rounds interleaved: ms."""
    import torch
    import torch.nn.functional as F

    from common.models import build_model
    from common.parallel.comm import GradientBuckets, launch_all_reduce

    def steps(sync: GradientBuckets | None) -> Callable[[], None]:
        def step() -> None:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if sync:
                sync.finish()
            optimizer.step()
        return step

    model = build_model(MODEL, 1, 28, 10, 0).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(PER_RANK, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (PER_RANK,))
    buckets = GradientBuckets(model, 25, launch_all_reduce("torch", shm), rank=rank, device=torch.device("cpu"),
                              scale=1.0 / world)
    timed: dict[str, list[float]] = {"nosync": [], "buckets": [], "slowest": [], "mean": []}
    for _ in range(5):
        with buckets.paused():
            timed["nosync"].append(median_ms(steps(None), 10))
            slowest, mean = stragglers(steps(None), world, 10)
            timed["slowest"].append(slowest)
            timed["mean"].append(mean)
        timed["buckets"].append(median_ms(steps(buckets), 10))
    return timed


def stragglers(step: Callable[[], None], world: int, calls: int) -> tuple[float, float]:
    """(median slowest rank's, median mean rank's) ms of steps started together: a synchronized step
    waits for its slowest rank, which on a shared machine is well behind the mean."""
    import torch
    import torch.distributed as dist

    slowest, mean = [], []
    for _ in range(calls):
        dist.barrier()
        start = time.perf_counter()
        step()
        took = torch.tensor([1000 * (time.perf_counter() - start)])
        total = took.clone()
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        dist.all_reduce(total)
        slowest.append(took.item())
        mean.append(total.item() / world)
    return statistics.median(slowest), statistics.median(mean)


# --- the driver ---------------------------------------------------------------------------------------


def fit(sizes: list[int], ms: list[float]) -> tuple[float, float]:
    """a + b n through the points, each weighted by 1 / its time (relative error): small sizes count."""
    w = [1 / t ** 2 for t in ms]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, sizes)), sum(wi * y for wi, y in zip(w, ms))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, sizes)), sum(wi * x * y for wi, x, y in zip(w, sizes, ms))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    a = (sy - b * sx) / sw
    return max(a, 0.0) / 1000, max(b, 0.0) / 1000  # seconds, seconds per byte


def measure_collectives(world: int) -> dict[str, dict[str, list[float]]]:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                           "-m", "bench.calibration"], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    if done.returncode or not lines:
        raise SystemExit(f"the collectives' probe at W={world} failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][len("PROBE "):])


def lines_of(probes: list[dict[str, dict[str, list[float]]]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per wire and op: the line through the median (over rounds) time of each size."""
    return {wire: {op: fit(SIZES, [statistics.median(p[wire][op][i] for p in probes) for i in range(len(SIZES))])
                   for op in ops} for wire, ops in probes[0].items() if wire != "step"}


def convnet_workload(compute_s: float) -> cm.Workload:
    from common.models import build_model
    from train_fsdp import blocks

    net = build_model(MODEL, 1, 28, 10, 0)
    return cm.Workload(sum(p.numel() for p in net.parameters()), compute_s, PER_RANK, blocks=len(blocks(net)) + 1,
                       buffers=sum(b.numel() for b in net.buffers() if b.is_floating_point()))


def measured_step(script: list[str], world: int) -> tuple[float, float]:
    """(ms per step, training state MB) of one run: the suite's clock, intervals after the first."""
    scalars = run(script, synthetic(MODEL, PER_RANK * world, STEPS, EVERY), world)
    return timing(scalars).step_ms, scalars.get("mem/state_mb", [float("nan")])[-1]


def model_ms(kind: str, wire: str, compute_s: float, world: int, lines: dict[str, dict[str, tuple[float, float]]],
             sync_every: int) -> tuple[float, float]:
    """(ms per step, state MB) the model gives, from the measured compute and collectives."""
    w = convnet_workload(compute_s)
    net = cm.Fitted(world if wire != "none" and world > 1 else 1, lines.get(wire, {}))
    s = cm.Strategy(kind, "", sync_every=sync_every)
    step = cm.step(kind, w, s, net, False, world)
    return 1000 * step.seconds, step.memory_bytes / cm.MB


def main(repeats: int, worlds: list[int], as_json: bool) -> None:
    print(f"calibration: {os.cpu_count()} cores (shared with other jobs), gloo, one thread per rank, {MODEL} "
          f"(MNIST shape), {PER_RANK} images per rank, {STEPS} steps per run; {repeats} interleaved rounds, medians",
          file=sys.stderr)
    steps: dict[tuple[str, int], list[float]] = {}
    memory: dict[tuple[str, int], float] = {}
    probes: dict[int, list[dict[str, dict[str, list[float]]]]] = {}
    raw = Path(tempfile.gettempdir()) / f"forecast-calibration-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for round_ in range(repeats):
        for world in worlds:
            if world > 1:
                probes.setdefault(world, []).append(measure_collectives(world))
            for label, (script, _, _) in {"nosync": (NOSYNC, "", ""), **ROWS}.items():
                ms, mb = measured_step(script, world)
                steps.setdefault((label, world), []).append(ms)
                memory[(label, world)] = mb
        raw.write_text(json.dumps({"steps": [[k, w, v] for (k, w), v in steps.items()],
                                   "memory": [[k, w, v] for (k, w), v in memory.items()], "probes": probes}))
        print(f"  round {round_ + 1} of {repeats} done; every timing so far: {raw}", file=sys.stderr)
    doc = report(steps, memory, probes, worlds)
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        print_report(doc)


def straggling(probes: list[dict]) -> float:
    """How much longer a step started on every rank at once takes to finish on the slowest rank than
    on the mean one (the probes' median): what a synchronized step waits for, beyond the mean."""
    ratios = [s / m for p in probes if "slowest" in p["step"] for s, m in zip(p["step"]["slowest"], p["step"]["mean"])]
    return statistics.median(ratios) if ratios else 1.0


def waits_for_slowest(kind: str, factor: float, sync_every: int) -> float:
    """What of the slowest rank's lead a strategy waits for: all of it where it synchronizes every
    step, none in one process (DataParallel); local SGD waits once per H steps, by when independent
    leads have grown as sqrt(H) against H steps of compute."""
    if kind == "dp":
        return 1.0
    return 1 + (factor - 1) / math.sqrt(sync_every)


def in_process(probes: list[dict], lines: dict[str, dict[str, tuple[float, float]]], world: int) -> dict[str, float]:
    """The probe's own step check: the suite's buckets over shared memory against the model (the
    no-sync step, times the slowest rank's lead, plus the fitted all-reduce)."""
    nosync = statistics.median(t for p in probes for t in p["step"]["nosync"])
    buckets = statistics.median(t for p in probes for t in p["step"]["buckets"])
    factor = straggling(probes)
    return {"nosync_ms": nosync, "buckets_ms": buckets, "straggling": factor,
            "model_ms": model_ms("allreduce", "shm", factor * nosync / 1000, world, lines, 1)[0]}


def report(steps: dict[tuple[str, int], list[float]], memory: dict[tuple[str, int], float],
           probes: dict[int, list[dict]], worlds: list[int]) -> dict:
    """The model's compute at W: the no-sync run's step at W (its ranks share the cores as the
    strategies' do) times the slowest rank's lead measured at W (1 at W=1)."""
    lines = {w: lines_of(p) for w, p in probes.items()}
    factor = {w: straggling(probes[w]) if w in probes else 1.0 for w in worlds}
    nosync = {w: statistics.median(steps[("nosync", w)]) / 1000 for w in worlds}
    rows = []
    for label, (script, kind, wire) in ROWS.items():
        every = int(script[script.index("--sync-every") + 1]) if "--sync-every" in script else 1
        for world in worlds:
            waits = waits_for_slowest(kind, factor[world], every)
            measured = steps[(label, world)]
            # Each round's row against the no-sync run of the same round: the load drifts by the minute.
            ratios = [model_ms(kind, wire, floor / 1000 * waits, world, lines.get(world, {}), every)[0] / ms
                      for floor, ms in zip(steps[("nosync", world)], measured)]
            predicted, model_mb = model_ms(kind, wire, nosync[world] * waits, world, lines.get(world, {}), every)
            rows.append({"strategy": label, "world": world, "measured_ms": statistics.median(measured),
                         "measured_range_ms": [min(measured), max(measured)], "model_ms": predicted,
                         "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                         "model_state_mb": model_mb, "logged_state_mb": memory[(label, world)]})
    links = {world: {wire: {op: {"a_us": 1e6 * a, "b_ns_per_byte": 1e9 * b,
                                 **({"alpha_us": 1e6 * cm.ring_link(a, b, world).alpha_s,
                                     "beta_gbps": 8 / cm.ring_link(a, b, world).beta_s_per_byte / 1e9}
                                    if op == "all_reduce" and b > 0 else {})}
                             for op, (a, b) in ops.items()} for wire, ops in by_wire.items()}
             for world, by_wire in lines.items()}
    per_sample = {w: 1000 * nosync[w] / PER_RANK for w in worlds}
    return {"compute_ms_per_sample": per_sample, "nosync_ms": {w: 1000 * nosync[w] for w in worlds},
            "straggling": factor,
            "collectives": links, "rows": rows,
            "in_process": {w: in_process(p, lines[w], w) for w, p in probes.items()}}


def print_report(doc: dict) -> None:
    print("\ncompute (the no-sync reference), ms per sample: "
          + ", ".join(f"W={w}: {ms:.3f}" for w, ms in doc["compute_ms_per_sample"].items())
          + "; the slowest rank's step over the mean rank's, steps started together: "
          + ", ".join(f"W={w}: {f:.2f}" for w, f in doc["straggling"].items()))
    print("\ncollectives: fitted a + b n (median time per size), and a ring's alpha and beta read from the "
          "all-reduce\n")
    print("| W | wire | collective | a (us) | b (ns/byte) | ring alpha (us) | ring beta (Gb/s) |\n"
          "|---|---|---|---|---|---|---|")
    for world, wires in doc["collectives"].items():
        for wire, ops in wires.items():
            for op, f in ops.items():
                alpha = f"{f['alpha_us']:.1f}" if "alpha_us" in f else ""
                beta = f"{f['beta_gbps']:.1f}" if "beta_gbps" in f else ""
                print(f"| {world} | {wire} | {op} | {f['a_us']:.1f} | {f['b_ns_per_byte']:.3f} | {alpha} | {beta} |")
    print("\nin the probe's processes: the convnet's step without sync, with the suite's buckets over shared memory "
          "(train_allreduce.py's sync), and the model (the first plus the fitted all-reduce)\n")
    print("| W | no sync ms | slowest / mean | buckets ms | model ms | model / measured |\n|---|---|---|---|---|---|")
    for world, r in doc["in_process"].items():
        print(f"| {world} | {r['nosync_ms']:.2f} | {r['straggling']:.2f} | {r['buckets_ms']:.2f} | "
              f"{r['model_ms']:.2f} | "
              f"{r['model_ms'] / r['buckets_ms']:.2f} |")
    print("\nthe model against the suite's step time: medians over the rounds; model / measured per round, its "
          "compute from that round's no-sync run (target: within 15%)\n")
    print("| strategy | W | measured ms (range) | model ms | model / measured: median (range) "
          "| state MB: model / logged |\n|---|---|---|---|---|---|")
    for r in doc["rows"]:
        lo, hi = r["measured_range_ms"]
        flag = "" if abs(r["ratio"] - 1) <= 0.15 else ", over 15%"
        print(f"| {r['strategy']} | {r['world']} | {r['measured_ms']:.1f} ({lo:.1f}-{hi:.1f}) | {r['model_ms']:.1f} | "
              f"{r['ratio']:.2f} ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}{flag}) | "
              f"{r['model_state_mb']:.2f} / {r['logged_state_mb']:.2f} |")


if __name__ == "__main__":
    probe()
