"""Bad flags exit 2 with a message naming the flag, before any process group starts."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from common.config import RECIPES, parse_args
from common.dist.context import resolve_backend, resolve_device
from common.errors import ConfigError
from common.train.run import Run
from tests.conftest import run_script


def parse(*argv: str, world_size: int = 1):
    return parse_args(list(argv), strategy="ddp", default_dataset="cifar10", world_size=world_size)


@pytest.mark.parametrize("argv, flag", [
    (["--dataset", "imagenet"], "--dataset"),
    (["--model", "vgg"], "--model"),
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", "-4"], "--batch-size"),
    (["--epochs", "0"], "--epochs"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-0.1"], "--lr"),
    (["--eval-batch-size", "0"], "--eval-batch-size"),
])
def test_bad_flag_exits_2_naming_it(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err.splitlines()[-1]


def test_batch_not_divisible_by_world(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--batch-size", "100", world_size=3)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--batch-size 100" in err and "multiple of 3" in err


def test_defaults_follow_the_dataset_and_scale_lr_with_batch():
    cfg = parse("--dataset", "mnist")
    assert (cfg.model, cfg.epochs, cfg.batch_size, cfg.lr) == ("convnet", 4, 128, RECIPES["mnist"].lr)
    assert parse("--dataset", "mnist", "--batch-size", "256").lr == pytest.approx(2 * RECIPES["mnist"].lr)
    assert parse().model == "resnet18"
    assert parse("--lr", "0.3").lr == 0.3


@pytest.mark.parametrize("argv, device, collective_forward, batch", [
    ((), "cpu", False, 64), ((), "cuda", False, 1000), ((), "cpu", True, 1000),
    (("--eval-batch-size", "300"), "cpu", False, 300)])
def test_the_evaluation_batch_is_cache_sized_on_a_cpu_unless_given(argv, device, collective_forward, batch):
    run = SimpleNamespace(cfg=parse(*argv), ctx=SimpleNamespace(device=torch.device(device)),
                          strategy=SimpleNamespace(collective_forward=collective_forward))
    assert Run.eval_batch_size.fget(run) == batch


def test_config_is_plain_types_only():
    values = parse().as_plain_dict().values()
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in values)


def test_device_and_backend_resolution():
    assert resolve_device("cpu", 0, 2) == torch.device("cpu")
    assert resolve_backend("auto", "cpu", torch.device("cpu")) == "gloo"
    assert resolve_backend("auto", "auto", torch.device("cuda", 0)) == "nccl"
    if not torch.cuda.is_available():
        assert resolve_device("auto", 1, 2) == torch.device("cpu")
        with pytest.raises(ConfigError, match="--device cuda"):
            resolve_device("cuda", 0, 1)
    with pytest.raises(ConfigError, match="--backend nccl"):
        resolve_backend("nccl", "cpu", torch.device("cpu"))


def test_script_rejects_bad_flag_before_process_group():
    start = time.monotonic()
    result = run_script(["train_ddp.py", "--epochs", "0"], nproc=2, timeout=60)
    assert result.returncode != 0
    assert result.stderr.count("error: --epochs must be >= 1") == 1  # one rank prints, not every rank
    assert time.monotonic() - start < 60


def test_nccl_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_script(["train_ddp.py", "--dataset", "synthetic", "--device", "cpu", "--backend", "nccl"], timeout=60)
    assert result.returncode == 2
    assert "error: --backend nccl needs every rank on a CUDA GPU" in result.stderr
    assert "Traceback" not in result.stderr
