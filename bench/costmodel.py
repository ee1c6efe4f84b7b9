"""The cost model behind `python -m bench forecast`: pure functions of sizes, link speeds and a
measured compute time; no torch, nothing from common/. Times in seconds, sizes in bytes.

A collective on p ranks over one kind of link costs alpha per message step, beta per byte sent and
gamma per byte reduced (Thakur, Rabenseifner and Gropp 2005; NOTES.md section 17):

    ring all-reduce         2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma
    halving-doubling        2 log2(p) alpha + the same bytes (the tree-like choice for small messages)
    reduce-scatter          (p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma; all-gather: no gamma
    reduce + broadcast      through one root: a flat root receives (p-1) n and sends (p-1) n (gloo's
                            and the shared-memory transport's), a chain (NCCL's pipelined reduce and
                            broadcast) moves n per link in (p-1) steps

On nodes of several GPUs a collective is hierarchical: the fast link (NVLink) inside a node, the
network between nodes, the node's network card shared by its GPUs. A strategy's step is its compute
plus the communication it cannot hide; where communication runs beside compute (a GPU's own
stream), gradient buckets launched during the backward hide behind it, and at least the last one is
exposed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

MB = 2**20


@dataclass(frozen=True)
class Link:
    alpha_s: float  # per message step (latency, launch)
    beta_s_per_byte: float  # 1 / bandwidth

    @classmethod
    def of(cls, gbit_per_s: float, alpha_us: float) -> "Link":
        return cls(alpha_us * 1e-6, 8 / (gbit_per_s * 1e9))


def ring_all_reduce(n: float, p: int, link: Link, gamma: float) -> float:
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * n * link.beta_s_per_byte + (p - 1) / p * n * gamma


def halving_doubling_all_reduce(n: float, p: int, link: Link, gamma: float) -> float:
    if p <= 1:
        return 0.0
    return (2 * math.ceil(math.log2(p)) * link.alpha_s + 2 * (p - 1) / p * n * link.beta_s_per_byte
            + (p - 1) / p * n * gamma)


def all_reduce(n: float, p: int, link: Link, gamma: float) -> float:
    """What a tuned library does: the faster of ring and halving-doubling (NCCL picks tree or ring by size)."""
    return min(ring_all_reduce(n, p, link, gamma), halving_doubling_all_reduce(n, p, link, gamma))


def reduce_scatter(n: float, p: int, link: Link, gamma: float) -> float:
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha_s + (p - 1) / p * n * (link.beta_s_per_byte + gamma)


def all_gather(n: float, p: int, link: Link) -> float:
    """n: the gathered (full) size."""
    return reduce_scatter(n, p, link, 0.0)


def reduce_broadcast(n: float, p: int, link: Link, gamma: float, root: str) -> float:
    """Reduce onto a root, then broadcast back. root "flat": the root's link carries every peer's n
    both ways and the root adds them all; "chain": pipelined along a chain, n per link, (p-1) steps."""
    if p <= 1:
        return 0.0
    if root == "flat":
        return 2 * (p - 1) * (link.alpha_s + n * link.beta_s_per_byte) + (p - 1) * n * gamma
    return 2 * ((p - 1) * link.alpha_s + n * link.beta_s_per_byte) + n * gamma


class Net(Protocol):
    """The collectives among all W ranks of a run, each the seconds for n bytes (n: the full tensor)."""

    local: int  # ranks per node
    nodes: int

    def all_reduce(self, n: float) -> float: ...
    def ring_all_reduce(self, n: float) -> float: ...  # one flat ring over every rank, in rank order
    def reduce_broadcast(self, n: float) -> float: ...
    def reduce_scatter(self, n: float) -> float: ...
    def all_gather(self, n: float) -> float: ...
    def all_reduce_in_node(self, n: float) -> float: ...  # among the ranks of one node (a replica group)
    def group_all_reduce(self, n: float) -> float: ...  # each rank with its peers of the other nodes, at once


@dataclass(frozen=True)
class Cluster:
    """W GPUs as nodes of gpus_per_node; intra: the link inside a node, inter: a node's network card."""

    gpus: int
    gpus_per_node: int
    intra: Link
    inter: Link
    gamma_s_per_byte: float  # summing one byte into another in GPU memory
    launch_s: float = 0.0  # fixed cost of starting one collective (a kernel launch, a Python hook)
    root: str = "chain"  # how reduce and broadcast go: NCCL's chain

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def local(self) -> int:
        return min(self.gpus, self.gpus_per_node)

    def all_reduce(self, n: float) -> float:
        """Inside: reduce-scatter, across nodes: an all-reduce of the node's n through its card (its
        GPUs' n/G shares side by side), inside: all-gather (NCCL's and Goyal et al.'s hierarchy)."""
        g, gamma = self.local, self.gamma_s_per_byte
        if self.nodes == 1:
            return self.launch_s + all_reduce(n, g, self.intra, gamma)
        return (self.launch_s + reduce_scatter(n, g, self.intra, gamma) + all_reduce(n, self.nodes, self.inter, gamma)
                + all_gather(n, g, self.intra))

    def ring_all_reduce(self, n: float) -> float:
        """A flat ring in rank order: one hop per node crosses the network, and every one of the
        2(W-1) steps waits for that hop's chunk of n/W."""
        link = self.intra if self.nodes == 1 else self.inter
        return self.launch_s + ring_all_reduce(n, self.gpus, link, self.gamma_s_per_byte)

    def reduce_broadcast(self, n: float) -> float:
        g, gamma = self.local, self.gamma_s_per_byte
        inside = 2 * self.launch_s + reduce_broadcast(n, g, self.intra, gamma, self.root)
        return inside if self.nodes == 1 else inside + reduce_broadcast(n, self.nodes, self.inter, gamma, self.root)

    def reduce_scatter(self, n: float) -> float:
        g, gamma = self.local, self.gamma_s_per_byte
        inside = self.launch_s + reduce_scatter(n, g, self.intra, gamma)
        return inside if self.nodes == 1 else inside + reduce_scatter(n, self.nodes, self.inter, gamma)

    def all_gather(self, n: float) -> float:
        inside = self.launch_s + all_gather(n, self.local, self.intra)
        return inside if self.nodes == 1 else inside + all_gather(n, self.nodes, self.inter)

    def all_reduce_in_node(self, n: float) -> float:
        return self.launch_s + all_reduce(n, self.local, self.intra, self.gamma_s_per_byte)

    def group_all_reduce(self, n: float) -> float:
        """The node's G ranks each all-reduce n with their peers: G n through one card."""
        return self.launch_s + all_reduce(self.local * n, self.nodes, self.inter, self.gamma_s_per_byte)


@dataclass(frozen=True)
class Workload:
    params: int  # trainable parameters
    compute_s: float  # forward + backward + optimizer of one rank's batch, alone on its device
    batch_per_gpu: int
    blocks: int = 16  # FSDP2's units (each block all-gathered on its own)
    buffers: int = 0  # floating-point buffers (BatchNorm statistics), averaged by local SGD
    param_bytes: int = 4  # fp32 parameters and gradients
    wire_bytes: int = 4  # bytes per gradient on the wire: 2 with --grad-compression fp16/bf16
    optimizer_states: int = 1  # floats per parameter: SGD momentum 1, AdamW 2
    backward_share: float = 2 / 3  # of forward + backward: the backward's two matrix products per layer
    optimizer_s: float = 0.0  # part of compute_s, not hidden by anything

    @property
    def gradient_wire(self) -> float:
        return self.params * self.wire_bytes

    @property
    def model_bytes(self) -> float:
        return self.params * self.param_bytes

    @property
    def backward_s(self) -> float:
        return (self.compute_s - self.optimizer_s) * self.backward_share

    @property
    def forward_s(self) -> float:
        return (self.compute_s - self.optimizer_s) - self.backward_s


@dataclass(frozen=True)
class Strategy:
    name: str  # the forecast's label
    script: str  # what runs it
    flags: tuple[str, ...] = ()
    bucket_mb: float = 25.0
    sync_every: int = 1  # local SGD's H
    outer: str = "sgd"  # local SGD: sgd (averaging) or nesterov (DiLoCo)
    quorum_s: float = 0.0  # replica groups: the Lighthouse's round trip, once per step
    one_node: bool = False  # DataParallel: one process drives every GPU of one node

    def with_(self, **changes: object) -> "Strategy":
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass
class Step:
    """One step of one rank: its time, what of it is communication nobody hid, the bytes each rank
    sends, the training state each rank holds, and how many collectives it waits on (the ranks
    meeting: calibration prices the first of a step apart)."""

    seconds: float
    exposed_s: float
    bytes_sent: float
    memory_bytes: float
    calls: float = 1.0  # collectives a rank waits on per step (1/H: one every H steps)
    notes: list[str] = field(default_factory=list)


def buckets(total: float, cap: float) -> list[float]:
    """Sizes of the buckets a total is cut into (cap 0: one per parameter, not modelled here: use a tiny cap)."""
    count = max(1, math.ceil(total / cap))
    return [total / count] * count


def overlapped(backward_s: float, costs: list[float], overlap: bool) -> float:
    """Exposed time of collectives launched as the backward makes their buckets ready (evenly spread
    over it, one after the other on one stream). Without overlap (CPU ranks: no spare core), all of
    them are exposed."""
    if not overlap:
        return sum(costs)
    done, k = 0.0, len(costs)
    for i, cost in enumerate(costs, 1):
        done = max(done, backward_s * i / k) + cost
    return max(0.0, done - backward_s)


def ring_bytes(n: float, p: int) -> float:
    return 2 * (p - 1) / p * n if p > 1 else 0.0


def state_bytes(w: Workload, world: int, shard_params: bool, shard_optimizer: bool) -> float:
    params = w.model_bytes / (world if shard_params else 1)
    optimizer = w.optimizer_states * w.model_bytes / (world if shard_optimizer else 1)
    return 2 * params + optimizer  # parameters, gradients, optimizer state


def bucketed(w: Workload, s: Strategy, net: Net, overlap: bool, world: int, collective: Callable[[float], float],
             extra_copy: bool) -> Step:
    sizes = buckets(w.gradient_wire, s.bucket_mb * MB)
    exposed = overlapped(w.backward_s, [collective(b) for b in sizes], overlap)
    # Hand-written buckets hold a flat copy of the gradients; DDP's are views of them.
    memory = state_bytes(w, world, False, False) + (w.gradient_wire if extra_copy else 0)
    return Step(w.compute_s + exposed, exposed, ring_bytes(w.gradient_wire, world), memory, len(sizes))


def ddp(w: Workload, s: Strategy, net: Net, overlap: bool, world: int) -> Step:
    return bucketed(w, s, net, overlap, world, net.all_reduce, extra_copy=False)


def allreduce(w: Workload, s: Strategy, net: Net, overlap: bool, world: int) -> Step:
    return bucketed(w, s, net, overlap, world, net.all_reduce, extra_copy=True)


def allreduce_ring(w: Workload, s: Strategy, net: Net, overlap: bool, world: int) -> Step:
    """The hand-written ring runs inside the backward hook, synchronously: nothing overlaps."""
    return bucketed(w, s, net, False, world, net.ring_all_reduce, extra_copy=True)


def master(w: Workload, s: Strategy, net: Net, overlap: bool, world: int) -> Step:
    step = bucketed(w, s, net, overlap, world, net.reduce_broadcast, extra_copy=True)
    step.bytes_sent = 2 * w.gradient_wire if world > 1 else 0.0  # each worker: n up, the root: n down per peer
    step.notes.append("the root sends and receives (W-1) n where its reduce and broadcast are flat")
    return step


def dataparallel(w: Workload, s: Strategy, net: Net, overlap: bool, world: int) -> Step:
    """nn.DataParallel: every step copies the parameters from GPU 0 to the others and sums the
    gradients back onto it, through GPU 0's links; nothing overlaps (one Python thread drives all)."""
    exposed = net.reduce_broadcast(w.model_bytes)  # replicate the parameters, gather the gradients
    return Step(w.compute_s + exposed, exposed, 2 * w.model_bytes if world > 1 else 0.0,
                state_bytes(w, 1, False, False), calls=0)  # one process: no ranks to meet


def zero1(w: Workload, s: Strategy, net: Net, overlap: bool, world: int) -> Step:
    """train_fsdp.py --shard optimizer: reduce-scatter the gradients after the backward, step the
    slice, all-gather the parameters: the bytes of one all-reduce, exposed (after the backward)."""
    exposed = net.reduce_scatter(w.gradient_wire) + net.all_gather(w.model_bytes)
    sent = (world - 1) / world * (w.gradient_wire + w.model_bytes) if world > 1 else 0.0
    return Step(w.compute_s + exposed, exposed, sent, state_bytes(w, world, False, True), calls=2)


def fsdp2(w: Workload, s: Strategy, net: Net, overlap: bool, world: int) -> Step:
    """train_fsdp.py --shard full: per block, an all-gather of its parameters before its forward and
    again before its backward, a reduce-scatter of its gradients after. With overlap (FSDP2's
    prefetch on a GPU) the next block's gathers run during this block's compute: exposed are the
    first gather of each pass, the last reduce-scatter, and whatever communication outlasts compute."""
    block_params, block_grads = w.model_bytes / w.blocks, w.gradient_wire / w.blocks
    gather, scatter = net.all_gather(block_params), net.reduce_scatter(block_grads)
    forward_comm, backward_comm = w.blocks * gather, w.blocks * (gather + scatter)
    if overlap:
        exposed = (gather + max(0.0, forward_comm - gather - w.forward_s)
                   + gather + scatter + max(0.0, backward_comm - gather - scatter - w.backward_s))
    else:
        exposed = forward_comm + backward_comm
    if world == 1:
        exposed = 0.0
    sent = (world - 1) / world * (2 * w.model_bytes + w.gradient_wire) if world > 1 else 0.0
    largest_unsharded = 2 * w.model_bytes / w.blocks  # one block's gathered parameters and gradients
    return Step(w.compute_s + exposed, exposed, sent, state_bytes(w, world, True, True) + largest_unsharded,
                calls=3 * w.blocks)


def local_sgd(w: Workload, s: Strategy, net: Net, overlap: bool, world: int) -> Step:
    """Every H steps one all-reduce of parameters and buffers (exposed: it follows the optimizer
    step); DiLoCo adds its outer step (a pass over parameters, anchor and momentum) then too."""
    n = (w.params + w.buffers) * w.param_bytes
    per_sync = net.all_reduce(n) if world > 1 else 0.0
    outer = 0.0
    if s.outer == "nesterov" and world > 1:
        outer = w.optimizer_s  # one more optimizer-like pass over the parameters
    exposed = (per_sync + outer) / s.sync_every
    anchor = w.model_bytes * (2 if s.outer == "nesterov" else 1)  # last synchronized weights (+ outer momentum)
    return Step(w.compute_s + exposed, exposed, ring_bytes(n, world) / s.sync_every,
                state_bytes(w, world, False, False) + anchor, calls=1 / s.sync_every)


def replica_groups(w: Workload, s: Strategy, net: Net, overlap: bool, world: int) -> Step:
    """train_ft.py, one replica group per node: after the backward the gradients are summed inside
    the group (process group), then across groups by torchft, each rank with its peers of the same
    rank in the other groups: every GPU's full n through the node's shared card. Neither overlaps
    the backward (the step's quorum decides who takes part); the quorum is asked for as the step
    starts and answers while it computes: exposed only where its round trip outlasts the compute."""
    inside = net.all_reduce_in_node(w.gradient_wire)
    cross = net.group_all_reduce(w.gradient_wire)
    exposed = inside + cross + max(0.0, s.quorum_s - w.compute_s)
    sent = ring_bytes(w.gradient_wire, net.local) + ring_bytes(w.gradient_wire, net.nodes)
    step = Step(w.compute_s + exposed, exposed, sent, state_bytes(w, world, False, False) + w.gradient_wire,
                calls=2 if net.nodes > 1 else 1)
    step.notes.append("one replica group per node")
    return step


@dataclass(frozen=True)
class Fitted:
    """Collectives as measured on one machine at one W: seconds = a + b n per collective, fitted to
    timings (python -m bench forecast --calibrate); n in bytes."""

    local: int
    lines: dict[str, tuple[float, float]]  # collective -> (a, b)
    nodes: int = 1

    def seconds(self, op: str, n: float) -> float:
        if self.local <= 1:
            return 0.0
        a, b = self.lines[op]
        return a + b * n

    def all_reduce(self, n: float) -> float:
        return self.seconds("all_reduce", n)

    def ring_all_reduce(self, n: float) -> float:
        return self.seconds("all_reduce", n)  # the ring's own line (its wire: "ring")

    def reduce_broadcast(self, n: float) -> float:
        return self.seconds("reduce_broadcast", n)

    def reduce_scatter(self, n: float) -> float:
        return self.seconds("reduce_scatter", n)

    def all_gather(self, n: float) -> float:
        return self.seconds("all_gather", n)

    def all_reduce_in_node(self, n: float) -> float:
        return self.all_reduce(n)

    def group_all_reduce(self, n: float) -> float:
        return 0.0  # one node, one group


def ring_link(a: float, b: float, p: int) -> Link:
    """The alpha and beta of a ring all-reduce whose fitted line is a + b n at p ranks."""
    return Link(a / (2 * (p - 1)), b * p / (2 * (p - 1)))


MODELS: dict[str, Callable[[Workload, Strategy, Net, bool, int], Step]] = {
    "ddp": ddp, "allreduce": allreduce, "allreduce-ring": allreduce_ring, "master": master, "dp": dataparallel,
    "zero1": zero1, "fsdp2": fsdp2, "localsgd": local_sgd, "ft": replica_groups,
}


def step(kind: str, w: Workload, s: Strategy, net: Net, overlap: bool, world: int) -> Step:
    return MODELS[kind](w, s, net, overlap, world)
