"""Every way a rank dies ends the job non-zero with one line naming it (rank, pid, host, how it
ended, and what the job was doing), through launch/single_node.sh and plain torchrun, over the
shared-memory transport and over gloo; and /dev/shm keeps no region of a killed set-up. The job's
store dying under a rank (torchrun's agent SIGKILLed in a save) is one line too, in-process, with a
real TCPStore."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from common import orphans
from common.errors import Crashed, first_line
from common.interrupts import STARTUP_LINE
from common.parallel.context import DistContext
from common.parallel.failures import how_it_ended, told
from common.parallel.transport import SHM_FOLDER, create_region
from tests.conftest import ENDS_PROMPTLY_S, ROOT, as_from_a_terminal, child_env, error_lines, script_command

FLAGS = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--batch-size", "32",
         "--epochs", "1", "--max-steps", "40"]
FAULT_STEP = 3  # rank 1 fails after its 3rd step: rank 0 is then in step 4's gradient exchange
HOW = {"sigkill": "was killed by SIGKILL (the out-of-memory killer sends it too: dmesg names what it killed) "
                  "during the gradient exchange at step 4",
       "segfault": "was killed by SIGSEGV (a crash in native code) during the gradient exchange at step 4",
       "raise": "failed with RuntimeError during the training step at step 3 (traceback above)"}


def run_with_fault(launcher: str, transport: str, fault: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess,
                                                                                        float, int]:
    """The job's result, the seconds from the fault to the end of the job, and the failing rank's pid."""
    args = ["tests/faults.py", "ddp", fault, str(FAULT_STEP), *FLAGS, "--transport", transport,
            "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "tb")]
    stamp = tmp_path / "fault_at"
    env = {**child_env(), "FAULT_AT_FILE": str(stamp), "NPROC": "2"}
    command = ["bash", "launch/single_node.sh", *args] if launcher == "single_node" else script_command(args, nproc=2)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=2 * ENDS_PROMPTLY_S)
    ended = time.time()
    assert stamp.exists(), result.stderr[-3000:]
    at, pid = stamp.read_text().split()
    return result, ended - float(at), int(pid)


@pytest.mark.parametrize("launcher, transport, fault", [
    ("single_node", "shm", "sigkill"), ("single_node", "gloo", "sigkill"), ("single_node", "shm", "segfault"),
    ("single_node", "gloo", "raise"), ("torchrun", "shm", "sigkill"), ("torchrun", "gloo", "segfault"),
    ("torchrun", "shm", "raise"),
])
def test_a_rank_that_dies_is_named_in_one_line(launcher, transport, fault, tmp_path):
    result, seconds, pid = run_with_fault(launcher, transport, fault, tmp_path)
    print(f"\n{launcher} {transport} {fault}: job ended {seconds:.1f} s after the fault, exit {result.returncode}")
    assert result.returncode != 0
    assert f"gradients via {transport}" in result.stdout
    named = f"rank 1 (pid {pid}) on {socket.gethostname()} "
    lines = [line for line in error_lines(result.stderr) if line.startswith(f"error: {named}")]
    assert len(lines) == 1, result.stderr[-3000:]
    if launcher == "single_node" or fault == "raise":  # plain torchrun's reaping may beat the survivor's look
        assert HOW[fault] in lines[0], lines[0]
    else:
        assert "during the gradient exchange at step 4" in lines[0], lines[0]
    if fault == "raise":  # the failing rank's traceback, once
        assert result.stderr.count("RuntimeError: injected failure on rank 1") == 1, result.stderr[-3000:]
    else:  # no rank printed a traceback (plain torchrun's report is its own)
        assert "common/" not in result.stderr, result.stderr[-3000:]
    assert seconds < ENDS_PROMPTLY_S  # not the 300 s a survivor blocked in a collective would wait


def _hold_region() -> subprocess.Popen:
    """A process that creates a region as rank 0's set-up does, prints its path and waits."""
    code = ("import sys, time; from common.parallel.transport import create_region; "
            "region, _ = create_region(2); print(region.path, flush=True); time.sleep(60)")  # killed by the test
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True)


def _age(path: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_killed_set_up_leaves_no_region_for_good(tmp_path):
    """A region whose creator was SIGKILLed before every rank mapped it is removed by the next set-up;
    one that a live set-up still holds is kept, however old."""
    if not os.path.isdir(SHM_FOLDER):
        pytest.skip(f"needs {SHM_FOLDER}")
    killed, live = _hold_region(), _hold_region()
    try:
        killed_path, live_path = killed.stdout.readline().strip(), live.stdout.readline().strip()
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert os.path.exists(killed_path)  # nothing could remove it
        for path in (killed_path, live_path):
            _age(path, 60)
        region, problem = create_region(2)
        assert region is not None, problem
        region.remove()
        assert not os.path.exists(killed_path)
        assert os.path.exists(live_path)
    finally:
        live.kill()
        live.wait()
        if os.path.exists(live_path):
            os.unlink(live_path)


@pytest.mark.quick
def test_a_sigkill_is_not_blamed_on_memory():
    """A kill -9 the user sent reads as SIGKILL, with the OOM killer as a possibility, not a verdict."""
    said = how_it_ended(-signal.SIGKILL)
    assert said.startswith("was killed by SIGKILL (") and "out of memory?" not in said
    assert "the out-of-memory killer sends it too" in said


# A program at start-up (common/interrupts.py's guard installed) that waits in native code for good
# ("wait": a mutex locked twice; no Python handler runs there), or forks from a thread as the data
# preparation does ("fork": the child says whether it kept its parent's SIGINT handling).
START_UP = """
import ctypes, os, signal, sys, threading
from common.interrupts import end_on_ctrl_c
end_on_ctrl_c("train_ddp.py")
if sys.argv[1] == "fork":
    def fork():
        if os.fork() == 0:
            print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.set_wakeup_fd(-1), flush=True)
            os._exit(0)
        os.wait()
    threading.Thread(target=fork).start()
    sys.exit(0)
mutex = ctypes.create_string_buffer(64)  # zeroed: glibc's PTHREAD_MUTEX_INITIALIZER
lock = ctypes.CDLL(None).pthread_mutex_lock
lock(mutex)
print("waiting", flush=True)
lock(mutex)
"""


@pytest.mark.quick
@pytest.mark.parametrize("local_rank, said", [("0", [STARTUP_LINE]), ("1", [])])
def test_ctrl_c_during_start_up_ends_a_process_waiting_in_native_code(local_rank, said):
    """A Ctrl-C that lands while the main thread waits in native code (joining the process group, a
    collective, a store's wait), where Python runs no handler: the watcher ends the process, status
    130, the line from local rank 0 only (every process of the node got the same Ctrl-C)."""
    env = {**child_env(), "LOCAL_RANK": local_rank}
    proc = subprocess.Popen([sys.executable, "-c", START_UP, "wait"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_terminal)
    try:
        assert proc.stdout.readline() == "waiting\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=ENDS_PROMPTLY_S)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT and err.splitlines() == said, err


@pytest.mark.quick
def test_a_data_worker_forked_during_start_up_keeps_pythons_ctrl_c():
    """A DataLoader worker forked during start-up takes SIGINT as Python does (its loader ends it
    quietly) and writes no signal into its parent's wakeup pipe (which would end the parent)."""
    forked = subprocess.run([sys.executable, "-c", START_UP, "fork"], cwd=ROOT, env=child_env(), capture_output=True,
                            text=True, timeout=ENDS_PROMPTLY_S, preexec_fn=as_from_a_terminal)  # a suite run in the
    # background (SIGINT ignored from its start) would hand that on: the guard then stays out, as it should
    assert forked.stdout == "True -1\n" and forked.returncode == 0, forked.stderr


# A program whose SIGINT is ignored from its start, as a shell without job control starts a background
# job (`python evaluate.py ... &` in a script): the guard is asked for, a Ctrl-C comes.
IGNORED_FROM_THE_START = """
import os, signal
signal.signal(signal.SIGINT, signal.SIG_IGN)
from common.interrupts import end_on_ctrl_c
end_on_ctrl_c("evaluate.py")
os.kill(os.getpid(), signal.SIGINT)
print("went on", signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
"""


@pytest.mark.quick
def test_a_ctrl_c_the_program_was_started_ignoring_stays_ignored():
    """A background job of a script ignores the Ctrl-C meant for the script's foreground, as Python
    leaves it: the guard is not put in its place (it ended such a job with status 130)."""
    ran = subprocess.run([sys.executable, "-c", IGNORED_FROM_THE_START], cwd=ROOT, env=child_env(), capture_output=True,
                         text=True, timeout=ENDS_PROMPTLY_S)
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, "went on True\n", "")


# A user's own script, named as one of the suite's programs, that imports the installed package and
# catches its own Ctrl-C.
OWN_SCRIPT = """
import gc, os, signal
import common
print(gc.isenabled(), signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
try:
    os.kill(os.getpid(), signal.SIGINT)
except KeyboardInterrupt:
    print("caught", flush=True)
"""


@pytest.mark.quick
@pytest.mark.parametrize("name", ["train_mine.py", "evaluate.py"])
def test_a_users_own_script_of_a_suite_programs_name_keeps_its_ctrl_c_and_its_collector(name, tmp_path):
    """The package's import sets the collector and the Ctrl-C guard up for the suite's own programs
    alone (common/collector.py suite_program), not for a script of the same name elsewhere, which
    catches its KeyboardInterrupt with its collector on (it was ended with the guard's line, status
    130, and a train_*.py's collector stayed off for its whole run)."""
    script = tmp_path / name
    script.write_text(OWN_SCRIPT)
    ran = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                         timeout=ENDS_PROMPTLY_S, preexec_fn=as_from_a_terminal)
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, "True True\ncaught\n", "")


# A user's driver that runs one of the suite's programs as runpy.run_path(FILE, run_name="__main__")
# does (FILE its __main__ for the run), then catches its own Ctrl-C.
DRIVER = """
import os, signal, sys, types
main = types.ModuleType("__main__")
main.__file__ = sys.argv[1]
sys.modules["__main__"] = main
import common
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
"""


@pytest.mark.quick
def test_a_suite_program_run_inside_a_users_driver_leaves_the_drivers_ctrl_c_alone():
    """The guard is the program's where the interpreter was started with it (common/collector.py
    run_by_the_interpreter), not where a driver (or IPython's %run) runs it: the driver's process and
    its Ctrl-C are its own (a Ctrl-C there ended the driver with predict.py's line, status 130)."""
    ran = subprocess.run([sys.executable, "-c", DRIVER, str(ROOT / "predict.py")], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=ENDS_PROMPTLY_S, preexec_fn=as_from_a_terminal)
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, "True\n", "")


class JobStore:
    """The job's key-value store as a worker holds it: a client of a TCPStore whose server (torchrun's
    agent's, here in this process) can die."""

    def __init__(self) -> None:
        self.server: dist.TCPStore | None = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", self.server.port, is_master=False, timeout=timedelta(seconds=5))
        self.client = dist.PrefixStore("suite", client)  # as common/parallel/context.py's distributed() hands it out

    def die(self) -> None:
        """The agent's SIGKILL: its server closes every connection. A client's first call after may still
        fit in its socket's buffer; the call that finds the connection reset raises, and every later one."""
        self.server = None  # its last reference: the server stops
        for _ in range(100):
            try:
                self.client.set("probe", "")
            except dist.DistNetworkError:
                return
            time.sleep(0.01)  # a poll with a bound (100 tries): the server's close reaching the client's socket
        raise AssertionError("the client never saw its store's server die")


def rank_0_with(store: JobStore) -> DistContext:
    return DistContext(0, 2, 0, 2, torch.device("cpu"), "gloo", store=store.client)


def saved_at_step_250(ctx: DistContext, action) -> None:
    """ctx.after_primary as the loop calls it for a checkpoint: the frames' names and locals are what
    failures.doing() reads "during a checkpoint save at step 250" from."""
    def train_epoch(global_step: int) -> None:
        def save() -> None:
            ctx.after_primary("checkpoint save at step 250", action, deadline_s=30)
        save()
    train_epoch(249)


@pytest.fixture
def told_here(monkeypatch):
    """told() as in a worker: no torchrun error file, and this test's own record of a line said."""
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setattr(orphans, "SAID", threading.Event())


@pytest.mark.quick
def test_the_store_dying_in_a_save_ends_rank_0_with_one_line(capfd, monkeypatch, told_here):
    """The chaos run's kill-agent: rank 0's save done, its store.set for the waiting ranks fails
    (DistNetworkError: Broken pipe); rank 0 ends non-zero with one line, not a traceback, and the
    watch on its agent (common/orphans.py), which sees the agent gone next, adds none."""
    store = JobStore()
    ctx = rank_0_with(store)
    with pytest.raises(dist.DistNetworkError) as raised:
        saved_at_step_250(ctx, store.die)
    failure = told(raised.value, ctx)
    ended = []
    monkeypatch.setattr(os, "_exit", ended.append)
    orphans._watch(agent=-1)  # no process's parent: the agent is gone at once
    said = capfd.readouterr().err  # the watch writes to fd 2 (c10d's own C++ warnings may come too)
    assert error_lines(said) == [
        f"error: rank 0 (pid {os.getpid()}) on {socket.gethostname()} ends: the job's store failed "
        f"({first_line(raised.value)}) during a checkpoint save at step 250; its host (torchrun's agent, or the "
        "rendezvous host) ended or did not answer in time"], said
    assert "Traceback" not in said and ended == [1], said
    assert not isinstance(failure, Crashed) and failure.exit_code == 1


@pytest.mark.quick
def test_an_orphan_that_said_nothing_yet_says_why_it_ends(capfd, monkeypatch, told_here):
    ended = []
    monkeypatch.setattr(os, "_exit", ended.append)
    monkeypatch.setenv("RANK", "1")
    orphans._watch(agent=-1)
    assert error_lines(capfd.readouterr().err) == [
        "error: rank 1's torchrun agent (pid -1) is gone: this worker stops rather than train on unsupervised (its "
        "checkpoints are kept: the same command resumes)"] and ended == [1]


@pytest.mark.quick
def test_the_store_dying_does_not_hide_the_error_rank_0_ends_with(capsys, told_here):
    """The save's own error (here a bug) is raised before the store's failure in after_primary's
    finally: the first is told, with its traceback, not replaced by the store's."""
    store = JobStore()

    def save_with_a_bug() -> None:
        store.die()
        raise ValueError("a bug in the save")
    with pytest.raises(ValueError) as raised:
        saved_at_step_250(rank_0_with(store), save_with_a_bug)
    failure = told(raised.value, rank_0_with(store))
    said = capsys.readouterr().err
    assert isinstance(failure, Crashed) and "ValueError: a bug in the save" in said, said
    assert error_lines(said) == [f"error: rank 0 (pid {os.getpid()}) on {socket.gethostname()} failed with ValueError "
                                 "during a checkpoint save at step 250 (traceback above)"], said
    assert "DistNetworkError" not in said and "the job's store" not in said, said
    with pytest.raises(dist.DistNetworkError):  # the store's failure was there to hide it
        store.client.set("after", "")


@pytest.mark.quick
def test_a_store_wait_that_times_out_is_one_line(capsys, monkeypatch, told_here):
    """DistStoreError (what a rank waited for in the store did not come in its timeout) is a store's
    failure too: one line, no traceback."""
    monkeypatch.setenv("RANK", "1")
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=0.1))
    with pytest.raises(dist.DistStoreError) as raised:
        store.get("never-set")
    told(raised.value, None)
    said = capsys.readouterr().err
    assert said.splitlines() == [
        f"error: rank 1 (pid {os.getpid()}) on {socket.gethostname()} ends: the job's store failed "
        f"({first_line(raised.value)}) during joining or leaving the process group; its host (torchrun's agent, "
        "or the rendezvous host) ended or did not answer in time"], said
