"""What each strategy would do on a cluster you have not rented: step time, images/s, scaling
efficiency against one GPU x W, bytes each rank sends and training state per rank, from a cost
model (bench/costmodel.py) fed with your model's one-GPU compute time and the cluster's links.

    python -m bench forecast --model resnet18 --compute-ms 40 --batch-per-gpu 64 \\
        --gpus-per-node 8 --intra-gbps 1200 --link-gbps 100 --gpus 8,64,512
    python -m bench forecast --params 25557032 --compute-ms 180 --batch-per-gpu 32 --gpus 8,352 --json
    python -m bench forecast --preset goyal2017          # the published setups, their hardware filled in
    python -m bench forecast --published                 # the model against Goyal et al. and the DDP paper
    python -m bench forecast --calibrate                 # the model against this machine's own step times

Prints a table per GPU count, the recommended strategy with its flags and launch commands (Slurm,
Kubernetes), and the model's assumptions; writes a plot (efficiency against GPUs, one curve per
strategy). --json prints one JSON document instead (fields: docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NoReturn, Sequence

from bench import costmodel as cm
from bench.costmodel import MB, Cluster, Link, Strategy, Workload

ROOT = Path(__file__).resolve().parent.parent

# The strategies of the suite, as the forecast names them: (model, how it runs).
STRATEGIES: dict[str, tuple[str, Strategy]] = {
    "ddp": ("ddp", Strategy("ddp", "train_ddp.py")),
    "allreduce": ("allreduce", Strategy("allreduce", "train_allreduce.py")),
    "allreduce-ring": ("allreduce-ring", Strategy("allreduce-ring", "train_allreduce.py", ("--allreduce", "ring"))),
    "master": ("master", Strategy("master", "train_master.py")),
    "dp": ("dp", Strategy("dp", "train_dp.py", one_node=True)),
    "zero1": ("zero1", Strategy("zero1", "train_fsdp.py", ("--shard", "optimizer"))),
    "fsdp2": ("fsdp2", Strategy("fsdp2", "train_fsdp.py", ("--shard", "full"))),
    "localsgd": ("localsgd", Strategy("localsgd", "train_localsgd.py", sync_every=16)),
    "diloco": ("localsgd", Strategy("diloco", "train_localsgd.py", ("--outer-optimizer", "nesterov"), sync_every=16,
                                    outer="nesterov")),
    "ft": ("ft", Strategy("ft", "train_ft.py", quorum_s=0.005)),
}
# The strategies that train as one GPU would, simplest first: within CLOSE of the fastest, the simpler
# one is recommended (the model's own error is of that order: stragglers, congestion, kernels it leaves out).
EXACT = ("ddp", "allreduce", "master", "zero1", "fsdp2", "allreduce-ring", "dp", "ft")
CLOSE = 0.95
BUCKET_FLAG = ("train_allreduce.py", "train_master.py")  # the scripts with --bucket-mb
COMPRESSES = ("ddp", "allreduce", "allreduce-ring", "master")  # the scripts with --grad-compression fp16|bf16

# Published setups: every number with where it comes from (docs/benchmarks.md repeats this).
RESNET50_PARAMS = 25_557_032  # torchvision resnet50, counted
RESNET50_TENSORS = 161  # its parameter tensors: one bucket each when buckets are per parameter
PRESETS: dict[str, dict[str, Any]] = {
    "goyal2017": {
        "source": "Goyal et al. 2017, arXiv 1706.02677: ResNet-50 on Big Basin servers, 8 P100 (NVLink) per "
                  "server, 50 Gb/s Ethernet, 32 images per GPU; time per iteration +12% from 8 to 352 GPUs",
        "params": RESNET50_PARAMS, "blocks": 17, "buffers": 53_120, "batch_per_gpu": 32,
        # The paper: ~120 ms of backward for ResNet-50 on a P100 (section 4, its 15 Gb/s estimate);
        # forward assumed half of backward (one matrix product per layer against two).
        "compute_ms": 120 / (2 / 3), "gpus_per_node": 8,
        "intra_gbps": 160,  # NVLink 1.0: 20 GB/s per direction per link; one ring uses one link per hop
        "link_gbps": 50,  # the paper's Mellanox ConnectX-4 50 Gb/s Ethernet
        "intra_alpha_us": 5, "link_alpha_us": 50,  # assumed: NVLink step, Gloo's TCP message latency
        "memory_gbps": 732 * 8,  # P100 HBM2, 732 GB/s: the reduction's gamma
        "gpus": [8, 16, 32, 64, 128, 256, 352],
    },
    "ddp-paper": {
        "source": "Li et al., VLDB 2020, arXiv 2006.15704: DDP, ResNet-50, 8 V100 (NVLink) per server, NCCL, "
                  "25 MB buckets overlapped with the backward: near-linear to 256 GPUs",
        "params": RESNET50_PARAMS, "blocks": 17, "buffers": 53_120, "batch_per_gpu": 32,
        # Assumed, not from the paper: a V100 trains ResNet-50 in fp32 at about 360 images/s, the order
        # of NVIDIA's published throughput: 32 images in ~89 ms.
        "compute_ms": 1000 * 32 / 360, "gpus_per_node": 8,
        "intra_gbps": 200,  # NVLink 2.0: 25 GB/s per direction per link, one link per ring hop
        "link_gbps": 100,  # assumed: a 100 Gb/s network per server
        "intra_alpha_us": 5, "link_alpha_us": 10,  # assumed: NCCL over NVLink / RDMA
        "memory_gbps": 900 * 8,  # V100 HBM2, 900 GB/s
        "gpus": [8, 16, 32, 64, 128, 256],
    },
}
GLOO_ALPHA_US = 100  # the DDP paper's bucket-size figure over Gloo: assumed latency of one Gloo TCP step
GLOO_GBPS = 25  # assumed: what Gloo's ring reaches on a 100 Gb/s link (it moves bytes through CPU threads)


class OneLineParser(argparse.ArgumentParser):
    """Bad flags: one line naming the flag, exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: python -m bench forecast: {message} (--help lists the flags)", file=sys.stderr)
        sys.exit(2)


def fail(message: str) -> NoReturn:
    print(f"error: python -m bench forecast: {message}", file=sys.stderr)
    sys.exit(2)


@dataclass
class Row:
    strategy: str
    script: str
    flags: list[str]
    gpus: int
    nodes: int
    step_ms: float
    exposed_comm_ms: float
    images_per_s: float
    efficiency: float
    bytes_per_rank: float
    memory_mb_per_rank: float
    feasible: bool
    note: str


def cluster(args: argparse.Namespace, gpus: int) -> Cluster:
    return Cluster(gpus, args.gpus_per_node, Link.of(args.intra_gbps, args.intra_alpha_us),
                   Link.of(args.link_gbps, args.link_alpha_us), 3 * 8 / (args.memory_gbps * 1e9), args.launch_us * 1e-6)


def workload(args: argparse.Namespace) -> Workload:
    compute = args.compute_ms / 1000
    optimizer = (2 + args.optimizer_states) * 2 * args.params * 4 * 8 / (args.memory_gbps * 1e9)  # read + write
    return Workload(args.params, compute, args.batch_per_gpu, blocks=args.blocks, buffers=args.buffers,
                    wire_bytes=2 if args.grad_compression in ("fp16", "bf16") else 4,
                    optimizer_states=args.optimizer_states, optimizer_s=min(optimizer, compute / 10))


def strategy_flags(s: Strategy) -> list[str]:
    flags = list(s.flags)
    if s.script in BUCKET_FLAG and s.bucket_mb != 25:
        flags += ["--bucket-mb", f"{s.bucket_mb:g}"]
    if s.script == "train_localsgd.py":
        flags += ["--sync-every", str(s.sync_every)]
    return flags


def forecast_row(kind: str, s: Strategy, w: Workload, c: Cluster, compression: str) -> Row:
    step = cm.step(kind, w, s, c, True, c.gpus)
    one = w.compute_s  # one GPU: nothing to send
    feasible, note = True, "; ".join(step.notes)
    if s.one_node and c.gpus > c.gpus_per_node:
        feasible, note = False, "nn.DataParallel drives the GPUs of one node only"
    if kind == "ft" and c.nodes < 2:
        feasible, note = False, "replica groups are nodes here: needs 2 nodes or more"
    flags = strategy_flags(s) + (["--grad-compression", compression] if compression != "none" else [])
    return Row(s.name, s.script, flags, c.gpus, c.nodes, 1000 * step.seconds, 1000 * step.exposed_s,
               c.gpus * w.batch_per_gpu / step.seconds, one / step.seconds, step.bytes_sent,
               step.memory_bytes / MB, feasible, note)


def forecast(args: argparse.Namespace, names: Sequence[str]) -> list[Row]:
    """Every strategy at every GPU count; --grad-compression where the strategy implements it."""
    rows = []
    for gpus in args.gpus:
        c = cluster(args, gpus)
        for name in names:
            kind, s = STRATEGIES[name]
            bucket = args.bucket_mb if s.script in BUCKET_FLAG else s.bucket_mb  # train_ddp.py keeps DDP's 25 MB
            s = s.with_(bucket_mb=bucket, sync_every=args.sync_every if args.sync_every else s.sync_every)
            compression = args.grad_compression if name in COMPRESSES else "none"
            rows.append(forecast_row(kind, s, workload(replace_ns(args, grad_compression=compression)), c, compression))
    return rows


def best_bucket(args: argparse.Namespace, gpus: int) -> tuple[float, float, float]:
    """(best bucket MB, its step, the 25 MB default's step) for the bucketed all-reduce. Not below
    5 MB: the model charges a bucket nothing on the compute side (its copy, its kernels beside the
    backward's), so it would favour ever smaller ones."""
    w, c = workload(args), cluster(args, gpus)
    steps = {mb: cm.step("ddp", w, STRATEGIES["ddp"][1].with_(bucket_mb=mb), c, True, gpus).seconds
             for mb in (5, 10, 25, 50, 100)}
    best = min(steps, key=steps.get)  # type: ignore[arg-type]
    return best, steps[best], steps[25]


@dataclass
class Recommendation:
    gpus: int
    strategy: str
    script: str
    flags: list[str]
    efficiency: float
    why: str
    slurm: str
    k8s: str


def recommend(args: argparse.Namespace, rows: list[Row], gpus: int) -> Recommendation:
    """The exact strategy with the most images/s that fits --gpu-memory-gb; its bucket size and
    compression where the model says they pay; local SGD named when no exact one reaches 80%."""
    fits = [r for r in rows if r.gpus == gpus and r.feasible and r.strategy in EXACT
            and (not args.gpu_memory_gb or r.memory_mb_per_rank <= args.gpu_memory_gb * 1024)]
    if not fits:
        fail(f"no exact strategy fits {gpus} GPUs with --gpu-memory-gb {args.gpu_memory_gb}: raise it, or lower "
             "--batch-per-gpu")
    fastest = max(r.images_per_s for r in fits)
    top = min((r for r in fits if r.images_per_s >= CLOSE * fastest), key=lambda r: EXACT.index(r.strategy))
    why = [(f"{top.strategy}: the simplest exact strategy within {1 - CLOSE:.0%} of the most images/s "
            f"({top.images_per_s:,.0f} against {fastest:,.0f})")]
    kind, strategy = STRATEGIES[top.strategy]
    chosen, compression = args, args.grad_compression
    if top.strategy in ("ddp", "allreduce"):
        bucket, best, default = best_bucket(args, gpus)
        if bucket != 25 and best < 0.97 * default:
            kind, strategy = STRATEGIES["allreduce"]
            chosen = replace_ns(args, bucket_mb=bucket)
            why.append(f"buckets of {bucket:g} MB: {1000 * best:.1f} ms against {1000 * default:.1f} ms at DDP's 25 "
                       "(train_allreduce.py sets the size; train_ddp.py keeps 25)")
    final = forecast_row(kind, strategy.with_(bucket_mb=chosen.bucket_mb), workload(chosen), cluster(chosen, gpus),
                         compression)
    if compression == "none" and top.strategy in COMPRESSES:
        half = forecast_row(kind, strategy.with_(bucket_mb=chosen.bucket_mb),
                            workload(replace_ns(chosen, grad_compression="bf16")), cluster(chosen, gpus), "bf16")
        if half.step_ms < 0.95 * final.step_ms:
            why.append(f"--grad-compression bf16: {half.step_ms:.1f} ms against {final.step_ms:.1f} ms")
            final = half
    if final.efficiency < 0.8:
        why.append(local_sgd_advice(args, gpus))
    nodes = math.ceil(gpus / args.gpus_per_node)
    return Recommendation(gpus, final.strategy, final.script, final.flags, final.efficiency, "; ".join(why),
                          *launch_commands(final.script, final.flags, nodes, min(gpus, args.gpus_per_node),
                                           gpus * args.batch_per_gpu))


def replace_ns(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def local_sgd_advice(args: argparse.Namespace, gpus: int) -> str:
    w, c = workload(args), cluster(args, gpus)
    for h in (2, 4, 8, 16, 32, 64, 128):
        step = cm.step("localsgd", w, STRATEGIES["localsgd"][1].with_(sync_every=h), c, True, gpus)
        if w.compute_s / step.seconds >= 0.9:
            return (f"no exact strategy reaches 80%: train_localsgd.py --sync-every {h} would reach "
                    f"{w.compute_s / step.seconds:.0%} (it trains differently: check accuracy, "
                    "python -m bench sharding localsgd)")
    return "no exact strategy reaches 80%, nor local SGD up to H=128"


def launch_commands(script: str, flags: list[str], nodes: int, per_node: int, batch: int) -> tuple[str, str]:
    args = shlex.join([script, "--batch-size", str(batch), *flags])
    if script == "train_ft.py":  # one torchrun per replica group (a node), a Lighthouse beside them
        per_group = (f"TORCHFT_LIGHTHOUSE=http://HOST:29510 torchrun --nnodes=1 --nproc_per_node={per_node} "
                     f"{args} --groups {nodes} --group-id G   # on each node G = 0..{nodes - 1}; docs/clusters.md")
        return per_group, per_group
    return (f"sbatch --nodes={nodes} --gpus-per-node={per_node} launch/slurm.sbatch {args}",
            f"IMAGE=... DATA_PVC=... WORKERS={nodes - 1} NPROC={per_node} launch/k8s.sh {args}")


def assumptions(args: argparse.Namespace) -> list[str]:
    return [
        (f"compute: {args.compute_ms:g} ms per step for {args.batch_per_gpu} images on one GPU (given): the optimizer "
         "step a pass over parameters, gradients and state at --memory-gbps, 2/3 of the rest backward; the same on "
         "every GPU (no stragglers)"),
        (f"links: {args.intra_gbps:g} Gb/s inside a node (alpha {args.intra_alpha_us:g} us), {args.link_gbps:g} Gb/s "
         f"per node between nodes (alpha {args.link_alpha_us:g} us), {args.launch_us:g} us to start each collective, "
         f"the node's card shared by its {args.gpus_per_node} GPUs; no congestion, a non-blocking fabric"),
        ("collectives: alpha-beta-gamma; all-reduce the faster of ring and halving-doubling, hierarchical "
         "(reduce-scatter inside, all-reduce across, all-gather inside); reduce and broadcast pipelined (NCCL); "
         "no protocol choices (NCCL's LL/LL128/Simple), no SHARP"),
        (f"overlap: the buckets of DDP (25 MB) and the hand-written all-reduce ({args.bucket_mb:g} MB) run beside the "
         "backward, spread evenly over it, the last one exposed; ZeRO-1's, local SGD's and the replica groups' "
         "collectives follow the backward; FSDP2 prefetches the next block's gather"),
        (f"memory: parameters, gradients and {args.optimizer_states} optimizer state(s) per parameter in fp32, "
         "sharded where the strategy shards; activations and the CUDA context left out (the same for all)"),
        "local SGD and DiLoCo train differently from one GPU (not exact): never recommended on speed alone",
    ]


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    for gpus in args.gpus:
        nodes = math.ceil(gpus / args.gpus_per_node)
        print(f"\n{gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''} of {min(gpus, args.gpus_per_node)})\n")
        print("| strategy | flags | step ms | exposed comm ms | images/s | efficiency | MB sent per rank "
              "| state MB per rank |\n|---|---|---|---|---|---|---|---|")
        for r in (r for r in rows if r.gpus == gpus):
            if not r.feasible:
                print(f"| {r.strategy} | {' '.join(r.flags)} | - | - | - | - | - | - ({r.note}) |")
                continue
            print(f"| {r.strategy} | {' '.join(r.flags)} | {r.step_ms:.1f} | {r.exposed_comm_ms:.1f} | "
                  f"{r.images_per_s:,.0f} | {r.efficiency:.0%} | {r.bytes_per_rank / MB:.1f} | "
                  f"{r.memory_mb_per_rank:.0f} |")


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.strategy for r in rows):
        points = [(r.gpus, r.efficiency) for r in rows if r.strategy == name and r.feasible]
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("scaling efficiency (vs one GPU x W)")
    ax.set_ylim(0, 1.05)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def params_of(model: str) -> tuple[int, int, int]:
    """(parameters, FSDP blocks, float buffer elements) of a model the suite builds (ImageNet shape)."""
    from common.errors import UserError
    from common.models import build_model
    from train_fsdp import units

    try:
        net = build_model(model, 3, 224, 1000, 0)
    except UserError as e:
        fail(f"--model {model}: {e}")
    return (sum(p.numel() for p in net.parameters() if p.requires_grad), units(net),
            sum(b.numel() for b in net.buffers() if b.is_floating_point()))


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = OneLineParser(prog="python -m bench forecast", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", help="a model the suite builds (resnet18, torchvision:resnet50, ...): its parameters")
    what.add_argument("--params", type=int, help="trainable parameters")
    what.add_argument("--preset", choices=list(PRESETS), help="a published setup, its hardware filled in")
    p.add_argument("--compute-ms", type=float, help="forward + backward + optimizer step on one GPU, ms")
    p.add_argument("--batch-per-gpu", type=int, help="images per GPU and step")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-gbps", type=float, default=1200,
                   help="inside a node, Gb/s per GPU (default: NVLink 4, 150 GB/s)")
    p.add_argument("--link-gbps", type=float, default=100, help="each node's network, Gb/s (default: %(default)s)")
    p.add_argument("--intra-alpha-us", type=float, default=5.0,
                   help="latency of a step inside a node (default: %(default)s)")
    p.add_argument("--link-alpha-us", type=float, default=10.0,
                   help="latency of a step between nodes (default: %(default)s)")
    p.add_argument("--launch-us", type=float, default=20.0,
                   help="fixed cost of starting one collective: a kernel launch, a Python hook (default: %(default)s)")
    p.add_argument("--memory-gbps", type=float, default=2000 * 8,
                   help="GPU memory bandwidth, Gb/s: the reduction's cost")
    p.add_argument("--gpus", default="8,64,512", help="comma list of GPU counts (default: %(default)s)")
    p.add_argument("--strategy", nargs="+", choices=list(STRATEGIES), help="the strategies to forecast (default: all)")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="gradient bucket size of train_allreduce.py and train_master.py; DDP keeps its 25 "
                        "(default: %(default)s)")
    p.add_argument("--sync-every", type=int, default=0, help="local SGD's H (default: 16)")
    p.add_argument("--grad-compression", choices=("none", "fp16", "bf16"), default="none")
    p.add_argument("--optimizer-states", type=int, default=1, help="floats per parameter: SGD 1, AdamW 2")
    p.add_argument("--blocks", type=int, default=16, help="FSDP2 units, with --params (default: %(default)s)")
    p.add_argument("--buffers", type=int, default=0, help="float buffer elements (BatchNorm), with --params")
    p.add_argument("--gpu-memory-gb", type=float, default=0, help="recommend only what fits (default: no limit)")
    p.add_argument("--plot", type=Path, default=Path("forecast.png"), help="where the plot goes (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the tables")
    p.add_argument("--published", action="store_true", help="the model against Goyal et al. 2017 and the DDP paper")
    p.add_argument("--calibrate", action="store_true", help="measure here and check the model against the suite")
    p.add_argument("--repeats", type=int, default=5,
                   help="--calibrate: interleaved rounds, about 10 minutes each; 3 rounds on this 2-core host can "
                        "move a row by 20%% (default: %(default)s)")
    p.add_argument("--worlds", default="1,2,4",
                   help="--calibrate: world sizes, 1 and those the model is checked at (default: %(default)s)")
    a = p.parse_args(argv)
    if a.calibrate:
        try:
            a.worlds = sorted({int(w) for w in a.worlds.split(",")})
        except ValueError:
            p.error(f"--worlds {a.worlds}: a comma list of whole numbers, e.g. 1,2,4")
        if a.repeats < 1 or min(a.worlds) < 1:
            p.error("--repeats and every --worlds entry must be >= 1")
        if 1 not in a.worlds or max(a.worlds) == 1:
            p.error(f"--worlds {','.join(map(str, a.worlds))}: include 1 (each strategy's own compute is its "
                    "step at W=1) and a larger W to check the model at, e.g. 1,2,4")
        return a
    if a.published:
        return a
    if a.preset:
        preset = PRESETS[a.preset]
        for key, value in preset.items():  # what the command line gives wins
            if key not in ("source", "gpus") and getattr(a, key) == p.get_default(key):
                setattr(a, key, value)
        a.gpus = ",".join(map(str, preset["gpus"])) if a.gpus == p.get_default("gpus") else a.gpus
    elif a.model:
        a.params, a.blocks, a.buffers = params_of(a.model)
    if not a.params:
        p.error("give --model NAME, --params N or --preset NAME")
    for flag in ("compute_ms", "batch_per_gpu"):
        if getattr(a, flag) is None:
            p.error(f"--{flag.replace('_', '-')} is required: one GPU's step time and batch, e.g. from a one-GPU "
                    "run's time/compute_ms in TensorBoard")
    try:
        a.gpus = sorted({int(g) for g in str(a.gpus).split(",")})
    except ValueError:
        p.error(f"--gpus {a.gpus}: a comma list of whole numbers, e.g. 8,64,512")
    positive = {"--params": a.params, "--compute-ms": a.compute_ms, "--batch-per-gpu": a.batch_per_gpu,
                "--gpus-per-node": a.gpus_per_node, "--intra-gbps": a.intra_gbps, "--link-gbps": a.link_gbps,
                "--memory-gbps": a.memory_gbps, "--bucket-mb": a.bucket_mb, "--blocks": a.blocks,
                "--gpus": min(a.gpus)}
    for flag, value in positive.items():
        if not value > 0:
            p.error(f"{flag} must be > 0 (got {value})")
    for flag, value in {"--intra-alpha-us": a.intra_alpha_us, "--link-alpha-us": a.link_alpha_us,
                        "--launch-us": a.launch_us,
                        "--sync-every": a.sync_every, "--optimizer-states": a.optimizer_states,
                        "--buffers": a.buffers, "--gpu-memory-gb": a.gpu_memory_gb}.items():
        if value < 0:
            p.error(f"{flag} must be >= 0 (got {value})")
    return a


def run_forecast(a: argparse.Namespace) -> dict[str, Any]:
    names = a.strategy or list(STRATEGIES)
    rows = forecast(a, names)
    title = (f"{a.params / 1e6:.1f} M params, {a.compute_ms:g} ms / {a.batch_per_gpu} images per GPU, "
             f"{a.gpus_per_node} GPUs/node, {a.intra_gbps:g} / {a.link_gbps:g} Gb/s")
    plot(rows, a.plot, title)
    recommendations = [recommend(a, rows, g) for g in a.gpus]
    inputs = {k: v for k, v in vars(a).items() if k not in ("json", "calibrate", "published", "repeats", "worlds")}
    inputs["plot"] = str(a.plot)
    if a.preset:
        inputs["source"] = PRESETS[a.preset]["source"]
    return {"inputs": inputs, "rows": [asdict(r) for r in rows],
            "recommendations": [asdict(r) for r in recommendations], "assumptions": assumptions(a),
            "plot": str(a.plot)}


def print_forecast(doc: dict[str, Any], a: argparse.Namespace) -> None:
    print(f"forecast: {doc['inputs']['params']:,} parameters, {a.compute_ms:g} ms per step of {a.batch_per_gpu} "
          f"images on one GPU" + (f" ({doc['inputs']['source']})" if a.preset else ""))
    print_table([Row(**r) for r in doc["rows"]], a)
    print("\nrecommended:")
    for r in doc["recommendations"]:
        print(f"  {r['gpus']} GPUs: {shlex.join([r['script'], *r['flags']])} ({r['efficiency']:.0%}): {r['why']}")
        print(f"    slurm: {r['slurm']}\n    k8s:   {r['k8s']}")
    print(f"\nplot: {doc['plot']}\nassumptions:")
    for line in doc["assumptions"]:
        print(f"  - {line}")


# --- checked against published results -------------------------------------------------------------


def preset_args(name: str) -> argparse.Namespace:
    return parse(["--preset", name, "--plot", os.devnull])


def efficiency_between(args: argparse.Namespace, kind: str, strategy: Strategy, base: int, gpus: int) -> float:
    """Time per iteration at `base` GPUs over that at `gpus` (weak scaling: Goyal et al.'s measure)."""
    w = workload(args)
    at = {g: cm.step(kind, w, strategy, cluster(args, g), True, g).seconds for g in (base, gpus)}
    return at[base] / at[gpus]


def ddp_bucket_sweep(args: argparse.Namespace, gpus: int, link: Link | None = None) -> dict[str, float]:
    """Iteration ms per bucket size (0: one bucket per parameter tensor), DDP over the given inter-node link."""
    c = cluster(args, gpus)
    if link:
        c = replace(c, inter=link, intra=Link(link.alpha_s, c.intra.beta_s_per_byte))
    w = workload(args)
    sizes = {"0": w.gradient_wire / RESNET50_TENSORS / MB, **{f"{mb:g}": mb for mb in (5, 10, 25, 50, 100, 200)}}
    return {label: 1000 * cm.step("ddp", w, STRATEGIES["ddp"][1].with_(bucket_mb=mb), c, True, gpus).seconds
            for label, mb in sizes.items()}


def published() -> dict[str, Any]:
    goyal = preset_args("goyal2017")
    ddp_paper = preset_args("ddp-paper")
    ddp = STRATEGIES["ddp"][1]
    sweep_nccl = ddp_bucket_sweep(ddp_paper, 16)
    sweep_gloo = ddp_bucket_sweep(ddp_paper, 16, Link.of(GLOO_GBPS, GLOO_ALPHA_US))
    return {
        "goyal2017": {"published": 1 / 1.12, "model": efficiency_between(goyal, "ddp", ddp, 8, 352),
                      "what": "time per iteration at 8 GPUs / at 352 GPUs, 32 images per GPU"},
        "ddp-paper-256": {"published": 0.9, "model": efficiency_between(ddp_paper, "ddp", ddp, 1, 256),
                          "what": "one GPU's iteration time / 256 GPUs' ('near-linear' read as 90%)"},
        "ddp-paper-buckets-nccl": {"iteration_ms": sweep_nccl,
                                   "ratio": max(sweep_nccl.values()) / min(sweep_nccl.values())},
        "ddp-paper-buckets-gloo": {"iteration_ms": sweep_gloo,
                                   "ratio": max(sweep_gloo.values()) / min(sweep_gloo.values()),
                                   "published_ratio_above": 2.0},
    }


def print_published(doc: dict[str, Any]) -> None:
    print("| setup | measure | published | model | points |\n|---|---|---|---|---|")
    for key in ("goyal2017", "ddp-paper-256"):
        r = doc[key]
        print(f"| {key} | {r['what']} | {r['published']:.1%} | {r['model']:.1%} | "
              f"{100 * (r['model'] - r['published']):+.1f} |")
    for key in ("ddp-paper-buckets-nccl", "ddp-paper-buckets-gloo"):
        r = doc[key]
        cells = ", ".join(f"{mb} MB {ms:.0f}" for mb, ms in r["iteration_ms"].items())
        print(f"\n{key}, 16 GPUs, iteration ms by bucket size: {cells}; slowest / fastest {r['ratio']:.2f}x")


def main(argv: Sequence[str] | None = None) -> None:
    a = parse(sys.argv[1:] if argv is None else argv)
    if a.calibrate:
        from bench import (
            calibration,  # torch and the suite load only for --calibrate (and --model)
        )
        calibration.main(a.repeats, a.worlds, a.json)
        return
    if a.published:
        doc = published()
        print(json.dumps(doc, indent=1)) if a.json else print_published(doc)
        return
    doc = run_forecast(a)
    print(json.dumps(doc, indent=1)) if a.json else print_forecast(doc, a)


if __name__ == "__main__":
    main()
