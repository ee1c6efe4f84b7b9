"""Faults at the worst moments (issue 41): whatever dies, nothing outlives the job and each process
that ends says so in one line; and `bench chaos` small, one seeded run per mode drawing the kinds that
no other test injects (a full checkpoint disk, the object store stopped during a save and a resume, a
slowed link), each against the oracle: the fault-free run's weights, exit 0, no process left, no
traceback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.parallel import procs
from tests.conftest import ENDS_PROMPTLY_S, ROOT, as_from_a_terminal, child_env

# A torchrun worker in set-up: it has imported the package (as every script does first), says so in a
# file, and then waits as a worker importing torch or reading its data would.
IN_SET_UP = """
import sys, time
from pathlib import Path
from types import SimpleNamespace
import common
Path(sys.argv[1]).write_text("importing")
time.sleep(600)
"""


# An agent that starts a worker (the package imported as under torchrun), holds the only read end of
# its stderr, and dies once the worker is up: the worker's line about it then meets a broken pipe.
AGENT_HOLDING_STDERR = """
import os, subprocess, sys, time
from pathlib import Path
ready = Path(sys.argv[1])
worker = subprocess.Popen([sys.executable, "-c", "import sys, time; import common; "
                           "open(sys.argv[1], 'w').close(); time.sleep(600)", str(ready)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          env={**os.environ, "TORCHELASTIC_RUN_ID": "orphan-test"})
deadline = time.monotonic() + 60
while not ready.exists() and time.monotonic() < deadline:
    time.sleep(0.05)  # a poll with a deadline: the worker's import of the package, which starts its watch
print(worker.pid, flush=True)
os._exit(0)
"""


@pytest.mark.quick
def test_a_worker_whose_agent_dies_with_the_read_end_of_its_stderr_still_ends(tmp_path):
    """The orphan's one line meets a pipe nobody reads (EPIPE): it still ends, rather than living on
    with its watch gone (a hung worker of a timed-out test once stayed for 10 minutes so)."""
    agent = subprocess.run([sys.executable, "-c", AGENT_HOLDING_STDERR, str(tmp_path / "ready")], cwd=ROOT,
                           env=child_env(), capture_output=True, text=True, timeout=120)
    worker = int(agent.stdout)
    deadline = time.monotonic() + 30
    while procs.running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)  # a poll with a deadline: the watch's poll is 0.5 s
    alive = procs.running(worker)
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, "the orphaned worker lived on with its stderr's reader gone"


def test_a_worker_whose_torchrun_agent_is_killed_during_its_set_up_ends_with_one_line(tmp_path):
    """SIGKILL of the agent while its worker sets up (before any step or process group): the worker,
    re-parented, ends within a second or so with one line naming the agent, instead of living on."""
    ready, script = tmp_path / "ready", tmp_path / "in_set_up.py"
    script.write_text(IN_SET_UP)
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                              str(script), str(ready)], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + ENDS_PROMPTLY_S
    while not ready.exists():
        assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[0]
        time.sleep(0.05)  # polling for the worker's file, with a deadline
    worker = procs.children(agent.pid)[0]
    os.kill(agent.pid, signal.SIGKILL)
    killed = time.monotonic()
    while procs.running(worker) and time.monotonic() < killed + ENDS_PROMPTLY_S:
        time.sleep(0.05)  # polling for the orphan's end, with a deadline
    gone = time.monotonic() - killed
    output = agent.communicate(timeout=30)[0]
    assert not procs.running(worker), f"worker {worker} outlived its agent:\n{output}"
    print(f"\nthe orphaned worker ended {gone:.1f} s after its agent's SIGKILL")
    assert f"error: rank 0's torchrun agent (pid {agent.pid}) is gone: this worker stops" in output, output
    assert "Traceback" not in output, output


@pytest.mark.quick
def test_a_chaos_schedule_draws_every_kind_at_distinct_steps_inside_the_run_the_same_for_a_seed():
    from bench.chaos import FT_KINDS, RESTART_KINDS, draw

    for kinds in (FT_KINDS, RESTART_KINDS):
        faults = draw(kinds, 30, 1000, 3, seed=7)
        assert {f.kind for f in faults} == set(kinds) and len(faults) == 30
        steps = [f.step for f in faults]
        assert steps == sorted(set(steps)) and 100 <= steps[0] and steps[-1] < 850  # 10% to 85% of the run
        assert all(0 <= f.target < 3 and 2 <= f.seconds <= 8 for f in faults)
        assert draw(kinds, 30, 1000, 3, seed=7) == faults != draw(kinds, 30, 1000, 3, seed=8)


@pytest.mark.quick
def test_a_chaos_run_is_proved_only_when_every_fault_drawn_landed_and_its_target_came_back():
    from bench.chaos import Fault, Outcome

    def outcome(*faults: Fault, run_notes: tuple[str, ...] = ()) -> Outcome:
        return Outcome([], list(faults), 0, 0.0, [], [], 0, "", list(run_notes))

    assert outcome(Fault("kill-worker", 10, 0, 2.0, landed=1.0, back=2.0)).proved
    # every fault as drawn, but a group did not finish (ft.sh exits 0 once one did) or died unkilled
    assert not outcome(Fault("kill-worker", 10, 0, 2.0, landed=1.0, back=2.0),
                       run_notes=["group 2 did not finish the run (gave up)"]).proved
    assert not outcome(Fault("kill-worker", 10, 0, 2.0, landed=1.0, back=None)).proved  # never trained again
    assert not outcome(Fault("kill-worker", 10, 0, 2.0, landed=1.0, back=2.0),
                       Fault("kill-agent", 90, 1, 2.0, notes=["the run had ended"])).proved  # one never landed
    # landed and back, but it did not happen as drawn: its signal found no process, its save did not fail
    assert not outcome(Fault("kill-rank", 10, 0, 2.0, landed=1.0, back=2.0, notes=["SIGKILL found no process"])).proved
    assert not outcome(Fault("store-down-in-save", 10, 0, 2.0, landed=1.0, back=2.0,
                             notes=["no failed save within 120 s"])).proved


@pytest.mark.quick
def test_a_chaos_signal_that_finds_no_process_is_the_faults_note():
    """A rank or group already gone when its fault lands (the run's end, a restart under way): the fault
    did not happen, so the run is not proved on it."""
    from bench.chaos import Fault, hit

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    fault = Fault("kill-during-evaluation", 90, 1, 2.0, landed=1.0)
    assert not hit(fault, None, signal.SIGKILL) and not hit(fault, ended.pid, signal.SIGKILL)
    assert fault.notes == ["SIGKILL found no process (none)", f"SIGKILL found no process (pid {ended.pid})"]


@pytest.mark.quick
def test_an_ft_job_whose_groups_all_left_and_rejoined_ends_as_the_rejoined_groups_do():
    """ft.sh exits 143 when every group it started left on SIGTERM and none of them finished (test_ft):
    where the runner's leave-and-rejoin stopped them all, the run's status is that of the groups
    started again in their place (seed 1 of the 3 x 30 run: ft.sh 143, the rejoined groups 0)."""
    from bench.chaos import ReplicaGroups

    def ended(status: int | None) -> SimpleNamespace:
        return SimpleNamespace(status=lambda: status)

    groups = object.__new__(ReplicaGroups)
    groups.groups, groups.rejoined = 3, {0: ended(0), 1: ended(0), 2: ended(0)}
    assert groups.job_status(143) == 0
    groups.rejoined[1] = ended(1)
    assert groups.job_status(143) == 1  # a rejoined group that failed fails the run
    assert groups.job_status(1) == 1  # ft.sh's own failure stands
    del groups.rejoined[2]
    groups.rejoined[1] = ended(0)
    assert groups.job_status(143) == 143  # group 2 was never the runner's to stop: ft.sh's 143 stands
    groups.rejoined[2] = ended(None)
    assert groups.job_status(143) == 143  # still running after ft.sh ended: not a finished run


@pytest.mark.quick
def test_every_group_must_finish_and_each_restart_must_follow_a_kill_of_the_runners(tmp_path):
    """ft.sh exits 0 once any group finished: a group that gave up, ran out of restarts or, started again
    by hand, failed, fails the run; so does a restart that no kill of the runner's explains (a process
    that crashed of itself, which a restart and --exact-sums would otherwise hide)."""
    from bench.chaos import ReplicaGroups

    groups = ReplicaGroups(tmp_path, tmp_path, 1, 24, 0.0, 3, 5.0)
    said = ["ft: group 0 finished [10:00:09]",
            "ft: group 1 lost (exit 137); restarted (1 of 100): it heals from a live group, if one is left [10:00:01]",
            "[g1] quorum of 3 group(s) at step 40: this group (group 1) is number 1 [10:00:02]",
            "ft: group 1 finished [10:00:09]",
            "ft: group 2 lost (exit 137); restarted (1 of 100): it heals from a live group, if one is left [10:00:03]",
            "ft: group 2 gave up (its line above says why); not restarted: a restart would fail alike [10:00:05]"]
    groups.job = SimpleNamespace(lines=[(0.0, line) for line in said])
    groups.kills = {1: 1, 2: 1}
    assert groups.unfinished() == ["group 2 did not finish the run (gave up)"]
    assert groups.unexplained_restarts() == []
    groups.kills = {2: 1}  # group 1's restart followed no kill: it died of itself
    assert groups.unexplained_restarts() == ["group 1 was lost 1 times, 0 of them by this runner's kills: a process "
                                             "died of something else"]
    groups.rejoined = {2: SimpleNamespace(status=lambda: 3)}  # started by hand, then gave up
    groups.relaunched = {2: 1}  # and once started again by the runner after a death
    assert groups.unfinished() == ["group 2, started again by hand, did not finish the run (status 3)"]
    assert "group 2 was lost 2 times, 1 of them" in " ".join(groups.unexplained_restarts())


@pytest.mark.quick
def test_each_of_torchruns_restarts_must_follow_a_kill_or_a_failed_save_of_the_runners(tmp_path):
    """Restart mode: torchrun's agent says each restart (LOGLEVEL=INFO in the job's environment); each
    must follow a kill or a failed save of the runner's not spent on an earlier restart. Else a rank
    died of itself, which the restart and the exact resume would otherwise hide."""
    from bench.chaos import Fault, Restarts

    chaos = Restarts(tmp_path, tmp_path, 1, 24, 0.0, 20)
    assert chaos.env["LOGLEVEL"] == "INFO"
    said = "I1128 [default] Worker group FAILED. 99/100 attempts left; will restart worker group"
    chaos.jobs = [SimpleNamespace(lines=[(0.0, "x"), (11.0, said), (21.0, said)]),
                  SimpleNamespace(lines=[(41.0, said)])]  # a second launch (kill-agent started it)
    chaos.landed = [Fault("full-disk", 10, 0, 3.0, landed=10.0), Fault("freeze-rank", 30, 0, 3.0, landed=30.0)]
    chaos.kill_times = [20.0, 40.0]  # a kill-rank, and a kill of a rank of the second launch
    assert chaos.unexplained_restarts() == []
    chaos.kill_times = [20.0, 45.0]  # the same count, but the last restart came before its kill
    assert chaos.unexplained_restarts() == ["torchrun restarted the ranks 3 times, 1 of them after none of this "
                                            "runner's kills and failed saves not yet spent: a rank died of something "
                                            "else"]
    chaos.kill_times = [20.0]
    assert "3 times, 1 of them" in chaos.unexplained_restarts()[0]


@pytest.mark.quick
def test_a_groups_worker_is_found_at_once_and_a_run_that_trains_no_step_is_ended_as_hung(tmp_path, monkeypatch):
    """kill-in-set-up tells its target's restart from the processes before the kill: those must be seen
    with no wait (a zero timeout once looked nowhere, so the dying worker was taken for its restart). A
    run that trains no step for STALL_S is ended, with a note that fails the oracle."""
    from bench import chaos

    groups = chaos.ReplicaGroups(tmp_path, tmp_path, 1, 24, 0.0, 2, 5.0)
    agent = subprocess.Popen(["bash", "-c", "bash -c 'exec -a train_ft.py sleep 60' & wait"], start_new_session=True)
    try:
        (tmp_path / "ft-logs").mkdir()
        (tmp_path / "ft-logs" / "group0.pid").write_text(str(agent.pid))
        worker = chaos.worker_of(agent.pid, "train_ft.py", timeout=10)
        assert worker and groups.processes() == {worker}
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()

    ended: list[Path] = []
    monkeypatch.setattr(chaos, "STALL_S", 0.5)
    monkeypatch.setattr(chaos, "end_every_run", ended.append)
    groups.running = lambda: not ended
    groups.wait_for(10)
    assert ended == [tmp_path] and groups.run_notes == ["the run trained no step for 0.5 s after step 0: ended"]


@pytest.mark.quick
def test_a_jobs_status_is_a_shells_its_last_lines_are_read_and_a_kill_counts_once_per_process(tmp_path,
                                                                                                 monkeypatch):
    """A launcher's status as ft.sh and a shell give it (128 + N for a signal N), read after its last
    line; its output held open by a process that outlived it is a run note (a process left behind that
    may end before the count); a process killed twice explains one restart, not two."""
    from bench import chaos

    killed = chaos.Job(["bash", "-c", "echo last; kill -9 $$"], child_env())
    assert killed.wait(10) == 137 and killed.lines[-1][1] == "last" and not killed.held
    monkeypatch.setattr(chaos, "OUTPUT_HELD_S", 0.5)  # after the killed job: its reader has the default's time
    held = chaos.Job(["bash", "-c", "sleep 30 & echo started"], child_env())
    try:
        assert held.wait(10) == 0 and held.held
        assert chaos.held_output([killed, held]) == ["a process still held the output of `bash -c sleep 30 & echo "
                                                     "started` 0.5 s after it ended"]
    finally:
        os.killpg(held.process.pid, signal.SIGKILL)

    groups = chaos.ReplicaGroups(tmp_path, tmp_path, 1, 24, 0.0, 2, 5.0)
    victim = subprocess.Popen(["sleep", "60"])
    fault = chaos.Fault("kill-worker", 1, 0, 2.0)
    assert groups.kill(fault, victim.pid) and groups.kill(fault, victim.pid)  # the second finds it dying
    victim.wait()
    assert groups.kills == {0: 1} and not groups.was_killed(os.getpid())


@pytest.mark.quick
def test_the_oracle_sees_nans_other_keys_hidden_processes_and_a_compiler_cache_with_files(tmp_path):
    """max |dw| is nan where either state holds a NaN (a max over keys dropped it after the first key)
    and inf where the keys differ; a process is the run's by its TMPDIR, whatever its command line (the
    Lighthouse, ft.sh's helpers name no run folder); torch's compiler cache is left alone only empty, and
    plain torchrun's log folders only in restart mode (ft.sh's launcher deletes its own)."""
    import math

    import torch

    from bench.chaos import Restarts, left_behind, max_dw, run_env, temp_files

    state = {"a": torch.zeros(2), "b": torch.zeros(3), "n": torch.tensor(4)}
    assert max_dw(state, {**state, "b": torch.ones(3)}) == 1.0
    assert math.isnan(max_dw(state, {**state, "b": torch.tensor([0.0, math.nan, 0.0])}))
    assert max_dw(state, {"a": state["a"], "b": state["b"]}) == math.inf
    assert max_dw(state, {**state, "b": torch.zeros(1)}) == math.inf  # broadcast would have said 0

    hidden = subprocess.Popen(["sleep", "60"], env=run_env(tmp_path))
    try:
        assert hidden.pid in left_behind(tmp_path)
    finally:
        hidden.kill()
        hidden.wait()
    scratch = tmp_path / "tmp"
    (scratch / "torchinductor_root").mkdir()
    (scratch / "torchelastic_abc").mkdir()
    assert temp_files(tmp_path, Restarts.torch_keeps) == []
    assert temp_files(tmp_path, ()) == [scratch / "torchelastic_abc"]  # ft mode
    (scratch / "torchinductor_root" / "cache").write_text("x")
    assert temp_files(tmp_path, Restarts.torch_keeps) == [scratch / "torchinductor_root"]


@pytest.mark.quick
def test_kill_while_healing_kills_a_restart_that_joined_without_a_heal_again_until_one_heals():
    """A group killed right after a checkpoint, its peers held at that step (a quorum that waits), comes
    back at their step and joins without a heal: the fault kills that restart again as the first time,
    then its next restart as it heals, and counts the group back from the last kill (seeds 1 and 3 of
    the 3 x 30 run: no heal to interrupt, and a group that trained to the end taken as not back)."""
    from bench.chaos import Fault, ReplicaGroups

    workers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]  # the first process, then two restarts
    said: dict[int, tuple[float, str]] = {}
    told = {1: "[g1] quorum of 2 group(s) at step 1601: this group (group 1) is number 1 [23:11:58]",
            2: "[g1] quorum of 2 group(s) at step 1652: this group (group 1) is not one of them yet: it copies a "
               "live group's state first (healing) [23:12:30]"}

    def lines() -> list[tuple[float, str]]:  # what the restarts say, as each of them comes up
        dead = sum(worker.poll() is not None for worker in workers)
        for restart in range(1, min(dead, 2) + 1):
            said.setdefault(restart, (time.monotonic(), told[restart]))
        return list(said.values())

    groups = object.__new__(ReplicaGroups)
    groups.kills, groups.killed, groups.kill_times = {}, set(), []
    groups.lines = lines
    groups.worker = lambda target, timeout=60: next(w.pid for w in workers if w.poll() is None)
    counted: list[float] = []
    groups.back = lambda fault, since: counted.append(since)
    fault = Fault("kill-while-healing", 1575, 1, 0.0, landed=1.0)
    try:
        groups.kill_while_healing(fault)
        assert [worker.wait(10) for worker in workers] == [-signal.SIGKILL] * 3
        assert fault.notes == [] and counted and counted[0] > time.time() - 30
        assert groups.kills == {1: 3}  # each kill is to explain one of the group's restarts
    finally:
        for worker in workers:
            worker.kill()


@pytest.mark.quick
@pytest.mark.parametrize("flags, error", [
    (["--faults", "0"], "--faults 0: at least 1"),
    (["--epochs", "1", "--faults", "50"], "--faults 50: a run of 50 steps (--epochs 1, --batch-size 24) has room "
                                          "for 37"),
    (["--seeds", "1,x"], "--seeds 1,x: a comma-separated list of integers"),
    (["--mode", "ft", "--groups", "1"], "--groups 1: at least 2"),
    (["--slow-steps", "-1"], "--slow-steps -1.0: at least 0"),
    (["--ft-timeout-s", "nan"], "--ft-timeout-s nan: at least 0.5"),
    (["--batch-size", "0"], "--batch-size 0: at least 1"),
    (["--mode", "restart", "--kinds", "store-down-in-save"], "--kinds store-down-in-save: none is drawn in restart "
                                                               "mode with --stores disk"),
    (["--mode", "both", "--kinds", "kill-worker"], "--kinds kill-worker: none is drawn in restart mode"),
    (["--keep", "{used}"], "--keep {used}: not a new or empty folder (runs in a used one would resume from"),
    (["--keep", "{used}/ft-seed1/output.txt"], "--keep {used}/ft-seed1/output.txt: not a new or empty folder"),
])
def test_a_chaos_flag_that_would_fail_a_run_or_prove_nothing_is_one_line_before_any_run(flags, error, monkeypatch,
                                                                                        capsys, tmp_path):
    """Checked before the fault-free run: these failed minutes later with a traceback (a draw of no kind,
    a sample larger than the run's room), or ran and proved nothing (no fault drawn)."""
    from bench import chaos

    used = tmp_path / "used"  # --keep: a folder an earlier benchmark ran in
    (used / "ft-seed1").mkdir(parents=True)
    (used / "ft-seed1" / "output.txt").write_text("")
    flags, error = [flag.format(used=used) for flag in flags], error.format(used=used)
    monkeypatch.setattr(sys, "argv", ["chaos", *flags])
    monkeypatch.setattr(chaos, "fault_free", lambda *_: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as ended:
        chaos.main()
    assert ended.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"chaos: error: {error}")


# Small: lenet at world 2 (restart) or three groups of one (ft), 2 epochs of 1,200 generated MNIST images
# (100 steps); the fault-free run at full speed, the run under chaos slowed, long enough for its faults
# to land and their targets to train again inside it. A restart stops the run until its ranks are back
# (0.2 s a step); replica groups train on while a group restarts (10-30 s on a loaded host), so their
# run is slower (0.8 s) and its seed draws the kill early (seed 2: steps 20 and 21 of 100: 65 s left,
# twice the 34 s a killed group took to train again beside another test and a benchmark).
SMALL = ["--epochs", "2", "--save-every", "10", "--seeds", "1"]
SLOWED = {"restart": ("0.2", 1), "ft": ("0.8", 2)}  # --slow-steps and seed under chaos, by mode


def under_chaos(tmp_path: Path, mode: str, runs: dict[str | None, list[str]]) -> None:
    """The fault-free run once, then one seeded run per store drawing `runs[store]`, each proved."""
    from bench.chaos import chaos_run, fault_free, parser
    from tests.datagen import write_mnist

    data = write_mnist(tmp_path / "mnist")
    planned = fault_free(mode, tmp_path / "fault-free", data, parser().parse_args([*SMALL, "--slow-steps", "0"]))
    for store, kinds in runs.items():
        slow, seed = SLOWED[mode]
        args = parser().parse_args([*SMALL, "--slow-steps", slow, "--kinds", ",".join(kinds)])
        outcome = chaos_run(mode, store, seed, len(kinds), args, tmp_path, data, planned)
        print(f"\n{mode} ({store or 'replica groups'}):\n" + "\n".join([*outcome.lines, outcome.table]))
        drawn = {f.kind for f in outcome.faults}
        missing = set(kinds) - drawn  # a kind this host cannot inject (no root, no tc): the lines say why
        assert all(any(line.startswith(f"{kind} not drawn: ") for line in outcome.lines) for kind in missing)
        assert drawn and all(f.landed for f in outcome.faults), outcome.table
        assert not any(f.notes for f in outcome.faults), outcome.table  # each happened as drawn (its save failed, ...)
        assert not outcome.not_back, outcome.table
        assert outcome.code == 0 and outcome.dw == 0, outcome.table  # the fault-free run's weights, bit for bit
        assert not outcome.run_notes, outcome.table  # every group finished; no restart but the runner's kills
        assert not outcome.processes and not outcome.files, outcome.table
        assert not outcome.tracebacks, outcome.table + traceback_excerpts(tmp_path)


def traceback_excerpts(folder: Path) -> str:
    """What each run under chaos printed around its tracebacks (its output.txt), for the failure's message."""
    excerpts = []
    for output in sorted(folder.glob("*/output.txt")):
        lines = output.read_text().splitlines()
        for i, line in enumerate(lines):
            if "Traceback (most recent call last)" in line or "frame #0" in line:
                excerpts.append(f"--- {output.parent.name}, line {i + 1}:\n" + "\n".join(lines[max(0, i - 3):i + 25]))
    return "\n" + "\n".join(excerpts)[-8000:]


def test_checkpoint_and_restart_survives_a_full_disk_and_the_store_stopped_in_a_save_and_a_resume(tmp_path):
    """Checkpoints on a small tmpfs, which fills before a save (the job ends with its one line, the disk
    is freed, torchrun's restart resumes), and a rank SIGKILLed while it saves; then in the local S3
    server, stopped during a save and as the restarted ranks resume: exact resume each time, and no
    traceback (the store's outage once left aiohttp's orphaned request task to asyncio's traceback)."""
    under_chaos(tmp_path, "restart", {"disk": ["full-disk", "kill-while-saving"],
                                      "s3": ["store-down-in-save", "store-down-in-resume"]})


def test_replica_groups_survive_a_slowed_link_and_a_killed_worker(tmp_path):
    """Three groups in a network namespace of their own, whose link is slowed (netem's delay and loss,
    or a rate limit where the kernel lacks netem) for 2-8 s, and a worker SIGKILLed: bit for bit."""
    under_chaos(tmp_path, "ft", {None: ["slow-link", "kill-worker"]})


def test_a_chaos_benchmark_stopped_by_ctrl_c_ends_its_runs_in_one_line(tmp_path):
    """`bench chaos` runs each launcher in a session of its own (a terminal's Ctrl-C reaches the
    benchmark alone): stopped while its fault-free run trains (its agent and two ranks are up), it
    ends every process of its runs and says so in one line, with status 130 (a SIGTERM: below)."""
    from bench.chaos import left_behind

    keep = tmp_path / "keep"
    bench = subprocess.Popen([sys.executable, "-m", "bench", "chaos", "--mode", "restart", "--stores", "disk",
                              "--faults", "1", "--epochs", "1", "--seeds", "1", "--keep", str(keep)],
                             cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=as_from_a_terminal)
    deadline = time.monotonic() + ENDS_PROMPTLY_S
    while len(left_behind(keep)) < 4:  # the benchmark (its --keep), the agent and two ranks name the folder
        assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
        time.sleep(0.1)  # polling for the run's processes, with a deadline
    bench.send_signal(signal.SIGINT)
    err = bench.communicate(timeout=ENDS_PROMPTLY_S)[1]
    assert bench.returncode == 130, err
    assert err.splitlines() == [f"bench chaos: stopped (Ctrl-C); every process of its runs was ended; the runs' "
                                f"files are in {keep}"], err
    ended = time.monotonic() + 10
    while (left := left_behind(keep)) and time.monotonic() < ended:
        time.sleep(0.1)  # a SIGKILLed process is gone from /proc within milliseconds; a deadline all the same
    assert not left, f"left running: {left}"


@pytest.mark.quick
def test_a_chaos_benchmark_stopped_by_sigterm_ends_its_runs_as_on_ctrl_c(tmp_path, monkeypatch, capsys):
    """The SIGTERM handler raises Stopped wherever the main thread is; main ends the runs (the launch
    above shows that ending) and exits 143 with its one line."""
    from bench import chaos

    def terminated(*_) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in here, between two bytecodes
        pytest.fail("the SIGTERM did not stop the benchmark")

    ended = []
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(sys, "argv", ["chaos", "--keep", str(tmp_path)])
    monkeypatch.setattr(chaos, "run_all", terminated)
    monkeypatch.setattr(chaos, "end_every_run", ended.append)
    try:
        with pytest.raises(SystemExit) as stopped:
            chaos.main()
    finally:
        for signum, handler in previous.items():  # main sets both
            signal.signal(signum, handler)
    assert stopped.value.code == 143 and ended == [tmp_path]
    assert capsys.readouterr().err.splitlines() == [
        f"bench chaos: stopped (SIGTERM); every process of its runs was ended; the runs' files are in {tmp_path}"]
