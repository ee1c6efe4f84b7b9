"""Runs you can trust: run identity, new runs beside old ones, storage faults, nothing pickled
between ranks, errors printed once. Real torchrun processes (gloo, CPU) where ranks matter."""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from concurrent.futures import wait
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

from common.errors import UserError
from common.storage import LocalStorage
from common.train.checkpoint import BackgroundWriter, CheckpointFolder
from common.train.flags import parse_args
from common.train.state import parse_checkpoint
from tests.conftest import (
    ROOT,
    error_lines,
    latest_checkpoint,
    latest_state,
    one_launch,
    run_script,
    split_runs,
    stop_after,
)
from tests.runs import launched_runs
from train_allreduce import AllReduceStrategy
from train_master import MasterWorkerStrategy

FLAGS = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--batch-size", "32"]


def ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def one_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0, result.stdout[-2000:]
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr[-4000:]
    return errors[0]


# ---------------------------------------------------------------- run identity, in process

def config(*flags: str, world_size: int = 1, strategy=None):
    extra = {"add_flags": strategy.add_flags, "identity_options": strategy.identity_options} if strategy else {}
    return parse_args([*FLAGS, "--epochs", "2", *flags], strategy=strategy.name if strategy else "ddp",
                      default_dataset="synthetic", world_size=world_size, **extra)


OWN_IMAGES = ["--dataset", "imagefolder", "--data-dir", "/images", "--image-size", "32"]
IDENTITY_ROWS = {  # every setting that changes the trained weights, and another value for it
    "dataset": ["--dataset", "mnist"], "synthetic_shape": ["--synthetic-shape", "cifar"],
    "model": ["--model", "cifar_net"], "batch_size": ["--batch-size", "64"], "lr": ["--lr", "0.01"],
    "momentum": ["--momentum", "0.8"], "weight_decay": ["--weight-decay", "0"], "schedule": ["--schedule", "cosine"],
    "epochs": ["--epochs", "3"], "seed": ["--seed", "7"], "max_steps": ["--max-steps", "5"], "sync_bn": ["--sync-bn"],
    "optimizer": ["--optimizer", "lamb"], "betas": ["--optimizer", "adamw", "--betas", "0.8,0.99"],
    "eps": ["--optimizer", "adamw", "--eps", "1e-6"],
    "decay_norm_and_bias": ["--decay-norm-and-bias"], "warmup": ["--warmup", "0.1"], "min_lr": ["--min-lr", "1e-4"],
    "milestones": ["--schedule", "step", "--milestones", "1"],
    "gamma": ["--schedule", "step", "--milestones", "1", "--gamma", "0.5"],
    "label_smoothing": ["--label-smoothing", "0.1"], "mixup": ["--mixup", "0.2"], "cutmix": ["--cutmix", "1"],
    "augment": ["--augment", "randaugment"], "random_erase": ["--random-erase", "0.25"], "ema": ["--ema", "0.99"],
    "clip_grad_norm": ["--clip-grad-norm", "1"], "class_weights": ["--class-weights", "balanced"],
    # chosen only (the default follows --weights' pretrained config): on own images at --image-size
    "crop_pct": [*OWN_IMAGES, "--crop-pct", "0.9"], "interpolation": [*OWN_IMAGES, "--interpolation", "bicubic"],
}
NOT_IDENTITY = [  # settings that may change between restarts of one run
    ["--device", "cpu"], ["--backend", "gloo"], ["--log-every", "7"], ["--keep", "5"], ["--save-every-steps", "9"],
    ["--log-dir", "elsewhere"], ["--checkpoint-dir", "elsewhere"], ["--timeout-s", "30"], ["--eval-batch-size", "10"],
    ["--log-all-ranks"], ["--check-replicas", "3"], ["--data-dir", "/data"], ["--no-download"],
    ["--decode", "auto"],
]


def saved(cfg, step: int = 4) -> dict:
    return {"model": {}, "optimizer": {}, "scheduler": {}, "epoch": 0, "step_in_epoch": step, "global_step": step,
            "config": cfg.as_plain_dict(), "world_size": 1, "identity": cfg.identity()}


@pytest.mark.quick
@pytest.mark.parametrize("row", list(IDENTITY_ROWS))
def test_every_identity_row_resumes_unchanged_and_refuses_changed(row, tmp_path):
    base, changed = config(), config(*IDENTITY_ROWS[row])
    assert changed.identity()[row] != base.identity().get(row)
    assert changed.run_id != base.run_id and changed.checkpoint_dir != base.checkpoint_dir  # own default folder
    folder = CheckpointFolder(LocalStorage(str(tmp_path)), keep=3)
    folder.write("first", saved(base))
    same = folder.choose("auto", config().identity())  # the same command again
    assert same.run == "first" and same.state["global_step"] == 4
    with pytest.raises(UserError) as refused:  # the changed command, pointed at the same folder
        folder.choose("auto", changed.identity())
    message = str(refused.value)
    assert f"{row} {base.identity().get(row)!r} -> {changed.identity()[row]!r}" in message
    assert "To continue it, rerun with its settings" in message and "pass --resume none" in message
    assert "\n" not in message


def pasted(message: str) -> list[str]:
    """The flags of the refusal's 'rerun with its settings: ...' command, as a shell reads them."""
    command = message.split("rerun with its settings: ", 1)[1].split(" (with the flags that are not settings", 1)[0]
    return shlex.split(command)


@pytest.mark.quick
@pytest.mark.parametrize("row", list(IDENTITY_ROWS))
def test_the_way_to_continue_is_a_command_of_the_flags_that_differ_from_the_defaults(row, tmp_path):
    """Pasted, the command gives the saved run's identity back; it names no default (no --momentum
    under adamw, which does not read it; no lr that follows from the batch) and no '(no --flag)'."""
    other = config(*IDENTITY_ROWS[row])
    folder = CheckpointFolder(LocalStorage(str(tmp_path)), keep=3)
    folder.write("first", saved(other))
    with pytest.raises(UserError) as refused:
        folder.choose("auto", config().identity())
    flags = pasted(str(refused.value))
    assert parse_args(flags, strategy="ddp", default_dataset="cifar10", world_size=1).identity() == other.identity()
    assert "(no" not in str(refused.value)
    assert "--momentum" not in flags or row == "momentum"  # the default, and unread by adamw and lamb
    assert "--lr" not in flags or row == "lr"
    assert flags[:2] == ["--dataset", other.dataset] and len(flags) <= 2 + 2 * len(IDENTITY_ROWS[row]) + 8


@pytest.mark.quick
def test_the_way_to_continue_names_a_strategys_own_settings_and_quotes_what_needs_it(tmp_path):
    from train_localsgd import LocalSGDStrategy
    other = config("--weights", "my weights.pt", "--sync-every", "3", strategy=LocalSGDStrategy())
    folder = CheckpointFolder(LocalStorage(str(tmp_path)), keep=3)
    folder.write("first", saved(other))
    with pytest.raises(UserError) as refused:
        folder.choose("auto", config().identity())
    assert "--weights 'my weights.pt'" in str(refused.value)
    flags = pasted(str(refused.value))
    again = parse_args(flags, strategy="localsgd", default_dataset="mnist", world_size=1,
                       add_flags=LocalSGDStrategy.add_flags, identity_options=LocalSGDStrategy.identity_options)
    assert again.identity() == other.identity()


@pytest.mark.quick
def test_a_run_of_an_earlier_version_is_refused_with_the_way_out_that_works(tmp_path):
    """A checkpoint whose identity predates settings that exist now cannot be continued by rerunning
    with its settings (the new ones would still differ): the message says so, and how to go on."""
    base = config()
    earlier = {key: value for key, value in base.identity().items() if key not in ("optimizer", "ema", "weights")}
    folder = CheckpointFolder(LocalStorage(str(tmp_path)), keep=3)
    folder.write("first", {**saved(base), "identity": earlier})
    with pytest.raises(UserError) as refused:
        folder.choose("auto", base.identity())
    message = str(refused.value)
    assert "written by an earlier version of the suite, before --ema, --optimizer, --weights existed" in message
    assert "rerun with its settings" not in message and "pass --resume none" in message


@pytest.mark.quick
@pytest.mark.parametrize("flags", NOT_IDENTITY, ids=lambda f: f[0])
def test_restart_settings_are_not_part_of_the_identity(flags):
    assert config(*flags).identity() == config().identity()


@pytest.mark.quick
def test_the_resampling_joins_the_identity_only_when_chosen():
    """A run of the default crop fraction and filter keeps the identity it had before the flags
    existed (they follow --weights' pretrained config then, which the pinned --weights names)."""
    plain = config(*OWN_IMAGES).identity()
    assert not {"crop_pct", "interpolation"} & plain.keys()
    assert config(*OWN_IMAGES, "--interpolation", "bilinear").identity() == {**plain, "interpolation": "bilinear"}


@pytest.mark.quick
def test_world_size_and_the_way_gradients_travel_are_not_part_of_the_identity():
    assert config(world_size=2).identity() == config().identity()
    allreduce = AllReduceStrategy()
    for flags in (["--allreduce", "ring"], ["--bucket-mb", "1"]):
        assert config(*flags, strategy=allreduce).run_id == config(strategy=allreduce).run_id
    master = MasterWorkerStrategy()
    assert config("--master-update", strategy=master).run_id == config(strategy=master).run_id


@pytest.mark.quick
def test_runs_in_one_folder_never_prune_each_other(tmp_path):
    folder = CheckpointFolder(LocalStorage(str(tmp_path)), keep=2)
    cfg = config()
    for step in range(1, 6):  # two runs saving in turn, as parallel jobs sharing a folder would
        folder.write("a", saved(cfg, step))
        folder.write("b", saved(cfg, 100 + step))
    assert sorted(p.name for p in (tmp_path / "a").glob("step-*")) == ["step-00000004.pt", "step-00000005.pt"]
    assert sorted(p.name for p in (tmp_path / "b").glob("step-*")) == ["step-00000104.pt", "step-00000105.pt"]


# ---------------------------------------------------------------- run identity, end to end

def test_smoke_run_then_real_run_trains_the_real_run(tmp_path):
    """Before: the real run printed 'training already complete' and trained nothing. The three
    commands one after another in one launch (tests/runs.py), in the default folders."""
    real_flags = [*FLAGS, "--epochs", "1", "--max-steps", "3", "--lr", "0.01", "--seed", "7"]
    runs = [["train_ddp.py", *FLAGS, "--epochs", "2", "--max-steps", "2"], ["train_ddp.py", *real_flags],
            ["train_ddp.py", *real_flags]]  # a smoke run, the real run, the same command again: that run
    launch = run_script(one_launch(runs), nproc=2, cwd=tmp_path)
    ok(launch)
    smoke, real, again = split_runs(launch.stdout)
    assert "epoch 2/2" in smoke, smoke
    assert "already complete" not in real and "resumed" not in real and "epoch 1/1" in real, real
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert len(folders) == 2 and all(f.startswith("ddp-synthetic-lenet-") for f in folders), folders
    assert "training already complete" in again, again


def test_changed_lr_never_continues_an_unfinished_run(tmp_path):
    """Before: the second command continued the first run with the first run's lr in its optimizer.
    The cut, the changed command and the first command again in one launch (tests/runs.py,
    --then-after-stop): the first command resumes in the processes that stopped; the resume in a
    fresh process of a run found by its identity is test_resume_none_in_a_used_folder's."""
    cut = ["tests/faults.py", "ddp", "sigterm", "10", *FLAGS, "--epochs", "1", "--max-steps", "16"]
    runs = [cut, ["train_ddp.py", *FLAGS, "--epochs", "1", "--max-steps", "16", "--lr", "0.01"],
            ["train_ddp.py", *FLAGS, "--epochs", "1", "--max-steps", "16"]]
    launch = run_script(one_launch(runs, stopping=[0]), nproc=2, cwd=tmp_path)
    ok(launch)
    stopped, changed, same = launched_runs(launch)
    assert stopped.returncode != 0 and f"stopped by SIGTERM after step {stop_after(10)} " in stopped.stderr, \
        stopped.stderr[-3000:]
    assert "resumed" not in changed.stdout and "peak lr 0.01;" in changed.stdout, changed.stdout
    folders = list((tmp_path / "checkpoints").iterdir())
    assert len(folders) == 2
    for folder in folders:  # each run with its own optimizer state
        state = latest_state(folder)
        assert state["optimizer"]["param_groups"][0]["initial_lr"] == state["config"]["lr"]
    assert "resumed from" in same.stdout and f"epoch 1, step {stop_after(10)}" in same.stdout, same.stdout
    # Pointed at one explicit folder, a changed command stops with the differences instead:
    # test_resume.py's test_checkpoint_of_another_model_is_a_clear_error.


def test_resume_none_in_a_used_folder_keeps_both_runs_apart(tmp_path):
    """Before: the new run's own checkpoint was pruned and a later auto resumed the old run. The old
    run and the new one's cut in one launch (tests/runs.py); the later command in processes of its
    own (a fresh process finds the new run by its identity)."""
    ckpt = tmp_path / "ckpt"
    common = [*FLAGS, "--epochs", "1", "--max-steps", "16", "--save-every-steps", "2", "--keep", "3",
              "--checkpoint-dir", str(ckpt)]
    old, new = launched_runs(run_script(one_launch([["train_ddp.py", *common],
                                                    ["tests/faults.py", "ddp", "sigterm", "10", *common, "--resume",
                                                     "none"]]), nproc=2))
    ok(old)
    old_run = Path(old.stdout.split("saved ")[-1].split()[0]).parent  # its last save's line names its folder
    # what the old run left (--keep 3 of its saves every 2 of 16 steps), untouched by the new run beside it
    assert sorted(p.name for p in old_run.iterdir()) == ["latest.json", *(f"step-{s:08d}.pt" for s in (12, 14, 16))]
    assert json.loads((old_run / "latest.json").read_text())["checkpoint"].endswith("step-00000016.pt")
    stop = stop_after(10, save_every=2)
    stopped = [line for line in new.stderr.splitlines() if line.startswith(f"stopped by SIGTERM after step {stop} ")]
    assert new.returncode != 0 and stopped, new.stderr[-3000:]
    named = Path(stopped[0].split("checkpoint ")[1].split(";")[0])
    assert named.is_file() and named.parent != old_run  # its own checkpoint survived, in its own folder
    later = run_script(["train_ddp.py", *common], nproc=2)
    ok(later)
    assert f"resumed from {named}: epoch 1, step {stop}" in later.stdout  # the new run, not the old one


# ---------------------------------------------------------------- storage faults

@contextmanager
def tmpfs(path: Path, size: str, *options: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_full_disk_ends_every_rank_with_one_line_and_the_previous_checkpoint_resumes(tmp_path):
    """Before: RuntimeError: [enforce fail at inline_container.cc] unexpected pos, after a whole epoch."""
    run = ["train_ddp.py", *FLAGS, "--epochs", "1", "--max-steps", "6", "--save-every-steps", "2"]
    with tmpfs(tmp_path / "small", "5m") as disk:  # one lenet checkpoint is ~3.5 MB: the second does not fit
        start = time.monotonic()
        full = run_script([*run, "--checkpoint-dir", str(disk)], nproc=2)
        seconds = time.monotonic() - start
        error = one_error(full)
        assert "saving checkpoint" in error and "step-00000004.pt failed (No space left on device (ENOSPC))" in error
        previous = latest_checkpoint(disk)
        assert previous.name == "step-00000002.pt" and f"the previous checkpoint {previous} is intact" in error
        assert not list(disk.rglob(".*.tmp-*")) and not list(disk.rglob("step-00000004.pt"))  # no partial file
        assert parse_checkpoint(previous.read_bytes())["global_step"] == 2
        print(f"\nfull disk at the second save: every process ended {seconds:.1f} s after start, one error line")
        subprocess.run(["mount", "-o", "remount,size=20m", str(disk)], check=True)
        resumed = run_script([*run, "--checkpoint-dir", str(disk)], nproc=2)
        ok(resumed)
        assert f"resumed from {previous}: epoch 1, step 2" in resumed.stdout


def test_a_disk_too_small_for_one_checkpoint_is_refused_before_training(tmp_path):
    with tmpfs(tmp_path / "tiny", "1m") as disk:
        error = one_error(run_script(["train_ddp.py", *FLAGS, "--epochs", "1", "--checkpoint-dir", str(disk)], nproc=2))
        assert f"--checkpoint-dir {disk} has 1.0 MB free, and one checkpoint of this run takes about" in error


def test_read_only_checkpoint_dir_is_refused_before_training(tmp_path):
    with tmpfs(tmp_path / "ro", "5m", "ro") as disk:
        start = time.monotonic()
        result = run_script(["train_ddp.py", *FLAGS, "--epochs", "1", "--checkpoint-dir", str(disk)], nproc=2)
        seconds = time.monotonic() - start
        error = one_error(result)
        assert f"--checkpoint-dir {disk} is not writable (Read-only file system (EROFS))" in error
        assert "epoch 1/1" not in result.stdout
        print(f"\nread-only --checkpoint-dir: one error before training, {seconds:.1f} s after start")


def test_an_io_error_during_a_save_ends_the_job_and_keeps_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    # fsyncs of files: 1 the write probe, 2 and 3 the first checkpoint and its pointer, 4 the second checkpoint
    result = run_script(["tests/patched.py", "eio-after-4", str(ROOT / "train_ddp.py"), *FLAGS, "--epochs", "1",
                         "--max-steps", "6", "--save-every-steps", "2", "--checkpoint-dir", str(ckpt)], nproc=2)
    error = one_error(result)
    assert "step-00000004.pt failed (Input/output error (EIO))" in error
    assert latest_checkpoint(ckpt).name == "step-00000002.pt" and not list(ckpt.rglob(".*.tmp-*"))


# Each stopped, then resumed in processes of its own (a fresh process finds and loads what the stop
# saved), under all three bans at once: no hard links, no renames (S3 Mountpoint), no object collectives.
BANS = ["tests/patched.py", "no-hard-links,no-rename,no-object-collectives", "tests/runs.py"]
BANNED = {"no-links": (["tests/faults.py", "ddp", "sigterm", "10"], ["train_ddp.py"]),
          "no-pickling": (["tests/faults.py", "ddp", "sigterm", "10"], ["tests/faults.py", "allreduce", "warn", "1"])}


@pytest.fixture(scope="module")
def banned(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, subprocess.CompletedProcess, Path]]:
    """BANNED's runs stopped (both in one launch, --then-after-stop), then resumed (both in another):
    each name's stop, its resume (launched_runs: one run of its launch each) and its --checkpoint-dir."""
    folder = tmp_path_factory.mktemp("banned")
    common = {name: [*FLAGS, "--epochs", "1", "--max-steps", "14", "--checkpoint-dir", str(folder / name)]
              for name in BANNED}
    stops = run_script([*BANS, *one_launch([[*cut, *common[n]] for n, (cut, _) in BANNED.items()], stopping=[0])[1:]],
                       nproc=2)
    resumes = run_script([*BANS, *one_launch([[*resume, *common[n]] for n, (_, resume) in BANNED.items()])[1:]],
                         nproc=2)
    return {name: (cut, resumed, Path(common[name][-1]))
            for name, cut, resumed in zip(BANNED, launched_runs(stops), launched_runs(resumes))}


def test_no_hard_links_and_no_rename_still_save_and_resume(banned):
    """Before: the first save failed on gcsfuse, blobfuse, S3 Mountpoint (last.pt was a hard link)."""
    cut, resumed, ckpt = banned["no-links"]
    assert f"stopped by SIGTERM after step {stop_after(10)} " in cut.stderr, cut.stderr[-3000:]
    ok(resumed)
    assert "resumed from" in resumed.stdout and f"epoch 1, step {stop_after(10)}" in resumed.stdout
    assert latest_state(ckpt)["global_step"] == 14


# ---------------------------------------------------------------- between ranks

def test_nothing_is_pickled_between_ranks(banned):
    """Every object collective raises in these processes; flags, the checkpoint choice, the resumed
    checkpoint and warnings still reach every rank."""
    cut, resumed, _ = banned["no-pickling"]
    assert f"stopped by SIGTERM after step {stop_after(10)} " in cut.stderr, cut.stderr[-3000:]
    ok(resumed)
    assert "resumed from" in resumed.stdout
    assert resumed.stderr.count("injected warning on rank 1") == 1  # relayed to rank 0, printed once


def test_an_error_every_rank_hits_is_printed_once(cifar_root, tmp_path):
    shutil.copytree(cifar_root, tmp_path / "data")
    batch = tmp_path / "data" / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:5000])  # every rank reads it
    result = run_script(["train_ddp.py", "--dataset", "cifar10", "--data-dir", str(tmp_path / "data"),
                         "--no-download", "--checkpoint-dir", str(tmp_path / "ckpt")], nproc=2)
    assert "data_batch_2" in one_error(result)
    assert "/common/" not in result.stderr  # no rank's traceback


@pytest.mark.quick
def test_a_background_write_commits_or_fails_with_one_line(tmp_path):
    """Rank 0's writer thread: a committed save becomes the run's last checkpoint and is reported once;
    a save that cannot even be serialized (here an object torch.save cannot pickle) is one line naming
    the file and the intact previous checkpoint, and is flagged as failed before anyone waits for it."""
    from common.storage import storage_for

    folder, writer, reported = CheckpointFolder(storage_for(str(tmp_path)), keep=2), BackgroundWriter(), []
    writer.start(folder, "run", {"global_step": 2, "identity": {}}, None, lambda path, s: reported.append(path))
    assert writer.outcome() is None and reported == [writer.last] and writer.last.endswith("run/step-00000002.pt")
    writer.start(folder, "run", {"global_step": 4, "identity": {}, "code": lambda: 0}, writer.last, reported.append)
    wait([writer.pending])
    assert writer.failed()
    error = writer.outcome()
    assert error.startswith(f"saving checkpoint {tmp_path}/run/step-00000004.pt failed (") and "\n" not in error
    assert f"the previous checkpoint {tmp_path}/run/step-00000002.pt is intact" in error
    assert len(reported) == 1 and not (tmp_path / "run" / "step-00000004.pt").exists()


# ---------------------------------------------------------------- --extend-to, in process

@pytest.mark.quick
def test_extend_to_is_a_run_of_its_own_in_the_folder_of_the_run_it_extends(tmp_path, capsys):
    """The extension's identity adds extend_to (a run of its own) but its default folder is the
    finished run's; a finished run is continued from its last checkpoint as a new run; an unfinished
    one is refused with the way out; --extend-to must pass --epochs."""
    base, extended = config(), config("--extend-to", "5")
    assert extended.identity() == {**base.identity(), "extend_to": 5} and "extend_to" not in base.identity()
    assert extended.checkpoint_dir == base.checkpoint_dir and extended.last_epoch == 5 and base.last_epoch == 2
    folder = CheckpointFolder(LocalStorage(str(tmp_path)), keep=3)
    folder.write("first", {**saved(base, step=8), "epoch": 2, "step_in_epoch": 0})  # the end of epoch 2 of 2
    choice = folder.choose("auto", extended.identity())
    assert choice.run != "first" and choice.checkpoint.endswith("first/step-00000008.pt") and choice.state["epoch"] == 2
    folder.write(choice.run, {**saved(extended, step=12), "epoch": 3, "step_in_epoch": 0})
    again = folder.choose("auto", extended.identity())  # the extension, cut and run again: it continues itself
    assert again.run == choice.run and again.state["global_step"] == 12
    with pytest.raises(UserError) as refused:  # another extension of the same run: not from the first one's end
        folder.choose("auto", config("--extend-to", "7").identity())
    assert "already extends this run to epoch 5" in str(refused.value) and "pass --extend-to 5" in str(refused.value)
    cut = CheckpointFolder(LocalStorage(str(tmp_path / "cut")), keep=3)
    cut.write("first", {**saved(base, step=4), "epoch": 1, "step_in_epoch": 0})
    with pytest.raises(UserError) as refused:
        cut.choose("auto", extended.identity())
    assert "has not finished (its newest checkpoint is in epoch 2 of 2); finish it with the same command without " \
           "--extend-to" in str(refused.value)
    with pytest.raises(SystemExit):
        config("--extend-to", "2")
    assert "--extend-to 2 must be more than --epochs 2" in capsys.readouterr().err


@pytest.mark.quick
def test_extend_to_follows_the_schedule_then_a_segment_of_its_own():
    from common.train.optim import lr_factor, make_scheduler

    steps = 10
    for schedule in ("onecycle", "cosine", "step"):
        flags = ["--schedule", schedule] + (["--milestones", "1"] if schedule == "step" else [])
        base, extended = config(*flags), config(*flags, "--extend-to", "5")
        segment = config(*flags, "--epochs", "3")  # the added epochs, alone
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        factor = make_scheduler(extended, optimizer, steps).lr_lambdas[0]
        assert [factor(s) for s in range(2 * steps)] == [lr_factor(base, s, 2 * steps, steps) for s in range(2 * steps)]
        after = [factor(2 * steps + s) for s in range(3 * steps)]
        if schedule == "step":  # its milestones are the run's: the lr it ended at
            assert after == [lr_factor(base, 2 * steps, 2 * steps, steps)] * (3 * steps)
        else:  # a warm restart: the schedule again over the added epochs
            assert after == [lr_factor(segment, s, 3 * steps, steps) for s in range(3 * steps)]


@pytest.mark.quick
def test_the_way_to_continue_names_the_settings_only_some_runs_have():
    """--extend-to and --normalization join the identity only when given: pasted back, they come too."""
    from common.train.settings import settings_flags

    other = config("--extend-to", "4", "--weights", "w.pt", "--normalization", "imagenet")
    flags = settings_flags(other.identity())
    assert flags[-4:] == ["--normalization", "imagenet", "--extend-to", "4"]
    assert parse_args(flags, strategy="ddp", default_dataset="cifar10", world_size=1).identity() == other.identity()
