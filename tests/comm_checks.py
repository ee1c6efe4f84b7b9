"""Collective checks that need real processes; run under torchrun by tests/test_comm.py.

    torchrun --nproc_per_node=N tests/comm_checks.py CHECK [CHECK ...]

The checks run one after another in one process group (a launch costs torch's import in every rank,
more than a check). Rank 0 prints `=== check NAME` before each and one 'ok ...' line per thing it
checked; the first failure exits non-zero (the checks after it are not run)."""
from __future__ import annotations

import contextlib
import copy
import gc
import sys
import unittest.mock
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from common.models import build_model
from common.parallel.comm import GatherSum, GradientBuckets, float_buffers, launch_all_reduce, ring_all_reduce
from common.parallel.context import DistContext, open_transport
from common.parallel.transport import SLOT_BYTES, ProcessGroupTransport, Transport, create_region

SIZES = (1, 7, 1000, 2**20 + 3)
MARK = "=== check "  # rank 0's line before each check


def check_ring(rank: int, world: int) -> None:
    for size in SIZES:
        g = torch.Generator().manual_seed(100 * rank + size)
        integers = torch.randint(-1000, 1000, (size,), generator=g).float()  # sums are exact in any order
        expected = integers.clone()
        dist.all_reduce(expected)
        assert torch.equal(ring_all_reduce(integers.clone()), expected), f"ring != all_reduce, integers, size {size}"
        reals = torch.randn(size, generator=g, dtype=torch.float64)  # float64: 1e-12 below is one sum's rounding
        expected = reals.clone()
        dist.all_reduce(expected)
        torch.testing.assert_close(ring_all_reduce(reals.clone()), expected, rtol=1e-12, atol=1e-12)
        gathered = reals.clone()
        GatherSum(gathered).wait()
        torch.testing.assert_close(gathered, expected, rtol=1e-12, atol=1e-12)
        bits = torch.stack([gathered, gathered.clone()])
        dist.broadcast(bits[1], src=0)
        assert torch.equal(bits[0], bits[1]), "gather-sum gave different bits on different ranks"
        report(rank, f"ring size {size}")


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 4)
        self.bn = nn.BatchNorm1d(4)
        self.unused = nn.Linear(8, 4)  # never called: must keep grad None, must not stall the buckets
        self.sometimes = nn.Linear(8, 4)  # used on rank 0 only: every rank must get rank 0's grad / world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.used(x))
        return out + self.sometimes(x) if dist.get_rank() == 0 else out


def check_buckets(rank: int, world: int, wire: str = "none", micro_batches: int = 1,
                  transport: Transport | None = None) -> None:
    """Every gradient averaged (fp16 on the wire: within fp16's rounding), BatchNorm buffers equal
    to rank 0's exactly, one launch per bucket per step however many micro-batches."""
    transport = transport or ProcessGroupTransport("gloo")
    torch.manual_seed(0)
    model = WithUnused()
    wire_dtype = {"none": None, "fp16": torch.float16}[wire]
    # A tiny cap: several buckets, so ordering and partial readiness are exercised.
    buckets = GradientBuckets(model, cap_mb=64 / 2**20, launch=launch_all_reduce("torch", transport), rank=rank,
                              device=torch.device("cpu"), scale=1.0 / world, root_buffers=float_buffers(model),
                              wire_dtype=wire_dtype)
    # one sum per step of 3, against the plain all-reduce: float32 rounding (or fp16 on the wire), never grown
    tolerance = {"rtol": 1e-6, "atol": 1e-7} if wire_dtype is None else {"rtol": 2e-3, "atol": 1e-4}
    for step in range(3):
        model.zero_grad(set_to_none=True)
        for micro in range(micro_batches):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
            with buckets.paused() if micro < micro_batches - 1 else contextlib.nullcontext():
                model(x).pow(2).mean().backward()
        local = {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                 for name, p in model.named_parameters()}
        buckets.finish()
        for name, p in model.named_parameters():
            expected = local[name].clone()
            dist.all_reduce(expected)
            expected /= world
            if name.startswith("unused"):
                assert p.grad is None, f"{name} got a gradient"
            else:
                torch.testing.assert_close(p.grad, expected, **tolerance, msg=f"{name} not averaged")
        reference = model.bn.running_mean.clone()
        dist.broadcast(reference, src=0)
        assert torch.equal(model.bn.running_mean, reference), "BatchNorm buffers differ from rank 0's"
    assert buckets.launches == 3 * len(buckets.buckets), \
        f"{buckets.launches} launches for {len(buckets.buckets)} buckets x 3 steps"
    report(rank, f"buckets ({wire} on the wire, {micro_batches} micro-batch(es), {transport.name}): "
                 f"{len(buckets.buckets)} buckets, one launch each per step, unused grad None")


def check_shared_memory(rank: int, world: int) -> None:
    """The shared-memory transport, set up as the scripts set it up, against gloo's collectives:
    exact on integer-valued floats, within rounding on reals, the same bits on every rank; tensors
    larger than a slot go through in chunks; nothing is left in /dev/shm."""
    ctx = DistContext(rank, world, rank, world, torch.device("cpu"), "gloo")
    created: list[str] = []  # this job's region (other jobs on the node may be setting up theirs)

    def recording(world_size: int):
        region, problem = create_region(world_size)
        created.extend([region.path] if region else [])
        return region, problem
    with unittest.mock.patch("common.parallel.context.create_region", recording):
        transport, note = open_transport(ctx, "shm", timeout_s=60)
    assert transport.name == "shm", note
    dist.barrier()
    assert len(created) == (1 if rank == 0 else 0) and not [p for p in created if Path(p).exists()], \
        "region left in /dev/shm"
    chunked = 2 * SLOT_BYTES // 4 + 3
    for size in (1, 7, 1000, chunked):
        g = torch.Generator().manual_seed(100 * rank + size)
        for dtype in (torch.float32, torch.float16, torch.float64):
            integers = torch.randint(-100, 100, (size,), generator=g).to(dtype)  # exact sums in any order
            for op in ("all_reduce", "reduce", "broadcast"):
                expected, got = integers.clone(), integers.clone()
                root = 0 if op == "reduce" else world - 1
                keyword = {} if op == "all_reduce" else {"dst" if op == "reduce" else "src": root}
                getattr(dist, op)(expected, **keyword)
                getattr(transport, op)(got, *([] if op == "all_reduce" else [root])).wait()
                if op != "reduce" or rank == 0:
                    assert torch.equal(got, expected), f"shm {op} != gloo's, {dtype}, size {size}"
        reals = torch.randn(size, generator=g, dtype=torch.float64)  # float64: 1e-12 below is one sum's rounding
        expected, got = reals.clone(), reals.clone()
        dist.all_reduce(expected)
        transport.all_reduce(got).wait()
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        bits = torch.stack([got, got.clone()])
        dist.broadcast(bits[1], src=0)
        assert torch.equal(bits[0], bits[1]), "shm all_reduce gave different bits on different ranks"
        report(rank, f"shm size {size}")
    check_buckets(rank, world, transport=transport)
    check_buckets(rank, world, wire="fp16", micro_batches=3, transport=transport)


def check_powersgd_factors(rank: int, world: int) -> None:
    """PowerSGD's P and Q memories, split by PowerSGD._factors, belong to the parameters they are named
    for: after the first compressed step each Q slice is the mean over ranks of M_r^T p, M_r being that
    parameter's gradient on rank r as a matrix. ResNet-18 repeats shapes, which the hook groups."""
    from torch.nn.parallel import DistributedDataParallel

    from train_ddp import PowerSGD, keep_registration_order
    model = build_model("resnet18", 3, 32, 10, seed=0)
    plain = copy.deepcopy(model)  # the local gradients, uncompressed
    ddp = DistributedDataParallel(model, bucket_cap_mb=200, gradient_as_bucket_view=True)
    keep_registration_order(ddp)
    cpu = torch.device("cpu")
    powersgd = PowerSGD(ddp, model, SimpleNamespace(device=cpu, comm_device=cpu, rank=rank, world_size=world))
    powersgd.state.iter = powersgd.state.start_powerSGD_iter  # compress from the first step
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(rank))
    ddp(x).sum().backward()
    plain(x).sum().backward()
    local = dict(plain.named_parameters())
    p_memory, q_memory, p_at, q_at = powersgd.state.p_memory_dict[0], powersgd.state.q_memory_dict[0], 0, 0
    factors = powersgd._factors(powersgd.layouts[0])
    for name, p_size, q_size in factors:
        p, q = p_memory[p_at:p_at + p_size], q_memory[q_at:q_at + q_size]
        expected = local[name].grad.reshape(p_size, -1).t() @ p
        dist.all_reduce(expected)
        # one matrix product each side, summed in another order: float32 rounding of one step
        torch.testing.assert_close(q, expected / world, rtol=1e-4, atol=1e-6, msg=f"Q slice named {name} is not its Q")
        p_at, q_at = p_at + p_size, q_at + q_size
    shapes = [tuple(p.shape) for p in model.parameters()]
    report(rank, f"powersgd factors: {len(factors)} compressed matrices, "
                 f"{len(shapes) - len(set(shapes))} repeated shapes")


def report(rank: int, message: str) -> None:
    if rank == 0:
        print(f"ok {message}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        checks = {"ring": check_ring, "buckets": check_buckets,
                  "buckets-fp16-accumulate": lambda r, w: check_buckets(r, w, wire="fp16", micro_batches=3),
                  "powersgd-factors": check_powersgd_factors, "shm": check_shared_memory}
        for name in sys.argv[1:]:
            if rank == 0:
                print(f"{MARK}{name}", flush=True)
            checks[name](rank, world)
            dist.barrier()
    finally:
        dist.destroy_process_group()
        # The checks' reference cycles (a DDP's reducer) hold process groups, and with them gloo's C++
        # threads: freed now, while the interpreter is whole. Left to its teardown, a running thread
        # can end the process with "terminate called without an active exception" (SIGABRT; measured:
        # 5 of 14 launches on 2 loaded cores). The training scripts' exit does this (common/collector.py).
        gc.collect()
