"""Bad flags exit 2 with a message naming the flag, before any process group starts."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from common.config import RECIPES
from common.errors import ConfigError
from common.parallel.context import DistContext, resolve_backend, resolve_device
from common.train.flags import parse_args
from common.train.run import Run
from tests.conftest import ENDS_PROMPTLY_S, run_script


def parse(*argv: str, world_size: int = 1):
    return parse_args(list(argv), strategy="ddp", default_dataset="cifar10", world_size=world_size)


@pytest.mark.quick
@pytest.mark.parametrize("argv, flag", [
    (["--dataset", "imagenet"], "--dataset"),
    (["--model", "vgg"], "--model"),
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", "-4"], "--batch-size"),
    (["--epochs", "0"], "--epochs"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-0.1"], "--lr"),
    (["--eval-batch-size", "0"], "--eval-batch-size"),
    (["--timeout-s", "nan"], "--timeout-s"),  # every wait has a deadline: nan or inf was a traceback
    (["--storage-timeout-s", "inf"], "--storage-timeout-s"),
])
def test_bad_flag_exits_2_naming_it(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err.splitlines()[-1]


@pytest.mark.quick
def test_a_rank_that_does_not_print_a_flag_error_exits_after_the_one_that_does(monkeypatch, capsys):
    """torchrun stops every rank within 0.1 s of the first exit: rank 1, silent, waits before its exit so
    that rank 0, later to the same refusal on a loaded host, is not stopped before its line is out (a
    launch that ended 1 with no line at all, issue 37). Rank 0's exit ends the wait, through torchrun."""
    waits: list[float] = []
    monkeypatch.setattr("common.errors.time.sleep", waits.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun sets both
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a-launch")
    with pytest.raises(SystemExit) as exc:
        parse("--epochs", "0")
    assert exc.value.code == 2 and capsys.readouterr().err == "" and waits == [ConfigError.quiet_exit_delay_s]


@pytest.mark.quick
def test_a_flag_error_is_printed_once_per_node_without_a_wait(monkeypatch, capsys):
    """On a second node (local rank 0, global rank 2) the refusal is printed there, at once: a
    refusal that depends on the node (a --class-weights file missing on it) was printed nowhere,
    its ranks waiting 10 s for a rank 0 that did not refuse."""
    waits: list[float] = []
    monkeypatch.setattr("common.errors.time.sleep", waits.append)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a-launch")
    with pytest.raises(SystemExit) as exc:
        parse("--epochs", "0")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--epochs must be >= 1" in err and err.count("\n") == 1 and waits == []


@pytest.mark.quick
def test_batch_not_divisible_by_world(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--batch-size", "100", world_size=3)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--batch-size 100" in err and "multiple of 3" in err


@pytest.mark.quick
def test_defaults_follow_the_dataset_and_scale_lr_with_batch():
    cfg = parse("--dataset", "mnist")
    assert (cfg.model, cfg.epochs, cfg.batch_size, cfg.lr) == ("convnet", 4, 128, RECIPES["mnist"].lr)
    assert parse("--dataset", "mnist", "--batch-size", "256").lr == pytest.approx(2 * RECIPES["mnist"].lr)
    assert parse().model == "resnet18"
    assert parse("--lr", "0.3").lr == 0.3


@pytest.mark.quick
@pytest.mark.parametrize("argv, devices, collective_forward, batch", [
    ((), ("cpu", "cpu"), False, 64), ((), ("cuda", "cuda"), False, 1000), ((), ("cpu",), True, 1000),
    ((), ("cuda", "cpu"), False, 64), ((), ("cpu", "cuda"), False, 64),  # one size for the job: every rank's
    (("--eval-batch-size", "300"), ("cpu",), False, 300)])
def test_the_evaluation_batch_is_cache_sized_where_a_rank_is_on_a_cpu_unless_given(argv, devices, collective_forward,
                                                                                    batch):
    """A CUDA rank beside a CPU rank (--device cpu,cuda) takes the CPU's size: evaluation runs as many
    batches on every rank and checks the stop at the same ones (on an H200, two sizes aborted gloo)."""
    run = SimpleNamespace(cfg=parse(*argv), ctx=SimpleNamespace(devices=devices),
                          strategy=SimpleNamespace(collective_forward=collective_forward))
    assert Run.eval_batch_size.fget(run) == batch


@pytest.mark.quick
def test_the_evaluation_batch_default_is_refused_without_the_ranks_devices():
    """A DistContext made elsewhere than distributed() has no devices: read as no CPU, it took the
    GPU's 1000 on a CPU, silently."""
    ctx = DistContext(0, 1, 0, 1, torch.device("cpu"), "gloo")
    run = SimpleNamespace(cfg=parse(), ctx=ctx, strategy=SimpleNamespace(collective_forward=False))
    with pytest.raises(ValueError, match="no rank's device type is known"):
        Run.eval_batch_size.fget(run)


@pytest.mark.quick
def test_config_is_plain_types_only():
    values = parse().as_plain_dict().values()
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in values)


@pytest.mark.quick
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
    result = run_script(["train_ddp.py", "--epochs", "0"], nproc=2)
    assert result.returncode != 0
    assert result.stderr.count("error: --epochs must be >= 1") == 1  # one rank prints, not every rank
    assert time.monotonic() - start < ENDS_PROMPTLY_S


@pytest.mark.slow
@pytest.mark.quick
def test_nccl_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_script(["train_ddp.py", "--dataset", "synthetic", "--device", "cpu", "--backend", "nccl"], timeout=60)
    assert result.returncode == 2
    assert "error: --backend nccl needs every rank on a CUDA GPU" in result.stderr
    assert "Traceback" not in result.stderr


# --storage-options from a file or a variable: errors name the file or variable, never what it holds.
SECRET = "s3cr3t-value-never-shown"
GOOD = json.dumps({"endpoint_url": "http://127.0.0.1:9000", "key": "AKIAEXAMPLE", "secret": SECRET})


@pytest.mark.quick
@pytest.mark.parametrize("form", ["file", "env"])
def test_storage_options_from_a_file_or_a_variable(form, tmp_path, monkeypatch):
    path = tmp_path / "store.json"
    path.write_text(GOOD)
    monkeypatch.setenv("DP_STORE", GOOD)
    cfg = parse("--storage-options", f"@{path}" if form == "file" else "env:DP_STORE")
    assert cfg.storage_options == json.loads(GOOD)
    assert SECRET not in repr(cfg) and "storage_options" not in cfg.as_plain_dict()


@pytest.mark.quick
@pytest.mark.parametrize("value, content, expected", [
    ("@{tmp}/missing.json", None, "--storage-options @{tmp}/missing.json: cannot read the file (No such file"),
    ("@{tmp}/store.json", '{"secret": "' + SECRET + '",}', "--storage-options @{tmp}/store.json: the file is not "
                                                            "valid JSON (Expecting property name"),
    ("@{tmp}/store.json", json.dumps([SECRET]), "--storage-options @{tmp}/store.json: the file must be a JSON object"),
    ("env:DP_STORE_UNSET", None, "--storage-options env:DP_STORE_UNSET: the environment variable DP_STORE_UNSET is "
                                 "not set"),
    ("env:DP_STORE", '{"token": ' + SECRET + '}', "--storage-options env:DP_STORE: the variable is not valid JSON"),
    ('{"secret": ' + SECRET + '}', None, "--storage-options is not valid JSON (Expecting value at line 1 column 12)"),
], ids=["missing file", "bad JSON in the file", "not an object", "unset variable", "bad JSON in the variable",
        "bad inline JSON"])
def test_a_bad_storage_options_source_is_one_line_naming_it(value, content, expected, tmp_path, monkeypatch, capsys):
    if content is not None:
        (tmp_path / "store.json").write_text(content)
        monkeypatch.setenv("DP_STORE", content)
    with pytest.raises(SystemExit) as exc:
        parse("--storage-options", value.replace("{tmp}", str(tmp_path)))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert expected.replace("{tmp}", str(tmp_path)) in err and SECRET not in err
