"""The seam between the shared training loop and the ways of synchronizing gradients.

The loop calls only these methods; each train_*.py implements them. common/ never asks which
strategy it runs.
"""
from __future__ import annotations

import argparse
import math
from contextlib import nullcontext
from typing import Any, ContextManager

import torch
from torch import nn

from common.config import Config
from common.errors import ConfigError
from common.parallel.context import DistContext
from common.train.optim import Stepping, entry_order, from_positions, make_optimizer, to_positions, whole_pieces
from common.train.precision import Precision
from common.train.preemption import StopRequest


def add_compression_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flag of what a strategy sends (Strategy.compressions: the ones each takes)."""
    group.add_argument("--grad-compression", default="none", choices=("none", "fp16", "bf16", "powersgd"),
                       help="gradients on the wire: fp16/bf16 halve the bytes, powersgd (DDP only) sends a rank-1 "
                            "approximation with error feedback (default: %(default)s)")


class Strategy:
    """Defaults describe a strategy that needs no help: override what yours does differently."""

    name: str = "base"
    default_dataset: str = "cifar10"
    identity_options: tuple[str, ...] = ()  # the strategy's flags that change the trained weights
    compressions: tuple[str, ...] = ("none",)  # --grad-compression values it implements
    compression = "none"
    collective_forward = False  # True: forward itself communicates (FSDP), so every rank runs as many forwards
    uses_transport = False  # True: its gradient collectives go through ctx.transport (shared memory on a CPU node)
    # None: common/train/trainer.py's Trainer runs the steps; a strategy that owns its step loop (train_ft.py:
    # quorums, retries, healing) names its subclass of it
    trainer_class: type | None = None
    # Steps between two checks for a stop request (common/train/preemption.py): a strategy whose jobs must
    # not wait for one that was stopped (train_ft.py's replica groups) checks at every step
    stop_check_every = StopRequest.CHECK_EVERY
    # False: several jobs train the run at once (train_ft.py's replica groups) and may write its checkpoints
    sole_writer = True

    @classmethod
    def add_flags(cls, group: argparse._ArgumentGroup) -> None:
        """The strategy's own flags; their values arrive in configure(), in cfg.options."""

    def configure(self, cfg: Config) -> None:
        """Check the flags against what the strategy can do (ConfigError: exit 2, before any process
        group exists) and keep what it needs."""
        if cfg.grad_compression not in self.compressions:
            raise ConfigError(f"--grad-compression {cfg.grad_compression} is not available with {self.name} "
                              f"(it implements: {', '.join(self.compressions)}); " + self.compression_hint())
        self.compression = cfg.grad_compression

    def compression_hint(self) -> str:
        return "drop the flag, or use train_ddp.py (fp16, bf16, powersgd) or train_allreduce.py (fp16, bf16)"

    def describe(self) -> str:
        """Name plus the options that change how it synchronizes, for logs and reports."""
        return self.name + self.compressed()

    def compressed(self) -> str:
        return "" if self.compression == "none" else f"+{self.compression}"

    def check_world(self, world_size: int) -> None:
        """Raise ConfigError if the strategy cannot run at this world size (before anything starts)."""

    def batch_shares(self, world_size: int) -> int:
        """Into how many equal shares the global batch is cut (one per rank, by default)."""
        return world_size

    def log_subfolder(self) -> str:
        """Where under --log-dir this job's TensorBoard files go: a strategy whose run is several
        jobs at once (train_ft.py's replica groups) keeps each one's curves apart."""
        return ""

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        """Called once, before the optimizer is built and a checkpoint (if any) is loaded."""
        return model

    def make_optimizer(self, cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
        """Built after wrap(), over the parameters the strategy trains (a shard, for ZeRO)."""
        plain = self.unwrap(model)
        params = list(plain.parameters())
        optimizer = make_optimizer(cfg, whole_pieces(params), Stepping.of(cfg, plain))
        self.order = entry_order(optimizer, params)
        return optimizer

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """Around the backward passes of all but the last micro-batch of a step: let gradients
        accumulate locally, with no communication."""
        return nullcontext()

    def after_backward(self, model: nn.Module) -> None:
        """Make gradients equal on every rank before the optimizer sees them. Time spent here is
        logged as time/sync_ms: the synchronization that backward did not hide."""

    def step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        precision.step(optimizer)

    def end_of_step(self, model: nn.Module, global_step: int, last_in_epoch: bool) -> None:
        """After each optimizer step (`global_step` steps done): a strategy that synchronizes on a
        schedule of its own (local SGD) does it here."""

    def synchronized(self, global_step: int, last_in_epoch: bool) -> bool:
        """Whether the replicas are equal after this step: checkpoints, stops and replica checks
        wait for such a step."""
        return True

    def consolidate(self, model: nn.Module) -> None:
        """Make state that no gradient carries (BatchNorm running statistics) equal on every rank,
        before anyone reads it: evaluation, a checkpoint, a replica check."""

    def replicated(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The tensors every rank holds a full, equal copy of (what --check-replicas compares)."""
        plain = self.unwrap(model)
        return [*plain.named_parameters(), *plain.named_buffers()]

    def grad_norm(self, model: nn.Module) -> float:
        """L2 norm of the synchronized gradients (equal on every rank); a collective where sharded."""
        norms = [p.grad.detach().norm() for p in self.unwrap(model).parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0

    def ema_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """The floating-point tensors this rank updates and an EMA of the weights averages (its shard
        where sharded): parameters, then BatchNorm's running statistics."""
        plain = self.unwrap(model)
        return [*plain.parameters(), *(b for b in plain.buffers() if b.is_floating_point())]

    def spread(self, model: nn.Module) -> None:
        """After ema_tensors() were overwritten in place, make the whole model follow (ZeRO-1: gather
        the slices into every rank's parameters); a collective where sharded."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model: what is saved (no 'module.' prefix) and what evaluation runs."""
        return model

    # Checkpoints hold the plain model's full state dict and a full optimizer state keyed by each
    # parameter's position in model.parameters(), whatever the strategy, so any script resumes any
    # other's checkpoint at any world size. A strategy that
    # shards state gathers it here (called on every rank: may be a collective) and re-shards on load.

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return self.unwrap(model).state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return to_positions(optimizer.state_dict(), self.order)

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        self.unwrap(model).load_state_dict(state)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(from_positions(state, self.order))

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own state that training depends on (e.g. PowerSGD's error feedback)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


WIRE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class HandWrittenSync(Strategy):
    """What train_allreduce.py and train_master.py share: replicas start from rank 0's weights,
    and a gradient synchronizer built by the subclass runs after backward (it also keeps the
    BatchNorm buffers equal to rank 0's, as DDP does)."""

    compressions = ("none", "fp16", "bf16")
    uses_transport = True

    @classmethod
    def add_flags(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--bucket-mb", type=float, default=25.0,
                           help="gradient bucket size in MB; each bucket is one collective (default: %(default)s)")

    def configure(self, cfg: Config) -> None:
        super().configure(cfg)
        if not 0 < cfg.options["bucket_mb"] < math.inf:
            raise ConfigError(f"--bucket-mb must be > 0 and finite (got {cfg.options['bucket_mb']})")
        self.bucket_mb = cfg.options["bucket_mb"]
        self.wire_dtype = WIRE_DTYPES[cfg.grad_compression]

    def compression_hint(self) -> str:
        return "PowerSGD needs DDP's communication hooks: use train_ddp.py --grad-compression powersgd"

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        from common.parallel.comm import replicate_from_rank0

        replicate_from_rank0(model, ctx.comm_device)
        self.sync = self.make_sync(model, ctx)
        return model

    def make_sync(self, model: nn.Module, ctx: DistContext) -> Any:
        """An object whose finish() leaves every rank with the averaged gradients, and whose
        paused() lets a micro-batch's gradients accumulate without communication."""
        raise NotImplementedError

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        return self.sync.paused()

    def after_backward(self, model: nn.Module) -> None:
        self.sync.finish()
