"""train_ddp.py under real torchrun processes (gloo, CPU) on generated data in the real formats."""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    ROOT,
    SharedLaunch,
    child_env,
    error_lines,
    free_port,
    latest_checkpoint,
    latest_state,
    read_scalars,
    run_script,
    saved_position,
    shared_launch,
    stop_after,
)

TAGS = {"train/loss", "train/acc", "test/loss", "test/acc", "test/samples", "lr", "train/images_per_s", "time/epoch_s"}


def assert_ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def train(tmp_path: Path, *flags: str, nproc: int = 2, name: str = "run"):
    log_dir, ckpt_dir = tmp_path / f"tb-{name}", tmp_path / "ckpt"
    result = run_script(["train_ddp.py", "--log-dir", str(log_dir), "--checkpoint-dir", str(ckpt_dir), *flags],
                        nproc=nproc)
    assert_ok(result)
    return result, log_dir, ckpt_dir


DATASETS = ["cifar10", "mnist"]


def flags(dataset: str, roots: dict[str, Path]) -> list[str]:
    return ["--dataset", dataset, "--data-dir", str(roots[dataset]), "--no-download", "--model", "lenet",
            "--batch-size", "100", "--epochs", "3", "--log-every", "5"]


def folders(folder: Path, name: str) -> list[str]:
    """The run's --log-dir (tb-NAME) and the data set's --checkpoint-dir (ckpt), under `folder`."""
    return ["--log-dir", str(folder / f"tb-{name}"), "--checkpoint-dir", str(folder / "ckpt")]


@dataclass(frozen=True)
class Cut:
    """A data set's run stopped by SIGTERM, what it saved, and the same command again."""
    first: subprocess.CompletedProcess
    state: dict  # the checkpoint the stop saved, read before the resume
    cut_at: Path
    second: subprocess.CompletedProcess
    folder: Path


@dataclass(frozen=True)
class Launched:
    cuts: dict[str, Cut]  # by data set
    first: SharedLaunch  # the stops' launch
    folder: Path  # the synthetic run's folders (tb-run, ckpt) and the missing data's


@pytest.fixture(scope="module")
def launched(cifar_root, mnist_gz_root, tmp_path_factory) -> Launched:
    """Two launches (tests/runs.py): each data set's run stopped by SIGTERM (one after another,
    --then-after-stop), the synthetic run, and last the run that fails (missing data); then the same
    commands without the fault, which resume in processes that did not stop."""
    roots = {"cifar10": cifar_root, "mnist": mnist_gz_root}
    folder = {dataset: tmp_path_factory.mktemp(dataset) for dataset in DATASETS}
    other = tmp_path_factory.mktemp("synthetic")
    cuts = {dataset: ["tests/faults.py", "ddp", "sigterm", "20", *folders(folder[dataset], "run"),
                      *flags(dataset, roots)] for dataset in DATASETS}
    first = shared_launch({**cuts, "synthetic": ["train_ddp.py", *folders(other, "run"), *SYNTHETIC],
                           "missing": ["train_ddp.py", "--data-dir", str(other / "empty"), "--no-download",
                                       "--log-dir", str(other / "tb-missing")]}, 2, stopping=DATASETS)
    saved = {dataset: (first[dataset], latest_state(folder[dataset] / "ckpt"),
                       latest_checkpoint(folder[dataset] / "ckpt")) for dataset in DATASETS}
    second = shared_launch({dataset: ["train_ddp.py", *folders(folder[dataset], "resumed"), *flags(dataset, roots)]
                            for dataset in DATASETS}, 2)
    return Launched({dataset: Cut(*saved[dataset], second[dataset], folder[dataset]) for dataset in DATASETS}, first,
                    other)


@pytest.mark.parametrize("dataset", DATASETS)
def test_two_ranks_train_log_checkpoint_and_resume(dataset, launched):
    """The stop and the resume are runs of `launched`'s two launches."""
    cut = launched.cuts[dataset]
    steps = 10 if dataset == "cifar10" else 12  # 1000 or 1200 training images, 100 per step
    # The SIGTERM comes during step 20: cifar10 stops at epoch 2's evaluation (after step 20), mnist after step 21.
    first, log_dir, ckpt_dir = cut.first, cut.folder / "tb-run", cut.folder / "ckpt"
    stop = stop_after(20, steps)
    assert f"stopped by SIGTERM after step {stop} " in first.stderr, first.stderr[-3000:]
    assert "global batch 100 = 50 per rank x 2" in first.stdout
    assert first.stdout.count("epoch 1/3") == 1  # rank 0 alone prints
    assert "(301 images)" in first.stdout  # 301 test images on 2 ranks: counted once each

    acc, scalars = read_scalars(log_dir)
    assert TAGS <= set(scalars)
    assert scalars["test/samples"][0] == (steps, 301.0)  # x axis: the global step
    assert 0.0 <= scalars["test/acc"][0][1] <= 1.0
    assert "config/text_summary" in acc.Tags()["tensors"]
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1  # one writer: rank 0's

    state = cut.state
    epoch, step = saved_position(stop, steps)
    assert (state["epoch"], state["step_in_epoch"]) == (epoch, step) and state["config"]["dataset"] == dataset
    assert not any(key.startswith("module.") for key in state["model"])
    assert {"optimizer", "scheduler"} <= set(state)

    second, resumed_log = cut.second, cut.folder / "tb-resumed"  # the same command, without the fault
    assert_ok(second)
    assert f"resumed from {cut.cut_at}: epoch {epoch + 1}, step {step}" in second.stdout
    assert "epoch 1/3" not in second.stdout and "epoch 3/3" in second.stdout
    assert [step for step, _ in read_scalars(resumed_log)[1]["test/acc"]] == list(range((epoch + 1) * steps,
                                                                                          3 * steps + 1, steps))
    acc = read_scalars(resumed_log)[0]
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(acc.PluginTagToContent("hparams"))
    after = latest_state(ckpt_dir)
    assert after["epoch"] == 3
    assert not all(torch.equal(after["model"][k], state["model"][k]) for k in state["model"])


SYNTHETIC = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--epochs", "2"]


def test_synthetic_learns_well_above_chance(launched):
    """A run of `launched`'s first launch."""
    result, log_dir = launched.first["synthetic"], launched.folder / "tb-run"
    assert_ok(result)
    final_acc = read_scalars(log_dir)[1]["test/acc"][-1][1]
    assert final_acc > 0.5, result.stdout  # chance is 0.1
    assert re.search(r"epoch 2/2 .* test acc \d+\.\d\d% \(2000 images\)", result.stdout)


def test_single_process_without_torchrun(tmp_path):
    result, log_dir, ckpt_dir = train(tmp_path, "--dataset", "synthetic", "--epochs", "1", "--max-steps", "5",
                                      nproc=None)
    assert "world 1" in result.stdout and latest_checkpoint(ckpt_dir).is_file()


def test_missing_data_ends_every_rank_with_one_message(launched):
    """`launched`'s first launch's last run (a run that fails ends its launch)."""
    launch = launched.first
    result = launch["missing"]
    assert result.returncode != 0 and launch.result.returncode == result.returncode
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "cifar10 is missing" in errors[0] and "cifar-10-python.tar.gz" in errors[0]
    assert "/common/" not in result.stderr and 'train_ddp.py", line' not in result.stderr  # no rank's traceback


def test_the_front_door_offline_shows_one_line_naming_the_way_to_try_now(tmp_path):
    """The README's run command (launch/single_node.sh train_ddp.py) on a machine without the data
    or the internet: one line, that names --dataset synthetic, and not torchrun's failure dump."""
    closed = f"http://127.0.0.1:{free_port()}/"  # nothing listens: as offline
    result = subprocess.run(["bash", "launch/single_node.sh", "train_ddp.py", "--data-dir", str(tmp_path / "data"),
                             "--download-from", closed], cwd=ROOT, env={**child_env(), "NPROC": "2"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cifar10 is missing"), result.stderr[-3000:]
    assert "try the suite right now without it: --dataset synthetic" in lines[0]


def test_a_crash_still_gets_torchruns_full_report_through_the_launcher(tmp_path):
    result = subprocess.run(["bash", "launch/single_node.sh", "tests/faults.py", "ddp", "raise", "2", "--dataset",
                             "synthetic", "--epochs", "1", "--max-steps", "4", "--checkpoint-dir", str(tmp_path / "ck"),
                             "--log-dir", str(tmp_path / "tb")], cwd=ROOT, env={**child_env(), "NPROC": "2"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "RuntimeError: injected failure on rank 1" in result.stderr and "Root Cause" in result.stderr
