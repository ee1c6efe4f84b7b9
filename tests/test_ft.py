"""train_ft.py under real faults: a real torchft Lighthouse, each replica group its own torchrun
(launch/ft.sh), groups SIGKILLed, frozen (SIGSTOP), stopped (SIGTERM) and started mid-run from
outside, the Lighthouse killed. Every run must end with the weights of the planned schedule: a
train_ddp.py run of the same flags at world 2, the global batch's slots (fixture `planned`).

Every fault lands at a known step whatever the host's speed: the groups are held at a step by
tests/patched.py's gates (tests/gates.py) while the test acts, and released only once a group it
started, restarted or thawed asks the Lighthouse for a quorum too. No wait is a race with the run's
end: a deadline only tells a run that hangs from one that works.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.parallel import procs
from tests.conftest import ROOT, as_from_a_terminal, child_env, free_port, latest_state, refusal_in_process, run_script
from tests.gates import Gate

pytest.importorskip("torchft", reason="torchft ships Linux x86_64 wheels only: train_ft.py refuses to run without it")

EPOCHS, STEPS_PER_EPOCH, BATCH = 3, 25, 48  # 1200 MNIST images
RUN = ["--dataset", "mnist", "--model", "lenet", "--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--lr", "0.05",
       "--log-every", "5"]
# The fault-free schedule's bits by design, on any CPU: two groups of one rank sum two slot gradients
# (a + b, the same in either order), each scaled by 1/2 (exact), as train_ddp.py at world 2 does;
# one group alone sums the same two; a heal copies a peer's bits. So the weights are compared with == 0.


def gated(*points: str) -> list[str]:
    """train_ft.py held at each WHO@POINT until the test releases it (tests/gates.py)."""
    return ["tests/patched.py", ",".join(f"gate={point}" for point in points), "train_ft.py"]


def flags(mnist_root: Path, folder: Path, *extra: str) -> list[str]:
    return [*RUN, "--data-dir", str(mnist_root), "--checkpoint-dir", str(folder / "ckpt"),
            "--log-dir", str(folder / "tb"), *extra]


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    state = latest_state(folder / "ckpt")
    assert (state["epoch"], state["step_in_epoch"]) == (EPOCHS, 0), (state["epoch"], state["step_in_epoch"])
    return state["model"]


def max_dw(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Over parameters and buffers (BatchNorm's running statistics and batch counts)."""
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def planned(mnist_root, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The fault-free run's weights: train_ddp.py at world SLOTS (2), whose ranks train exactly the
    micro-batches the slots are, summed in the same order (a fault-free train_ft.py run measured
    max |dw| 0 against it). One process on the whole batch rounds differently, and 75 steps at lr
    0.05 grow that to 8.5e-02: lenet's training is chaotic at this rate (a 7e-08 gap at step 25 is
    1.4e-05 at step 26), so only the same cut of the batch can be held to 1e-5 over whole epochs."""
    folder = tmp_path_factory.mktemp("planned")
    result = run_script(["train_ddp.py", *flags(mnist_root, folder)], nproc=2, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return final_weights(folder)


# convnet (BatchNorm: every group takes the running statistics slot 0's micro-batches left) with a batch
# planned for three groups, its slots added in slot order: the weights must be the same bits whatever failed.
EXACT = ["--model", "convnet", "--groups", "3", "--exact-sums"]


@pytest.fixture(scope="module")
def exact3(mnist_root, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The fault-free weights for EXACT: one group that trains all three slots of every step."""
    folder = tmp_path_factory.mktemp("exact3")
    run = FtRun(folder, 1, ["train_ft.py", *flags(mnist_root, folder, *EXACT)])
    assert run.job.finish() == 0, run.job.text()[-5000:]
    return final_weights(folder)


STARTED: list[Job] = []  # every job of the running test: whatever a failed assertion leaves running is killed


@pytest.fixture(autouse=True)
def nothing_left_running():
    yield
    for job in STARTED:
        job.kill_tree()
    STARTED.clear()


class Job:
    """launch/ft.sh (or one more group's torchrun), its output read line by line with the time each
    line came."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True, preexec_fn=as_from_a_terminal)
        STARTED.append(self)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout: float = 120, after: float = 0.0) -> tuple[float, re.Match]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                if at >= after and (match := re.search(pattern, line)):
                    return at, match
            if self.process.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)  # a poll with a deadline: the lines come from a reader thread
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + self.text()[-6000:])

    def finish(self, timeout: float = 180) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise AssertionError("did not end by itself:\n" + self.text()[-6000:]) from None
        self.reader.join(10)
        return code

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def processes(self) -> str:
        """Each process of the job: pid, parent, process group, state, signals ignored, blocked and caught
        (a failed wait's message: which process did not take a stop, and why)."""
        rows = []
        for pid in [self.process.pid, *procs.descendants(self.process.pid)]:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                              if ":\t" in line)
                command = procs.command_line(pid)[:100]
            except OSError:
                continue
            rows.append(f"{pid} ppid {stat[1]} pgid {stat[2]} {stat[0]} ign {status['SigIgn']} blk "
                        f"{status['SigBlk']} cgt {status['SigCgt']} {command}")
        return "\n".join(rows)

    def kill_tree(self) -> None:
        for pid in [*procs.descendants(self.process.pid), self.process.pid]:
            for signum in (signal.SIGCONT, signal.SIGKILL):  # a frozen (SIGSTOPped) group too
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        self.process.wait(10)


class FtRun:
    """launch/ft.sh GROUPS 1 on a free port, its pid files and logs in `folder`."""

    def __init__(self, folder: Path, groups: int, training: list[str], restarts: int = 3,
                 gate: Gate | None = None, lighthouse_restarts: int = 10, env: dict[str, str] | None = None) -> None:
        self.logs, self.port = folder / "ft-logs", free_port()
        self.env = {**child_env(), "FT_PORT": str(self.port), "FT_LOGS": str(self.logs),
                    "FT_RESTARTS": str(restarts), "FT_LIGHTHOUSE_RESTARTS": str(lighthouse_restarts),
                    **(gate.env() if gate else {}), **(env or {})}
        if gate:  # a quorum waits for every group whose heartbeat it hears, held ones too, however loaded the host
            self.env["FT_JOIN_MS"] = "60000"
        self.training = training
        self.job = Job(["bash", "launch/ft.sh", str(groups), "1", *training], self.env)
        if gate:
            gate.job_output = self.state

    def state(self) -> str:
        """What ft.sh printed, its markers and its processes (for a failed wait's message)."""
        markers = sorted(path.name for path in self.logs.glob("*")) if self.logs.exists() else []
        return f"{self.job.text()}\nft-logs: {markers}\nprocesses:\n{self.job.processes()}"

    def worker(self, group: int) -> int:
        """The group's training process (torchrun's child), not its agent."""
        agent = int((self.logs / f"group{group}.pid").read_text())
        children = procs.children(agent)
        workers = [pid for pid in children if "train_ft.py" in procs.command_line(pid)]
        assert len(workers) == 1, (agent, children)
        return workers[0]

    def extra_group(self, group: int, groups: int) -> Job:
        """One more group, started by hand as a user would on another machine."""
        env = {**self.env, "REPLICA_GROUP_ID": str(group), "FT_GROUPS": str(groups),
               "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{self.port}"}
        return Job([sys.executable, "launch/quiet_torchrun.py", "--standalone", "--nproc_per_node=1", *self.training],
                   env)


TOGETHER = "all@first-quorum"


def start_together(gate: Gate, run: FtRun, groups: int) -> None:
    """Release the groups (one rank each) held before their first quorum once all are and the
    Lighthouse hears every one: a group up a little before its peers would get a quorum of its own,
    and a late one heal from it at step 1 (where a test's heal gate for that group would hold it)."""
    gate.held(TOGETHER, processes=groups)
    heard_from(run.port, groups)
    gate.release(TOGETHER)


def outliving(pids: list[int], grace_s: float = 2.0) -> list[int]:
    """Those of `pids` still running `grace_s` after ft.sh ended (a killed process's exit is asynchronous)."""
    deadline = time.monotonic() + grace_s
    while (alive := [pid for pid in pids if procs.running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)  # a poll with a deadline
    return alive


def every_sample_once(text: str, group: int) -> list[int]:
    """The samples the group's epoch lines count, for epochs it trained from their first step."""
    return [int(n) for n in re.findall(rf"\[g{group}\] epoch \d+: (\d+) samples in {STEPS_PER_EPOCH} committed steps "
                                       r"from step 1 on, every slot of every step trained once", text)]


# 0 -------------------------------------------------------------------------------------------
@pytest.mark.quick
def test_slots_are_dealt_to_the_ranks_of_the_groups_in_the_quorum_once_each():
    from common.train.ft import Quorum, share

    def dealt(slots: int, groups: int, ranks: int) -> list[list[int]]:
        return [share(slots, Quorum(groups, g), r, ranks) for g in range(groups) for r in range(ranks)]
    assert dealt(4, 2, 2) == [[0], [1], [2], [3]]  # the fault-free run: rank r of group g trains slot 2g + r
    assert dealt(4, 1, 2) == [[0, 2], [1, 3]]  # one group left: each rank trains two micro-batches
    assert dealt(3, 2, 1) == [[0, 2], [1]]
    assert dealt(2, 3, 1) == [[0], [1], []]  # a group beyond the plan takes no samples
    for slots, groups, ranks in [(6, 2, 3), (8, 3, 2), (5, 5, 1)]:
        assert sorted(sum(dealt(slots, groups, ranks), [])) == list(range(slots))


@pytest.mark.quick
def test_the_cross_group_replica_check_tells_equal_bits_from_a_changed_or_moved_value():
    from common.train.ft import fingerprint

    weights = torch.randn(1000)
    assert fingerprint(weights) == fingerprint(weights.clone())
    nudged = weights.clone()
    nudged[417] = torch.nextafter(nudged[417], torch.tensor(1e9))  # the last bit of one value
    swapped = weights.clone()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert len({int(fingerprint(t)) for t in (weights, nudged, swapped)}) == 3
    # the check's arithmetic: the quorum's sum is the count times each group's own only when all are equal
    own, other = fingerprint(weights), fingerprint(nudged)
    assert own + own == 2 * own and own + other != 2 * own and own + other != 2 * other


class OneOtherGroup:
    """torchft's manager, as far as the per-quorum check uses it: the cross-group sum adds one other
    group's part (zeros where that group heals, as torchft sends a healing group's)."""

    def __init__(self, part: list[int] | None) -> None:
        self.part, self._quorum_id = part, 7

    def allreduce(self, summed: torch.Tensor, reduce_op) -> SimpleNamespace:
        if self.part is not None:
            summed += torch.tensor([*self.part, 1])
        return SimpleNamespace(wait=lambda: None)

    def errored(self) -> None:
        return None


@pytest.mark.quick
def test_a_quorum_naming_the_store_of_a_group_gone_fails_at_once_without_cpp_frames(capfd):
    """A quorum can name the store of a group that has just died: the cross-group process group asks
    the port first, and fails the quorum at once with a line of its own, where c10d's connect waited
    out the timeout (5 s) and logged its failure with a dump of C++ frames (seen in bench chaos's
    output). A store that is there is connected to as before."""
    from datetime import timedelta

    import torch.distributed as dist

    from common.train.ft import StoreCheckedGloo, StoreGone

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = closed.getsockname()[1]
    group = StoreCheckedGloo(timeout=timedelta(seconds=5))
    started = time.monotonic()
    with pytest.raises(StoreGone, match=rf"store at 127.0.0.1:{gone} does not answer \(Connection refused\)"):
        group.configure(f"127.0.0.1:{gone}/torchft/3/0", "group0", 0, 1, 3, 0, 1, [0])
    assert time.monotonic() - started < 4  # not the 5 s timeout: a closed port answers at once
    assert "frame #" not in capfd.readouterr().err
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    group.configure(f"127.0.0.1:{store.port}/torchft/4/0", "group0", 0, 1, 4, 0, 1, [0])
    assert group.size() == 1
    group.shutdown()


@pytest.mark.quick
def test_a_quorum_whose_training_groups_are_at_other_steps_is_refused_but_a_healing_group_is_behind_by_design():
    """The per-quorum check: the same run and cut (a user's mistake: one line), and every group that
    trains the step at that step (the loop's fault: the group ends rather than add two steps' sums)."""
    from common.errors import UserError
    from common.train.ft import FaultTolerantTrainer, Position

    def agree(step: int, other: list[int] | None, healing: bool = False) -> int:
        trainer = SimpleNamespace(manager=OneOtherGroup(other), agreed_in=-1, ft=SimpleNamespace(
            slots=2, vector_length=lambda: 100, group_id=1, lighthouse="http://h:1"),
            run=SimpleNamespace(cfg=SimpleNamespace(run_id="ab12"), global_step=lambda at: at.epoch * 25 + at.step,
                                ctx=SimpleNamespace(comm_device=torch.device("cpu"))))
        trainer.differing_across_groups = lambda own: FaultTolerantTrainer.differing_across_groups(trainer, own)
        FaultTolerantTrainer.agree_on_the_run(trainer, Position(*divmod(step, 25)), healing)
        return trainer.agreed_in

    same_run = [2, 100, 0xAB12]
    assert agree(35, [*same_run, 36]) == 7  # both at step 36: agreed for the quorum
    assert agree(35, None) == 7  # the other group heals: its part is zeros
    assert agree(25, [*same_run, 36], healing=True) == 7  # this group heals: it is behind by design
    with pytest.raises(RuntimeError, match="is to train step 26 in a quorum whose other groups train another step"):
        agree(25, [*same_run, 36])
    with pytest.raises(UserError, match="met groups that train another run"):
        agree(35, [2, 100, 0xAB13, 36])



class TrainedAgain(Exception):
    """The step's second vote: the loop trains the step again."""


class HealVote:
    """torchft's manager in a step the group heals in, as one_step() uses it: the vote loads the peer's
    state on a rank whose transfer came (torchft applies it as the vote begins, and counts the rank at
    the peer's step 35 from then on) and fails (a group died in the step)."""

    def __init__(self, trainer, loads: bool) -> None:
        self.trainer, self.loads, self.votes = trainer, loads, 0

    def start_quorum(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass

    def should_commit(self) -> bool:
        self.votes += 1
        if self.votes > 1:
            raise TrainedAgain
        if self.loads:
            self.trainer.load_peer_state({"state": {}, "group": 0})
        return False

    def current_step(self) -> int:
        return 35 if self.loads else 25


@pytest.mark.quick
@pytest.mark.parametrize("rank, loads, loaded_in_group, outcome", [
    (0, True, 2, "healed at 35"),  # every rank has the peer's state: the group goes on from it
    (1, False, 0, "trained again"),  # none has: the step is trained again, from the group's own place
    (0, True, 1, "the group ends"),  # the transfer came to rank 0 only: neither way is one state for the group
    (1, False, 1, "the group ends"),
])
def test_a_heal_whose_step_fails_goes_one_way_for_every_rank_of_the_group(rank, loads, loaded_in_group, outcome,
                                                                           monkeypatch):
    """A group of two ranks heals in step 26 (its checkpoint's place) from a peer at step 35 that dies in
    the step: each rank receives its own part of the peer's state, so a transfer cut between the two
    leaves one rank with the peer's state and step and the other with its own. The ranks then take
    one way together: on from the peer's step, the step again, or (split) the group ends, one line
    from rank 0, to heal once started again. Going separate ways, rank 0 trained step 36 and rank 1
    step 26 again in one group, adding their gradients, each on its own weights."""
    from common.errors import PeerFailed, UserError
    from common.parallel.context import DistContext
    from common.train import ft

    @dataclass(frozen=True)
    class GroupOfTwo(DistContext):
        loaded: int = 0  # the group's sum: how many of its ranks loaded the peer's state

        def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
            return torch.tensor([self.loaded])

    monkeypatch.setattr(ft, "load_training_state", lambda run, state: None)
    trainer = object.__new__(ft.FaultTolerantTrainer)  # the loop's state, without a run or a Lighthouse
    trainer.run = SimpleNamespace(ctx=GroupOfTwo(rank, 2, rank, 2, torch.device("cpu"), "gloo", loaded=loaded_in_group),
                                  global_step=lambda at: at.epoch * 25 + at.step, steps_per_epoch=25)
    trainer.ft = SimpleNamespace(quorum_every=1, group_id=1, synchronize=lambda extra, rows: extra)
    trainer.manager, trainer.quorum, trainer.healed_from, trainer.retried = HealVote(trainer, loads), None, None, 0
    trainer.settle = lambda at: ft.Quorum(1, None)  # the peer's group trains; this one heals
    trainer.train_share = lambda quorum, at, clock: ([], (torch.zeros(2), None, torch.zeros(1)))
    trainer.log = SimpleNamespace(warn=lambda line: None, info=lambda line: None)
    try:
        ft.FaultTolerantTrainer.one_step(trainer, None, ft.Position(1, 0), SimpleNamespace(lap=lambda what: None))
    except ft.Healed as healed:
        took = f"healed at {trainer.run.global_step(healed.at)}"
    except TrainedAgain:
        took = "trained again"
    except UserError as ended:
        took = "the group ends"
        assert isinstance(ended, PeerFailed) == (rank != 0), ended  # rank 0 says it, the other ends quietly
        assert "group 1: 1 of its 2 ranks loaded their peer's state before the step they healed in failed" in \
            str(ended), ended
    assert took == outcome



@pytest.mark.quick
def test_a_peer_state_read_waits_while_the_slots_move_batchnorm_statistics():
    """torchft's quorum thread copies this group's state for a healing peer while the step's forward
    runs, and forward moves BatchNorm's running statistics (train_slots() puts them back at its end).
    The copy waits for them (torchft's read lock, here with a 0.2 s bound): a heal whose step then
    failed kept statistics part way through a step, and went on with them."""
    from torchft.checkpointing._rwlock import RWLock

    from common.train import ft

    statistics = torch.zeros(3)

    class StateReads:  # torchft's Manager as far as a peer's state is read: its lock, and the quorum thread's read
        _state_dict_lock, _is_state_dict_read_allowed = RWLock(timeout=0.2), True
        _user_state_dicts = {"run": lambda: statistics.clone()}
        disallow_state_dict_read = ft.Manager.disallow_state_dict_read
        allow_state_dict_read = ft.Manager.allow_state_dict_read
        _manager_state_dict = ft.Manager._manager_state_dict

        def state_dict(self) -> dict[str, int]:
            return {"step": 35, "batches_committed": 70}

    def read() -> object:
        try:
            return StateReads._manager_state_dict(manager)["user"]["run"]
        except TimeoutError:
            return "waited"

    read_in_step = []

    def train_slots(mine: list[int], batches: list, at: ft.Position) -> str:
        statistics.add_(1)  # a micro-batch's forward
        quorum_thread = threading.Thread(target=lambda: read_in_step.append(read()))
        quorum_thread.start()
        quorum_thread.join()
        statistics.sub_(1)  # put back: slot 0's come with the step's sum
        return "trained"

    manager = StateReads()
    trainer = object.__new__(ft.FaultTolerantTrainer)
    trainer.manager, trainer.train_slots = manager, train_slots
    trainer.ft, trainer.run = SimpleNamespace(slots=2), SimpleNamespace(ctx=SimpleNamespace(rank=0, world_size=1))
    trainer.slots = SimpleNamespace(batch=lambda slot, at: (slot, at))
    trained = ft.FaultTolerantTrainer.train_share(trainer, ft.Quorum(1, 0), ft.Position(1, 10),
                                                  SimpleNamespace(lap=lambda what: None))
    assert trained == ([(0, ft.Position(1, 10)), (1, ft.Position(1, 10))], "trained")
    assert read_in_step == ["waited"]  # not the statistics part way through the step
    assert torch.equal(read(), torch.zeros(3))  # once the slots are done: the step's own


REFUSALS = [
    ([], "--groups is missing: launch/ft.sh sets it"),
    (["--groups", "2"], "--group-id is missing"),
    (["--groups", "2", "--group-id", "0"], "--lighthouse is missing"),
    (["--groups", "5", "--group-id", "0", "--lighthouse", "http://h:1"],
     "--batch-size 48 must be a multiple of 5 with --groups 5 x 1 rank(s) per group"),
    (["--groups", "2", "--group-id", "0", "--lighthouse", "http://h:1", "--mixup", "0.2", "--batch-size", "50"],
     "--batch-size 50 must be a multiple of"),
    (["--groups", "2", "--group-id", "0", "--lighthouse", "http://h:1", "--check-equivalence", "3"],
     "--check-equivalence is not available with train_ft.py"),
    (["--groups", "0", "--group-id", "0", "--lighthouse", "http://h:1"], "must be >= 1"),
    (["--groups", "2", "--group-id", "0", "--lighthouse", "http://h:1", "--ft-timeout-s", "0"],
     "--ft-timeout-s and --quorum-timeout-s must be > 0"),
]


@pytest.mark.quick
@pytest.mark.parametrize("extra, says", REFUSALS, ids=[says.split(":")[0][:40] for _, says in REFUSALS])
def test_train_ft_refuses_what_cannot_work_in_one_line_before_any_process_group(extra, says, capsys, monkeypatch):
    for name in ("FT_GROUPS", "REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    code, err = refusal_in_process(["train_ft.py", "--dataset", "mnist", "--batch-size", "48", *extra],
                                   capsys, monkeypatch)
    assert code == 2 and says in err and "Traceback" not in err, err


@pytest.mark.quick
def test_without_torchft_train_ft_says_so_in_one_line(capsys, monkeypatch):
    from common.train import ft

    monkeypatch.setattr(ft, "Manager", None)
    monkeypatch.setattr(ft, "TORCHFT_MISSING", "No module named 'torchft'", raising=False)
    code, err = refusal_in_process(["train_ft.py", "--groups", "2", "--group-id", "0", "--lighthouse", "http://h:1"],
                                   capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and "train_ft.py needs torchft (No module named 'torchft')" in err, err


# 1 -------------------------------------------------------------------------------------------
MID_EPOCH_2 = 35  # past epoch 1's checkpoint, which a restarted group reads first
ALONE_TO = 60  # group 1 alone to this step (epoch 3), where group 0, restarted, rejoins it


def test_a_group_killed_mid_epoch_heals_though_its_source_dies_in_the_heal_and_the_weights_are_the_planned_ones(
        mnist_root, planned, tmp_path):
    """SIGKILL of group 1's worker held at step 35 (mid-epoch 2): launch/ft.sh says it was lost and starts it
    again, and it heals from group 0 (weights, optimizer state, position) at step 36, where group 0,
    held until the restarted group asks for a quorum, goes on. Group 0 is SIGKILLed in that step,
    after its state reached group 1 and before the step's sum (group 1 held there): the step fails,
    and group 1 keeps group 0's state of step 35 and goes on alone from step 36 (it used to go on from
    its checkpoint's place with torchft counting it at step 35: two steps' sums added from then on).
    Group 0, restarted, heals from group 1. The replicas are checked bit-equal across groups at every
    step (--check-replicas 1), every committed step trained every slot once (counted), and the final
    weights are the planned schedule's."""
    gate, hold, in_heal, alone = Gate(tmp_path / "gates"), f"all@{MID_EPOCH_2}", "g1@heal-sum", f"g1@{ALONE_TO}"
    back = "g0@restart-data"  # group 0 started again, kept out of the quorum until group 1 trained alone to 60
    run = FtRun(tmp_path, 2, [*gated(TOGETHER, hold, in_heal, alone, back),
                              *flags(mnist_root, tmp_path, "--check-replicas", "1")], gate=gate)
    start_together(gate, run, 2)
    gate.held(hold, processes=2)
    asked = gate.quorum_requests(1)
    killed = time.monotonic()
    os.kill(run.worker(1), signal.SIGKILL)
    lost_at, _ = run.job.wait_for(r"^ft: group 1 lost \(exit \d+\); restarted \(1 of 3\)", after=killed)
    gate.asked_quorum(1, beyond=asked)  # the restarted group waits in the quorum: group 0 meets it there
    gate.release(hold)
    gate.held(in_heal)  # group 1 has group 0's state, not yet loaded, and is about to add the step's sum
    os.kill(run.worker(0), signal.SIGKILL)
    run.job.wait_for(r"^ft: group 0 lost \(exit \d+\); restarted \(1 of 3\)", after=killed)
    gate.release(in_heal)
    went_on, _ = run.job.wait_for(rf"\[g1\] group 1 has group 0's state of step {MID_EPOCH_2}, but the step it "
                                  rf"healed in failed across groups: it goes on from step {MID_EPOCH_2 + 1}",
                                  after=killed)
    gate.held(back)  # not a race with group 1's steps: group 0, started again, waits out of the quorum
    gate.held(alone)  # group 1 trained alone to here; group 0, restarted, meets it in its next quorum
    # Counted here, not before the kill: the killed worker may have written its last request down
    # after it was counted; now it is gone and its restart is held before its first.
    asked = gate.quorum_requests(0)
    gate.release(back)
    gate.asked_quorum(0, beyond=asked)
    gate.release(alone)
    healed, _ = run.job.wait_for(rf"\[g0\] group 0 healed from group 1 at step {ALONE_TO + 1}", after=killed)
    assert run.job.finish() == 0, run.job.text()[-6000:]
    text = run.job.text()
    # Epochs trained from their first step, every slot once: both groups' first, and group 1's third.
    assert every_sample_once(text, 0) == [STEPS_PER_EPOCH * BATCH], text[-4000:]
    assert every_sample_once(text, 1) == [STEPS_PER_EPOCH * BATCH] * 2, text[-4000:]
    dw = max_dw(final_weights(tmp_path), planned)
    print(f"\nSIGKILL of group 1 mid-epoch 2: ft.sh restarted it {lost_at - killed:.1f} s later; its source killed "
          f"in the heal, it went on {went_on - killed:.1f} s after the first kill; group 0 healed from it at step "
          f"{ALONE_TO + 1}; max |dw| against the fault-free run = {dw:.3g}")
    assert dw == 0, "the fault-free schedule's bits by design (the note under RUN)"


# 2 -------------------------------------------------------------------------------------------
LIGHTHOUSE_KILLS = (45, 55, 65)  # steps of the resumed run at which its Lighthouse is SIGKILLed, groups held


def test_the_lighthouse_killed_for_good_ends_every_group_saved_and_when_started_again_ends_none(mnist_root, planned,
                                                                                                tmp_path):
    """The groups held at step 35, the Lighthouse SIGKILLed and not started again (FT_LIGHTHOUSE_RESTARTS=0): no
    quorum, no step: each group notices within --quorum-timeout-s (5 s here), the quorum's first group saves
    where they stand, both end with one line, and launch/ft.sh restarts nothing. The same command resumes from
    that checkpoint; in it the Lighthouse is SIGKILLed three times (the groups held at steps 45, 55, 65, and
    released at once): ft.sh starts it again each time, the groups ask again for their quorum and go on, no
    group ends, and the run ends with the fault-free weights."""
    gate, hold = Gate(tmp_path / "gates"), f"all@{MID_EPOCH_2}"
    training = [*gated(hold), *flags(mnist_root, tmp_path, "--quorum-timeout-s", "5")]
    run = FtRun(tmp_path, 2, training, gate=gate, lighthouse_restarts=0)
    _, match = run.job.wait_for(r"^ft: Lighthouse on \S+ \(pid (\d+)")
    gate.held(hold, processes=2)
    killed = time.monotonic()
    os.kill(int(match[1]), signal.SIGKILL)
    gate.release(hold)
    assert run.job.finish(timeout=90) != 0
    text = run.job.text()
    ended = [at for at, line in run.job.lines if re.search(r"\[g\d\] error: no quorum from the Lighthouse", line)]
    assert len(ended) == 2, text[-5000:]
    saved = re.search(r"\[g0\] error: no quorum from the Lighthouse at \S+ within --quorum-timeout-s 5 \(\w+\): "
                      r"stopped after step (\d+); checkpoint (\S+);", text)
    assert saved and "restarted" not in text and "the Lighthouse is gone" in text, text[-5000:]
    assert re.search(r"\[g1\] error: no quorum .* checkpoint none from this group", text), text[-5000:]
    step = int(saved[1])
    assert step == MID_EPOCH_2 and Path(saved[2]).exists(), text[-3000:]  # no quorum for the step after it
    print(f"\nLighthouse SIGKILLed with the groups held at step {MID_EPOCH_2}: both groups ended "
          f"{max(ended) - killed:.1f} s later, saved at step {step}")

    kills = [f"all@{at}" for at in LIGHTHOUSE_KILLS]
    resumed = [*gated(hold, *kills), *flags(mnist_root, tmp_path)]  # the gate at 35 stays open: released
    again = FtRun(tmp_path, 2, resumed, gate=gate)
    for point in kills:
        gate.held(point, processes=2)
        os.kill(int((again.logs / "lighthouse.pid").read_text()), signal.SIGKILL)
        gate.release(point)  # the groups' next quorum asks a Lighthouse that is down or starting again
    assert again.job.finish() == 0, again.job.text()[-5000:]
    text = again.job.text()
    assert "saved at world 1)" in text and f"step-{step:08d}.pt: " in text
    assert text.count("ft: the Lighthouse died (killed by SIGKILL); restarted") == len(kills), text[-5000:]
    assert not re.search(r"^(\[g\d\] )?error:", text, re.M) and " lost (" not in text and "Traceback" not in text, \
        text[-5000:]
    waits = re.findall(r"no quorum from the Lighthouse at \S+ at step (\d+) \(\w+\): asking again", text)
    dw = max_dw(final_weights(tmp_path), planned)
    print(f"resumed from step {step}, the Lighthouse SIGKILLed at steps {LIGHTHOUSE_KILLS}: {len(waits)} quorum "
          f"request(s) asked again, no group ended; max |dw| against the fault-free run = {dw:.3g}")
    assert dw == 0, "the fault-free schedule's bits by design (the note under RUN)"


# 3 -------------------------------------------------------------------------------------------
LEAVE = 45  # mid-epoch: held at an epoch's last step, a stop is honoured at the epoch's save, after that step
LAST_LEAVES, HAND_HELD = 60, 70  # group 0 leaves too; the hand-started group held till ft.sh says why it stays
# The hand-started group frozen as its Lighthouse comes back, for less than the heartbeat timeout: ft.sh,
# polling once a second, sees 2 or 3 polls of silence where 6 in a row would end the Lighthouse (3 s of a
# slowed host's delays to spare; the default 3 s timeout left about 1).
HEARTBEAT_MS, SILENT_S = 5000, 2.0


def heard_from(port: int, groups: int, timeout: float = 60) -> None:
    """Wait until the Lighthouse on `port` answers its status page, hearing from `groups` groups."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            page = urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2).read().decode()
        except OSError:
            page = ""  # not serving yet
        if f"[{groups} heartbeating]" in page:
            return
        time.sleep(0.05)  # a poll with a deadline
    raise AssertionError(f"the Lighthouse on {port} never answered hearing from {groups} group(s) within {timeout} s")


FAKE_LIGHTHOUSE = """
import http.server, sys, time
from pathlib import Path
folder, port = Path(sys.argv[1]), int(sys.argv[sys.argv.index("--bind") + 1].rsplit(":", 1)[1])
restarted = (folder / "started").exists()
(folder / "started").touch()
class Status(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if restarted:
            with (folder / "polls").open("a") as polls:
                polls.write(f"{time.time()}\\n")
        body = f"[{0 if restarted else 1} heartbeating]".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if not restarted:
            self.wfile.flush()
            sys.exit(1)  # dies once it has said it hears a group: ft.sh starts it again
    def log_message(self, *args):
        pass
with http.server.HTTPServer(("127.0.0.1", port), Status) as server:
    server.serve_forever()
"""
GIVES_UP = """
import sys
from common.errors import UserError
from common.parallel.failures import report_to_torchrun
report_to_torchrun(UserError("gave up (a stand-in)"))
sys.exit(3)
"""


def test_ft_sh_ends_a_lighthouse_started_again_only_after_a_heartbeat_timeout_of_hearing_no_group(tmp_path):
    """A Lighthouse started again has heard no group yet: ft.sh, its own groups ended, ends it only once
    it has heard none for FT_HEARTBEAT_MS (here 1.9 s: polled once a second, that is 3 polls, not 2).
    A stand-in Lighthouse says it hears a group, dies, and comes back hearing none. ft.sh waits for it
    to end: its port is free as ft.sh exits."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchft_lighthouse").write_text(f"#!{sys.executable}\nimport sys; sys.argv.insert(1, {str(tmp_path)!r})\n"
                                             + FAKE_LIGHTHOUSE)
    (fake / "torchft_lighthouse").chmod(0o755)
    (tmp_path / "gives_up.py").write_text(GIVES_UP)
    env = {**child_env(), "FT_PORT": str(free_port()), "FT_LOGS": str(tmp_path / "ft-logs"), "FT_HEARTBEAT_MS": "1900"}
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    job = Job(["bash", "launch/ft.sh", "1", "1", str(tmp_path / "gives_up.py")], env)
    assert job.finish(120) == 3, job.text()
    assert "the Lighthouse died (exit 1); restarted (1 of" in job.text(), job.text()
    polls = [float(line) for line in (tmp_path / "polls").read_text().split()]
    assert polls[-1] - polls[0] >= 1.9, (polls, job.text())
    with socket.socket() as probe:  # ft.sh waited for its Lighthouse to end: the same command runs again at once
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", int(env["FT_PORT"])))


def test_a_third_group_joins_mid_run_and_stopped_groups_leave_without_a_restart_or_ending_its_lighthouse(
        mnist_root, exact3, tmp_path):
    """Two groups of convnet (BatchNorm) with a batch planned for three (--groups 3: one group trains 2 slots).
    A third group started by hand while the two are held at step 35 joins the quorum, heals from a live
    group at step 36 and takes its slot; then group 1, stopped with SIGTERM while all are held at step
    45, leaves after step 46 (launch/ft.sh does not restart it) and the others go on without a restart.
    At step 60 group 0 leaves too: every group ft.sh started has ended, but the Lighthouse it serves
    stays up for the group started by hand (ft.sh used to end it, and that group then had no quorum),
    which trains on alone to the end, through a restart of that Lighthouse. With --exact-sums the weights
    and the BatchNorm statistics are the fault-free run's, bit for bit."""
    gate = Gate(tmp_path / "gates")
    join, leave, last, held = f"all@{MID_EPOCH_2}", f"all@{LEAVE}", f"all@{LAST_LEAVES}", f"g2@{HAND_HELD}"
    training = [*gated(join, leave, last, held), *flags(mnist_root, tmp_path, *EXACT, "--check-replicas", "5")]
    run = FtRun(tmp_path, 2, training, gate=gate, env={"FT_HEARTBEAT_MS": str(HEARTBEAT_MS)})
    gate.held(join, processes=2)
    started = time.monotonic()
    third = run.extra_group(2, 3)
    gate.asked_quorum(2, beyond=0)
    gate.release(join)
    joined, match = third.wait_for(r"group 2 healed from group \d at step (\d+)")
    third.wait_for(r"quorum of 3 group\(s\) at step \d+: this group \(group 2\) is number 2")
    gate.held(leave, processes=3)
    stopped = time.monotonic()
    os.killpg(int((run.logs / "group1.pid").read_text()), signal.SIGTERM)
    gate.signalled(leave)  # group 1's worker has it: agreed on as step 51 begins
    gate.release(leave)
    left, gone = run.job.wait_for(r"\[g1\] group 1 stopped by SIGTERM after step (\d+) and left the quorum")
    run.job.wait_for(r"^ft: group 1 left \(stopped by SIGTERM\)")
    regrouped, _ = run.job.wait_for(r"\[g0\] quorum of 2 group\(s\) at step \d+", after=stopped)
    gate.held(last, processes=2)
    os.killpg(int((run.logs / "group0.pid").read_text()), signal.SIGTERM)
    gate.signalled(last)
    gate.release(last)
    run.job.wait_for(r"^ft: group 0 left \(stopped by SIGTERM\)")
    [hand] = gate.held(held)  # the group started by hand, alone, waits at a step until ft.sh has decided
    run.job.wait_for(r"^ft: every group started here has ended; the Lighthouse stays up for the groups it still "
                     r"hears from")
    # The Lighthouse it stays up for dies, and is started again while that group is silent for less than
    # the heartbeat timeout (frozen): a Lighthouse that has heard no group yet is not "none left" (ft.sh
    # took it so in bench chaos, and ended it under the groups started by hand).
    os.kill(hand, signal.SIGSTOP)
    killed = time.monotonic()
    os.kill(int((run.logs / "lighthouse.pid").read_text()), signal.SIGKILL)
    run.job.wait_for(r"^ft: the Lighthouse died \(killed by SIGKILL\); restarted \(1 of", after=killed)
    heard_from(run.port, 0)
    time.sleep(SILENT_S)  # deliberate: a silence shorter than the heartbeat timeout, which ft.sh polls every second
    os.kill(hand, signal.SIGCONT)
    gate.release(held)
    assert third.finish() == 0, run.job.text()[-5000:] + third.text()[-3000:]
    assert run.job.finish() == 128 + signal.SIGTERM, run.job.text()[-5000:]  # its groups left: ft.sh says so
    assert "group 1 lost" not in run.job.text() and "group 0 lost" not in run.job.text()  # no group restarted
    # held at a step, the SIGTERM is agreed on as the next step begins: the group leaves after it
    assert (int(match[1]), int(gone[1])) == (MID_EPOCH_2 + 1, LEAVE + 1), run.job.text()[-5000:]
    dw = max_dw(final_weights(tmp_path), exact3)
    print(f"\na third group joined {joined - started:.1f} s after its start, healed at step {match[1]}; group 1 left "
          f"after step {gone[1]} {left - stopped:.1f} s after its SIGTERM, the others' next quorum "
          f"{regrouped - stopped:.1f} s after it; group 0 left at step {LAST_LEAVES + 1} and the group started by "
          f"hand trained on alone; max |dw| against the fault-free run = {dw:.3g}")
    assert dw == 0, "--exact-sums: the same bits whatever failed when"


# 4 -------------------------------------------------------------------------------------------
FREEZE_KILL_THAW = (30, 40, 60)


def test_a_frozen_group_a_group_killed_while_healing_and_the_last_group_alone_never_hang(mnist_root, exact3,
                                                                                        tmp_path):
    """Three groups, one restart each. Group 2 freezes (SIGSTOP) at step 30: its heartbeat stops and the
    others go on without it. Group 1 is SIGKILLed at step 40, restarted, and SIGKILLed again while it
    is held as it loads group 0's state (the heal): the source goes on. With no restarts left, group
    0 trains alone to step 60, where it is held until group 2, thawed (SIGCONT), finds itself behind
    in the quorum: it heals at step 61 and rejoins. Every
    wait is bounded; the weights and statistics are still the fault-free run's, bit for bit."""
    gate = Gate(tmp_path / "gates")
    freeze, kill, thaw = (f"all@{step}" for step in FREEZE_KILL_THAW)
    training = [*gated(TOGETHER, freeze, kill, thaw, "g1@heal"),
                *flags(mnist_root, tmp_path, *EXACT, "--ft-timeout-s", "4")]
    run = FtRun(tmp_path, 3, training, restarts=1, gate=gate)
    start_together(gate, run, 3)
    gate.held(freeze, processes=3)
    frozen_worker = run.worker(2)
    os.kill(frozen_worker, signal.SIGSTOP)
    frozen = time.monotonic()
    gate.release(freeze)  # groups 0 and 1 go on; group 2, frozen, stays where it was held
    left_behind, _ = run.job.wait_for(r"\[g0\] quorum of 2 group\(s\)", after=frozen)

    gate.held(kill, processes=2)
    asked = gate.quorum_requests(1)
    os.kill(run.worker(1), signal.SIGKILL)
    run.job.wait_for(r"^ft: group 1 lost \(exit \d+\); restarted \(1 of 1\)")
    gate.asked_quorum(1, beyond=asked)  # the restarted group is in the quorum: group 0 meets it there and heals it
    gate.release(kill)
    gate.held("g1@heal")  # group 1 has the step's sum and is about to load group 0's state
    os.kill(run.worker(1), signal.SIGKILL)
    killed_healing = time.monotonic()
    run.job.wait_for(r"^ft: group 1 lost \(exit \d+\); no restarts left")
    alone, _ = run.job.wait_for(r"\[g0\] epoch 2: \d+ samples", after=killed_healing)  # group 0 trains on alone

    gate.held(thaw)
    asked = gate.quorum_requests(2)
    os.kill(frozen_worker, signal.SIGCONT)
    thawed = time.monotonic()
    gate.asked_quorum(2, beyond=asked)  # the thawed group, behind, is in the quorum: group 0 meets it there
    gate.release(thaw)
    healed, at = run.job.wait_for(r"\[g2\] group 2 healed from group 0 at step (\d+)", after=thawed)
    assert int(at[1]) == FREEZE_KILL_THAW[2] + 1, run.job.text()[-6000:]
    assert run.job.finish() == 0, run.job.text()[-6000:]
    dw = max_dw(final_weights(tmp_path), exact3)
    print(f"\nfrozen group left behind after {left_behind - frozen:.1f} s; group 0 ended an epoch alone "
          f"{alone - killed_healing:.1f} s after the kill during a heal; the thawed group healed "
          f"{healed - thawed:.1f} s after SIGCONT; max |dw| against the fault-free run = {dw:.3g}")
    assert dw == 0, "--exact-sums: the same bits whatever failed when"


# 5 -------------------------------------------------------------------------------------------
def test_another_run_or_batch_cut_is_refused_and_ctrl_c_stops_every_group_saved(mnist_root, tmp_path):
    """A second launch/ft.sh on the port of a running one must not send its groups into the other
    run's quorum (they would heal from its weights): it ends at once, naming FT_PORT. A group that
    cuts the batch otherwise (--groups 3) ends with one line, not gloo's abort, and the run goes on.
    A terminal's
    Ctrl-C (SIGINT to ft.sh's whole process group) stops every group: the first saves, ft.sh ends
    after them, and no process of the run is left."""
    gate, meet, stop = Gate(tmp_path / "gates"), "all@30", "all@45"
    run = FtRun(tmp_path / "a", 2, [*gated(meet, stop), *flags(mnist_root, tmp_path / "a")], gate=gate)
    gate.held(meet, processes=2)
    other = Job(["bash", "launch/ft.sh", "2", "1", "train_ft.py", *flags(mnist_root, tmp_path / "b")],
                {**run.env, "FT_LOGS": str(tmp_path / "b-logs")})
    assert other.finish(timeout=30) == 2 and "set FT_PORT to a free port" in other.text(), other.text()
    odd = run.extra_group(2, 3)  # --groups 3 by its FT_GROUPS (the run has 2): it would cut the batch otherwise
    gate.asked_quorum(2, beyond=0)  # the running groups meet it in their next quorum
    gate.release(meet)
    assert odd.finish(timeout=90) != 0, odd.text()
    assert "met groups that train another run or cut the batch otherwise" in odd.text(), odd.text()[-3000:]
    assert "Traceback" not in odd.text() and "SIGABRT" not in odd.text(), odd.text()[-3000:]
    gate.held(stop, processes=2)
    pids = [run.worker(0), run.worker(1), int((run.logs / "group0.pid").read_text())]
    stopped = time.monotonic()
    os.killpg(run.job.process.pid, signal.SIGINT)
    gate.signalled(stop, processes=2)
    gate.release(stop)
    code = run.job.finish(timeout=60)
    ended = time.monotonic() - stopped
    text = run.job.text()
    saved = re.search(r"\[g0\] stopped by SIGINT after step (\d+) \(epoch \d+, step \d+\); checkpoint (\S+);", text)
    assert code != 0 and saved and Path(saved[2]).exists() and int(saved[1]) == 46, text[-4000:]
    assert not outliving(pids), "a process of the run outlived ft.sh"
    assert latest_state(tmp_path / "a" / "ckpt")["global_step"] == int(saved[1])
    print(f"\nCtrl-C: ft.sh ended {ended:.1f} s later, group 0 saved step {saved[1]}; a second ft.sh on the port "
          "refused")


# 6 -------------------------------------------------------------------------------------------
QUORUM_S = 30  # above a group's start on a loaded host (torchrun, imports, data), the give-up's wait


def test_with_min_groups_2_a_group_waits_for_its_peer_then_gives_up_in_one_line_saved_when_it_is_gone(mnist_root,
                                                                                                       tmp_path):
    """A run planned for two groups with --min-groups 2, one group started by launch/ft.sh and the
    second by hand once the first waits in its first quorum (its request: tests/gates.py). launch/ft.sh
    started the Lighthouse with --min_replicas 2, so the first group waits for its peer rather than
    failing step 1 alone (with --min_replicas 1 it gave up in 3 s, after MAX_RETRIES retries, before its
    peer came), and the two train. The peer is then SIGKILLed while both are held after step 30: the
    first group's quorum for step 31 waits --quorum-timeout-s for it, then the group gives up with one
    line, saved, status GAVE_UP, and launch/ft.sh (restarts left: 3) does not restart it."""
    from common.train.ft import GAVE_UP

    gate, held = Gate(tmp_path / "gates"), "all@30"
    training = [*gated(held), *flags(mnist_root, tmp_path, "--groups", "2", "--min-groups", "2", "--quorum-timeout-s",
                                     str(QUORUM_S))]
    run = FtRun(tmp_path, 1, training, gate=gate)
    gate.asked_quorum(0, beyond=0)  # the first group waits in its first quorum
    peer = run.extra_group(1, 2)
    alone = time.monotonic()
    joined, _ = run.job.wait_for(r"\[g0\] quorum of 2 group\(s\) at step 1: this group \(group 0\) is number 0",
                                 timeout=QUORUM_S)
    gate.held(held, processes=2)
    peer.kill_tree()
    gate.release(held)
    killed = time.monotonic()
    code = run.job.finish(timeout=QUORUM_S + 60)
    gave_up = time.monotonic() - killed
    text = run.job.text()
    assert code == GAVE_UP, text[-5000:]
    assert "failed across groups" not in text, "the first group's steps failed alone: the Lighthouse formed a quorum " \
                                               "of fewer than --min-groups\n" + text[-5000:]
    errors = re.findall(r"^\[g0\] error: .*$", text, re.M)
    assert len(errors) == 1 and re.fullmatch(
        rf"\[g0\] error: group 0 gave up at step 31: no quorum of --min-groups 2 groups at the Lighthouse \S+ within "
        rf"--quorum-timeout-s {QUORUM_S} \(TimeoutError\): fewer groups joined it: stopped after step 30; checkpoint "
        r"(\S+); start the missing groups .*", errors[0]), text[-5000:]
    assert Path(re.search(r"checkpoint (\S+);", errors[0])[1]).exists(), errors[0]
    assert latest_state(tmp_path / "ckpt")["global_step"] == 30
    ended = [line for line in text.splitlines() if line.startswith("ft: group 0")]
    assert len(ended) == 1 and re.fullmatch(r"ft: group 0 gave up \(its line above says why\); not restarted: a "
                                            r"restart would fail alike \[\d\d:\d\d:\d\d\]", ended[0]), text[-3000:]
    assert "Traceback" not in text and "restarted (" not in text, text[-5000:]
    assert gave_up < QUORUM_S + 30, f"gave up {gave_up:.1f} s after its peer was killed"
    asked = text.count("[g0] no quorum from the Lighthouse")
    print(f"\n--min-groups 2: group 0 waited {joined - alone:.1f} s for its peer started by hand, trained 30 steps "
          f"with it; after the peer's SIGKILL it gave up {gave_up:.1f} s later (--quorum-timeout-s {QUORUM_S}, "
          f"{asked} 'asking again' line(s)), status {code}, not restarted")
