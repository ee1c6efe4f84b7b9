"""Replica groups on torchft (train_ft.py's machinery): the quorum at every step, the global batch's
slots dealt among the live groups, the retry of a step that failed across groups, the heal of a group
from a live peer, and the cross-group checks.

The strategy (train_ft.py) owns the flags and the gradient vector; this module owns the loop around
it. torchft is optional: connect() says so in one line when it is missing.
"""
from __future__ import annotations

import http.server
import logging
import os
import signal
import socket
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, NoReturn
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from common.data.loader import TrainLoader
from common.errors import ConfigError, UserError, first_line
from common.parallel.comm import flatten, unflatten
from common.train.preemption import SAVE_FAILED, Preempted
from common.train.run import Position
from common.train.state import detached_copy, load_training_state, training_state
from common.train.step import COMPUTE, DATA, SYNC, StepClock, backward, reseed, update
from common.train.trainer import Trainer

os.environ.setdefault("RUST_LOG", "warn")  # torchft's own log: a line per step at its default level
try:
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
except ImportError as missing:  # torchft ships manylinux x86_64 wheels only
    Manager = None
    TORCHFT_MISSING = str(missing)

MAX_RETRIES = 20  # consecutive failed steps before a group gives up (a peer that fails every step)
GAVE_UP = 3  # a group's exit status once it gave up: launch/ft.sh does not restart it (a restart fails alike)
# One quorum request's bound: a request in flight when the Lighthouse died is never answered (the new one
# knows nothing of it), so it is asked again after this long. Above a quorum's usual wait: the Lighthouse's
# join wait and heartbeat timeout (launch/ft.sh: 2 s and 3 s).
QUORUM_ATTEMPT_S = 10.0


def require_torchft() -> None:
    if Manager is None:
        raise ConfigError(f"train_ft.py needs torchft ({TORCHFT_MISSING}), which ships Linux x86_64 wheels only: "
                          "pip install -r requirements.txt there, or use train_ddp.py with checkpoint-and-restart "
                          "(docs/fault-tolerance.md)")


def quiet_torchft() -> None:
    """Process-wide, once: torchft's tracebacks, its heal server's request log and its read-only
    buffer warning are told as this module's lines instead (or are not news)."""
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    http.server.BaseHTTPRequestHandler.log_message = lambda *args: None  # a line per heal request on stderr
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # a warning per heal


def connect(group_id: int, lighthouse: str, min_groups: int, backend: str, ft_timeout_s: float,
            quorum_timeout_s: float) -> Any:
    """This group's torchft Manager, registered with the Lighthouse (within quorum_timeout_s)."""
    quiet_torchft()
    seconds = timedelta(seconds=ft_timeout_s)
    pg = (StoreCheckedNCCL if backend == "nccl" else StoreCheckedGloo)(timeout=seconds)
    waited = timedelta(seconds=quorum_timeout_s)
    attempt = timedelta(seconds=min(QUORUM_ATTEMPT_S, quorum_timeout_s))
    try:
        return Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=min_groups,
                       use_async_quorum=True, timeout=seconds, quorum_timeout=attempt, connect_timeout=waited,
                       lighthouse_addr=lighthouse, replica_id=f"group{group_id}", init_sync=False,
                       max_retries=MAX_RETRIES)
    except RuntimeError as error:  # the Lighthouse did not answer within the connect timeout
        raise UserError(f"--lighthouse {lighthouse}: no answer within --quorum-timeout-s {quorum_timeout_s:g} "
                        f"({first_line(error)}); start it (torchft_lighthouse --min_replicas {min_groups} --bind "
                        "[::]:PORT, --min_replicas being --min-groups; or launch/ft.sh) or correct the URL") from None


class StoreChecked:
    """A cross-group process group whose quorum's store is asked first whether it is there. A quorum
    can name the store of a group that has just died (its heartbeat not yet timed out): c10d's
    connect to it would wait out the whole timeout and log its failure with a dump of C++ frames,
    where a closed port answers at once. The step then fails across groups, in one line, and is
    trained again without that group (torchft reports the error as the step's)."""

    _timeout: timedelta

    def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
        check_store(store_addr, self._timeout)
        super().configure(store_addr, *args, **kwargs)  # type: ignore[misc]


def check_store(store_addr: str, timeout: timedelta) -> None:
    """Raise StoreGone unless a TCP connection to the store (HOST:PORT/PREFIX, as torchft writes it)
    opens within `timeout`."""
    host, _, port = store_addr.partition("/")[0].rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout.total_seconds()).close()
    except OSError as error:
        raise StoreGone(f"the quorum's store at {host}:{port} does not answer ({error.strerror or error}): the group "
                        "that hosted it has ended") from None


class StoreGone(ConnectionError):
    pass


if Manager is not None:
    class StoreCheckedGloo(StoreChecked, ProcessGroupGloo):
        pass

    class StoreCheckedNCCL(StoreChecked, ProcessGroupNCCL):
        pass


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
        self.manager.register_state_dict_fn("run", self.load_peer_state, self.peer_state)

    def fit(self, start: Position) -> Any:
        self.manager.load_state_dict({"step": self.run.global_step(start), "batches_committed": 0})
        try:
            while True:
                try:
                    return super().fit(start)
                except Healed as healed:  # this group's steps so far were left behind: go on where the peer is
                    self.steps.discard_pending()
                    self.steps.take_epoch()
                    self.stop.drain()
                    start = healed.at
                except NoStep as ended:
                    self.end_saved(ended)
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
        fresh = self.quorum is None or run.global_step(at) % self.ft.quorum_every == 0
        while True:
            started = time.perf_counter()
            if fresh:  # answered in a thread of torchft's, during the slots' forward and backward
                self.manager.start_quorum()
            assumed = self.quorum or self.settle(at)
            batches, (stats, rows, extra) = self.train_share(assumed, at, clock)
            quorum = self.settle(at) if fresh else assumed
            if quorum != assumed:  # the groups changed: this step's slots are dealt anew
                batches, (stats, rows, extra) = self.train_share(quorum, at, clock)
            summed = self.ft.synchronize(extra, rows)
            clock.lap(SYNC)
            if self.commit(at):  # a healing group loads its peer's state here
                self.count_samples(summed[:self.ft.slots], at)
                self.restore_slot0_buffers(summed[self.ft.slots:])
                norm = update(run.model, run.strategy, run.optimizer, run.scheduler, run.precision, self.recipe)
                clock.lap(COMPUTE)
                self.slots.done(at)
                if quorum.index is None:
                    self.end_heal(started)
                return stats, norm, sum(len(labels) for _, labels in batches)
            if quorum.index is None and self.peer_state_loaded():
                self.heal_not_committed()
            self.retried += 1
            fresh = True  # a new quorum, without the group that failed
            self.log.warn(f"step {run.global_step(at) + 1} failed across groups and is trained again on the same "
                          "samples (a group left or froze mid-step)")

    def train_share(self, quorum: Quorum, at: Position, clock: StepClock) -> tuple[list, tuple]:
        """The batches of this rank's slots under `quorum`, and train_slots() of them."""
        mine = share(self.ft.slots, quorum, self.run.ctx.rank, self.run.ctx.world_size)
        batches = [self.slots.batch(slot, at) for slot in mine]
        clock.lap(DATA)
        with self.state_unread():
            trained = self.train_slots(mine, batches, at)
        clock.lap(COMPUTE)
        return batches, trained

    def commit(self, at: Position) -> bool:
        """Every group's vote on the step. torchft raises once the step was retried MAX_RETRIES times:
        a peer that fails every step, or fewer live groups than --min-groups for that long."""
        try:
            return self.manager.should_commit()
        except RuntimeError as error:
            if "should_commit failed" not in str(error):
                raise
            raise GaveUp(f"group {self.ft.group_id} gave up at step {self.run.global_step(at) + 1}: it failed across "
                         f"groups {MAX_RETRIES + 1} times in a row (fewer than --min-groups {self.ft.min_groups} "
                         "live groups, from a Lighthouse whose --min_replicas is lower, or a group that fails every "
                         "step: see the other groups' lines)", at) from None

    def settle(self, at: Position) -> Quorum:
        """Wait for the quorum asked for as the step started. A group behind the others is not one of its
        participants (index None): it trains no slot, receives the step's sum, and loads a live
        group's state (taken before that group's update) as the step commits. A quorum request that
        the Lighthouse's death cut off is asked again, every QUORUM_ATTEMPT_S, until one answers (a
        Lighthouse started again: launch/ft.sh does) or --quorum-timeout-s has gone by."""
        deadline = time.monotonic() + self.ft.quorum_timeout_s
        while True:
            try:
                self.manager.wait_quorum()
                break
            except Exception as error:  # torchft's quorum raises once its attempt's timeout ran out
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.no_quorum(at, type(error).__name__) from None
                self.log.warn(f"no quorum from the Lighthouse at {self.ft.lighthouse} at step "
                              f"{self.run.global_step(at) + 1} ({type(error).__name__}{self.short_of_groups()}): "
                              f"asking again, for {left:.0f} s more at most (--quorum-timeout-s)")
                self.agreed_in = -1  # a Lighthouse started again counts its quorums from 1 anew
                self.manager._quorum_future = None  # torchft 0.2.0 raises a failed quorum again at the next start
                self.manager.start_quorum(timeout=timedelta(seconds=min(QUORUM_ATTEMPT_S, left)))
        quorum = Quorum(self.manager.num_participants(), self.manager.participating_rank())
        self.agree_on_the_run(at, healing=quorum.index is None)
        if quorum != self.quorum:
            # torchft counts the groups that train the step: a healing group is not one of them yet.
            place = ("is not one of them yet: it copies a live group's state first (healing)" if quorum.index is None
                     else f"is number {quorum.index}")
            # The wall time: how long a group trained alone reads from two of these lines.
            self.log.info(f"quorum of {quorum.groups} group(s) at step {self.run.global_step(at) + 1}: this group "
                          f"(group {self.ft.group_id}) {place} [{time.strftime('%H:%M:%S')}]")
            self.quorum = quorum
        return quorum

    def short_of_groups(self) -> str:
        """Why a live Lighthouse may not answer: it forms no quorum of fewer groups than --min-groups
        (launch/ft.sh starts it with --min_replicas set so)."""
        return f"; fewer than --min-groups {self.ft.min_groups} groups have joined it, or it is gone" \
            if self.ft.min_groups > 1 else ""

    def no_quorum(self, at: Position, error: str) -> NoStep:
        """The verdict once --quorum-timeout-s went by without a quorum: a Lighthouse that still
        answers is waiting for groups that did not come (the group gives up: a restart would wait
        alike); one that does not is gone."""
        waited = f"within --quorum-timeout-s {self.ft.quorum_timeout_s:g} ({error})"
        if self.ft.min_groups > 1 and answers(self.ft.lighthouse):
            return GaveUp(f"group {self.ft.group_id} gave up at step {self.run.global_step(at) + 1}: no quorum of "
                          f"--min-groups {self.ft.min_groups} groups at the Lighthouse {self.ft.lighthouse} "
                          f"{waited}: fewer groups joined it", at)
        return LighthouseLost(f"no quorum from the Lighthouse at {self.ft.lighthouse} {waited}", at)

    def agree_on_the_run(self, at: Position, healing: bool) -> None:
        """Once per quorum, before any gradient crosses: every group must train this run and cut its
        batch alike (a vector of another length aborts gloo's process; another run's weights would
        be taken silently), and the groups that train the step must all be at it (else the sums of
        two steps would be added: a healing group is behind by design, its part is zeros)."""
        quorum_id = self.manager._quorum_id  # torchft 0.2.0 keeps each quorum's id to itself
        if quorum_id == self.agreed_in:
            return
        step = self.run.global_step(at) + 1
        own = torch.tensor([self.ft.slots, self.ft.vector_length(), int(self.run.cfg.run_id, 16), step])
        differs = self.differing_across_groups(own)
        if differs is None:  # the sum failed: the step is tried again, with a new quorum
            return
        if (differs < len(own) - 1).any():
            raise UserError(f"group {self.ft.group_id} met groups that train another run or cut the batch "
                            f"otherwise at the Lighthouse {self.ft.lighthouse} (this group: run "
                            f"{self.run.cfg.run_id}, {self.ft.slots} slots): start every group with the same "
                            "flags, --groups and ranks per group, or give each run its own Lighthouse (FT_PORT)")
        if len(differs) and not healing:  # the loop's fault, not the user's: ended, it heals when restarted
            raise RuntimeError(f"group {self.ft.group_id} is to train step {step} in a quorum whose other groups "
                               "train another step: it stops rather than add the gradients of two steps")
        self.agreed_in = quorum_id

    def end_heal(self, started: float) -> None:
        """This group trained the step it healed in with its peer's state and the step's sum: it is
        now where the others are. Its EMA takes the step too; then the loop goes on from there."""
        step, cfg = self.manager.current_step(), self.run.cfg
        if self.run.ema:
            self.run.ema.update(step)
        if cfg.check_replicas and step % cfg.check_replicas == 0:  # the check the other groups make after it
            self.check_groups_equal(step)
        self.log.info(f"group {self.ft.group_id} healed from group {self.healed_from} at step {step}: weights, "
                      f"optimizer state and position from a live peer, {time.perf_counter() - started:.2f} s "
                      "from its quorum to its first step")
        self.go_on_from(step)

    def heal_not_committed(self) -> NoReturn:
        """torchft counts this group's steps as its peer's once the peer's state has arrived, and loads
        that state as the step's vote begins: a vote that then fails (a group died in the step) leaves
        this group with its peer's state of step S and torchft counting S. It goes on from there;
        trained again from its old place, its next quorum would count it as one of the groups at S
        while it trained its old place's samples: the sums of two steps added (bench chaos found it)."""
        step = self.manager.current_step()
        self.log.warn(f"group {self.ft.group_id} has group {self.healed_from}'s state of step {step}, but the step "
                      f"it healed in failed across groups: it goes on from step {step + 1}")
        self.go_on_from(step)

    def peer_state_loaded(self) -> bool:
        """After a failed vote in a step this group healed in: whether it holds its peer's state, as all
        its ranks find. Each rank receives its own from the peer's rank of its number: a source that
        dies as it sends, or a transfer that times out on one rank, leaves some ranks with the peer's
        state and step and the others with their own; gone on from two places, the group's ranks would
        add two steps' gradients and train apart. Such a group ends (a collective every rank of it
        makes: the vote and the quorum are the group's)."""
        ctx = self.run.ctx
        mine = torch.tensor([int(self.healed_from is not None)])
        loaded = int((ctx.all_reduce_sum(mine) if ctx.world_size > 1 else mine).item())
        if 0 < loaded < ctx.world_size:
            ctx.fail_together(f"group {self.ft.group_id}: {loaded} of its {ctx.world_size} ranks loaded their peer's "
                              "state before the step they healed in failed across groups (the transfer failed on the "
                              "others): the group cannot go on from two states; it ends, and started again "
                              "(launch/ft.sh does) heals from a live group or resumes from the last checkpoint")
        return loaded > 0

    def go_on_from(self, step: int) -> NoReturn:
        """A peer's state loaded: the loop goes on after its `step` steps, with a quorum asked anew."""
        self.quorum, self.healed_from = None, None
        raise Healed(Position(*divmod(step, self.run.steps_per_epoch)))

    @contextmanager
    def state_unread(self) -> Iterator[None]:
        """While this rank's slots train, no peer's heal reads this group's state: torchft's quorum thread
        copies it for a healing group while the step's forward moves BatchNorm's statistics, which
        train_slots() puts back at its end. A heal whose step then fails keeps what it copied: the
        copy waits for the step's own statistics (torchft's lock for it; its wait is bounded by
        --ft-timeout-s, as the healing group's wait for this step's sum is)."""
        self.manager.disallow_state_dict_read()
        try:
            yield
        finally:
            self.manager.allow_state_dict_read()

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
        scale = run.loader.label_scale(run.class_weights, at.epoch, at.step)  # the global batch's, every slot's
        for slot, (images, labels) in zip(mine, batches):
            if self.random:
                reseed(run.cfg.seed, slot, run.global_step(at))  # slot s draws what rank s of a plain run draws
            stats += backward(run.step_model, run.strategy, run.precision, images, labels, recipe,
                              recipe.accumulate * self.ft.slots, scale)
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

    def end_saved(self, ended: NoStep) -> None:
        """No step can commit: the group saves where it stands and ends with one line (rank 0's: the
        group's ranks reached the verdict together), with the status of the kind of end."""
        where = self.save(ended.at, wait=True, check_stop=False) if self.saves() else \
            "none from this group (the quorum's first group saves)"
        final = UserError(f"{ended}: stopped after step {self.run.global_step(ended.at)}; checkpoint {where}; "
                          f"{ended.remedy}")
        final.exit_code = ended.exit_code
        self.run.ctx.fail_together_with(final)

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


def answers(url: str) -> bool:
    """Whether something listens at the Lighthouse's HOST:PORT (a connection within a second)."""
    address = urlsplit(url)
    try:
        socket.create_connection((address.hostname, address.port), timeout=1.0).close()
    except OSError:
        return False
    return True


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 of the tensor's bytes, each weighted by its position: equal bits, equal fingerprints;
    a changed or moved byte changes it (sums wrap around the same way everywhere)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).long()
    return (data * (torch.arange(len(data)) % 65_521 + 1)).sum()


class NoStep(UserError):
    """No step can commit from `at` on: the group ends, saved (FaultTolerantTrainer.end_saved)."""

    remedy = ""  # what the user does next

    def __init__(self, message: str, at: Position) -> None:
        super().__init__(message)
        self.at = at


class LighthouseLost(NoStep):
    remedy = "start the Lighthouse again and rerun the same command to resume"


class GaveUp(NoStep):
    """Every retry of the step failed, or no quorum of --min-groups groups formed within
    --quorum-timeout-s: a restarted group would fail or wait alike."""

    exit_code = GAVE_UP
    remedy = ("start the missing groups or lower --min-groups, or fix the group that fails, then rerun the same "
              "command to resume")


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
                             cfg.max_steps, run.memory_format, cfg.augment, cfg.random_erase, lanes=cfg.shard_lanes)
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
