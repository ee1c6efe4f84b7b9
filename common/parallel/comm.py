"""Gradient communication written by hand: buckets launched from backward hooks, a ring all-reduce.

DDP and Horovod hide most of the synchronization behind backward by packing gradients into a few
flat buckets and launching each bucket's collective as soon as its last gradient is ready. The
`GradientBuckets` below does the same for any collective, so hand-written strategies pay one
round trip per bucket, not one per parameter (NOTES.md §2).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from common.parallel.transport import Done, Handle, Transport

# A collective started on a flat bucket: returns a handle to wait on before reading the bucket.
Launch = Callable[[torch.Tensor], Handle]


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `tensor` over all ranks in place with a ring: reduce-scatter, then all-gather.

    The tensor is cut into W chunks; in W-1 steps each rank sends one chunk to its right neighbour
    and adds the chunk from its left, after which rank r holds the full sum of chunk r+1; W-1 more
    steps pass the finished chunks around. Each rank sends 2(W-1)/W of the tensor, whatever W.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return tensor
    flat = tensor.view(-1)
    chunks = list(torch.tensor_split(flat, world))
    right, left = dist.get_global_rank(group or dist.group.WORLD, (rank + 1) % world), \
        dist.get_global_rank(group or dist.group.WORLD, (rank - 1) % world)
    for step in range(world - 1):  # reduce-scatter
        send, recv = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        recv.add_(_exchange(send, torch.empty_like(recv), right, left, group))
    for step in range(world - 1):  # all-gather
        send, recv = chunks[(rank - step + 1) % world], chunks[(rank - step) % world]
        recv.copy_(_exchange(send, torch.empty_like(recv), right, left, group))
    return tensor


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int,
              group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send to the right while receiving from the left; empty chunks (tensor smaller than W) skip."""
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, right, group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, left, group))
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    return recv


class GatherSum:
    """All-reduce in one round: all-gather every rank's bucket, then sum locally in rank order (the
    same order on every rank, so every rank gets the same bits). Each rank sends its bucket to W-1
    peers instead of 2(W-1)/W of it around a ring in 2(W-1) steps: fewer round trips, more bytes,
    a win for small, latency-bound buckets at small W."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        self.handle = dist.all_gather(self.parts, flat, async_op=True)

    def wait(self) -> None:
        self.handle.wait()
        torch.sum(torch.stack(self.parts), dim=0, out=self.flat)


def launch_all_reduce(mode: str, transport: Transport) -> Launch:
    """mode: torch (the transport's all-reduce: the process group's, or shared memory on one CPU
    node), ring (ring_all_reduce, synchronous) or gather (GatherSum); ring and gather are written
    on the process group's point-to-point and all_gather."""
    def ring_now(flat: torch.Tensor) -> Handle:
        ring_all_reduce(flat)
        return Done()

    return {"ring": ring_now, "gather": GatherSum}.get(mode, transport.all_reduce)


def _split_into_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive groups of at most cap_bytes (a parameter larger than the cap gets its own).
    cap_bytes 0: one parameter per bucket."""
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


@dataclass
class Bucket:
    """One flat buffer: [gradients | one 'used here' flag per parameter | root-wins buffers]."""

    params: list[nn.Parameter]
    flat: torch.Tensor
    grads: torch.Tensor  # views into flat
    used: torch.Tensor
    buffers: list[torch.Tensor] = field(default_factory=list)
    ready: set[int] = field(default_factory=set)
    handle: Handle | None = None

    @classmethod
    def make(cls, params: list[nn.Parameter], buffers: list[torch.Tensor], device: torch.device,
             dtype: torch.dtype) -> "Bucket":
        n_grads = sum(p.numel() for p in params)
        flat = torch.zeros(n_grads + len(params) + sum(b.numel() for b in buffers), dtype=dtype, device=device)
        return cls(params, flat, flat[:n_grads], flat[n_grads:n_grads + len(params)], buffers)

    @property
    def buffer_region(self) -> torch.Tensor:
        return self.flat[self.grads.numel() + len(self.params):]


Then = Callable[[Bucket], Handle]


class GradientBuckets:
    """Flattens gradients into buckets and starts `launch` on each as soon as it is complete.

    Buckets are filled in reverse registration order (roughly the order backward produces
    gradients) and launched strictly in bucket order, so every rank issues the same collectives in
    the same order even when gradients arrive in a different order. Parameters that got no gradient
    on this rank are sent as zeros with a 'used' flag of 0; a parameter no rank used keeps grad None,
    as in a single process.

    `root_buffers` (BatchNorm running statistics) ride in the last bucket: rank 0 sends its values,
    the others zeros, so after a summing collective every rank holds rank 0's buffers. That is DDP's
    buffer broadcast without a collective of its own.

    `wire_dtype` (fp16 or bf16) compresses the gradients: each bucket travels in that type, halving
    the bytes on the wire, and is cast back on arrival. Packed gradients are multiplied by `scale`
    (1/W) before the collective, so a sum of W of them cannot overflow fp16 (DDP's fp16 hook does the
    same); the buffers, which must not lose precision, then travel in a float32 bucket of their own.
    """

    def __init__(self, model: nn.Module, cap_mb: float, launch: Launch, *, rank: int, device: torch.device,
                 scale: float = 1.0, then: Then | None = None, root_buffers: list[torch.Tensor] | None = None,
                 wire_dtype: torch.dtype | None = None) -> None:
        """`then`, if given, starts on each bucket once `launch` finished (reduce, then broadcast).
        `device` holds the buckets: the parameters' own device, or the CPU when gloo serves a CUDA
        rank."""
        params = [p for p in reversed(list(model.parameters())) if p.requires_grad]
        dtype = wire_dtype or params[0].dtype
        groups = _split_into_buckets(params, int(cap_mb * 2**20))
        buffers = root_buffers or []
        separate = bool(buffers) and dtype != buffers[0].dtype
        self.buckets = [Bucket.make(group, buffers if i == len(groups) - 1 and not separate else [], device, dtype)
                        for i, group in enumerate(groups)]
        if separate:
            self.buckets.append(Bucket.make([], buffers, device, buffers[0].dtype))
        self.launch, self.then, self.scale, self.is_root = launch, then, scale, rank == 0
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        self.next_launch = 0
        self.active = True
        self.launches = 0  # collectives started so far, for tests and the benchmark
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Gradients accumulate in .grad without any bucket launching (all micro-batches but the last)."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.active:
            return
        self.buckets[self.bucket_of[id(param)]].ready.add(id(param))
        while self.next_launch < len(self.buckets) and \
                len(self.buckets[self.next_launch].ready) == len(self.buckets[self.next_launch].params):
            self._launch(self.buckets[self.next_launch])

    def _launch(self, bucket: Bucket) -> None:
        with torch.profiler.record_function(f"sync: launch bucket {self.next_launch}"):
            offset = 0
            for p in bucket.params:  # view(p.shape).copy_ also packs channels_last gradients
                view = bucket.grads[offset:offset + p.numel()].view(p.shape)
                view.zero_() if p.grad is None else view.copy_(p.grad)
                offset += p.numel()
            if self.scale != 1.0:
                bucket.grads.mul_(self.scale)
            # Filled on the device: copying a host list into a CUDA bucket would wait for the GPU
            # inside backward, every bucket, every step.
            bucket.used.fill_(1)
            for i, p in enumerate(bucket.params):
                if p.grad is None:
                    bucket.used[i].fill_(0)
            if bucket.buffers:
                region = bucket.buffer_region
                if self.is_root:
                    region.copy_(torch.cat([b.detach().reshape(-1) for b in bucket.buffers]))
                else:
                    region.zero_()
            bucket.handle = self.launch(bucket.flat)
        self.next_launch += 1
        self.launches += 1

    def finish(self) -> None:
        """Launch what backward left (unused parameters, a separate buffer bucket), wait for every
        bucket, write the results back into .grad and the buffers. Called once per step, after
        the last backward."""
        for bucket in self.buckets[self.next_launch:]:
            self._launch(bucket)
        with torch.profiler.record_function("sync: wait for buckets"):
            if self.then is not None:
                for bucket in self.buckets:
                    bucket.handle.wait()
                    bucket.handle = self.then(bucket)
            for bucket in self.buckets:
                bucket.handle.wait()
                self._write_back(bucket)
                bucket.ready.clear()
                bucket.handle = None
        self.next_launch = 0

    def _write_back(self, bucket: Bucket) -> None:
        offset = 0
        # Used here means used somewhere; only a rank that skipped a parameter reads the flags (on a
        # GPU, a read that waits for the collective).
        used = bucket.used.tolist() if any(p.grad is None for p in bucket.params) else [1] * len(bucket.params)
        for p, used_anywhere in zip(bucket.params, used):
            if used_anywhere:
                grad = bucket.grads[offset:offset + p.numel()].view_as(p)
                p.grad = grad.to(p.device, p.dtype) if p.grad is None else p.grad.copy_(grad)
            offset += p.numel()
        offset = 0
        for b in bucket.buffers:
            b.copy_(bucket.buffer_region[offset:offset + b.numel()].view_as(b))
            offset += b.numel()


def float_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Buffers that training changes differently per rank (BatchNorm running mean and variance).
    Integer buffers (BatchNorm's batch counter) advance identically on every rank."""
    return [b for b in model.buffers() if b.is_floating_point()]


def flatten(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' values (each in its logical order) in one flat tensor on `device`: one collective for all."""
    return torch.cat([t.detach().reshape(-1).to(device) for t in tensors])


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like each tensor of `like`: the inverse of flatten()."""
    views, offset = [], 0
    for t in like:
        views.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


def broadcast_coalesced(tensors: list[torch.Tensor], device: torch.device, src: int = 0,
                        transport: Transport | None = None) -> None:
    """Rank src's values to every rank, one broadcast per dtype (BatchNorm counts are int64),
    through a flat tensor on the communication device (by `transport`, else the process group)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = flatten(group, device)
        transport.broadcast(flat, src).wait() if transport else dist.broadcast(flat, src=src)
        for t, value in zip(group, unflatten(flat, group)):
            t.data.copy_(value)


def replicate_from_rank0(model: nn.Module, device: torch.device) -> None:
    """Start every rank from rank 0's weights and buffers instead of trusting equal seeds."""
    broadcast_coalesced([*model.parameters(), *model.buffers()], device)


class PerParameterAllReduce:
    """The tutorials' loop, kept as the benchmark's baseline: after backward, one blocking
    all_reduce per parameter, each paying a full round trip (plus one broadcast of the BatchNorm
    buffers, which the tutorials forgot)."""

    def __init__(self, model: nn.Module, scale: float, device: torch.device) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = float_buffers(model)
        self.scale, self.device = scale, device
        self.launches = 0

    @contextmanager
    def paused(self) -> Iterator[None]:
        yield  # it communicates only in finish(), after the last micro-batch

    def finish(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad.to(self.device)
            dist.all_reduce(grad)
            p.grad.copy_(grad.mul_(self.scale))
            self.launches += 1
        broadcast_coalesced(self.buffers, self.device)
