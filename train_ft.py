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
from __future__ import annotations

import argparse
import http.server
import logging
import os
import signal
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator
from urllib.parse import SplitResult, urlsplit

import torch
import torch.distributed as dist
from torch import nn

from common.config import Config, world_size_from_env
from common.data.loader import TrainLoader
from common.errors import ConfigError, UserError, first_line
from common.parallel.comm import flatten, replicate_from_rank0, unflatten
from common.parallel.context import DistContext
from common.train.app import main as run
from common.train.checkpoint import detached_copy, load_training_state, training_state
from common.train.preemption import SAVE_FAILED, Preempted
from common.train.run import Position
from common.train.step import COMPUTE, DATA, SYNC, StepClock, backward, reseed, update
from common.train.strategy import Strategy
from common.train.trainer import Trainer

os.environ.setdefault("RUST_LOG", "warn")  # torchft's own log: a line per step at its default level
try:
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
except ImportError as missing:  # torchft ships manylinux x86_64 wheels only
    Manager = None
    TORCHFT_MISSING = str(missing)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
MAX_RETRIES = 20  # consecutive failed steps before a group gives up (a peer that fails every step)


class FaultTolerantStrategy(Strategy):
    name = "ft"
    default_dataset = "mnist"
    sole_writer = False  # a restarted group resumes the run whose checkpoints a live group writes

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
        if Manager is None:
            raise ConfigError(f"train_ft.py needs torchft ({TORCHFT_MISSING}), which ships Linux x86_64 wheels only: "
                              "pip install -r requirements.txt there, or use train_ddp.py with checkpoint-and-restart "
                              "(docs/fault-tolerance.md)")
        options = cfg.options
        self.group_id, self.groups, self.lighthouse = options["group_id"], options["groups"], options["lighthouse"]
        for flag, value in (("--groups", self.groups), ("--group-id", self.group_id),
                            ("--lighthouse", self.lighthouse)):
            if value is None:
                raise ConfigError(f"{flag} is missing: launch/ft.sh sets it for each group; by hand, pass it or set "
                                  "its variable (train_ft.py --help)")
        if options["quorum_every"] < 1:
            raise ConfigError(f"--quorum-every must be >= 1 (got {options['quorum_every']})")
        if self.groups < 1 or self.group_id < 0 or options["min_groups"] < 1:
            raise ConfigError(f"--groups ({self.groups}) and --min-groups ({options['min_groups']}) must be >= 1, "
                              f"--group-id ({self.group_id}) >= 0")
        url = urlsplit(self.lighthouse)
        if url.scheme not in ("http", "https") or not url.hostname or not _has_port(url):
            raise ConfigError(f"--lighthouse {self.lighthouse}: expected http://HOST:PORT (the Lighthouse's --bind)")
        if not options["ft_timeout_s"] > 0 or not options["quorum_timeout_s"] > 0:
            raise ConfigError("--ft-timeout-s and --quorum-timeout-s must be > 0 seconds")
        if cfg.check_equivalence:
            raise ConfigError("--check-equivalence is not available with train_ft.py: its weights are compared "
                              "with train_ddp.py's and with its own fault-free run's (tests/test_ft.py); check "
                              "the other strategies with it")
        if self.group_id >= self.groups:
            raise ConfigError(f"--group-id {self.group_id}: the groups are numbered 0 to {self.groups - 1} "
                              f"(--groups {self.groups}); give each group its own number below --groups")
        if options["min_groups"] > self.groups:  # no quorum could ever commit a step
            raise ConfigError(f"--min-groups {options['min_groups']} is more than --groups {self.groups}: no step "
                              "could commit; lower --min-groups or plan for more groups")
        self.slots = self.groups * world_size_from_env()
        self.check_slots(cfg)
        if "MASTER_ADDR" not in os.environ:  # torchft's Manager reads the group's store address from torchrun
            raise ConfigError("train_ft.py runs each replica group as a torchrun job: launch/ft.sh GROUPS "
                              "NPROC_PER_GROUP train_ft.py [FLAGS...], or torchrun --standalone "
                              "--nproc_per_node=N train_ft.py --groups G --group-id I")
        self.min_groups, self.options, self.exact = options["min_groups"], options, options["exact_sums"]
        self.quorum_every = options["quorum_every"]

    def check_slots(self, cfg: Config) -> None:
        """The global batch is cut into SLOTS micro-batches, each split by --accumulate and, with
        mixing, into halves (config.py checks the same per rank)."""
        b = cfg.batch_size // self.slots
        parts = cfg.accumulate * (2 if cfg.mixup or cfg.cutmix else 1)
        if cfg.batch_size % self.slots or b % parts:
            raise ConfigError(f"--batch-size {cfg.batch_size} must be a multiple of {self.slots * parts} with "
                              f"--groups {self.groups} x {self.slots // self.groups} rank(s) per group"
                              f"{' x --accumulate' if cfg.accumulate > 1 else ''}{' x 2 (mixing)' if parts % 2 == 0 else ''}"
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
        logging.getLogger("torchft").setLevel(logging.CRITICAL)  # its tracebacks: told as one line here
        # torchft's heal server (http.server) logs every request on stderr
        http.server.BaseHTTPRequestHandler.log_message = lambda *args: None
        seconds = timedelta(seconds=self.options["ft_timeout_s"])
        pg = ProcessGroupNCCL(timeout=seconds) if ctx.backend == "nccl" else ProcessGroupGloo(timeout=seconds)
        # torchft's heal transfer reads the received bytes through a read-only buffer: a warning per heal
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        waited = self.options["quorum_timeout_s"]
        try:
            self.manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=self.min_groups,
                                   use_async_quorum=True, timeout=seconds, quorum_timeout=timedelta(seconds=waited),
                                   connect_timeout=timedelta(seconds=waited), lighthouse_addr=self.lighthouse,
                                   replica_id=f"group{self.group_id}", init_sync=False, max_retries=MAX_RETRIES)
        except RuntimeError as error:  # the Lighthouse did not answer within the connect timeout
            raise UserError(f"--lighthouse {self.lighthouse}: no answer within --quorum-timeout-s {waited:g} "
                            f"({first_line(error)}); start it (torchft_lighthouse --min_replicas 1 --bind "
                            "[::]:PORT, or launch/ft.sh) or correct the URL") from None
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


@dataclass(frozen=True)
class Quorum:
    groups: int  # participating in this step
    index: int | None  # this group's place among them; None: it is healing


class Healed(Exception):
    """The quorum moved this group to another step: its state came from a live peer."""

    def __init__(self, at: Position) -> None:
        super().__init__(at)
        self.at = at


class FaultTolerantTrainer(Trainer):
    """The shared loop, with each step run under a quorum: this rank's slots of the global batch
    for the groups alive, retried until the groups commit it, and a jump wherever a heal puts the
    group."""

    def __post_init__(self) -> None:
        super().__post_init__()
        strategy = self.run.strategy
        self.ft, self.manager = strategy, strategy.manager
        self.slots = SlotBatches(self.run, strategy.slots)
        self.quorum: Quorum | None = None
        self.healed_from: int | None = None
        self.agreed_in = -1  # the quorum whose groups were found to train this run alike
        self.agent = os.getppid()  # torchrun's agent: a worker left behind by it ends (ft.sh restarts the group)
        self.stop.CHECK_EVERY = 1  # a stopped group leaves after the step it is in: the others wait for none
        self.manager.register_state_dict_fn("run", self.load_peer_state, self.peer_state)

    def fit(self, start: Position) -> Any:
        self.manager.load_state_dict({"step": self.run.global_step(start), "batches_committed": 0})
        try:
            while True:
                try:
                    return super().fit(start)
                except Healed as healed:  # this group's steps so far were left behind: go on where the peer is
                    self.steps.rows.clear()
                    self.steps.take_epoch()
                    if self.stop.handle is not None:
                        self.stop.handle.wait()
                        self.stop.handle = None
                    start = healed.at
                except LighthouseLost as lost:
                    self.end_without_lighthouse(lost)
        finally:
            self.manager.shutdown(wait=False)

    def step_batches(self, epoch: int, first_step: int) -> Iterator[Any]:
        """Nothing ahead of the step: which slots this rank trains is known only once its quorum is."""
        return iter(range(first_step, self.run.steps_per_epoch))

    def one_step(self, batch: Any, at: Position, clock: StepClock) -> tuple[torch.Tensor, float | None, int]:
        """Quorum, this rank's slots, one synchronization, commit; the same samples again until the
        groups commit the step. The quorum is asked for as the step starts and answers while the
        slots train (those of the last quorum: trained again only if the answer deals them otherwise)."""
        run = self.run
        if os.getppid() != self.agent:
            raise UserError(f"group {self.ft.group_id}'s torchrun agent (pid {self.agent}) is gone: this worker "
                            "stops rather than train on as a group nothing supervises")
        fresh = self.quorum is None or run.global_step(at) % self.ft.quorum_every == 0
        while True:
            started = time.perf_counter()
            if fresh:  # answered in a thread of torchft's, during the slots' forward and backward
                self.manager.start_quorum()
            assumed = self.quorum or self.settle(at)
            mine, batches, (stats, rows, extra) = self.train_share(assumed, at, clock)
            quorum = self.settle(at) if fresh else assumed
            if quorum != assumed:  # the groups changed: this step's slots are dealt anew
                mine, batches, (stats, rows, extra) = self.train_share(quorum, at, clock)
            summed = self.ft.synchronize(extra, rows)
            clock.lap(SYNC)
            if self.manager.should_commit():  # a healing group loads its peer's state here
                self.count_samples(summed[:self.ft.slots], at)
                self.restore_slot0_buffers(summed[self.ft.slots:])
                norm = update(run.model, run.strategy, run.optimizer, run.scheduler, run.precision, self.recipe)
                clock.lap(COMPUTE)
                self.slots.done(at)
                if quorum.index is None:
                    self.end_heal(started)
                return stats, norm, sum(len(labels) for _, labels in batches)
            self.retried += 1
            fresh = True  # a new quorum, without the group that failed
            self.log.warn(f"step {run.global_step(at) + 1} failed across groups and is trained again on the same "
                          "samples (a group left or froze mid-step)")

    def train_share(self, quorum: Quorum, at: Position, clock: StepClock) -> tuple[list[int], list, tuple]:
        """This rank's slots under `quorum`, their batches, and train_slots() of them."""
        mine = share(self.ft.slots, quorum, self.run.ctx.rank, self.run.ctx.world_size)
        batches = [self.slots.batch(slot, at) for slot in mine]
        clock.lap(DATA)
        trained = self.train_slots(mine, batches, at)
        clock.lap(COMPUTE)
        return mine, batches, trained

    def settle(self, at: Position) -> Quorum:
        """Wait for the quorum asked for as the step started. A group behind the others is not one of its
        participants (index None): it trains no slot, receives the step's sum, and loads a live
        group's state (taken before that group's update) as the step commits."""
        try:
            self.manager.wait_quorum()
        except Exception as error:  # the Lighthouse is gone (torchft's quorum raises once its timeout ran out)
            raise LighthouseLost(f"no quorum from the Lighthouse at {self.ft.lighthouse} within "
                                 f"--quorum-timeout-s {self.ft.options['quorum_timeout_s']:g} "
                                 f"({type(error).__name__})", at) from None
        quorum = Quorum(self.manager.num_participants(), self.manager.participating_rank())
        self.agree_on_the_run()
        if quorum != self.quorum:
            # torchft counts the groups that train the step: a healing group is not one of them yet.
            place = ("is not one of them yet: it copies a live group's state first (healing)" if quorum.index is None
                     else f"is number {quorum.index}")
            # The wall time: how long a group trained alone reads from two of these lines.
            self.log.info(f"quorum of {quorum.groups} group(s) at step {self.run.global_step(at) + 1}: this group "
                          f"(group {self.ft.group_id}) {place} [{time.strftime('%H:%M:%S')}]")
            self.quorum = quorum
        return quorum

    def agree_on_the_run(self) -> None:
        """Once per quorum, before any gradient crosses: every group must train this run and cut its
        batch alike (a vector of another length aborts gloo's process; another run's weights would
        be taken silently)."""
        quorum_id = self.manager._quorum_id  # torchft 0.2.0 keeps each quorum's id to itself
        if quorum_id == self.agreed_in:
            return
        own = torch.tensor([self.ft.slots, self.ft.vector_length(), int(self.run.cfg.run_id, 16)])
        differs = self.differing_across_groups(own)
        if differs is None:  # the sum failed: the step is tried again, with a new quorum
            return
        if len(differs):
            raise UserError(f"group {self.ft.group_id} met groups that train another run or cut the batch "
                            f"otherwise at the Lighthouse {self.ft.lighthouse} (this group: run "
                            f"{self.run.cfg.run_id}, {self.ft.slots} slots): start every group with the same "
                            "flags, --groups and ranks per group, or give each run its own Lighthouse (FT_PORT)")
        self.agreed_in = quorum_id

    def end_heal(self, started: float) -> None:
        """This group trained the step it healed in with its peer's state and the step's sum: it is
        now where the others are. Its EMA takes the step too; then the loop goes on from there."""
        step, cfg = self.manager.current_step(), self.run.cfg
        if self.run.ema:
            self.run.ema.update(step)
        if cfg.check_replicas and step % cfg.check_replicas == 0:  # the check the other groups make after it
            self.check_groups_equal(step)
        self.quorum = None
        self.log.info(f"group {self.ft.group_id} healed from group {self.healed_from} at step {step}: weights, "
                      f"optimizer state and position from a live peer, {time.perf_counter() - started:.2f} s "
                      "from its quorum to its first step")
        raise Healed(Position(*divmod(step, self.run.steps_per_epoch)))

    def train_slots(self, mine: list[int], batches: list[tuple[torch.Tensor, torch.Tensor]], at: Position,
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Forward and backward of each slot as its own micro-batches, each mean loss divided by
        SLOTS x --accumulate: the sum over all ranks is the global batch's mean gradient (with
        --exact-sums each slot's gradients kept in a row of their own). Returns (loss sum and
        correct), the rows (None without the flag), and what goes along with the gradients: 1 for each of
        this rank's slots, and the buffers (BatchNorm's statistics) as slot 0's micro-batches left
        them, from the rank that trained slot 0 (zeros elsewhere)."""
        run, recipe = self.run, self.recipe
        run.strategy.zero_grad(run.model, run.optimizer)
        stats = torch.zeros(2, device=run.ctx.device)
        coverage = torch.zeros(self.ft.slots, device=run.ctx.device)
        buffers = torch.zeros(sum(b.numel() for b in self.ft.buffers), device=run.ctx.device)
        before = [b.clone() for b in self.ft.buffers]
        rows = self.ft.slot_rows()
        for slot, (images, labels) in zip(mine, batches):
            if self.random:
                reseed(run.cfg.seed, slot, run.global_step(at))  # slot s draws what rank s of a plain run draws
            stats += backward(run.step_model, run.strategy, run.precision, images, labels, recipe,
                              recipe.accumulate * self.ft.slots)
            if rows is not None:
                self.ft.take_gradients(rows[slot])
            coverage[slot] += 1
            if slot == 0 and self.ft.buffers:
                buffers = flatten([b.float() for b in self.ft.buffers], run.ctx.device)
        for b, old in zip(self.ft.buffers, before):
            b.copy_(old)  # every rank takes slot 0's below, once the step commits
        return stats, rows, torch.cat([coverage, buffers])

    def count_samples(self, coverage: torch.Tensor, at: Position) -> None:
        """How often each slot of the committed step was trained, summed over every group: once."""
        if not torch.equal(coverage.round(), torch.ones_like(coverage)):
            raise RuntimeError(f"step {self.run.global_step(at) + 1}: the groups trained the global batch's slots "
                               f"{coverage.round().int().tolist()} times, not once each")
        self.counted.append(int(coverage.sum().item()) * (self.run.cfg.batch_size // self.ft.slots))

    def train_epoch(self, epoch: int, first_step: int) -> Any:
        self.counted, self.retried = [], 0
        result = super().train_epoch(epoch, first_step)
        if self.counted:
            self.log.info(f"epoch {epoch + 1}: {sum(self.counted)} samples in {len(self.counted)} committed steps "
                          f"from step {first_step + 1} on, every slot of every step trained once across the groups; "
                          f"{self.retried} step(s) trained again after a failure")
        return result

    def restore_slot0_buffers(self, values: torch.Tensor) -> None:
        for b, value in zip(self.ft.buffers, unflatten(values, self.ft.buffers)):
            b.copy_(value)

    def end_without_lighthouse(self, lost: LighthouseLost) -> None:
        """No quorum means no step: the group saves where it stands and ends with one line."""
        where = self.save(lost.at, wait=True, check_stop=False) if self.saves() else \
            "none from this group (the quorum's first group saves)"
        raise UserError(f"{lost}: stopped after step {self.run.global_step(lost.at)}; checkpoint {where}; start the "
                        "Lighthouse again and rerun the same command to resume")

    def peer_state(self) -> dict[str, Any]:
        """What a healing group receives (in the quorum, between two steps): a checkpoint's state."""
        at = Position(*divmod(self.manager.current_step(), self.run.steps_per_epoch))
        return {"state": detached_copy(training_state(self.run, at)), "group": self.ft.group_id}

    def load_peer_state(self, received: dict[str, Any]) -> None:
        """A live group's state (of this run: agree_on_the_run() checked it in this quorum)."""
        self.healed_from = received["group"]
        load_training_state(self.run, received["state"])

    def saves(self) -> bool:
        """One group writes each checkpoint: the first of the last quorum (every group before one)."""
        return self.quorum is None or self.quorum.index == 0

    def save(self, at: Position, wait: bool, check_stop: bool = True) -> str:
        if self.saves():
            return super().save(at, wait, check_stop)
        self.steps.flush(self.log, self.run)
        if check_stop and (verdict := self.stop.agree_now()):
            self.stop_at(at, verdict)
        return ""

    def stop_at(self, at: Position, verdict: int, saved: str | None = None, during: str = "") -> None:
        """A group that does not save leaves: the quorum's first group goes on and writes the checkpoints."""
        if self.saves() or verdict == SAVE_FAILED:
            return super().stop_at(at, verdict, saved, during)
        raise Preempted(f"group {self.ft.group_id} stopped by {signal.Signals(verdict).name} after step "
                        f"{self.run.global_step(at)} and left the quorum; the groups still running go on and the "
                        "first of them saves (started again, this group heals from one)", verdict,
                        printing=self.run.ctx.is_primary)

    def after_step(self, done: Position) -> None:
        super().after_step(done)
        cfg, step = self.run.cfg, self.run.global_step(done)
        if cfg.check_replicas and step % cfg.check_replicas == 0:
            self.check_groups_equal(step)

    def check_groups_equal(self, step: int) -> None:
        """--check-replicas across groups, bit for bit: each tensor's bytes as an integer fingerprint,
        the same in every group of the quorum. Skipped in a step whose quorum failed since (it is
        trained again)."""
        named = self.run.strategy.replicated(self.run.model)
        differs = self.differing_across_groups(torch.stack([fingerprint(t) for _, t in named]))
        if differs is not None and len(differs):
            self.run.ctx.fail_together(f"replica check at step {step}: {named[int(differs[0])][0]} differs across "
                                       "replica groups; the groups drifted apart")

    def differing_across_groups(self, own: torch.Tensor) -> torch.Tensor | None:
        """The positions where the quorum's groups hold other integers than this group (None if the
        sum failed). Summed through torchft with a count of the groups that took part: a healing
        group's part is zeros, so equal values make the sum the count times each one's own, and
        the group that differs (a newcomer heals) is the one that finds out."""
        summed = torch.cat([own, torch.ones(1, dtype=own.dtype)]).to(self.run.ctx.comm_device)
        self.manager.allreduce(summed, reduce_op=dist.ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return None
        summed = summed.cpu()
        return (summed[:-1] != summed[-1] * own).nonzero().flatten()


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 of the tensor's bytes, each weighted by its position: equal bits, equal fingerprints;
    a changed or moved byte changes it (sums wrap around the same way everywhere)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).long()
    return (data * (torch.arange(len(data)) % 65_521 + 1)).sum()


class LighthouseLost(UserError):
    def __init__(self, message: str, at: Position) -> None:
        super().__init__(message)
        self.at = at


class SlotBatches:
    """Slot s of every global batch is what rank s of a plain run of SLOTS ranks trains: a loader of
    that rank, streamed while the slot stays with this rank, started over at the step where it
    changes hands. The step's batches are kept until it commits (a retry trains them again)."""

    def __init__(self, run: Any, slots: int) -> None:
        self.run, self.slots = run, slots
        self.streams: dict[int, tuple[Position, Iterator]] = {}  # slot -> (the step its next batch is, batches)
        self.kept: dict[tuple[int, Position], tuple[torch.Tensor, torch.Tensor]] = {}

    def batch(self, slot: int, at: Position) -> tuple[torch.Tensor, torch.Tensor]:
        if (slot, at) not in self.kept:
            next_at, batches = self.streams.get(slot, (None, None))
            if next_at != at:
                batches = self._stream(slot, at)
            self.kept[(slot, at)] = next(batches)
            self.streams[slot] = (Position(at.epoch, at.step + 1), batches)
        return self.kept[(slot, at)]

    def _stream(self, slot: int, at: Position) -> Iterator:
        cfg, data, run = self.run.cfg, self.run.data, self.run
        loader = TrainLoader(data.train, data.spec, cfg.batch_size, slot, self.slots, cfg.seed, run.ctx.device,
                             cfg.max_steps, run.memory_format, cfg.augment, cfg.random_erase)
        return run.mixing.batches(loader.epoch(at.epoch, at.step), at.epoch, at.step)

    def done(self, at: Position) -> None:
        """The step committed: its batches, and the streams of slots it did not use, go."""
        used = {slot for slot, step in self.kept if step == at}
        self.kept.clear()
        self.streams = {slot: stream for slot, stream in self.streams.items() if slot in used}


def share(slots: int, quorum: Quorum, rank: int, world_size: int) -> list[int]:
    """This rank's slots: dealt in turn to the ranks of the participating groups, group by group
    (none to a group that is not one of them)."""
    if quorum.index is None:
        return []
    ranks = quorum.groups * world_size
    return list(range(quorum.index * world_size + rank, slots, ranks))


def _has_port(url: SplitResult) -> bool:
    try:
        return url.port is not None
    except ValueError:  # not a number, or out of range
        return False


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else None


FaultTolerantStrategy.trainer_class = FaultTolerantTrainer


def main(argv: list[str] | None = None) -> None:
    run(FaultTolerantStrategy(), argv)


if __name__ == "__main__":
    main()
