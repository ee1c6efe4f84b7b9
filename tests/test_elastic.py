"""Elastic membership through launch/elastic.sh and launch/elastic_store.py: two torchrun agents on
127.0.0.1 (one rank each), the first alone, the second joining mid-run and later leaving (TERM).

Asserted: the worlds go 1, 2, 1; each change stops the job after one step, saves, and the next world
resumes at exactly that step (no step lost, none trained twice: the steps of the three worlds add up
to the plan); the final weights are, bit for bit, those of the same schedule run by plain torchrun
(world 1 to step 21, world 2 to step 31, world 1 to the end, each stopped and resumed through a
checkpoint): the same sums in the same order, on any CPU (against one uninterrupted process the
gap is the CPU's rounding, grown step by step: 1.2e-07 on one host, 1.7e-05 on another); the
leaving node exits 143 with its one line. The
seconds from the join and from the leave to the first step at the new world size are printed. And
the launcher's one-line refusals (a fixed NNODES, a setting that is not a whole number, no store
answering, the store's port in use) and the command it shows.

train_ddp.py is enough: the six scripts share common/train/app.py, which does the stop, the save and
the resume, and differ only in the strategy, whose resume at another world size is checked
elsewhere, each in one launch rather than four agents and a store (a sharded FSDP2 checkpoint saved at
world 2 and resumed at world 1: test_resume.py's "sharded" run; from world 2 to 4 and back, ZeRO-1
and FSDP2 with AdamW and EMA: test_optimizers.py); what a membership change adds is the launcher's
side, the same for all six. (An FSDP2 row here cost 170-230 s of the suite, under load, for no
assertion the ddp row and those two do not make.)

The workers run this file (below: the script's own main, held at two steps): while the test's gate
file exists, a worker waits before global step GATES[0] until it gets a signal (the stop for the
join, which the test asks for, by starting the second node, once the first is held there) and
before GATES[1] until it gets one or the gate is removed (the leaving node's worker gets the signal;
the staying one waits for the test, which removes the gate once the leaving agent has passed the
TERM on). The leaving node gets its TERM only once its worker has begun a step (it says so in a
file): before that, a TERM is start-up's, which ends a worker at once, without the stop. So the join
and the leave land at known points on a host of any speed, and the rest of the run goes at full
speed.
"""
from __future__ import annotations

import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from common.train.preemption import StopRequest
from tests.conftest import ENDS_PROMPTLY_S, ROOT, child_env, free_port, latest_state, run_script

EPOCHS, STEPS_PER_EPOCH = 2, 1200 // 32  # mnist_root's 1200 images, batch 32
# Global step indices, multiples of StopRequest.CHECK_EVERY: a signal that opens a gate is agreed on
# as that step begins, and the job stops after it.
GATES = (20, 30)
WORLD = re.compile(r"^[\w/+-]+: world (\d+) = ")  # the banner: "ddp: world 2 = ...", "fsdp/full: world 1 = ..."
STARTED = re.compile(r"^start-up: ")
# A stop on the node that leaves; the agent's restart at a new world size on the node that stays.
STOPPED = re.compile(r"^(?:stopped by SIGTERM|membership change \(a node joined or left the elastic job\): saved) "
                     r"after step (\d+) ")
RESUMED = re.compile(r"^resumed from \S+/step-0*(\d+)\.pt: .*\(saved at world (\d+)\)")


class Console:
    """Every agent's lines, each with the seconds since the test began, in the order they came."""

    def __init__(self) -> None:
        self.began = time.monotonic()
        self.lines: list[tuple[float, str, str]] = []
        self.lock = threading.Lock()

    def read(self, name: str, stream) -> None:
        for line in stream:
            with self.lock:
                self.lines.append((time.monotonic() - self.began, name, line.rstrip("\n")))

    def now(self) -> float:
        return time.monotonic() - self.began

    def matches(self, pattern: re.Pattern, after: float = 0.0, name: str = "") -> list[tuple[float, re.Match]]:
        with self.lock:
            found = [(t, pattern.search(line)) for t, who, line in self.lines if t >= after and name in ("", who)]
        return [(t, m) for t, m in found if m]

    def wait_for(self, pattern: re.Pattern, after: float, what: str, name: str = "") -> float:
        """When the first line matching `pattern` (from agent `name`, or any) came at or after `after`."""
        deadline = time.monotonic() + ENDS_PROMPTLY_S
        while time.monotonic() < deadline:
            if found := self.matches(pattern, after, name):
                return found[0][0]
            time.sleep(0.05)  # a poll with a deadline: the lines come from reader threads
        raise AssertionError(f"no {what} within {ENDS_PROMPTLY_S} s:\n{self.text()}")

    def first_step_of_next_world(self, after: float, what: str) -> float:
        """When the first world formed after `after` began training (rank 0's start-up line, said as
        its first step begins)."""
        return self.wait_for(STARTED, self.wait_for(WORLD, after, f"world after the {what}"), f"step after the {what}")

    def text(self) -> str:
        return "\n".join(f"{t:6.1f} [{name}] {line}" for t, name, line in self.lines)[-8000:]


class Store:
    """launch/elastic_store.py on a free port."""

    def __enter__(self) -> "Store":
        self.proc = subprocess.Popen([sys.executable, "launch/elastic_store.py", "--port", "0"], cwd=ROOT,
                                     env=child_env(), stdout=subprocess.PIPE, text=True)
        first = self.proc.stdout.readline()
        found = re.match(r"rendezvous store on port (\d+) ", first)
        assert found, f"the store did not start: {first!r}"
        self.port = int(found[1])
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def start_agent(name: str, console: Console, env: dict[str, str], args: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(["bash", "launch/elastic.sh", *args], cwd=ROOT, env={**env, "NODE_NAME": name},
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=console.read, args=(name, proc.stdout), daemon=True).start()
    return proc


def end(agents: list[subprocess.Popen]) -> None:
    """Each agent that is still running is told to leave (TERM, passed on to torchrun), then waited for."""
    for proc in agents:
        if proc.poll() is None:
            proc.terminate()
    for proc in agents:
        proc.wait(timeout=ENDS_PROMPTLY_S)


def max_dw(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def join_then_leave(script: str, flags: list[str], gate: Path) -> tuple[Console, list[subprocess.Popen], float, float]:
    """The first node alone, the second joining, then leaving: both agents' console, the agents (ended),
    and the seconds from the join, and from the leave, to the first step at the new world size."""
    console, agents = Console(), []
    with Store() as store:
        env = {**child_env(), "NNODES": "1:2", "NPROC": "1", "RDZV_ENDPOINT": f"127.0.0.1:{store.port}",
               "RDZV_ID": f"elastic-{script}", "ELASTIC_GATE": str(gate)}
        args = ["tests/test_elastic.py", script, *flags]
        try:
            agents.append(start_agent("A", console, env, args))
            # Held before step GATES[0] + 1 until the join's stop reaches it: B starts only then, so the
            # stop is agreed on at that step however fast B's start-up is against A's first steps.
            marked(gate, "held-A", "A's worker was not held at its first gate", console)
            joined = console.now()
            agents.append(start_agent("B", console, env, args))
            world2 = console.first_step_of_next_world(joined, "join")
            # Rank 0's start-up line does not say that B's worker is past its own start-up (a loaded host
            # can hold it there for a second or more): its first step does.
            marked(gate, "training-B", "B's worker began no step", console)
            left = console.now()
            agents[1].send_signal(signal.SIGTERM)
            # The leaving agent passed the TERM on to its worker, held at the gate.
            marked(gate, "signalled-B", "node B's worker took no signal", console)
            gate.unlink()
            world1 = console.first_step_of_next_world(left, "leave")
            agents[0].wait(timeout=ENDS_PROMPTLY_S)
        finally:
            end(agents)
    return console, agents, world2 - joined, world1 - left


def test_a_node_joins_and_leaves_without_losing_a_step(mnist_root, tmp_path):
    flags = ["--dataset", "mnist", "--data-dir", str(mnist_root), "--no-download", "--model", "lenet",
             "--batch-size", "32", "--epochs", str(EPOCHS)]
    plan = EPOCHS * STEPS_PER_EPOCH
    reference = same_schedule([*flags, "--checkpoint-dir", str(tmp_path / "ref"), "--log-dir",
                                       str(tmp_path / "tb-ref")])
    gate = tmp_path / "gate"
    gate.touch()
    console, (a, b), join_s, leave_s = join_then_leave(
        "train_ddp.py", [*flags, "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "tb")], gate)
    print(f"\ntrain_ddp.py: first step at world 2 {join_s:.1f} s after the second node started (join), at world 1 "
          f"{leave_s:.1f} s after its TERM (leave)")
    assert a.returncode == 0 and b.returncode == 143, f"exit {a.returncode}, {b.returncode}\n{console.text()}"
    assert [line for _, name, line in console.lines if name == "B" and line.startswith("left the job")] == [
        "left the job after SIGTERM: the other nodes, if any, continue from the checkpoint saved at the stop; "
        "run this command again to join again"]
    assert [int(m[1]) for _, m in console.matches(WORLD)] == [1, 2, 1], console.text()
    stops = [int(m[1]) for _, m in console.matches(STOPPED)]
    resumes = [(int(m[1]), int(m[2])) for _, m in console.matches(RESUMED)]
    assert stops == [GATES[0] + 1, GATES[1] + 1], console.text()
    assert resumes == [(stops[0], 1), (stops[1], 2)], console.text()  # each world starts where the last stopped
    final = latest_state(tmp_path / "ckpt")
    assert final["global_step"] == plan and final["world_size"] == 1
    print(f"steps: {stops[0]} at world 1, {stops[1] - stops[0]} at world 2, {plan - stops[1]} at world 1 = {plan}")
    dw = max_dw(final["model"], latest_state(reference)["model"])
    print(f"final weights vs the same schedule under plain torchrun: max |dw| = {dw:.3g}")
    assert dw == 0, "the same world sizes at the same steps: the same sums in the same order"


def marked(gate: Path, name: str, failure: str, console: Console) -> None:
    """Wait until a worker has written the file `name` beside the gate (see gated)."""
    marker, deadline = gate.with_name(name), time.monotonic() + ENDS_PROMPTLY_S
    while not marker.exists():
        assert time.monotonic() < deadline, f"{failure} within {ENDS_PROMPTLY_S} s; the agents said:\n{console.text()}"
        time.sleep(0.05)  # a poll with a deadline: the marker is a file the worker writes


def same_schedule(flags: list[str]) -> Path:
    """The elastic run's worlds at its steps, under plain torchrun: world 1 stopped after step
    GATES[0] + 1, world 2 resumed there and stopped after step GATES[1] + 1, world 1 to the end
    (tests/faults.py's SIGTERM after the N-th step of the process is agreed on as the next step,
    a multiple of CHECK_EVERY, begins). Returns the checkpoint folder."""
    for nproc, fault, after, stop in [(None, "sigterm", GATES[0], GATES[0] + 1),
                                      (2, "sigterm", GATES[1] - GATES[0] - 1, GATES[1] + 1), (None, "none", 0, None)]:
        result = run_script(["tests/faults.py", "ddp", fault, str(after), *flags], nproc=nproc)
        ended = result.returncode == 0 if stop is None else \
            result.returncode != 0 and f"stopped by SIGTERM after step {stop} " in result.stderr
        assert ended, result.stderr[-3000:]
    return Path(flags[flags.index("--checkpoint-dir") + 1])


@pytest.mark.parametrize("env, line", [
    ({"NNODES": "2"}, "error: NNODES=2 is not MIN:MAX with 1 <= MIN <= MAX (e.g. 1:4); for a fixed number of nodes use "
                      "launch/multi_node.sh"),
    ({"DEAD_AFTER": "2.5"}, "error: DEAD_AFTER=2.5 is not a positive whole number; see the settings in "
                            "launch/elastic.sh's header"),
    ({"STORE_WAIT": "1"}, "error: no rendezvous store answers at 127.0.0.1:{port} (waited 1 s): start "
                          "'python3 launch/elastic_store.py --port {port}' on 127.0.0.1, a machine that stays up "
                          "for the whole job"),
    ({"RDZV_ENDPOINT": "head:abc"}, "error: RDZV_ENDPOINT=head:abc is not HOST:PORT (a host name or IPv4 address, a "
                                    "port 1-65535, e.g. head:29400): where launch/elastic_store.py serves"),
], ids=["fixed-size", "fraction", "no-store", "bad-endpoint"])
def test_elastic_sh_refuses_bad_settings_and_an_absent_store_in_one_line(env, line):
    port = free_port()
    result = subprocess.run(["bash", "launch/elastic.sh", "train_ddp.py"], cwd=ROOT, capture_output=True, text=True,
                            env={**child_env(), "NNODES": "1:2", "RDZV_ENDPOINT": f"127.0.0.1:{port}", **env},
                            timeout=ENDS_PROMPTLY_S)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == line.format(port=port), result.stderr


def test_elastic_sh_shows_the_command_with_what_makes_a_join_work():
    env = {**child_env(), "NNODES": "1:4", "RDZV_ENDPOINT": "head:29400", "NPROC": "2", "DRY_RUN": "1"}
    result = subprocess.run(["bash", "launch/elastic.sh", "train_ddp.py", "--epochs", "2"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=ENDS_PROMPTLY_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:4 --nproc_per_node=2 --rdzv-backend=c10d "
        "--rdzv-endpoint=head:29400 --rdzv-id=dp-suite-elastic --rdzv-conf=is_host=false,join_timeout=600,"
        "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5 --max-restarts=20 train_ddp.py --epochs 2")


def test_the_store_refuses_a_port_in_use_in_one_line():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "launch/elastic_store.py", "--port", str(port)], cwd=ROOT,
                                env=child_env(), capture_output=True, text=True, timeout=ENDS_PROMPTLY_S)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"error: port {port} is already in use (EADDRINUSE); pass another --port, "
                                     "or --port 0 for a free one")


def gated(script: str, args: list[str], gate: Path) -> None:
    """SCRIPT's own main with ARGS, held at GATES while `gate` exists (see the module's docstring). A
    worker says in files beside the gate, named for its node, that it began a step (its stop handler
    is in place), that it is held at a gate, and that a signal released it."""
    begin_step = StopRequest.begin_step
    node = os.environ.get("NODE_NAME", "?")

    def held(self: StopRequest, index: int) -> None:
        gate.with_name(f"training-{node}").touch()
        deadline = time.monotonic() + ENDS_PROMPTLY_S * 2  # the test is gone or stuck: end, not hang
        if index in GATES and gate.exists() and not self.received:
            gate.with_name(f"held-{node}").touch()
        while index in GATES and gate.exists() and not self.received:
            if time.monotonic() > deadline:
                raise SystemExit(f"error: held before step {index + 1} for {ENDS_PROMPTLY_S * 2} s: the test is gone")
            time.sleep(0.01)  # a poll with a deadline: the gate is a file, the release a signal or its removal
        if index in GATES and gate.exists() and self.received:
            gate.with_name(f"signalled-{node}").touch()
        begin_step(self, index)
    StopRequest.begin_step = held
    sys.argv = [script, *args]
    runpy.run_path(str(ROOT / script), run_name="__main__")


if __name__ == "__main__":  # a worker, under launch/elastic.sh's torchrun
    gated(sys.argv[1], sys.argv[2:], Path(os.environ["ELASTIC_GATE"]))
