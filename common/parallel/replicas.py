"""Replica check: every parameter and buffer must be the same on every rank."""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from common.parallel.context import DistContext


def add_replica_check_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flag of the replicas' comparison."""
    group.add_argument("--check-replicas", type=int, default=0, metavar="N",
                       help="every N steps, stop with an error if any parameter or buffer differs across ranks")


RELATIVE_TOLERANCE = 1e-6  # ranks on different device types (CPU + CUDA) differ in the last bits


def _checksums(tensor: torch.Tensor) -> torch.Tensor:
    """Plain and position-weighted sums: equal replicas give equal pairs, and a permutation or a
    single changed element changes the pair."""
    flat = tensor.detach().double().flatten()
    weights = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
    return torch.stack([flat.sum(), (flat * weights).sum()])


def check_replicas(named: list[tuple[str, torch.Tensor]], ctx: DistContext, step: int) -> None:
    """All-reduce min and max of every tensor's checksums; every rank sees the same verdict and
    stops together, naming the first tensor that differs."""
    if not named:  # e.g. FSDP on a model without buffers: its parameters exist once, in shards
        return
    sums = torch.stack([_checksums(t) for _, t in named]).to(ctx.comm_device)
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    differs = ((high - low).abs() > RELATIVE_TOLERANCE * high.abs().clamp(min=1.0)).any(dim=1)
    if differs.any():
        first = int(differs.nonzero()[0])
        ctx.fail_together(f"replica check at step {step}: {named[first][0]} differs across ranks "
                          f"(checksum {low[first, 0].item():.9g} .. {high[first, 0].item():.9g}); "
                          "the strategy let the replicas drift apart")
