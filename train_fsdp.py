"""Sharded data parallel: each rank keeps only its share of what training holds in memory.

    torchrun --standalone --nproc_per_node=2 train_fsdp.py [--shard full|optimizer]

--shard optimizer (ZeRO-1): every rank keeps the full parameters and gradients, but the optimizer
state (SGD's momentum) only for its 1/W of the flattened parameters. Gradients are reduce-scattered
(each rank receives the average of its slice), each rank steps its slice, and the slices are
all-gathered back into the parameters: the bytes of one all-reduce, and 1/W of the momentum.

--shard full (ZeRO-3, FSDP2's fully_shard): parameters, gradients and optimizer state are all
sharded; each block's parameters are all-gathered just before its forward and backward and freed
after, and gradients are reduce-scattered as backward goes.
"""
from __future__ import annotations  # noqa: I001 - ruff wants a blank line above `# isort: split`, test_layout none

# First, before torch and any sorted block: importing `common` pauses the garbage collector while torch
# loads, and registers the collector's exit handler before any other (common/collector.py says why).
# `isort: split` keeps an import sorter (isort, ruff's I rules) from moving torch above this line.
from common.train.app import main as run
# isort: split
import argparse
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from common.config import Config
from common.errors import ConfigError
from common.parallel.comm import broadcast_coalesced, replicate_from_rank0
from common.parallel.context import DistContext
from common.train.optim import Piece, Stepping, local, make_optimizer, tensor_state, whole_pieces
from common.train.strategy import Strategy

SHARDS = ("full", "optimizer")


class Sharded(Strategy):
    """What both sharding modes share: the flag, and BatchNorm buffers sent from rank 0 when read."""

    name = "fsdp"
    default_dataset = "cifar10"

    @classmethod
    def add_flags(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--shard", default="full", choices=SHARDS,
                           help="full: parameters, gradients and optimizer state (ZeRO-3, FSDP2); optimizer: "
                                "the optimizer state only (ZeRO-1) (default: %(default)s)")

    def configure(self, cfg: Config) -> None:
        super().configure(cfg)
        if "," in cfg.device or (cfg.backend == "gloo" and cfg.device != "cpu" and torch.cuda.is_available()):
            raise ConfigError(f"--device {cfg.device} --backend {cfg.backend}: sharded training runs its collectives "
                              "on the parameters' device, so every rank must be on the CPU with gloo or on CUDA with "
                              "nccl; use --device cpu, or --backend nccl (or auto) on GPUs")
        if cfg.precision == "fp16":
            raise ConfigError("sharded training steps a different slice on every rank, so fp16's loss scaler would "
                              "decide per slice; use --precision bf16 (no scaler), or train_ddp.py --precision fp16")

    def describe(self) -> str:
        return f"{self.name}/{self.shard}"

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        self.device = ctx.comm_device
        replicate_from_rank0(model, ctx.comm_device)  # every rank starts from rank 0's weights, then shards
        return model

    def consolidate(self, model: nn.Module) -> None:
        broadcast_coalesced(list(self.unwrap(model).buffers()), self.device)


class ZeroOne(Sharded):
    """ZeRO-1 written on the suite's own collectives (not torch's ZeroRedundancyOptimizer, whose
    state consolidation pickles objects between ranks and whose per-parameter partition keeps the
    optimizer from stepping one flat slice): the parameters live in one flat buffer, padded to a
    multiple of W, and rank r owns slice r of it."""

    shard = "optimizer"

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        super().wrap(model, ctx)
        self.flat = FlatParameters(model, ctx.rank, ctx.world_size)
        return model

    def make_optimizer(self, cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
        """Over the parts of each parameter in this rank's slice: each keeps its parameter's decay,
        and LARS/LAMB sum their norms over the ranks."""
        self.state_keys = tensor_state(cfg)
        self.stepping = Stepping.of(cfg, model)
        return make_optimizer(cfg, self.flat.pieces(), self.stepping, reduce=dist.all_reduce)

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.flat.zero_grad()  # in place: the gradients stay views of the flat buffer

    def after_backward(self, model: nn.Module) -> None:
        self.flat.reduce_scatter_gradients()

    def end_of_step(self, model: nn.Module, global_step: int, last_in_epoch: bool) -> None:
        self.spread(model)

    def spread(self, model: nn.Module) -> None:
        self.flat.all_gather_parameters()  # every rank's updated slice, into everyone's parameters

    def ema_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        return [self.flat.slice, *(b for b in model.buffers() if b.is_floating_point())]

    def grad_norm(self, model: nn.Module) -> float:
        """Each rank holds the average of its own slice only: sum the slices' squares over ranks."""
        squares = self.flat.slice.grad.detach().double().square().sum().reshape(1)
        dist.all_reduce(squares)
        return squares.sqrt().item()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The state as one process over model.parameters() would have it (a collective): each
        state tensor's pieces placed in a slice, the slices all-gathered and cut per parameter."""
        pieces = [p for group in optimizer.param_groups for p in group["params"]]
        step = self._step_count(optimizer, pieces)
        groups = [{**g, "params": self.stepping.members(key)}  # in make_optimizer's order
                  for g, key in zip(optimizer.state_dict()["param_groups"], self.stepping.groups())]
        if step is None:
            return {"state": {}, "param_groups": groups}
        full = {key: self.flat.unflatten(self.flat.gather(self.flat.place(
            [(p, optimizer.state[p][key]) for p in pieces]))) for key in self.state_keys}
        extra = {} if step == 0 else {"step": torch.tensor(float(step))}
        return {"state": {position: {**{key: full[key][i] for key in self.state_keys}, **extra}
                          for i, position in enumerate(self.flat.positions)}, "param_groups": groups}

    def _step_count(self, optimizer: torch.optim.Optimizer, pieces: list[torch.Tensor]) -> int | None:
        """None before the first step (no state yet), else the optimizer's step count (0 for SGD and
        LARS, which keep none): agreed over ranks, as a slice of padding only holds no state."""
        mine = [optimizer.state[p] for p in pieces if optimizer.state.get(p)]
        count = float(mine[0]["step"]) if mine and "step" in mine[0] else 0.0
        agreed = torch.tensor([float(bool(mine)), count], dtype=torch.float64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return int(agreed[1]) if agreed[0] else None

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        pieces = [p for group in optimizer.param_groups for p in group["params"]]
        groups = [{**saved, "params": list(range(start, start + len(group["params"])))}
                  for saved, group, start in zip(state["param_groups"], optimizer.param_groups,
                                                 _starts(optimizer.param_groups))]
        saved = [state["state"].get(position) for position in self.flat.positions]
        present = [s for s in saved if s]
        if not present:  # saved before the first step
            optimizer.load_state_dict({"state": {}, "param_groups": groups})
            return
        own = {}
        for key in self.state_keys:  # cloned: each piece's own storage, not a view of the W slices
            # A parameter saved without state (one no gradient reached elsewhere) starts from zeros.
            flat = self.flat.flatten([s[key] if s else torch.zeros_like(p) for s, p in zip(saved, self.flat.params)])
            for index, value in enumerate(self.flat.cut(flat, pieces)):
                own.setdefault(index, {})[key] = value.clone()
        if "step" in present[0]:
            for index in range(len(pieces)):
                own.setdefault(index, {})["step"] = present[0]["step"].clone()
        optimizer.load_state_dict({"state": own, "param_groups": groups})


def _starts(groups: list[dict[str, Any]]) -> list[int]:
    """Where each group's entries begin in an optimizer's own numbering."""
    starts, start = [], 0
    for group in groups:
        starts.append(start)
        start += len(group["params"])
    return starts


class FlatParameters:
    """The parameters and their gradients as views into two flat buffers, padded to a multiple of
    W, and this rank's slice of the parameters (a view too) for the optimizer. Per rank: the
    parameters and gradients once each, and 1/W of the optimizer state, as DDP holds them all."""

    def __init__(self, model: nn.Module, rank: int, world: int) -> None:
        self.everything = list(model.parameters())  # positions in it key the optimizer state, as everywhere
        self.positions = [i for i, p in enumerate(self.everything) if p.requires_grad]  # of the flattened ones
        self.params = [self.everything[i] for i in self.positions]
        self.per_rank = -(-sum(p.numel() for p in self.params) // world)
        self.rank, self.world = rank, world
        self.lo, self.hi = rank * self.per_rank, (rank + 1) * self.per_rank
        self.stepped: list[Piece] = []
        self.span: dict[int, tuple[int, int]] = {}  # a piece (by id) -> its region of the flat buffers
        p0 = self.params[0]
        self.flat = torch.zeros(self.per_rank * world, dtype=p0.dtype, device=p0.device)
        self.grads = torch.zeros_like(self.flat)
        self.offsets, offset = [], 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        for p, view, grad in zip(self.params, self._views(self.flat), self._views(self.grads)):
            view.copy_(p.detach())
            p.data, p.grad = view, grad  # autograd accumulates into the flat gradient buffer
        self.slice = self.slice_of(self.flat)  # stepping it updates this rank's part of the parameters

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A region per parameter, in the parameter's own layout (channels_last stays channels_last)."""
        return [flat.as_strided(p.shape, p.stride(), o) for p, o in zip(self.params, self.offsets)]

    def pieces(self) -> list[Piece]:
        """Each parameter's part that falls in this rank's slice, as a view of the flat buffer (the
        padding at the end belongs to no parameter and is never stepped)."""
        spans = [(i, a, b) for i, (p, o) in enumerate(zip(self.params, self.offsets))
                 if (a := max(o, self.lo)) < (b := min(o + p.numel(), self.hi))]
        self.stepped = [Piece(self.flat[a:b], self.positions[i]) for i, a, b in spans]
        self.span = {id(piece.tensor): (a, b) for piece, (_, a, b) in zip(self.stepped, spans)}  # in the flat buffer
        return self.stepped

    def place(self, values: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """This rank's slice with each piece's state tensor at its place (zeros where there is none)."""
        own = torch.zeros(self.per_rank, dtype=self.flat.dtype, device=self.flat.device)
        for piece, value in values:
            a, b = self.span[id(piece)]
            own[a - self.lo:b - self.lo].copy_(value)
        return own

    def cut(self, flat: torch.Tensor, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """The pieces' regions of a full flat buffer, in the order given."""
        return [flat[slice(*self.span[id(p)])] for p in pieces]

    def zero_grad(self) -> None:
        self.grads.zero_()
        self.slice.grad = None
        for piece in self.stepped:
            piece.tensor.grad = None

    def reduce_scatter_gradients(self) -> None:
        """In place: this rank's slice of the gradient buffer receives the average of that slice
        (NCCL's documented in-place form, output = input + rank * count), so no second buffer.
        Each piece's gradient is its region of it."""
        with torch.profiler.record_function("sync: reduce-scatter gradients"):
            own = self.slice_of(self.grads)
            dist.reduce_scatter_tensor(own, self.grads)
            self.slice.grad = own.div_(self.world)
            for piece in self.stepped:
                piece.tensor.grad = self.grads[slice(*self.span[id(piece.tensor)])]

    def all_gather_parameters(self) -> None:
        with torch.profiler.record_function("sync: all-gather parameters"):
            dist.all_gather_into_tensor(self.flat, self.slice.clone())  # the input may not alias the output

    def slice_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]

    def gather(self, own: torch.Tensor) -> torch.Tensor:
        full = torch.empty_like(self.flat)
        dist.all_gather_into_tensor(full, own.contiguous())
        return full

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros_like(self.flat)
        for view, t in zip(self._views(flat), tensors):
            view.copy_(t)
        return flat

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [view.clone() for view in self._views(flat)]


class FullShard(Sharded):
    """FSDP2: fully_shard on each block (the parameterized children of the root, or of its
    nn.Sequential children), then on the root. With --precision bf16 the blocks gather their
    parameters in bf16 and reduce gradients in fp32; BatchNorm layers keep fp32 throughout (their
    running statistics would lose precision)."""

    shard = "full"
    collective_forward = True  # each forward all-gathers: every rank must run as many

    def configure(self, cfg: Config) -> None:
        super().configure(cfg)
        self.precision = cfg.precision

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        super().wrap(model, ctx)
        for p in model.parameters():  # FSDP2 shards contiguous parameters only (inputs stay channels_last)
            p.data = p.data.contiguous()
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.precision == "bf16" else MixedPrecisionPolicy()
        if self.precision == "bf16":
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy())
        for block in blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model = model
        return model

    @contextmanager
    def _gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def no_sync(self, model: nn.Module) -> Any:
        return self._gradient_sync(model, False)

    def replicated(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return list(model.named_buffers())  # the parameters exist once, in shards

    def make_optimizer(self, cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
        """Over the shards (DTensors); LARS/LAMB sum each parameter's squared norm over them."""
        return make_optimizer(cfg, whole_pieces(model.parameters()), Stepping.of(cfg, model), reduce=dist.all_reduce)

    def ema_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """The shards: resharded first, as a forward without a backward (evaluation) leaves the
        root's own parameters (a ViT's class token) gathered whole."""
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return [*(local(p) for p in model.parameters()), *(b for b in model.buffers() if b.is_floating_point())]

    def grad_norm(self, model: nn.Module) -> float:
        squares = sum((p.grad.to_local().double() ** 2).sum() for p in model.parameters() if p.grad is not None)
        total = torch.as_tensor(squares, dtype=torch.float64, device=self.device).reshape(1)
        dist.all_reduce(total)
        return total.sqrt().item()

    def _options(self, **extra: bool) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, **extra)

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=self._options(cpu_offload=True))  # full on rank 0 only

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state, options=self._options())

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """FSDP2's full optimizer state is keyed by parameter name; checkpoints key it by position
        in model.parameters(), as any other script's optimizer does."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        named = get_optimizer_state_dict(self.model, optimizer, options=self._options(cpu_offload=True))
        if not named:  # ranks other than 0
            return {}
        position = {name: i for i, (name, _) in enumerate(self.model.named_parameters())}
        return {"state": {position[name]: value for name, value in named["state"].items()},
                "param_groups": [{**g, "params": [position[n] for n in g["params"]]} for g in named["param_groups"]]}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        names = [name for name, _ in self.model.named_parameters()]
        named = {"state": {names[i]: value for i, value in state["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(self.model, optimizer, named, options=self._options())


def blocks(model: nn.Module) -> list[nn.Module]:
    """The units FSDP gathers one at a time: each parameterized child of the root, or, for an
    nn.Sequential child (a ResNet stage, a conv stack), each of its parameterized children."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    for child in model.children():
        parts = list(child.children()) if isinstance(child, nn.Sequential) else [child]
        units += [m for m in parts if any(True for _ in m.parameters())]
    return [m for m in units if not isinstance(m, FSDPModule)]  # BatchNorm already wrapped on its own (bf16)


def units(model: nn.Module) -> int:
    """How many groups FSDP2 gathers one at a time: the blocks, and the root where it holds
    parameters of its own (a ResNet's root or the convnet's holds none: it gathers nothing). The
    cost model prices a root's group like a block's, though the root is not resharded after its
    forward (one gather a step, not two)."""
    groups = blocks(model)
    in_blocks = {id(p) for b in groups for p in b.parameters()}
    return len(groups) + (1 if any(id(p) not in in_blocks for p in model.parameters()) else 0)


def chosen_shard(argv: list[str] | None) -> str:
    """--shard picks the class; the full parser (with --help) still sees the flag, and refuses a bad
    value in its one line (this one would print its usage block, on every rank)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--shard", nargs="?")  # a value missing: the full parser says so
    shard = pre.parse_known_args(sys.argv[1:] if argv is None else argv)[0].shard
    return shard if shard in SHARDS else "full"


def main(argv: list[str] | None = None) -> None:
    run({"full": FullShard, "optimizer": ZeroOne}[chosen_shard(argv)](), argv)


if __name__ == "__main__":
    main()
