"""Local SGD and DiLoCo: every rank steps its own optimizer on its share of the global batch, with
no communication, and every --sync-every H steps (and at each epoch end) the replicas are made
equal again with one bucketed all-reduce of their parameters AND BatchNorm buffers (torch's
PeriodicModelAverager averages parameters only, and lets the running statistics drift).

    torchrun --standalone --nproc_per_node=2 train_localsgd.py --sync-every 16
    torchrun --standalone --nproc_per_node=2 train_localsgd.py --sync-every 16 --outer-optimizer nesterov

--outer-optimizer sgd with --outer-lr 1 is plain averaging. Otherwise the averaged change since
the last synchronization is a pseudo-gradient for an outer optimizer (DiLoCo, Douillard et al.
2023: Nesterov momentum 0.9, outer lr 0.7) that steps from the last synchronized weights.
"""
from __future__ import annotations  # noqa: I001 - ruff wants a blank line above `# isort: split`, test_layout none

# First, before torch and any sorted block: importing `common` pauses the garbage collector while torch
# loads, and registers the collector's exit handler before any other (common/collector.py says why).
# `isort: split` keeps an import sorter (isort, ruff's I rules) from moving torch above this line.
from common.train.app import main as run
# isort: split
import argparse
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common.config import Config
from common.errors import ConfigError
from common.parallel.comm import flatten, float_buffers, replicate_from_rank0, unflatten
from common.parallel.context import DistContext
from common.train.optim import tensor_state
from common.train.strategy import Strategy

OUTER_DEFAULT_LR = {"sgd": 1.0, "nesterov": 0.7}
OUTER_MOMENTUM = 0.9


class LocalSGDStrategy(Strategy):
    name = "localsgd"
    default_dataset = "mnist"
    identity_options = ("sync_every", "outer_optimizer", "outer_lr")

    @classmethod
    def add_flags(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--sync-every", type=int, default=4, metavar="H",
                           help="optimizer steps between averagings (default: %(default)s)")
        group.add_argument("--outer-optimizer", default="sgd", choices=("sgd", "nesterov"),
                           help="step taken with the averaged change since the last averaging: sgd (with "
                                "--outer-lr 1: plain averaging) or nesterov (DiLoCo) (default: %(default)s)")
        group.add_argument("--outer-lr", type=float, default=None,
                           help="outer learning rate (default: 1 for sgd, 0.7 for nesterov)")

    def configure(self, cfg: Config) -> None:
        super().configure(cfg)
        options = cfg.options
        self.every, self.outer = options["sync_every"], options["outer_optimizer"]
        self.outer_lr = OUTER_DEFAULT_LR[self.outer] if options["outer_lr"] is None else options["outer_lr"]
        if self.every < 1 or not 0 < self.outer_lr < math.inf:  # nan or inf would train to nan weights
            raise ConfigError(f"--sync-every must be >= 1 and --outer-lr > 0 and finite (got {self.every}, "
                              f"{self.outer_lr})")
        self.plain_averaging = self.outer == "sgd" and self.outer_lr == 1.0
        if cfg.check_equivalence and not (self.every == 1 and self.plain_averaging):
            raise ConfigError("--check-equivalence compares against gradient averaging, which local SGD equals only "
                              "with --sync-every 1 and plain averaging (--outer-optimizer sgd --outer-lr 1); use "
                              "--check-replicas N (a multiple of --sync-every) to check the replicas after each "
                              "averaging instead")
        if cfg.check_equivalence and (cfg.optimizer != "sgd" or cfg.clip_grad_norm):
            raise ConfigError(f"--check-equivalence: averaging the replicas after each step equals averaging the "
                              f"gradients only for an update linear in the gradient; --optimizer {cfg.optimizer}"
                              f"{' with --clip-grad-norm' if cfg.clip_grad_norm else ''} is not (each rank steps "
                              "on its own gradient); use --optimizer sgd without --clip-grad-norm, or "
                              "--check-replicas N")
        if cfg.check_replicas % self.every:
            raise ConfigError(f"--check-replicas {cfg.check_replicas}: replicas are equal only right after an "
                              f"averaging; use a multiple of --sync-every {self.every}")
        if cfg.precision == "fp16":
            raise ConfigError("with local steps each rank's fp16 loss scaler would decide on its own and a checkpoint "
                              "could keep only one of them; use --precision bf16 (no scaler)")

    def describe(self) -> str:
        return f"{self.name}/H{self.every}" + ("" if self.plain_averaging else f"+{self.outer}{self.outer_lr:g}")

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        replicate_from_rank0(model, ctx.comm_device)
        self.device, self.world = ctx.comm_device, ctx.world_size
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = float_buffers(model)  # BatchNorm's running statistics: averaged too
        self.anchor = [p.detach().clone() for p in self.params]  # the weights at the last averaging
        self.outer_optimizer = torch.optim.SGD(
            self.anchor, lr=self.outer_lr, momentum=OUTER_MOMENTUM if self.outer == "nesterov" else 0.0,
            nesterov=self.outer == "nesterov")
        return model

    def synchronized(self, global_step: int, last_in_epoch: bool) -> bool:
        return global_step % self.every == 0 or last_in_epoch

    def end_of_step(self, model: nn.Module, global_step: int, last_in_epoch: bool) -> None:
        if self.synchronized(global_step, last_in_epoch):
            self.average()

    @torch.no_grad()
    def average(self) -> None:
        """One all-reduce of every parameter and buffer; then the outer step from the anchor."""
        tensors = [*self.params, *self.buffers]
        with torch.profiler.record_function("sync: average replicas"):
            flat = flatten(tensors, self.device)
            dist.all_reduce(flat)
            flat /= self.world
        averaged = [value.to(t.device) for t, value in zip(tensors, unflatten(flat, tensors))]
        for buffer, value in zip(self.buffers, averaged[len(self.params):]):
            buffer.copy_(value)
        if self.plain_averaging:  # the average itself, not anchor - (anchor - average), which rounds
            for anchor, value in zip(self.anchor, averaged):
                anchor.copy_(value)
        else:
            for anchor, value in zip(self.anchor, averaged):
                anchor.grad = anchor - value  # the pseudo-gradient: how far the replicas moved, on average
            self.outer_optimizer.step()
        for param, anchor in zip(self.params, self.anchor):
            param.copy_(anchor)

    # The replicas are equal at every save (saves wait for an averaging); each rank's own optimizer
    # state (momentum, Adam's moments) is not, so a checkpoint carries all of them.

    def make_optimizer(self, cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
        self.state_keys = tensor_state(cfg)
        return super().make_optimizer(cfg, model)

    def _own_state(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """This rank's state tensors, parameter by parameter (zeros where a parameter has none)."""
        return [optimizer.state.get(p, {}).get(key, torch.zeros_like(p)) for p in self.params
                for key in self.state_keys]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        if not optimizer.state:  # before the first step, or SGD without momentum: the same on every rank
            return state
        flat = torch.cat([t.reshape(-1) for t in self._own_state(optimizer)]).to(self.device)
        gathered = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(gathered, flat)
        return {**state, "state_per_rank": [g.cpu() for g in gathered]}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Each rank its own state when the world size is the same; rank 0's otherwise."""
        per_rank = state.get("state_per_rank")
        super().load_optimizer_state(optimizer, {key: value for key, value in state.items()
                                                 if key != "state_per_rank"})
        if per_rank and len(per_rank) == self.world and optimizer.state:
            own, offset = per_rank[dist.get_rank()], 0
            for target in self._own_state(optimizer):
                target.copy_(own[offset:offset + target.numel()].view_as(target))
                offset += target.numel()

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        super().load_model_state(model, state)
        for anchor, param in zip(self.anchor, self.params):
            anchor.copy_(param.detach())

    def state_dict(self) -> dict[str, Any]:
        return {"outer": self.outer_optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.outer_optimizer.load_state_dict(state["outer"])


def main(argv: list[str] | None = None) -> None:
    run(LocalSGDStrategy(), argv)


if __name__ == "__main__":
    main()
