"""train_ddp.py under real torchrun processes (gloo, CPU) on generated data in the real formats."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    ROOT,
    child_env,
    error_lines,
    free_port,
    latest_checkpoint,
    latest_state,
    read_scalars,
    run_script,
    saved_position,
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


@pytest.mark.parametrize("dataset", ["cifar10", "mnist"])
def test_two_ranks_train_log_checkpoint_and_resume(dataset, cifar_root, mnist_gz_root, tmp_path):
    root = cifar_root if dataset == "cifar10" else mnist_gz_root
    steps = 10 if dataset == "cifar10" else 12  # 1000 or 1200 training images, 100 per step
    flags = ["--dataset", dataset, "--data-dir", str(root), "--no-download", "--model", "lenet", "--batch-size", "100",
             "--epochs", "3", "--log-every", "5"]
    # The SIGTERM comes during step 20: cifar10 stops at epoch 2's evaluation (after step 20), mnist after step 21.
    log_dir, ckpt_dir = tmp_path / "tb-run", tmp_path / "ckpt"
    first = run_script(["tests/faults.py", "ddp", "sigterm", "20", "--log-dir", str(log_dir),
                        "--checkpoint-dir", str(ckpt_dir), *flags], nproc=2)
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

    state = latest_state(ckpt_dir)
    epoch, step = saved_position(stop, steps)
    assert (state["epoch"], state["step_in_epoch"]) == (epoch, step) and state["config"]["dataset"] == dataset
    assert not any(key.startswith("module.") for key in state["model"])
    assert {"optimizer", "scheduler"} <= set(state)

    cut_at = latest_checkpoint(ckpt_dir)
    second, resumed_log, _ = train(tmp_path, *flags, name="resumed")  # the same command, without the fault
    assert f"resumed from {cut_at}: epoch {epoch + 1}, step {step}" in second.stdout
    assert "epoch 1/3" not in second.stdout and "epoch 3/3" in second.stdout
    assert [step for step, _ in read_scalars(resumed_log)[1]["test/acc"]] == list(range((epoch + 1) * steps,
                                                                                          3 * steps + 1, steps))
    acc = read_scalars(resumed_log)[0]
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(acc.PluginTagToContent("hparams"))
    after = latest_state(ckpt_dir)
    assert after["epoch"] == 3
    assert not all(torch.equal(after["model"][k], state["model"][k]) for k in state["model"])


def test_synthetic_learns_well_above_chance(tmp_path):
    result, log_dir, _ = train(tmp_path, "--dataset", "synthetic", "--synthetic-shape", "mnist", "--epochs", "2")
    final_acc = read_scalars(log_dir)[1]["test/acc"][-1][1]
    assert final_acc > 0.5, result.stdout  # chance is 0.1
    assert re.search(r"epoch 2/2 .* test acc \d+\.\d\d% \(2000 images\)", result.stdout)


def test_single_process_without_torchrun(tmp_path):
    result, log_dir, ckpt_dir = train(tmp_path, "--dataset", "synthetic", "--epochs", "1", "--max-steps", "5",
                                      nproc=None)
    assert "world 1" in result.stdout and latest_checkpoint(ckpt_dir).is_file()


def test_missing_data_ends_every_rank_with_one_message(tmp_path):
    result = run_script(["train_ddp.py", "--data-dir", str(tmp_path / "empty"), "--no-download",
                         "--log-dir", str(tmp_path / "tb")], nproc=2, timeout=60)
    assert result.returncode != 0
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
