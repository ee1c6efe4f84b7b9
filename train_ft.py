"""Fault-tolerant replica groups on torchft: when a group dies the others keep stepping, and a group
that comes back copies its state from a live peer instead of reading a checkpoint.

Each replica group is its own torchrun job; a torchft Lighthouse forms a quorum of the live groups
at every step. Beyond torchft, every step trains the same global batch whatever the quorum: the
batch is cut into SLOTS = --groups x (ranks per group) micro-batches of the usual size, and the
participating ranks share them out (a group of the quorum takes its absent peers' slots as extra
micro-batches). Gradients are summed over the group's ranks (gloo or nccl) and then across groups
(torchft), in one vector with one entry per slot: every committed step proves that each slot was
trained exactly once. So the weights do not depend on when groups failed, and a step that fails
mid-collective is retried on the same samples.

    launch/ft.sh 2 1 train_ft.py --dataset mnist        # a Lighthouse and two groups on this machine
    TORCHFT_LIGHTHOUSE=http://HOST:29510 torchrun --standalone --nproc_per_node=2 train_ft.py --groups 2 --group-id 0
"""
from __future__ import annotations  # noqa: I001 - ruff wants a blank line above `# isort: split`, test_layout none

# First, before torch and any sorted block: importing `common` pauses the garbage collector while torch
# loads, and registers the collector's exit handler before any other (common/collector.py says why).
# `isort: split` keeps an import sorter (isort, ruff's I rules) from moving torch above this line.
from common.train.app import main as run
# isort: split
import argparse
import math
import os
from urllib.parse import SplitResult, urlsplit

import torch
import torch.distributed as dist
from torch import nn

from common.config import Config, world_size_from_env
from common.errors import ConfigError
from common.parallel.comm import flatten, replicate_from_rank0, unflatten
from common.parallel.context import DistContext
from common.train import ft
from common.train.strategy import Strategy

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class FaultTolerantStrategy(Strategy):
    name = "ft"
    default_dataset = "mnist"
    sole_writer = False  # a restarted group resumes the run whose checkpoints a live group writes
    stop_check_every = 1  # a stopped group leaves after the step it is in: the others wait for none
    trainer_class = ft.FaultTolerantTrainer

    @classmethod
    def add_flags(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--groups", type=int, default=int(os.environ.get("FT_GROUPS", "0")) or None,
                           help="the replica groups the global batch is planned for: it is cut into this many x "
                                "(ranks per group) micro-batches, shared among the groups alive at each step "
                                "(default: $FT_GROUPS, set by launch/ft.sh)")
        group.add_argument("--group-id", type=int, default=_env_int("REPLICA_GROUP_ID"),
                           help="this group's number, 0 to --groups - 1 (default: $REPLICA_GROUP_ID)")
        group.add_argument("--lighthouse", default=os.environ.get(LIGHTHOUSE_ENV),
                           help=f"the torchft Lighthouse's URL, http://HOST:PORT (default: ${LIGHTHOUSE_ENV})")
        group.add_argument("--min-groups", type=int, default=1,
                           help="the fewest groups a step may commit with (default: %(default)s)")
        group.add_argument("--exact-sums", action="store_true",
                           help="add the slots' gradients in slot order, whichever groups trained them: the weights "
                                "are then the same bits whatever failed when, at the price of sending a gradient per "
                                "slot (SLOTS x the bytes); without it, the sum's order follows the quorum and the "
                                "weights differ in rounding")
        group.add_argument("--quorum-every", type=int, default=1,
                           help="steps between two quorums (and after every failed step): a group that joins waits "
                                "for the next one; each quorum is a round trip to the Lighthouse, a few ms that a "
                                "short step feels (default: %(default)s)")
        group.add_argument("--ft-timeout-s", type=float, default=30.0,
                           help="bound on a cross-group collective and on a heal's transfer: a frozen group is "
                                "left behind after this long (default: %(default)s)")
        group.add_argument("--quorum-timeout-s", type=float, default=60.0,
                           help="bound on forming a quorum: a Lighthouse that does not answer within it ends the "
                                "run, saved (default: %(default)s)")

    def configure(self, cfg: Config) -> None:
        super().configure(cfg)
        ft.require_torchft()
        options = cfg.options
        self.group_id, self.groups, self.lighthouse = options["group_id"], options["groups"], options["lighthouse"]
        for flag, value in (("--groups", self.groups), ("--group-id", self.group_id),
                            ("--lighthouse", self.lighthouse)):
            if value is None:
                raise ConfigError(f"{flag} is missing: launch/ft.sh sets it for each group; by hand, pass it or set "
                                  "its variable (train_ft.py --help)")
        self.min_groups, self.exact, self.quorum_every = options["min_groups"], options["exact_sums"], \
            options["quorum_every"]
        self.ft_timeout_s, self.quorum_timeout_s = options["ft_timeout_s"], options["quorum_timeout_s"]
        self.check_counts()
        url = urlsplit(self.lighthouse)
        if url.scheme not in ("http", "https") or not url.hostname or not _has_port(url):
            raise ConfigError(f"--lighthouse {self.lighthouse}: expected http://HOST:PORT (the Lighthouse's --bind)")
        if cfg.check_equivalence:
            raise ConfigError("--check-equivalence is not available with train_ft.py: its weights are compared "
                              "with train_ddp.py's and with its own fault-free run's (tests/test_ft.py); check "
                              "the other strategies with it")
        self.slots = self.groups * world_size_from_env()
        self.check_slots(cfg)
        if "MASTER_ADDR" not in os.environ:  # torchft's Manager reads the group's store address from torchrun
            raise ConfigError("train_ft.py runs each replica group as a torchrun job: launch/ft.sh GROUPS "
                              "NPROC_PER_GROUP train_ft.py [FLAGS...], or torchrun --standalone "
                              "--nproc_per_node=N train_ft.py --groups G --group-id I")

    def check_counts(self) -> None:
        if self.quorum_every < 1:
            raise ConfigError(f"--quorum-every must be >= 1 (got {self.quorum_every})")
        if self.groups < 1 or self.group_id < 0 or self.min_groups < 1:
            raise ConfigError(f"--groups ({self.groups}) and --min-groups ({self.min_groups}) must be >= 1, "
                              f"--group-id ({self.group_id}) >= 0")
        if self.group_id >= self.groups:
            raise ConfigError(f"--group-id {self.group_id}: the groups are numbered 0 to {self.groups - 1} "
                              f"(--groups {self.groups}); give each group its own number below --groups")
        if self.min_groups > self.groups:  # no quorum could ever commit a step
            raise ConfigError(f"--min-groups {self.min_groups} is more than --groups {self.groups}: no step "
                              "could commit; lower --min-groups or plan for more groups")
        if not 0 < self.ft_timeout_s < math.inf or not 0 < self.quorum_timeout_s < math.inf:  # every wait a deadline
            raise ConfigError("--ft-timeout-s and --quorum-timeout-s must be > 0 seconds, and finite")

    def check_slots(self, cfg: Config) -> None:
        """The global batch is cut into SLOTS micro-batches, each split by --accumulate and, with
        mixing, into halves (config.py checks the same per rank)."""
        b = cfg.batch_size // self.slots
        parts = cfg.accumulate * (2 if cfg.mixup or cfg.cutmix else 1)
        if cfg.batch_size % self.slots or b % parts:
            raise ConfigError(f"--batch-size {cfg.batch_size} must be a multiple of {self.slots * parts} with "
                              f"--groups {self.groups} x {self.slots // self.groups} rank(s) per group"
                              f"{' x --accumulate' if cfg.accumulate > 1 else ''}"
                              f"{' x 2 (mixing)' if parts % 2 == 0 else ''}"
                              "; pass such a --batch-size, or another --groups")

    def describe(self) -> str:
        return f"ft/{self.groups}-groups{'/exact-sums' if self.exact else ''}"

    def log_subfolder(self) -> str:
        return f"group{self.group_id}"

    def batch_shares(self, world_size: int) -> int:
        return self.slots

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        """Equal weights within the group; across groups the same seed gives the same start, and a
        group that joins late heals from a live one."""
        replicate_from_rank0(model, ctx.comm_device)
        self.ctx, self.params = ctx, [p for p in model.parameters() if p.requires_grad]
        self.buffers = list(model.buffers())
        self.manager = ft.connect(self.group_id, self.lighthouse, self.min_groups, ctx.backend, self.ft_timeout_s,
                                  self.quorum_timeout_s)
        return model

    def slot_rows(self) -> torch.Tensor | None:
        """--exact-sums: one row of gradients per slot (zeros but this rank's), else None."""
        if not self.exact:
            return None
        return torch.zeros(self.slots, sum(p.numel() for p in self.params), device=self.params[0].device)

    def take_gradients(self, row: torch.Tensor) -> None:
        """The slot's gradients into its row, and .grad cleared for the next slot."""
        row.copy_(self.gradients())
        for p in self.params:
            p.grad = None

    def gradients(self) -> torch.Tensor:
        """This rank's gradients in one flat tensor (zeros for a parameter forward did not use)."""
        return flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params],
                       self.params[0].device)

    def synchronize(self, extra: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """One vector, the gradients (or the slots' rows) then `extra`, summed over the group's ranks
        and across groups. Rows hold one rank's values and zeros elsewhere, so their sums are exact;
        they are then added in slot order: the same bits whichever groups trained which slots.
        Returns extra's sum. After a failed cross-group sum the values are garbage: should_commit()
        is then False and the step is retried."""
        gradients = rows.reshape(-1) if rows is not None else self.gradients()
        flat = torch.cat([gradients, extra.to(gradients.dtype)]).to(self.ctx.comm_device)
        if self.ctx.world_size > 1:
            dist.all_reduce(flat)
        self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        flat = flat.to(self.params[0].device)
        total = flat[:gradients.numel()]
        if rows is not None:
            per_slot = total.view(self.slots, -1)
            total = per_slot[0].clone()
            for row in per_slot[1:]:
                total += row
        for p, grad in zip(self.params, unflatten(total, self.params)):  # views of this step's own vector
            p.grad = grad
        return flat[gradients.numel():]

    def vector_length(self) -> int:
        """The values synchronize() sends: gradients (a row per slot with --exact-sums), the slots'
        coverage, the buffers."""
        gradients = sum(p.numel() for p in self.params) * (self.slots if self.exact else 1)
        return gradients + self.slots + sum(b.numel() for b in self.buffers)


def _has_port(url: SplitResult) -> bool:
    try:
        return url.port is not None
    except ValueError:  # not a number, or out of range
        return False


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else None


def main(argv: list[str] | None = None) -> None:
    run(FaultTolerantStrategy(), argv)


if __name__ == "__main__":
    main()
