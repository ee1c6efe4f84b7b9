"""--model torchvision:NAME and --model MODULE:FUNCTION: built, trained, checkpointed and resumed like
the built-ins, and every bad input ends the job with one line naming --model."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from common.models import build_model
from common.train.flags import parse_args
from tests.conftest import error_lines, latest_checkpoint, latest_state, run_script, stop_after

# A user's module: a small BatchNorm net (buffers in the checkpoint) and the ways to get it wrong.
USER_MODULE = """
import torch
from torch import nn


def tiny(channels, size, classes):
    return nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, classes))


def too_few_classes(channels, size, classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * size * size, classes - 1))


def fixed_size(channels, size, classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * 64 * 64, classes))


def not_a_module(channels, size, classes):
    return {"layers": [channels, size, classes]}


def raises(channels, size, classes):
    raise ValueError(f"no net for {size}-pixel images")
"""


def write_module(folder: Path, name: str, text: str = USER_MODULE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(text))
    return folder


@pytest.fixture
def in_user_folder(tmp_path, monkeypatch):
    """The current directory holds the user's module; sys.path is restored after (module names are unique per test)."""
    monkeypatch.chdir(write_module(tmp_path, f"nets_{tmp_path.name}"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    return f"nets_{tmp_path.name}"


def build_error(model: str, channels: int = 1, size: int = 28) -> str:
    with pytest.raises(UserError) as caught:
        build_model(model, channels, size, 10, seed=0)
    message = str(caught.value)
    assert message.startswith(f"--model {model}") and "\n" not in message
    return message


@pytest.mark.quick
def test_a_user_function_from_the_current_directory(in_user_folder):
    model = build_model(f"{in_user_folder}:tiny", 1, 28, 10, seed=0)
    assert model.training and model[1].num_batches_tracked.item() == 0  # the build-time check left no trace
    assert torch.equal(model[1].running_mean, torch.zeros(8))
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


@pytest.mark.quick
@pytest.mark.parametrize("function, expected", [
    ("too_few_classes", "in training mode it returned shape (2, 9); it must return logits of shape (batch, classes) = "
                        "(2, 10)"),
    ("fixed_size", "fails on a batch of shape (2, 1, 28, 28) (RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ("not_a_module", "the builder returned a dict, not a torch.nn.Module"),
    ("raises", "building it for (channels, size, classes) = (1, 28, 10) raised ValueError: no net for 28-pixel images"),
    ("tiny_net", "has no function 'tiny_net'; close names: tiny"),
])
def test_a_bad_user_function_is_one_line(in_user_folder, function, expected):
    assert expected in build_error(f"{in_user_folder}:{function}")


@pytest.mark.quick
def test_a_missing_or_broken_user_module_is_one_line(in_user_folder, tmp_path):
    assert f"no module 'absent' in the current directory ({tmp_path}) or on PYTHONPATH" in build_error("absent:tiny")
    write_module(tmp_path, "needs_dependency", "import not_installed_anywhere\n")
    assert "importing needs_dependency failed: ModuleNotFoundError: No module named 'not_installed_anywhere'" in \
        build_error("needs_dependency:tiny")
    write_module(tmp_path, "broken", "def tiny(:\n")
    assert "importing broken raised SyntaxError: invalid syntax" in build_error("broken:tiny")


def test_torchvision_names_and_their_errors():
    model = build_model("torchvision:squeezenet1_1", 1, 28, 10, seed=0)  # RGB stem adapted to one channel
    assert model.features[0].in_channels == 1 and model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert "not a torchvision model; close names: resnet18" in build_error("torchvision:resnet19")
    assert "not a classification model" in build_error("torchvision:fasterrcnn_resnet50_fpn")
    too_small = build_error("torchvision:alexnet", channels=3, size=32)
    assert "fails on a batch of shape (2, 3, 32, 32)" in too_small and "it runs on 64x64 images" in too_small


@pytest.mark.quick
def test_the_first_conv_of_a_grey_model_sees_the_rgb_weights_summed():
    """Adapting an RGB model to one channel starts it where the RGB model would be on a grey image."""
    rgb, grey = (build_model("torchvision:resnet18", channels, 32, 10, seed=3).eval() for channels in (3, 1))
    image = torch.rand(2, 1, 32, 32)
    with torch.no_grad():
        # one forward: the summed filter against three channels' sum, a few roundings that no step grows
        assert torch.allclose(grey(image), rgb(image.expand(-1, 3, -1, -1)), atol=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize("model", ["a b", "torchvision:", "my-nets:build", "nets:build:x"])
def test_a_malformed_model_flag_exits_2(model, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_args(["--model", model], strategy="ddp", default_dataset="synthetic", world_size=1)
    assert caught.value.code == 2 and "torchvision:NAME" in capsys.readouterr().err


@pytest.mark.quick
def test_run_folders_hold_no_colon():
    cfg = parse_args(["--model", "torchvision:resnet18"], strategy="ddp", default_dataset="synthetic", world_size=1)
    assert Path(cfg.checkpoint_dir).name.startswith("ddp-synthetic-torchvision-resnet18-")


def test_a_user_model_trains_saves_and_resumes_under_torchrun(tmp_path):
    """From the current directory (torchrun puts the script's folder on sys.path, not it), world 2: the
    run's default folders are valid names, the checkpoint loads with weights_only=True, and the same
    command resumes it mid-epoch."""
    folder = write_module(tmp_path / "work", "nets")
    flags = ["--model", "nets:tiny", "--dataset", "synthetic", "--synthetic-shape", "mnist", "--batch-size", "32",
             "--epochs", "1", "--max-steps", "14"]
    first = run_script(["tests/faults.py", "ddp", "sigterm", "1", *flags], nproc=2, cwd=folder)
    assert f"stopped by SIGTERM after step {stop_after(1)} " in first.stderr, first.stderr[-3000:]
    (checkpoints,) = (folder / "checkpoints").iterdir()
    (runs,) = (folder / "runs").iterdir()
    assert checkpoints.name.startswith("ddp-synthetic-nets-tiny-")
    assert runs.name.startswith("ddp-synthetic-nets-tiny-w2-") and list(runs.glob("events.out.tfevents.*"))
    state = latest_state(checkpoints)  # torch.load(weights_only=True)
    assert state["config"]["model"] == "nets:tiny" and state["step_in_epoch"] == stop_after(1)
    assert state["model"]["1.num_batches_tracked"].item() == stop_after(1)

    cut = latest_checkpoint(checkpoints).relative_to(folder)  # the log names the default folder as given
    second = run_script(["train_ddp.py", *flags], nproc=2, cwd=folder)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {cut}: epoch 1, step {stop_after(1)}" in second.stdout
    assert latest_state(checkpoints)["model"]["1.num_batches_tracked"].item() == 14


def test_a_torchvision_model_trains_by_name(tmp_path):
    result = run_script(["train_ddp.py", "--model", "torchvision:squeezenet1_1", "--dataset", "synthetic",
                         "--synthetic-shape", "mnist", "--batch-size", "16", "--epochs", "1", "--max-steps", "2",
                         "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "tb")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model torchvision:squeezenet1_1" in result.stdout and "epoch 1/1" in result.stdout
    assert latest_state(tmp_path / "ck")["model"]["features.0.weight"].shape == (64, 1, 3, 3)


def test_a_bad_user_model_ends_every_rank_with_one_line(tmp_path):
    folder = write_module(tmp_path, "nets")
    result = run_script(["train_ddp.py", "--model", "nets:too_few_classes", "--dataset", "synthetic",
                         "--log-dir", str(tmp_path / "tb"), "--checkpoint-dir", str(tmp_path / "ck")],
                        nproc=2, cwd=folder, timeout=60)
    assert result.returncode == 1
    (line,) = error_lines(result.stderr)
    assert line.startswith("error: --model nets:too_few_classes: on a batch of shape (2, 3, 32, 32)")
    assert "/common/" not in result.stderr and 'train_ddp.py", line' not in result.stderr  # no rank's traceback
