"""The process's place in the job, read once from torchrun's environment, and the process group.

Without torchrun (RANK unset) the script runs as one process with a one-rank process group, so
strategies and collectives work the same at every world size.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from common.config import Config
from common.errors import ConfigError, PeerFailed, UserError


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_primary(self) -> bool:
        """The one rank that prints, writes TensorBoard and saves checkpoints."""
        return self.rank == 0

    @property
    def is_node_primary(self) -> bool:
        """The one rank per node that downloads data."""
        return self.local_rank == 0

    def barrier(self) -> None:
        dist.barrier()

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def fail_together(self, message: str) -> None:
        """For a verdict every rank reached together: rank 0 reports it, the others exit quietly."""
        self.fail_together_with(UserError(message))

    def fail_together_with(self, error: UserError) -> None:
        if not self.is_primary:
            quiet = PeerFailed(str(error))
            quiet.exit_code = error.exit_code
            raise quiet
        raise error

    def all_ok(self, ok: bool) -> bool:
        """True only if every rank says ok: lets ranks fail together instead of hanging."""
        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def resolve_device(flag: str, local_rank: int, local_world_size: int) -> torch.device:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if flag == "auto":
        return torch.device("cuda", local_rank) if gpus >= local_world_size else torch.device("cpu")
    if flag == "cpu":
        return torch.device("cpu")
    if flag == "cuda":
        if gpus < local_world_size:
            raise ConfigError(f"--device cuda needs {local_world_size} GPU(s) on this node, found {gpus}; "
                              "use --device cpu or fewer processes per node")
        return torch.device("cuda", local_rank)
    raise ConfigError(f"--device {flag!r} is unknown; use auto, cpu or cuda")


def resolve_backend(flag: str, device: torch.device) -> str:
    if flag == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if flag == "nccl" and device.type != "cuda":
        raise ConfigError("--backend nccl needs every rank on a CUDA GPU, but this rank is on the CPU; "
                          "use --backend gloo (or auto)")
    return flag


def _set_cpu_threads(local_world_size: int) -> None:
    """Ranks sharing a host split its cores instead of each spawning one thread per core."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // local_world_size))


def context_from_env(cfg: Config) -> DistContext:
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    device = resolve_device(cfg.device, local_rank, local_world)
    return DistContext(rank, world, local_rank, local_world, device, resolve_backend(cfg.backend, device))


@contextmanager
def distributed(cfg: Config) -> Iterator[DistContext]:
    """Join the process group (a private one-rank group without torchrun) and always leave it."""
    ctx = context_from_env(cfg)
    _set_cpu_threads(ctx.local_world_size)
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    timeout = timedelta(seconds=cfg.timeout_s)
    if "RANK" in os.environ:
        # torchrun keeps its store across restarts: without a per-attempt prefix a restarted rank
        # can read the dead attempt's gloo addresses and fail to connect.
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(ctx.backend, store=dist.PrefixStore(f"attempt-{attempt}", store),
                                rank=ctx.rank, world_size=ctx.world_size, timeout=timeout)
    else:
        dist.init_process_group(ctx.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        yield ctx
        dist.barrier()  # leave together: a rank tearing down gloo while a peer still talks can abort it
    finally:
        dist.destroy_process_group()
