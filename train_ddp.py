"""DistributedDataParallel: gradients are averaged in buckets, overlapped with backward, by DDP itself.

    torchrun --standalone --nproc_per_node=2 train_ddp.py [--grad-compression fp16|bf16|powersgd]
"""
from __future__ import annotations  # noqa: I001 - ruff wants a blank line above `# isort: split`, test_layout none

# First, before torch and any sorted block: importing `common` pauses the garbage collector while torch
# loads, and registers the collector's exit handler before any other (common/collector.py says why).
# `isort: split` keeps an import sorter (isort, ruff's I rules) from moving torch above this line.
from common.train.app import main as run
# isort: split
import inspect
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from common.config import Config
from common.parallel.comm import broadcast_coalesced, flatten, unflatten
from common.parallel.context import DistContext
from common.parallel.transport import ProcessGroupTransport, Transport
from common.train.strategy import WIRE_DTYPES, Strategy

# Buffers are still sent from rank 0 once, when DDP is built. The flag's name changed in torch 2.14.
NO_BUFFER_SYNC_PER_FORWARD = ({"forward_sync_buffers": False}
                              if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                              else {"broadcast_buffers": False})


Layout = list[tuple[str, tuple[int, ...]]]  # a bucket's parameters: (name, shape), in bucket order


class DDPStrategy(Strategy):
    name = "ddp"
    default_dataset = "cifar10"
    compressions = ("none", "fp16", "bf16", "powersgd")

    def configure(self, cfg: Config) -> None:
        super().configure(cfg)
        self.powersgd: PowerSGD | None = None
        self.uses_transport = self.compression != "powersgd"  # torch's PowerSGD hook talks to the process group

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        """DDP broadcasts BatchNorm buffers from rank 0 before every forward; they matter only when
        read (evaluation, checkpoints), so consolidate() sends them then instead: the same values,
        without a collective per step."""
        self.device = ctx.comm_device
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # PowerSGD's hook starts its second all-reduce from the first one's completion callback: with
        # two buckets in flight the ranks can issue them in different orders (gloo aborts with a
        # collective mismatch). One bucket keeps the order.
        cap_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1 \
            if self.compression == "powersgd" else 25
        ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True, bucket_cap_mb=cap_mb,
                                      **NO_BUFFER_SYNC_PER_FORWARD)
        if self.compression == "powersgd":  # rank 1: one P and one Q per matrix; error feedback keeps it unbiased
            keep_registration_order(ddp)
            self.powersgd = PowerSGD(ddp, model, ctx)
        elif not isinstance(ctx.transport, ProcessGroupTransport):
            ddp.register_comm_hook(TransportHook(ctx.transport, ctx.world_size, WIRE_DTYPES[self.compression]),
                                   TransportHook.hook)
        elif self.compression != "none":
            hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
            ddp.register_comm_hook(None, hook[self.compression])
        return ddp

    def no_sync(self, model: nn.Module) -> Any:
        return model.no_sync()

    def consolidate(self, model: nn.Module) -> None:
        broadcast_coalesced(list(self.unwrap(model).buffers()), self.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module

    def state_dict(self) -> dict[str, Any]:
        return self.powersgd.state_dict() if self.powersgd else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.powersgd and state:
            self.powersgd.load_state_dict(state)


class TransportHook:
    """DDP's buckets through the suite's own transport (shared memory on a CPU node) instead of the
    process group: what torch's allreduce and fp16/bf16 hooks do, over another wire. The bucket,
    cast to the wire dtype, is divided by W before the sum, so W fp16 shares cannot overflow."""

    def __init__(self, transport: Transport, world: int, wire_dtype: torch.dtype | None) -> None:
        self.transport, self.world, self.wire_dtype = transport, world, wire_dtype

    @staticmethod
    def hook(self, bucket):  # noqa: ANN001, ANN205 - DDP rejects a hook annotated other than with its classes
        buffer = bucket.buffer()
        wire = buffer.div_(self.world) if self.wire_dtype is None else buffer.to(self.wire_dtype).div_(self.world)
        self.transport.all_reduce(wire).wait()
        if wire is not buffer:
            buffer.copy_(wire)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done


def keep_registration_order(ddp: DistributedDataParallel) -> None:
    """Fix DDP's bucket layout for the life of the process (a collective: every rank builds DDP here).
    DDP lays a bucket out in registration order for a process's first step, then rebuilds it in
    gradient-ready order. A resumed process would run its first step in the other layout than the
    uninterrupted run: the same sums at other memory offsets round differently (max |dw| 1.5e-8
    after 13 steps). One bucket is sent only when all its gradients are ready, so the rebuild gains
    nothing. These are the calls DDP's own Join hook makes to rebuild early."""
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()


class PowerSGD:
    """torch's PowerSGD hook, with its state saved per parameter. The hook keeps its error feedback
    and warm-start factors per bucket, in the bucket's parameter order; a checkpoint keeps them by
    parameter name, placed into whatever bucket holds the parameters when training resumes.

    The error feedback is each rank's own (its gradient minus the agreed approximation), so a
    checkpoint carries every rank's; P and Q are all-reduced, the same on every rank, and saved once."""

    def __init__(self, ddp: DistributedDataParallel, model: nn.Module, ctx: DistContext) -> None:
        self.state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                 start_powerSGD_iter=2, random_seed=0)
        self.names = {p: name for name, p in model.named_parameters()}
        self.layouts: dict[int, Layout] = {}  # bucket index -> its parameters, in order
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # per-parameter state waiting for its bucket
        self.device, self.comm_device, self.rank, self.world = ctx.device, ctx.comm_device, ctx.rank, ctx.world_size
        ddp.register_comm_hook(self, PowerSGD.hook)

    @staticmethod
    def hook(self, bucket):  # noqa: ANN001, ANN205 - DDP rejects a hook annotated other than with its classes
        index, layout = bucket.index(), [(self.names[p], tuple(p.shape)) for p in bucket.parameters()]
        if self.pending:
            self._place(index, layout)
        self.layouts[index] = layout
        return powerSGD_hook.powerSGD_hook(self.state, bucket)

    def _factors(self, layout: Layout) -> list[tuple[str, int, int]]:
        """(name, P size, Q size) of each parameter the hook compresses, in the hook's order: grouped
        by matrix shape, groups in order of first appearance, bucket order within a group."""
        groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for name, shape in layout:
            n = shape[0] if shape else 1
            m = max(1, int(torch.Size(shape).numel()) // max(n, 1))
            rank = min(n, m, self.state.matrix_approximation_rank)
            if powerSGD_hook._should_compress(n, m, rank, self.state.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((name, n * rank, m * rank))
        return [factor for group in groups.values() for factor in group]

    def _per_parameter(self, layouts: dict[int, Layout]) -> dict[str, dict[str, torch.Tensor]]:
        """The state of these buckets, split by parameter (and taken out of the hook's dicts)."""
        s, out = self.state, {"error": {}, "p": {}, "q": {}}
        for index, layout in layouts.items():
            if index in s.error_dict:
                sizes = [int(torch.Size(shape).numel()) for _, shape in layout]
                out["error"].update(zip([n for n, _ in layout], s.error_dict.pop(index).split(sizes)))
            if index in s.p_memory_dict:
                factors = self._factors(layout)
                names = [n for n, _, _ in factors]
                out["p"].update(zip(names, s.p_memory_dict.pop(index).split([p for _, p, _ in factors])))
                out["q"].update(zip(names, s.q_memory_dict.pop(index).split([q for _, _, q in factors])))
        return out

    def _merge(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for key, tensors in state.items():
            self.pending.setdefault(key, {}).update(tensors)

    def _place(self, index: int, layout: Layout) -> None:
        """Put the waiting per-parameter state into this bucket, in its current order."""
        s, pending, names = self.state, self.pending, [n for n, _ in layout]
        if names and all(n in pending.get("error", {}) for n in names):
            s.error_dict[index] = torch.cat([pending["error"].pop(n) for n in names]).to(self.device)
        factors = [n for n, _, _ in self._factors(layout)]
        if factors and all(n in pending.get("p", {}) for n in factors):
            s.p_memory_dict[index] = torch.cat([pending["p"].pop(n) for n in factors]).to(self.device)
            s.q_memory_dict[index] = torch.cat([pending["q"].pop(n) for n in factors]).to(self.device)
        if not any(pending.values()):
            self.pending = {}

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        name, keys, position, has_gauss, cached = s.rng.get_state()
        saved = {key: {n: t.clone() for n, t in tensors.items()} for key, tensors in self.pending.items()}
        for key, tensors in self._per_parameter(dict(self.layouts)).items():
            saved.setdefault(key, {}).update({n: t.cpu().clone() for n, t in tensors.items()})
        for index, layout in self.layouts.items():  # _per_parameter took the state out: put it back
            self._merge(saved)
            self._place(index, layout)
        return {"iter": s.iter, "rng": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)),
                                        "position": int(position), "has_gauss": int(has_gauss),
                                        "cached": float(cached)},
                **saved, "error": self._every_ranks(saved.get("error", {}))}

    def _every_ranks(self, errors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """A collective: each rank's error feedback, indexed by rank. Every rank holds errors for the
        same parameters (the hook runs on every rank in the same steps)."""
        if not errors:
            return []
        names = sorted(errors)
        flat = flatten([errors[n] for n in names], self.comm_device)
        gathered = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(gathered, flat)
        return [dict(zip(names, unflatten(g.cpu(), [errors[n] for n in names]))) for g in gathered]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s, rng = self.state, state["rng"]
        s.iter = state["iter"]
        s.rng.set_state((rng["name"], rng["keys"].numpy().astype(np.uint32), rng["position"], rng["has_gauss"],
                         rng["cached"]))
        self.pending = {key: dict(state.get(key, {})) for key in ("p", "q")}
        errors = state.get("error", [])
        if isinstance(errors, dict):  # a checkpoint of an earlier version, which saved rank 0's alone
            errors = [errors]
        self.pending["error"] = own_error(errors, self.rank, self.world)


def own_error(per_rank: list[dict[str, torch.Tensor]], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's saved error feedback at the same world size. At another one, every rank takes the
    mean of the saved ranks' errors: the averaged gradient then carries the same total correction."""
    if len(per_rank) == world:
        return dict(per_rank[rank])
    if not per_rank:
        return {}
    return {name: torch.stack([errors[name] for errors in per_rank]).mean(0) for name in per_rank[0]}


def main(argv: list[str] | None = None) -> None:
    run(DDPStrategy(), argv)


if __name__ == "__main__":
    main()
