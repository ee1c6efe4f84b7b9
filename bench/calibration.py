"""`python -m bench forecast --calibrate`: what the cost model needs, measured on this machine, and
the model against the suite's own step times.

Measured: each collective the strategies use, over gloo and the shared-memory transport, at W=2 and
4 (torchrun processes of this module: a line a + b n fitted to each size's time, and the ring's
alpha and beta read from it), back to back (the wire's own cost) and issued from a step, both after
the step's compute and at FSDP2's spacing, a block's compute apart (the cost training sees, and the
model's: on CPU ranks the collective's threads wait for a core the step's compute held, and the
ranks arrive apart); each strategy's step time (the suite's own clock: data + compute + sync) at
W=1, 2 and 4 as real torchrun runs of train_*.py, each between two runs of the no-sync reference
at the same W. A strategy's compute at W is its own step at W=1, where it sends nothing, scaled as
the no-sync step beside it scales from W=1 to W (the ranks share the 2 cores: at W=4 two ranks per
core): the host's load drifts by 15% and more over the minutes of a round (other jobs share it),
and the runs either side of a run, seconds away, share its load. Rounds interleave
every row; medians are reported, with the range.

The model then puts each strategy's step together from those parts, as it does for a cluster, with
two differences: CPU ranks have no spare core, so nothing overlaps the backward, and each collective
costs what it cost in a step (on a GPU, NCCL's kernels run on their own stream and the link's
alpha and beta are the cluster's).
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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from bench import costmodel as cm
from bench.strategies import ONE_PROCESS, run, synthetic, timing

ROOT = Path(__file__).resolve().parent.parent
MODEL, PER_RANK, STEPS, EVERY = "convnet", 16, 80, 10
SIZES = [1 << 12, 1 << 15, 1 << 17, 1 << 19, 1 << 21]  # bytes: the convnet's blocks up to 16x its gradients
IN_STEP_ROUNDS, IN_STEP_CALLS = 3, 8  # a collective timed in a step: interleaved rounds, steps to a mean

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
NOSYNC_ONE_PROCESS = "nosync, one process"  # the reference laid out as train_dp.py runs: see reference_of


# --- in each torchrun process -------------------------------------------------------------------------


def timed_ms(f: Callable[[], object], calls: int) -> list[float]:
    """`calls` timed calls, after a few untimed ones (ms)."""
    for _ in range(3):
        f()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        f()
        times.append(1000 * (time.perf_counter() - start))
    return times


def median_ms(f: Callable[[], object], calls: int) -> float:
    return statistics.median(timed_ms(f, calls))


def mean_ms(f: Callable[[], object], calls: int) -> float:
    return statistics.fmean(timed_ms(f, calls))


def probe(chosen: list[str], rounds: int) -> None:
    """Time every collective (or the `chosen` ones: an op on every wire, or wire:op) at every size,
    back to back and issued from a step; rank 0 prints one JSON line: kind -> wire -> op -> [ms per
    size], and the steps."""
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
    ops = {wire: {op: call for op, call in table.items() if not chosen or {op, f"{wire}:{op}"} & set(chosen)}
           for wire, table in ops.items()}
    ops = {wire: table for wire, table in ops.items() if table}
    convnet = ConvnetStep(shm, rank, world)
    with convnet.buckets.paused():  # else their hooks launch the buckets' all-reduces, which no step finishes
        in_steps = in_step(ops, convnet, rounds)
    found = {"back_to_back": back_to_back(ops), **in_steps, "step": convnet.timed()}
    if rank == 0:
        print("PROBE " + json.dumps(found), flush=True)
    dist.destroy_process_group()


def back_to_back(ops: dict[str, dict[str, Callable]]) -> dict[str, dict[str, list[float]]]:
    """Each collective in a loop of calls: the wire's own cost, ms per size."""
    import torch
    import torch.distributed as dist

    found: dict[str, dict[str, list[float]]] = {}
    for wire, table in ops.items():
        for op, call in table.items():
            for i, size in enumerate(SIZES):
                tensor = torch.zeros(size // 4)
                dist.barrier()
                found.setdefault(wire, {}).setdefault(op, []).append(
                    median_ms(lambda call=call, tensor=tensor: call(tensor), max(8, 60 >> i)))
    return found


def in_step(ops: dict[str, dict[str, Callable]], convnet: "ConvnetStep", rounds: int) -> dict[str, dict]:
    """Each collective as training issues it, two ways: once after a step's compute (a step with it
    less the step alone: where DDP's last bucket, the ring and ZeRO-1's reduce-scatter sit) and at
    the spacing of FSDP2's calls (before each block's forward and after each block's backward: the
    step with them less the step alone, per call); means of IN_STEP_CALLS steps (the suite's clock
    is a mean, and a wait that misses its wake-up is a slow mode a median drops), medians over
    interleaved rounds, ms per size. On a host whose cores all compute, a collective's I/O threads
    wait for a core and the ranks arrive apart: 1-3.5 ms at W=2 where the same call costs 0.04-0.7
    ms back to back; the first call after a whole step's compute pays the ranks' lead over the step,
    a call a block after the last pays one block's."""
    import torch
    import torch.distributed as dist

    extras: dict[tuple[str, str, str, int], list[float]] = {}  # per round
    step = convnet.step(None)
    for _ in range(rounds):
        for wire, table in ops.items():
            for op, call in table.items():
                dist.barrier()
                alone = mean_ms(step, IN_STEP_CALLS)
                for i, size in enumerate(SIZES):
                    tensor = torch.zeros(size // 4)
                    dist.barrier()
                    after = mean_ms(lambda call=call, tensor=tensor: (step(), call(tensor)), IN_STEP_CALLS)
                    dist.barrier()
                    with convnet.at_blocks(lambda call=call, tensor=tensor: call(tensor)) as calls:
                        spaced = mean_ms(step, IN_STEP_CALLS)
                    extras.setdefault(("after_step", wire, op, i), []).append(after - alone)
                    extras.setdefault(("at_blocks", wire, op, i), []).append((spaced - alone) / calls)
    found: dict[str, dict[str, dict[str, list[float]]]] = {}
    for (placed, wire, op, _), extra in extras.items():  # below 0 where the step's jitter outweighs a small call
        found.setdefault(placed, {}).setdefault(wire, {}).setdefault(op, []).append(statistics.median(extra))
    return found


class ConvnetStep:
    """The convnet's training step in this process, with or without the suite's hand-written
    buckets over the shared-memory transport (train_allreduce.py's sync)."""

    def __init__(self, shm: object, rank: int, world: int) -> None:
        import torch

        from common.models import build_model
        from common.parallel.comm import GradientBuckets, launch_all_reduce
        from train_fsdp import blocks

        self.model = build_model(MODEL, 1, 28, 10, 0).to(memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.x = torch.randn(PER_RANK, 1, 28, 28).contiguous(memory_format=torch.channels_last)
        self.y = torch.randint(0, 10, (PER_RANK,))
        self.buckets = GradientBuckets(self.model, 25, launch_all_reduce("torch", shm), rank=rank,
                                       device=torch.device("cpu"), scale=1.0 / world)
        self.world = world
        self.units = blocks(self.model)
        self.spaced: Callable[[], object] | None = None
        for unit in self.units:  # FSDP2's places: before each unit's forward, after its backward
            unit.register_forward_pre_hook(lambda module, args: self._spaced_call())
            next(unit.parameters()).register_post_accumulate_grad_hook(lambda param: self._spaced_call())

    def _spaced_call(self) -> None:
        if self.spaced is not None:
            self.spaced()

    @contextmanager
    def at_blocks(self, call: Callable[[], object]) -> Iterator[int]:
        """Steps issue `call` where FSDP2 issues its collectives; yields how many a step."""
        self.spaced = call
        try:
            yield 2 * len(self.units)
        finally:
            self.spaced = None

    def step(self, sync: object | None) -> Callable[[], None]:
        import torch.nn.functional as F

        def one() -> None:
            loss = F.cross_entropy(self.model(self.x), self.y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if sync:
                sync.finish()
            self.optimizer.step()
        return one

    def timed(self) -> dict[str, list[float]]:
        """Without sync and with the buckets, means of 10 steps, rounds interleaved (ms); and the
        slowest rank's step against the mean rank's when started together (medians)."""
        timed: dict[str, list[float]] = {"nosync": [], "buckets": [], "slowest": [], "mean": []}
        for _ in range(5):
            with self.buckets.paused():
                timed["nosync"].append(mean_ms(self.step(None), 10))
                slowest, mean = stragglers(self.step(None), self.world, 10)
                timed["slowest"].append(slowest)
                timed["mean"].append(mean)
            timed["buckets"].append(mean_ms(self.step(self.buckets), 10))
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


def fit(sizes: list[int], ms: list[float], relative: bool = True) -> tuple[float, float]:
    """a + b n through the points, each weighted by 1 / its time (relative error: small sizes count),
    or all alike where the noise is absolute (a collective in a step: the step's own jitter)."""
    w = [1 / t ** 2 if relative else 1.0 for t in ms]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, sizes)), sum(wi * y for wi, y in zip(w, ms))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, sizes)), sum(wi * x * y for wi, x, y in zip(w, sizes, ms))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    a = (sy - b * sx) / sw
    return max(a, 0.0) / 1000, max(b, 0.0) / 1000  # seconds, seconds per byte


def measure_collectives(world: int, ops: tuple[str, ...] = (), rounds: int = IN_STEP_ROUNDS) -> dict[str, dict]:
    """One torchrun launch of the probe at W (every collective, or only `ops`; `rounds` of the
    timings in a step)."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                           "-m", "bench.calibration", str(rounds), *ops], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
                          check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    if done.returncode or not lines:
        raise SystemExit(f"the collectives' probe at W={world} failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][len("PROBE "):])


def lines_of(probes: list[dict], timed: str = "after_step") -> dict[str, dict[str, tuple[float, float]]]:
    """Per wire and op: the line through the median (over rounds) time of each size, as `timed`
    (after_step and at_blocks: in a step, the cost training sees; back_to_back: the wire's own)."""
    def line(wire: str, op: str) -> tuple[float, float]:
        ms = [statistics.median(p[timed][wire][op][i] for p in probes) for i in range(len(SIZES))]
        return fit(SIZES, ms, relative=timed == "back_to_back")
    return {wire: {op: line(wire, op) for op in ops} for wire, ops in probes[0][timed].items()}


def convnet_workload(compute_s: float) -> cm.Workload:
    from common.models import build_model
    from train_fsdp import units

    net = build_model(MODEL, 1, 28, 10, 0)
    return cm.Workload(sum(p.numel() for p in net.parameters()), compute_s, PER_RANK, blocks=units(net),
                       buffers=sum(b.numel() for b in net.buffers() if b.is_floating_point()))


def measured_step(script: list[str], world: int, one_process: bool = False) -> tuple[float, float]:
    """(ms per step, training state MB) of one run at W (the global batch W ranks' images): a
    torchrun script as W processes of a thread, or with `one_process` as one process of W threads
    (train_dp.py always runs so); the suite's clock, intervals after the first."""
    processes, threads = (1, world) if one_process else (world, 1)
    scalars = run(script, synthetic(MODEL, PER_RANK * world, STEPS, EVERY), processes, threads)
    return timing(scalars).step_ms, scalars.get("mem/state_mb", [float("nan")])[-1]


Lines = dict[str, dict[str, tuple[float, float]]]  # wire -> op -> (a seconds, b seconds per byte)


@dataclass(frozen=True)
class Prices:
    """What a collective costs in a step at one W: the step's first call, after the step's compute
    (less the slowest rank's lead, which the compute holds), and each later one, a block's compute
    after the last (FSDP2's gathers, ZeRO-1's all-gather after the slice's update)."""

    first: Lines
    then: Lines


@dataclass(frozen=True)
class Noting(cm.Fitted):
    """Fitted lines that note each collective the model prices, in order: (op, bytes)."""

    priced: list[tuple[str, float]] = field(default_factory=list)

    def seconds(self, op: str, n: float) -> float:
        self.priced.append((op, n))
        return super().seconds(op, n)


def model_ms(kind: str, wire: str, compute_s: float, world: int, priced: Prices,
             sync_every: int) -> tuple[float, float]:
    """(ms per step, state MB) the model gives, from the measured compute and collectives: every
    call priced as a later one, then the step's first call (the first the strategy's model prices)
    repriced as a first, once per meeting of the ranks (local SGD: one step in H)."""
    w = convnet_workload(compute_s)
    ranks = world if wire != "none" and world > 1 else 1
    first, then = (cm.Fitted(ranks, lines.get(wire, {})) for lines in (priced.first, priced.then))
    noting = Noting(ranks, then.lines)
    step = cm.step(kind, w, cm.Strategy(kind, "", sync_every=sync_every), noting, False, world)
    extra = first.seconds(*noting.priced[0]) - then.seconds(*noting.priced[0]) if noting.priced else 0.0
    return 1000 * (step.seconds + min(1.0, step.calls) * extra), step.memory_bytes / cm.MB


def reference_of(label: str, world: int) -> str:
    """The no-sync reference a row runs beside, laid out as the row runs: nn.DataParallel on a CPU
    host is one process, a pass-through whose W threads split each op, not W processes (at W=2 it
    ran 6.6 ms against their 4.8 in 3 rounds of 5 on 2026-11-28); at W=1 the two layouts are one."""
    return NOSYNC_ONE_PROCESS if ROWS[label][0][0] in ONE_PROCESS and world > 1 else "nosync"


def beside_no_sync(world: int,
                   labels: list[str]) -> tuple[list[tuple[str, float]], list[tuple[str, float, float, float]]]:
    """Each strategy's run at W between two runs of its no-sync reference (one run between two rows
    of the same reference serves both): (the references' runs in order, (reference, ms per step);
    per strategy (label, ms per step, state MB, the mean of the runs just before and just after it))."""
    floors: list[tuple[str, float]] = []
    found: list[tuple[str, float, float, float]] = []
    for label in labels:
        reference = reference_of(label, world)
        if not floors or floors[-1][0] != reference:
            floors.append((reference, no_sync_step(reference, world)))
        before = floors[-1][1]
        ms, mb = measured_step(ROWS[label][0], world)
        floors.append((reference, no_sync_step(reference, world)))
        found.append((label, ms, mb, (before + floors[-1][1]) / 2))
    return floors, found


def no_sync_step(reference: str, world: int) -> float:
    """One run of the no-sync reference at W, laid out as `reference` names (ms per step)."""
    return measured_step(NOSYNC, world, one_process=reference == NOSYNC_ONE_PROCESS)[0]


@dataclass
class Timings:
    """Every timing of a calibration as it comes: ms per step per (label, W), one a round for a
    strategy, every run for each no-sync reference ("nosync" and NOSYNC_ONE_PROCESS, each in the
    order they ran); the no-sync step beside each strategy's run; the
    state MB logged; the probes per W; the order the rows ran in, per round and W."""

    steps: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    beside: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    memory: dict[tuple[str, int], float] = field(default_factory=dict)
    probes: dict[int, list[dict]] = field(default_factory=dict)
    order: list[tuple[int, int, list[str]]] = field(default_factory=list)

    def add_round(self, round_: int, worlds: list[int]) -> None:
        labels = list(ROWS)
        turn = round_ % len(labels)  # the first row of a W follows the probe's processes: not always the same row
        labels = labels[turn:] + labels[:turn]
        for world in worlds:
            self.probe(world)
            floors, runs = beside_no_sync(world, labels)
            for reference, ms in floors:
                self.steps.setdefault((reference, world), []).append(ms)
            for label, ms, mb, floor in runs:
                self.steps.setdefault((label, world), []).append(ms)
                self.beside.setdefault((label, world), []).append(floor)
                self.memory[(label, world)] = mb
            self.order.append((round_, world, labels))
            self.probe(world)  # a second launch: a step's first call at W=4 cost 0.9-6.2 ms by launch

    def probe(self, world: int) -> None:
        if world > 1:
            self.probes.setdefault(world, []).append(measure_collectives(world))

    def as_json(self) -> str:
        def listed(table: dict[tuple[str, int], object]) -> list[list]:
            return [[label, world, v] for (label, world), v in table.items()]
        return json.dumps({"steps_per_run": STEPS, "order": self.order, "steps": listed(self.steps),
                           "beside": listed(self.beside), "memory": listed(self.memory), "probes": self.probes})


def main(repeats: int, worlds: list[int], as_json: bool) -> None:
    print(f"calibration: {os.cpu_count()} cores (shared with other jobs), gloo, one thread per rank, {MODEL} "
          f"(MNIST shape), {PER_RANK} images per rank, {STEPS} steps per run, each strategy's between two no-sync "
          f"runs (DataParallel's: one process of W threads, as it runs); {repeats} interleaved rounds, medians",
          file=sys.stderr)
    timings = Timings()
    raw = Path(tempfile.gettempdir()) / f"forecast-calibration-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for round_ in range(repeats):
        timings.add_round(round_, worlds)
        raw.write_text(timings.as_json())
        print(f"  round {round_ + 1} of {repeats} done; every timing so far: {raw}", file=sys.stderr)
    doc = report(timings, worlds)
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        print_report(doc)


def lead_s(probes: list[dict]) -> float:
    """The slowest rank's lead over the mean rank's in a step started on every rank at once (the
    probes' median, seconds): inside each collective timed in a step, yet a step waits for it once
    however many collectives it issues (FSDP2: three a block), each after a part of its compute."""
    leads = [s - m for p in probes for s, m in zip(p["step"]["slowest"], p["step"]["mean"])]
    return statistics.median(leads) / 1000 if leads else 0.0


def prices(probes: list[dict], lead: float) -> Prices:
    """The lines the model prices calls by: the first call of a step timed after the step, less the
    lead (counted once a step, in the compute); a later one timed at FSDP2's block spacing; neither
    below the same call back to back."""
    alone = lines_of(probes, "back_to_back")

    def floored(lines: Lines, less: float) -> Lines:
        return {wire: {op: (max(a - less, alone[wire][op][0]), b) for op, (a, b) in ops.items()}
                for wire, ops in lines.items()}
    return Prices(floored(lines_of(probes), lead), floored(lines_of(probes, "at_blocks"), 0.0))


def lead_waited(kind: str, sync_every: int) -> float:
    """What of the slowest rank's lead a step waits for: none in one process (DataParallel), all of
    it where the ranks meet every step; local SGD meets every H steps, by when independent leads have
    grown as sqrt(H) against H steps of compute: 1 / sqrt(H) of it a step."""
    return 0.0 if kind == "dp" else 1 / math.sqrt(sync_every)


def straggling(probes: list[dict]) -> float:
    """How much longer a step started on every rank at once takes to finish on the slowest rank than
    on the mean one (the probes' median): what a synchronized step waits for, beyond the mean."""
    ratios = [s / m for p in probes for s, m in zip(p["step"]["slowest"], p["step"]["mean"])]
    return statistics.median(ratios) if ratios else 1.0


def in_process(probes: list[dict], world: int) -> dict[str, float]:
    """The probe's own step check: the suite's buckets over shared memory against the model (the
    no-sync step and the slowest rank's lead, plus the all-reduce's call)."""
    nosync = statistics.median(t for p in probes for t in p["step"]["nosync"])
    buckets = statistics.median(t for p in probes for t in p["step"]["buckets"])
    lead = lead_s(probes)
    return {"nosync_ms": nosync, "buckets_ms": buckets, "straggling": straggling(probes),
            "model_ms": model_ms("allreduce", "shm", nosync / 1000 + lead, world, prices(probes, lead), 1)[0]}


def own_compute(timings: Timings, label: str, world: int) -> list[float]:
    """Per round, the strategy's compute at W (ms): the no-sync step beside its run at W (the ranks
    share the cores as the strategy's do; at W=4 two ranks per core) times the strategy's own step
    over the no-sync step beside it at W=1, where it sends nothing (its hooks, copies and
    bookkeeping: FSDP2's per-block DTensor work is 2.2x the no-sync step there); that factor the
    median over the rounds, a property of the strategy where one W=1 run moves by 10%."""
    steps, beside = timings.steps, timings.beside
    factor = statistics.median(alone / floor for alone, floor in zip(steps[(label, 1)], beside[(label, 1)]))
    return [floor * factor for floor in beside[(label, world)]]


def report(timings: Timings, worlds: list[int]) -> dict:
    """The model's compute for a strategy at W: its own step at W=1 scaled to W by the no-sync runs
    beside it (own_compute), and the slowest rank's lead once a step; its collectives: the lines
    fitted to them timed in a step at W (Prices). Checked at every W > 1; W=1 is the model's input."""
    steps, memory, probes = timings.steps, timings.memory, timings.probes
    lead = {w: lead_s(probes[w]) if w in probes else 0.0 for w in worlds}
    priced = {w: prices(p, lead[w]) for w, p in probes.items()}
    nosync = {w: statistics.median(steps[("nosync", w)]) / 1000 for w in worlds}
    rows = []
    for label, (script, kind, wire) in ROWS.items():
        every = int(script[script.index("--sync-every") + 1]) if "--sync-every" in script else 1
        for world in (w for w in worlds if w > 1):
            measured, computes = steps[(label, world)], own_compute(timings, label, world)
            waited = lead[world] * lead_waited(kind, every)
            ratios = [model_ms(kind, wire, compute / 1000 + waited, world, priced[world], every)[0] / ms
                      for compute, ms in zip(computes, measured)]
            predicted, model_mb = model_ms(kind, wire, statistics.median(computes) / 1000 + waited, world,
                                           priced[world], every)
            rows.append({"strategy": label, "world": world, "measured_ms": statistics.median(measured),
                         "measured_range_ms": [min(measured), max(measured)], "model_ms": predicted,
                         "compute_ms": statistics.median(computes), "ratio": statistics.median(ratios),
                         "ratio_range": [min(ratios), max(ratios)],
                         "model_state_mb": model_mb, "logged_state_mb": memory[(label, world)]})
    per_sample = {w: 1000 * nosync[w] / PER_RANK for w in worlds}
    one_process = {w: statistics.median(steps[(NOSYNC_ONE_PROCESS, w)]) for w in worlds
                   if (NOSYNC_ONE_PROCESS, w) in steps}
    return {"compute_ms_per_sample": per_sample, "nosync_ms": {w: 1000 * nosync[w] for w in worlds},
            "nosync_one_process_ms": one_process,
            "straggling": {w: straggling(probes[w]) if w in probes else 1.0 for w in worlds},
            "collectives": {timed: {w: described(lines_of(p, timed), w) for w, p in probes.items()}
                            for timed in ("back_to_back", "after_step", "at_blocks")},
            "lead_ms": {w: 1000 * s for w, s in lead.items()},
            "rows": rows, "in_process": {w: in_process(p, w) for w, p in probes.items()}}


def described(lines: dict[str, dict[str, tuple[float, float]]], world: int) -> dict[str, dict[str, dict]]:
    """Fitted lines in microseconds and nanoseconds per byte; an all-reduce's read as a ring's alpha and beta."""
    def one(op: str, a: float, b: float) -> dict[str, float]:
        ring = cm.ring_link(a, b, world)
        return {"a_us": 1e6 * a, "b_ns_per_byte": 1e9 * b,
                **({"alpha_us": 1e6 * ring.alpha_s, "beta_gbps": 8 / ring.beta_s_per_byte / 1e9}
                   if op == "all_reduce" and b > 0 else {})}
    return {wire: {op: one(op, a, b) for op, (a, b) in ops.items()} for wire, ops in lines.items()}


def print_report(doc: dict) -> None:
    print("\ncompute (the no-sync reference), ms per sample: "
          + ", ".join(f"W={w}: {ms:.3f}" for w, ms in doc["compute_ms_per_sample"].items())
          + "; DataParallel's reference, one process of W threads, ms per step: "
          + ", ".join(f"W={w}: {ms:.2f}" for w, ms in doc["nosync_one_process_ms"].items())
          + "; the slowest rank's step over the mean rank's, steps started together: "
          + ", ".join(f"W={w}: {f:.2f} ({doc['lead_ms'][w]:.2f} ms ahead)" for w, f in doc["straggling"].items()))
    print("\ncollectives: fitted a + b n (median over rounds of each size's mean), back to back, after a step's "
          "compute and at FSDP2's block spacing (the model prices a step's first call as after a step less the "
          "slowest rank's lead, which it counts once a step, and each later call as at blocks), and a ring's "
          "alpha and beta read from the all-reduce\n")
    print("| W | wire | collective | timed | a (us) | b (ns/byte) | ring alpha (us) | ring beta (Gb/s) |\n"
          "|---|---|---|---|---|---|---|---|")
    for timed, worlds in doc["collectives"].items():
        for world, wires in worlds.items():
            for wire, ops in wires.items():
                for op, f in ops.items():
                    alpha = f"{f['alpha_us']:.1f}" if "alpha_us" in f else ""
                    beta = f"{f['beta_gbps']:.1f}" if "beta_gbps" in f else ""
                    print(f"| {world} | {wire} | {op} | {timed.replace('_', ' ')} | {f['a_us']:.1f} | "
                          f"{f['b_ns_per_byte']:.3f} | {alpha} | {beta} |")
    print("\nin the probe's processes: the convnet's step without sync, with the suite's buckets over shared memory "
          "(train_allreduce.py's sync), and the model (the first, the slowest rank's lead, the all-reduce's first "
          "call)\n")
    print("| W | no sync ms | slowest / mean | buckets ms | model ms | model / measured |\n|---|---|---|---|---|---|")
    for world, r in doc["in_process"].items():
        print(f"| {world} | {r['nosync_ms']:.2f} | {r['straggling']:.2f} | {r['buckets_ms']:.2f} | "
              f"{r['model_ms']:.2f} | "
              f"{r['model_ms'] / r['buckets_ms']:.2f} |")
    print("\nthe model against the suite's step time: medians over the rounds; model / measured per round, its "
          "compute the no-sync step beside the run times the strategy's own step over the no-sync step beside it "
          "at W=1 (target: within 15%)\n")
    print("| strategy | W | measured ms (range) | compute ms | model ms | model / measured: median (range) "
          "| state MB: model / logged |\n|---|---|---|---|---|---|---|")
    for r in doc["rows"]:
        lo, hi = r["measured_range_ms"]
        flag = "" if abs(r["ratio"] - 1) <= 0.15 else ", over 15%"
        print(f"| {r['strategy']} | {r['world']} | {r['measured_ms']:.1f} ({lo:.1f}-{hi:.1f}) | "
              f"{r['compute_ms']:.1f} | {r['model_ms']:.1f} | "
              f"{r['ratio']:.2f} ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}{flag}) | "
              f"{r['model_state_mb']:.2f} / {r['logged_state_mb']:.2f} |")


if __name__ == "__main__":
    probe(sys.argv[2:], int(sys.argv[1]))  # rounds, then ops (measure_collectives)
