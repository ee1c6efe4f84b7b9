"""Crash-safe checkpoints and exact resume, with real torchrun processes (gloo, CPU)."""
from __future__ import annotations

import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common import collector, storage
from common.errors import UserError
from common.parallel.context import DistContext
from common.storage import TRANSIENT, LocalStorage, StorageError
from common.train.checkpoint import CheckpointFolder, Checkpoints, Resumed
from common.train.preemption import FORCE_AFTER_S
from common.train.state import InvalidCheckpoint, model_mismatches, parse_checkpoint
from tests.conftest import (
    ENDS_PROMPTLY_S,
    ROOT,
    TORCHRUN_GRACE_S,
    child_env,
    error_lines,
    latest_checkpoint,
    latest_state,
    one_launch,
    run_script,
    saved_position,
    shared_launch,
    stop_after,
)
from tests.gates import Gate
from tests.runs import AFTER_STOP, SEPARATOR, launched_runs, planned_runs
from tests.runs import main as runs_main
from tests.save_loop import IDENTITY, save_until_stopped
from tests.save_loop import state as loop_state

# 8 steps per epoch, 3 epochs: small enough for CI, long enough to cut mid-epoch.
STEPS = 8
RUN = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--batch-size", "32",
       "--epochs", "3", "--max-steps", "8"]
SCRIPTS = {"ddp": ["train_ddp.py"], "allreduce": ["train_allreduce.py"], "master": ["train_master.py"],
           "master-update": ["train_master.py", "--master-update"], "dp": ["train_dp.py"],
           "fsdp": ["train_fsdp.py", "--shard", "full"], "zero1": ["train_fsdp.py", "--shard", "optimizer"],
           "localsgd": ["train_localsgd.py", "--sync-every", "2", "--outer-optimizer", "nesterov"]}
FAULT_NAME = {"master-update": "master"}


def folders(ckpt: Path) -> list[str]:
    return ["--checkpoint-dir", str(ckpt), "--log-dir", str(ckpt.parent / f"tb-{ckpt.name}")]


# A run resumed at another world size adds its gradients in another order for its last 13 of 24 steps:
# 1.49e-08 from the uninterrupted run (lenet, 2026-11-28), where the same world gives 0. The bound
# leaves 670x that for another CPU's rounding; a resume that trained other samples or another
# schedule moves the weights by the learning rate times a gradient, far beyond it.
ANOTHER_WORLD_BOUND = 1e-5


def train(script: list[str], ckpt: Path, *extra: str, nproc: int | None = 2, torchrun: list[str] = ()):
    flags = [*RUN, *folders(ckpt), *extra]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *torchrun, *script, *flags]
        return subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    return run_script([*script, *flags], nproc=nproc, timeout=300)


def faulty(name: str, fault: str, step: int) -> list[str]:
    return ["tests/faults.py", FAULT_NAME.get(name, name), fault, str(step), *SCRIPTS[name][1:]]


def final_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    state = latest_state(ckpt)
    assert state["epoch"] == 3 and state["step_in_epoch"] == 0, (state["epoch"], state["step_in_epoch"])
    return state["model"]


def max_dw(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def preempted(result, step: int) -> None:
    """torchrun exits 1 when its workers exit non-zero; the workers' own line says what happened."""
    assert result.returncode != 0 and f"stopped by SIGTERM after step {step} " in result.stderr, result.stderr[-3000:]


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"


# test_damaged_checkpoint_warning_in_a_real_resume's stop: the last run of `reference`'s launch (its status ends it)
DAMAGED_CUT = [*faulty("ddp", "sigterm", 10), *RUN, "--save-every-steps", "4", "--log-every", "2"]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, subprocess.CompletedProcess | Path]:
    """Uninterrupted runs, one per strategy, made once at the first test that asks: those at world 2
    one after another in one launch (tests/runs.py), then DAMAGED_CUT in it; DataParallel's (one
    process) on its own. Each run's folder by name; "damaged cut": that run's own output and status."""
    folder = tmp_path_factory.mktemp("reference")
    runs = {n: [*SCRIPTS[n], *RUN, *folders(folder / n)] for n in SCRIPTS if n != "dp"}
    launch = shared_launch({**runs, "damaged cut": [*DAMAGED_CUT, *folders(folder / "damaged")]}, 2, timeout=500)
    for name in runs:
        ok(launch[name])
    ok(train(SCRIPTS["dp"], folder / "dp", nproc=None))
    return {**{n: folder / n for n in SCRIPTS}, "damaged": folder / "damaged", "damaged cut": launch["damaged cut"]}


@pytest.fixture(scope="module")
def reference(references):
    """The uninterrupted run's final weights, by strategy (`references`' runs)."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def weights(name: str) -> dict[str, torch.Tensor]:
        if name not in cache:
            cache[name] = final_weights(references[name])
        return cache[name]
    return weights


# 1 -------------------------------------------------------------------------------------------
def test_killed_worker_is_restarted_and_ends_with_the_uninterrupted_weights(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    result = train(faulty("ddp", "sigkill", 12), ckpt, "--save-every-steps", "3", torchrun=["--max-restarts=1"])
    ok(result)
    assert "resumed from" in result.stdout  # the restart found the checkpoint by itself
    dw = max_dw(final_weights(ckpt), reference("ddp"))
    print(f"\nkilled rank 1 at step 12 (epoch 2), restarted: max |dw| = {dw:.3g}")
    assert dw == 0  # the same world and the same sums in the same order: the same bits by design, on any CPU


# 2 -------------------------------------------------------------------------------------------
def drained(reports: Connection) -> list[int]:
    """What a writer reported before its death (each report one write to the pipe: whole or absent)."""
    received = []
    while True:
        try:
            received.append(reports.recv())
        except EOFError:
            return received


KILLS = 12  # each at a random point of a save: mid-write, before the rename, before the pointer, pruning


def test_sigkill_during_saves_never_costs_the_newest_complete_checkpoint(tmp_path):
    rng = random.Random(0)
    folder = CheckpointFolder(LocalStorage(str(tmp_path)), keep=3)
    last_done = 0
    leftovers_seen = 0
    # Each writer a process of its own, SIGKILLed: forked from a server that imported torch and the
    # writer once (tests/save_loop.py), not a fresh interpreter per kill.
    processes = multiprocessing.get_context("forkserver")
    processes.set_forkserver_preload(["tests.save_loop"])
    for _ in range(KILLS):
        reports, report = processes.Pipe(duplex=False)
        writer = processes.Process(target=save_until_stopped, args=(str(tmp_path), "run", last_done, None, report.send))
        writer.start()
        report.close()  # the writer holds the only end that sends: its death is the reader's end of file
        assert reports.poll(ENDS_PROMPTLY_S), "the save loop did not start"
        completed = [reports.recv()]  # the writer is up and saving
        # a random point of an endless save loop, not of training: the chance is the test
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(ENDS_PROMPTLY_S)
        completed += drained(reports)
        choice = folder.choose("auto", IDENTITY)
        assert choice.state is not None, choice.warnings
        assert choice.state["global_step"] >= max(completed), "a save reported complete was lost"
        assert torch.equal(choice.state["model"]["w"][:3], parse_checkpoint(choice.data)["model"]["w"][:3])
        leftovers_seen += len(list(tmp_path.glob("*/.*.tmp-*")))
        folder.storage.remove_leftovers("run")  # what the next start of this run does
        assert not list(tmp_path.glob("*/.*.tmp-*")), "temp files survived the next start"
        last_done = choice.state["global_step"]
    assert len(list(tmp_path.glob("run/step-*.pt"))) <= 3 + 1  # --keep 3, plus one if a kill beat the pruning
    print(f"\n{KILLS} SIGKILLs during saves: newest complete checkpoint loaded every time; "
          f"{leftovers_seen} temp files left by the kills, all removed at the next start")


# 3 -------------------------------------------------------------------------------------------
def _three_checkpoints(folder: CheckpointFolder) -> None:
    for step in (3, 6, 9):
        folder.write("run", loop_state(step, torch.zeros(4)))


@pytest.mark.quick
@pytest.mark.parametrize("damage, why", [
    (lambda raw: raw[: len(raw) // 2], "is truncated or not a checkpoint"),
    (lambda raw: b"", "is empty"),
    (lambda raw: os.urandom(len(raw)), "is truncated or not a checkpoint"),
])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(damage, why, tmp_path):
    folder = CheckpointFolder(LocalStorage(str(tmp_path)), keep=3)
    _three_checkpoints(folder)
    newest = tmp_path / "run" / "step-00000009.pt"
    newest.write_bytes(damage(newest.read_bytes()))
    choice = folder.choose("auto", IDENTITY)
    assert choice.checkpoint == str(tmp_path / "run" / "step-00000006.pt") and choice.state["global_step"] == 6
    assert any(str(newest) in w and why in w for w in choice.warnings), choice.warnings
    assert all("\n" not in w for w in choice.warnings)


@pytest.mark.quick
def test_a_step_file_newer_than_the_pointer_is_found(tmp_path):
    """Killed between writing the step file and moving the pointer: the complete file still counts."""
    folder = CheckpointFolder(LocalStorage(str(tmp_path)), keep=3)
    _three_checkpoints(folder)
    pointer = (tmp_path / "run" / "latest.json").read_text()
    folder.write("run", loop_state(12, torch.zeros(4)))
    (tmp_path / "run" / "latest.json").write_text(pointer)  # still names step 9
    assert folder.choose("auto", IDENTITY).state["global_step"] == 12


class PointerRefused(LocalStorage):
    """A store that takes the step file, then goes away before the pointer (an outage between the two)."""

    def write(self, name: str, data: bytes) -> None:
        if name.endswith("latest.json"):
            raise StorageError(self.url(name), "the store is unreachable")
        super().write(name, data)


@pytest.mark.quick
def test_a_save_cut_before_its_pointer_names_the_checkpoint_it_resumes_from(tmp_path):
    folder = CheckpointFolder(LocalStorage(str(tmp_path)), keep=3)
    _three_checkpoints(folder)
    with pytest.raises(UserError) as cut:
        CheckpointFolder(PointerRefused(str(tmp_path)), keep=3).write(
            "run", loop_state(12, torch.zeros(4)), previous=str(tmp_path / "run" / "step-00000009.pt"))
    newest = tmp_path / "run" / "step-00000012.pt"
    assert str(cut.value).startswith(f"saving checkpoint {newest} failed at the run's pointer "
                                     "(the store is unreachable)")
    assert "the checkpoint file itself is whole and the same command resumes from it" in str(cut.value)
    assert folder.choose("auto", IDENTITY).checkpoint == str(newest)


class GoneAfterThePointer(LocalStorage):
    """A store that goes away right after a save's pointer: the prune's listing finds it gone."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.listings = 0

    def list(self, prefix: str) -> list[str]:
        self.listings += 1
        raise StorageError(self.url(prefix), "the store is unreachable", TRANSIENT)


@pytest.mark.quick
def test_a_store_gone_during_the_prune_is_left_to_the_next_save(tmp_path, monkeypatch):
    """The flake of test_object_storage's outage test, at its root: the prune listed the folder with
    the start's patience, waited a minute and ended the job with the start's words ("nothing was
    started"). It asks once and leaves the store's absence to the next save, whose error is right."""
    monkeypatch.setattr(storage, "RESUME_RETRY_S", 0.0)  # the start's patience, were it used, fails at once
    _three_checkpoints(CheckpointFolder(LocalStorage(str(tmp_path)), keep=3))
    gone = GoneAfterThePointer(str(tmp_path))
    saved = CheckpointFolder(gone, keep=3).write("run", loop_state(12, torch.zeros(4)))
    assert saved == str(tmp_path / "run" / "step-00000012.pt") and gone.listings == 1
    assert CheckpointFolder(LocalStorage(str(tmp_path)), keep=3).choose("auto", IDENTITY).state["global_step"] == 12


def test_damaged_checkpoint_warning_in_a_real_resume(reference, references):
    """The stop is `references`' last run; the resume, after its newest checkpoint is overwritten, a
    launch of its own (fresh processes find the previous one)."""
    ckpt = references["damaged"]
    preempted(references["damaged cut"], stop_after(10))
    damaged = latest_checkpoint(ckpt)
    assert damaged.name == "step-00000011.pt"
    damaged.write_bytes(os.urandom(1000))  # the step-11 checkpoint is lost
    resumed = train(SCRIPTS["ddp"], ckpt, "--log-every", "2")
    ok(resumed)
    assert f"warning: checkpoint {damaged} is truncated or not a checkpoint" in resumed.stderr
    assert f"resumed from {damaged.parent / 'step-00000008.pt'}" in resumed.stdout
    assert max_dw(final_weights(ckpt), reference("ddp")) == 0  # it redid steps 9-11 exactly: the same bits by design
    # Both runs wrote step 10 to the same TensorBoard run; the resumed one purged the cut run's.
    events = EventAccumulator(str(ckpt.parent / f"tb-{ckpt.name}"))
    events.Reload()
    assert [e.step for e in events.Scalars("time/sync_ms")] == list(range(2, 25, 2))
    assert [e.step for e in events.Scalars("test/acc")] == [8, 16, 24]


# 4 -------------------------------------------------------------------------------------------
def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    """The run, then the same folder with another model: one after another in one launch (tests/runs.py)."""
    flags = [*RUN, *folders(tmp_path / "ckpt"), "--epochs", "1", "--max-steps", "2"]
    start = time.monotonic()
    launch = run_script(one_launch([[*SCRIPTS["ddp"], *flags],
                                    [*SCRIPTS["ddp"], *flags, "--model", "cifar_net", "--batch-size", "64"]]),
                        nproc=2, timeout=300)
    seconds = time.monotonic() - start
    runs = launched_runs(launch)
    assert len(runs) == 2, f"exit {launch.returncode}\n{launch.stderr[-3000:]}"  # the first run ended cleanly
    result = runs[1]
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr[-3000:]
    for part in ("with other settings", "batch_size 32 -> 64", "model 'lenet' -> 'cifar_net'",
                 "To continue it, rerun with its settings: --dataset ", "--model lenet", "pass --resume none"):
        assert part in errors[0]
    print(f"\nmismatched checkpoint: exit {result.returncode}, the launch {seconds:.1f} s (process start and the first "
          "run included)")
    # Found before the first step: a mismatch met in a collective would wait out its timeout (300 s).
    assert seconds < ENDS_PROMPTLY_S


@pytest.mark.quick
def test_a_checkpoint_of_other_data_is_refused_before_it_loads(tmp_path):
    """Your own data changed since the checkpoint (its index's content, tests/test_own_data.py): one
    line naming --data-dir and the ways out, before the weights are loaded (a mid-epoch position
    would continue another sample stream)."""
    model = torch.nn.Linear(2, 2)
    run = SimpleNamespace(plain=model, cfg=SimpleNamespace(data_dir="my_set"), data=SimpleNamespace(content="new"))
    checkpoints = Checkpoints(str(tmp_path), 1, DistContext(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    try:
        with pytest.raises(UserError, match=r"^checkpoint c\.pt was trained on other data than --data-dir my_set "
                                            r"holds now .*restore the files .*--resume none \(--weights c\.pt"):
            checkpoints._restore(run, Resumed("c.pt", {"model": model.state_dict(), "data_content": "old"}))
    finally:
        checkpoints.close()


@pytest.mark.quick
def test_model_mismatches_name_keys_and_shapes():
    saved = {"a.weight": torch.zeros(2, 3), "b.bias": torch.zeros(2)}
    expected = {"a.weight": torch.zeros(4, 3), "c.bias": torch.zeros(2)}
    problems = "; ".join(model_mismatches(saved, expected))
    assert "missing keys ['c.bias']" in problems and "unexpected keys ['b.bias']" in problems
    assert "a.weight (2, 3) vs (4, 3)" in problems


# 5 -------------------------------------------------------------------------------------------
class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload-ran"
    bad = tmp_path / "bad.pt"
    torch.save({**loop_state(1, torch.zeros(1)), "model": Payload(marker)}, bad)
    with pytest.raises(InvalidCheckpoint, match="was refused unread"):
        parse_checkpoint(bad.read_bytes())
    result = train(SCRIPTS["ddp"], tmp_path / "ckpt", "--resume", str(bad), nproc=None)
    assert result.returncode == 1 and "was refused unread" in result.stderr
    assert not marker.exists()


# 6 -------------------------------------------------------------------------------------------
def test_sigterm_to_torchrun_saves_exits_and_resumes_losing_nothing(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    gate, hold = Gate(tmp_path / "gates"), "all@10"  # held after step 10 until the TERM reached both ranks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/patched.py",
           f"gate={hold}", "train_ddp.py", *RUN, "--max-steps", "0", "--epochs", "1", "--checkpoint-dir", str(ckpt),
           "--log-dir", str(tmp_path / "tb")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**child_env(), **gate.env()}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    gate.held(hold, processes=2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    gate.signalled(hold, processes=2)
    gate.release(hold)
    _, stderr = proc.communicate(timeout=2 * ENDS_PROMPTLY_S)
    seconds = time.monotonic() - sent
    stopped = [line for line in stderr.splitlines() if line.startswith("stopped by SIGTERM after step")]
    assert len(stopped) == 1, stderr[-3000:]
    step = int(stopped[0].split("after step ")[1].split()[0])
    state = latest_state(ckpt)
    print(f"\nSIGTERM to torchrun: all processes gone after {seconds:.1f} s; stopped after step {step}, "
          f"checkpoint at step {state['global_step']}: {step - state['global_step']} steps lost")
    assert seconds < TORCHRUN_GRACE_S and state["global_step"] == step  # every rank ended by itself
    assert step == 11  # agreed on as the step after the one the ranks were held at begins


# 7 -------------------------------------------------------------------------------------------
def test_resume_at_another_world_size_continues_the_same_sample_stream(reference, stopped):
    run = stopped("another world")
    preempted(run.cut, stop_after(11, STEPS))  # world 2, before epoch 2's evaluation
    ok(run.resumed)  # world 1, same global batch
    assert "saved at world 2" in run.console and "world 1" in run.console
    dw = max_dw(final_weights(run.final), reference("ddp"))
    print(f"\nsaved at world 2, resumed at world 1: max |dw| = {dw:.3g} vs the uninterrupted world-2 run")
    assert dw <= ANOTHER_WORLD_BOUND, dw


def test_a_sharded_checkpoint_is_the_suites_format_for_every_script(reference, stopped):
    """FSDP2 at world 2 saves a full, unprefixed state dict and optimizer state: DDP at world 1
    resumes from it (resharded: unsharded) and ends with the uninterrupted FSDP run's weights."""
    run = stopped("sharded")
    preempted(run.cut, stop_after(11, STEPS))
    state = run.saved
    assert not any(key.startswith(("module.", "_fsdp")) for key in state["model"]) and state["optimizer"]["state"]
    ok(run.resumed)
    assert f"resumed from {latest_checkpoint(run.ckpt)}" in run.console, run.console
    dw = max_dw(final_weights(run.final), reference("fsdp"))
    print(f"\nfsdp (world 2) checkpoint resumed by ddp (world 1): max |dw| = {dw:.3g}")
    assert dw <= ANOTHER_WORLD_BOUND, dw


# 8 -------------------------------------------------------------------------------------------
def test_one_rank_raising_ends_every_process(tmp_path):
    start = time.monotonic()
    result = train(faulty("ddp", "raise", 3), tmp_path / "ckpt")
    seconds = time.monotonic() - start
    assert result.returncode != 0
    assert result.stderr.count("RuntimeError: injected failure on rank 1") == 1
    print(f"\nrank 1 raised at step 3: every process exited non-zero after {seconds:.1f} s")
    assert seconds < ENDS_PROMPTLY_S  # not the 300 s rank 0 would wait in its collective


# 9 -------------------------------------------------------------------------------------------
# How each strategy's run is stopped, at step 13 (the stop comes at epoch 2's evaluation): every
# rank signals itself, or, on three rows, the ways a cluster or a terminal signals a whole job
# (Slurm's proctrack/cgroup, systemd, a Ctrl-C: torchrun and every worker get the signal, and
# torchrun forwards its own copy, so each worker gets it twice, in either order).
STOPS = {"ddp": ("sigterm-job", "SIGTERM"), "allreduce": ("sigterm-workers-first", "SIGTERM"),
         "master": ("sigint-job", "SIGINT")}


RESUMES = "resumes"  # a Plan's cut_launch: the stop runs in the resumes' launch, right before its own resume


@dataclass(frozen=True)
class Plan:
    """A run stopped by tests/faults.py, then resumed by `resume` (a script and its flags)."""
    stop: list[str]
    resume: list[str]
    extra: tuple[str, ...] = ()  # flags of both
    world: int | None = 2  # the stop's
    resume_world: int | None = 2
    resume_from_stop: bool = False  # --resume the stop's newest checkpoint, into a folder of its own
    # Which launch makes the stop: "" one of its own; "A, B" the stops of plans A then B in one
    # launch (--then-after-stop between them: every stop but the last one signals only its own
    # ranks); RESUMES: the resumes' launch, the resume then running in the processes that stopped.
    cut_launch: str = ""


# Every run this file stops and then resumes, by name, and where each stop runs (cut_launch). A
# stop of torchrun's whole job (ddp, allreduce, master) ends its launch, so it comes last in one;
# dp's is the exit status of a process of its own. master-update, fsdp, zero1 and localsgd stop in
# the resumes' launch and resume in the processes that stopped (tests/runs.py puts back what a run
# leaves in them and reseeds the global generators, as a fresh process has them). Every other resume
# runs in processes that did not stop, so each guarantee keeps a resume in a fresh process: the exact
# resume (ddp, allreduce, master, dp), a stop during evaluation, another world size, an FSDP
# checkpoint loaded by DDP ("sharded"; test_optimizers resumes FSDP and ZeRO-1 in fresh processes too).
IN_THE_RESUMES_LAUNCH = ("master-update", "fsdp", "zero1", "localsgd")
PLANS = {
    **{name: Plan(faulty(name, STOPS.get(name, ("sigterm",))[0], 13), SCRIPTS[name], world=world, resume_world=world,
                  cut_launch=RESUMES if name in IN_THE_RESUMES_LAUNCH else "evaluation, ddp" if name == "ddp" else "")
       for name, world in ((name, None if name == "dp" else 2) for name in SCRIPTS)},
    "another world": Plan(faulty("ddp", "sigterm", 11), SCRIPTS["ddp"], resume_world=None,
                          cut_launch="another world, sharded"),
    "sharded": Plan(faulty("fsdp", "sigterm", 11), SCRIPTS["ddp"], resume_world=None, resume_from_stop=True,
                    cut_launch="another world, sharded"),
    "evaluation": Plan(faulty("ddp", "sigterm-eval", 5), SCRIPTS["ddp"], extra=("--eval-batch-size", "16"),
                       cut_launch="evaluation, ddp"),
}


@dataclass(frozen=True)
class Stopped:
    cut: subprocess.CompletedProcess  # the stop's own output and status (launched_runs: one run of its launch)
    # The checkpoint the stop's line names, read before any resume (which may write it again: a stop
    # at an epoch's end is saved before its evaluation, the resume saves that step once it evaluated);
    # None for a stop in the resumes' launch, whose resume is the first to read it (and says so).
    saved: dict | None
    resumed: subprocess.CompletedProcess  # the launch that resumed it (with the others of its world size)
    console: str  # the resume's own rank-0 stdout
    ckpt: Path  # where the stop saved
    final: Path  # where the resume saved


NOT_STARTED = subprocess.CompletedProcess([], -1, "", "not started: a run before it ended its launch")
STOP_LINE = re.compile(r"^stopped by \w+ after step \d+ .*; checkpoint (\S+); run the same command", re.MULTILINE)


def stop_checkpoint(cut: subprocess.CompletedProcess) -> Path | None:
    """The checkpoint the stop's line names."""
    line = STOP_LINE.search(cut.stderr)
    return Path(line[1]) if line else None


def plan_run(name: str, folder: Path, resume: bool) -> list[str]:
    """PLANS[name]'s stop or resume as a run of tests/runs.py."""
    plan = PLANS[name]
    if not resume:
        return [*plan.stop, *RUN, *folders(folder / name), *plan.extra]
    final = folder / f"{name}-resumed" if plan.resume_from_stop else folder / name
    return [*plan.resume, *RUN, *folders(final), *plan.extra,
            *(["--resume", str(latest_checkpoint(folder / name))] if plan.resume_from_stop else [])]


def cuts(names: list[str], folder: Path) -> dict[str, subprocess.CompletedProcess]:
    """The stops of `names` made in launches of their own: those of one cut_launch in one, in its order."""
    made = {}
    for launch in dict.fromkeys(PLANS[n].cut_launch or n for n in names):
        stops = launch.split(", ")
        assert set(stops) <= set(names), f"the stops of {launch} are resumed at {PLANS[stops[0]].resume_world}"
        runs, world = [plan_run(n, folder, resume=False) for n in stops], PLANS[stops[0]].world
        if len(runs) == 1:
            made[stops[0]] = run_script(runs[0], nproc=world, timeout=300)
        else:
            launched = run_script(one_launch(runs, stopping=range(len(runs) - 1)), nproc=world, timeout=300)
            made.update(zip(stops, launched_runs(launched)))
    return made


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A PLANS run stopped, then resumed: the resumes of one world size one after another in one
    launch (tests/runs.py), the stops as their cut_launch says. Those of a world size are made at
    the first test that asks for one of them (a test's 600 s cover one world's)."""
    folder = tmp_path_factory.mktemp("stopped")
    cache: dict[str, Stopped] = {}

    def outcome(name: str) -> Stopped:
        if name not in cache:
            world = PLANS[name].resume_world
            names = [n for n, p in PLANS.items() if p.resume_world == world]
            made = cuts([n for n in names if PLANS[n].cut_launch != RESUMES], folder)
            named = {n: stop_checkpoint(cut) for n, cut in made.items()}
            saved = {n: torch.load(path, weights_only=True) for n, path in named.items() if path}  # before any resume
            runs = {(n, resume): plan_run(n, folder, resume) for n in names
                    for resume in ((False, True) if PLANS[n].cut_launch == RESUMES else (True,))}
            stops = [index for index, (_, resume) in enumerate(runs) if not resume]
            launch = run_script(one_launch(list(runs.values()), stopping=stops), nproc=world, timeout=400)
            ran = dict(zip(runs, launched_runs(launch)))  # fewer where a run ended the launch
            made.update({n: result for (n, resume), result in ran.items() if not resume})
            for n in names:
                cut = made.get(n, NOT_STARTED)
                console = ran[n, True].stdout if (n, True) in ran else ""
                cache[n] = Stopped(cut, saved.get(n), launch, console, folder / n,
                                   folder / f"{n}-resumed" if PLANS[n].resume_from_stop else folder / n)
        return cache[name]
    return outcome


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_every_strategy_resumes_exactly(name, reference, stopped):
    """Covers, per strategy: a stop saves at the step the ranks agreed on and the resume ends with the
    uninterrupted run's weights (bit for bit), resuming at the saved epoch and step; one process (dp)
    ends with 128 + SIGTERM. ddp and allreduce: SIGTERM to torchrun and every worker, in both
    orders, is one request. master: a Ctrl-C reaching torchrun and every worker is one request, and
    local rank 0 alone says how to force the exit. master-update, fsdp, zero1 and localsgd resume in
    the processes that stopped, the others in fresh ones (PLANS)."""
    run, nproc = stopped(name), None if name == "dp" else 2
    fault, signame = STOPS.get(name, ("sigterm", "SIGTERM"))
    stop = stop_after(13, STEPS)
    if name == "localsgd":  # a stop waits for the next averaging (every 2 steps here): nothing is saved unaveraged
        stop += stop % 2
    cut = run.cut
    assert cut.returncode != 0 and f"stopped by {signame} after step {stop} " in cut.stderr, cut.stderr[-3000:]
    if PLANS[name].cut_launch != RESUMES:  # else the resume below reads it first
        assert run.saved is not None and run.saved["global_step"] == stop
    if nproc is None:  # no torchrun in between: the process's own status, 128 + SIGTERM
        assert cut.returncode == 128 + signal.SIGTERM
    if signame == "SIGINT":
        assert cut.stderr.count(f"Ctrl-C again, {FORCE_AFTER_S:g} s or more from now") == 1  # local rank 0 says how
        assert "second Ctrl-C" not in cut.stderr
    ok(run.resumed)
    epoch, step = saved_position(stop, STEPS)
    # the checkpoint the stop named, as the resume read it: at the stop's step
    assert f"resumed from {stop_checkpoint(cut)}: epoch {epoch + 1}, step {step} (saved at world {nproc or 1})" \
        in run.console, run.console
    dw = max_dw(final_weights(run.final), reference(name))
    print(f"\n{name} ({fault} at step 13): stopped after step {stop}, resumed: max |dw| = {dw:.3g}")
    assert dw == 0  # the same world and the same sums in the same order: the same bits by design, on any CPU


@pytest.mark.parametrize("nproc", [2, None])
def test_a_second_ctrl_c_after_the_delay_ends_every_process_at_once_unsaved(nproc, tmp_path):
    ckpt = tmp_path / "ckpt"
    result = train(faulty("ddp", "sigint-twice", 12), ckpt, nproc=nproc)
    ended = time.time()
    assert result.stderr.count("stopped by a second Ctrl-C, at once and without saving") == 1, result.stderr[-3000:]
    assert "stopped by SIGINT after" not in result.stderr
    assert latest_state(ckpt)["global_step"] == STEPS  # epoch 1's checkpoint: none at the stop
    if nproc is None:  # no torchrun in between: the process's own status
        assert result.returncode == 128 + signal.SIGINT
    assert result.returncode != 0
    seconds = ended - float(result.stderr.split("second SIGINT sent at ")[1].split()[0])
    print(f"\nsecond Ctrl-C at world {nproc or 1}: every process gone {seconds:.2f} s later")
    assert seconds < TORCHRUN_GRACE_S  # every rank ended by itself, none waited for torchrun's SIGKILL


def test_a_stop_during_evaluation_is_saved_before_it_and_the_resume_evaluates_first(reference, stopped):
    run = stopped("evaluation")  # --eval-batch-size 16: 63 batches per rank; the signal at the 5th of epoch 1's
    preempted(run.cut, STEPS)
    assert "during the epoch's evaluation (11 of 63 batches scored" in run.cut.stderr, run.cut.stderr[-3000:]
    assert "epoch 1/3" not in run.cut.stdout
    assert (run.saved["epoch"], run.saved["step_in_epoch"]) == (0, STEPS)
    ok(run.resumed)
    assert f"resumed from {latest_checkpoint(run.ckpt).parent / 'step-00000008.pt'}: epoch 1, step 8" in run.console
    assert "epoch 1/3  (trained before the resume)  test loss" in run.console
    # the same world and the same sums in the same order: the same bits by design, on any CPU
    assert max_dw(final_weights(run.ckpt), reference("ddp")) == 0
    events = EventAccumulator(str(run.ckpt.parent / f"tb-{run.ckpt.name}"))
    events.Reload()
    assert [e.step for e in events.Scalars("test/acc")] == [8, 16, 24]  # every epoch evaluated once
    assert [e.step for e in events.Scalars("time/epoch_s")] == [16, 24]  # epoch 1 was not trained by the resume


def test_a_signal_while_a_save_is_waited_for_stops_at_that_checkpoint(tmp_path):
    """The store is slow: step 6's save waits for step 5's; the signals land meanwhile. The stop
    comes with step 6's checkpoint, not 5 steps and a second save later."""
    ckpt = tmp_path / "ckpt"
    cut = train(faulty("ddp", "sigterm-saving", 5), ckpt, "--save-every-steps", "1")
    preempted(cut, 6)
    assert latest_state(ckpt)["global_step"] == 6


# 10 ------------------------------------------------------------------------------------------
STOPPING_SCRIPTS = {
    "stops": "raise Preempted('stopped by SIGTERM after step 3 (epoch 1, step 3); checkpoint c.pt', 15, True)",
    "fails": "raise UserError('the data is missing')",
    "exits_143": "sys.exit(143)",  # the stop's status, but no stop: a failure like any other
    "trains": "print('trained', flush=True)",
}


@pytest.fixture
def scripts(tmp_path, monkeypatch):
    """Scripts whose main() ends as app.main ends a run (a caught error's status), on sys.path for runs.py."""
    for name, body in STOPPING_SCRIPTS.items():
        (tmp_path / f"{name}.py").write_text(
            "import sys\nfrom common.errors import UserError\nfrom common.train.preemption import Preempted\n\n"
            f"def main(argv):\n    try:\n        {body}\n    except UserError as error:\n"
            "        sys.exit(error.exit_code)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(collector._Exit, "clean", False)  # runs.main marks the process's run clean


@pytest.mark.quick
@pytest.mark.parametrize("after, goes_on", [
    ("stops", True), ("fails", False), ("exits_143", False)])
def test_a_run_goes_on_after_a_stop_only_when_asked_and_only_after_a_stop(after, goes_on, scripts, capsys,
                                                                          monkeypatch):
    """`--then-after-stop`: the next run starts after a stop every rank agreed on and saved, never
    after another failure (an error, the stop's status without a stop); `--then` ends the launch
    at a stop too."""
    for separator, asked in ((AFTER_STOP, True), (SEPARATOR, False)):
        monkeypatch.setattr(sys, "argv", ["tests/runs.py", f"{after}.py", separator, "trains.py"])
        status = None
        try:
            runs_main()
        except SystemExit as ended:
            status = ended.code
        output = capsys.readouterr()
        went_on = asked and goes_on
        assert ("trained" in output.out) == went_on and (status is None) == went_on, (separator, status, output)
        reported = launched_runs(subprocess.CompletedProcess([], status or 0, output.out, output.err))
        assert [run.returncode for run in reported] == ([143, 0] if went_on else [status]), reported


@pytest.mark.quick
def test_the_stop_marker_needs_a_run_after_it():
    with pytest.raises(SystemExit, match="--then-after-stop needs a run after it"):
        planned_runs(["stops.py", AFTER_STOP])
    plan = planned_runs(one_launch([["a.py", "-x"], ["b.py"], ["c.py"]], stopping=[0])[1:])
    assert plan == [(["a.py", "-x"], True), (["b.py"], False), (["c.py"], False)]
