"""Every strategy trains the same model as one process, end to end under torchrun."""
from __future__ import annotations

import re
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import AVERAGING, ENDS_PROMPTLY_S, error_lines, latest_state, run_script

STRATEGIES = {
    **AVERAGING,
    "fsdp-full": ["train_fsdp.py", "--shard", "full"],
    "fsdp-optimizer": ["train_fsdp.py", "--shard", "optimizer"],
    "localsgd-every-step": ["train_localsgd.py", "--sync-every", "1"],
}
EQUIVALENCE = re.compile(r"equivalence: max \|dw\| = (\S+) after 4 steps \(([\w/+-]+), world (\d), tolerance \S+\)")


def check_equivalence(script: list[str], world: int | None, model: str, tmp_path,
                      *flags: str) -> tuple[int, str, float]:
    result = run_script([*script, "--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", model,
                         "--batch-size", "48", "--check-equivalence", "4", "--log-dir", str(tmp_path / "tb"), *flags],
                        nproc=world, timeout=240)
    found = EQUIVALENCE.search(result.stdout)
    assert found, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    assert found.group(3) == str(world or 1)
    return result.returncode, result.stderr, float(found.group(1))


# World 1 runs no collective to get wrong: resume tests cover it. World 2 of the averaging strategies:
# test_recipes' accumulate rows (W=2, float32, <= 1e-5), one launch fewer each.
WORLDS = [(name, world) for name in STRATEGIES for world in (2, 4) if world == 4 or name not in AVERAGING]


@pytest.mark.parametrize("name, world", WORLDS)
def test_strategy_equals_one_process(name, world, tmp_path):
    model = "lenet" if world != 2 else "cifar_net"
    code, stderr, max_dw = check_equivalence(STRATEGIES[name], world, model, tmp_path)
    assert code == 0 and max_dw <= 1e-5, stderr[-2000:]


@pytest.mark.parametrize("name", ["ddp", "master"])
def test_process_group_transport_equals_one_process(name, tmp_path):
    """--transport gloo: the collectives through the process group, as on several nodes."""
    code, stderr, max_dw = check_equivalence(STRATEGIES[name], 2, "cifar_net", tmp_path, "--transport", "gloo")
    assert code == 0 and max_dw <= 1e-5, stderr[-2000:]


def test_data_parallel_equals_one_process(tmp_path):
    code, stderr, max_dw = check_equivalence(["train_dp.py"], None, "lenet", tmp_path)
    assert code == 0 and max_dw <= 1e-5, stderr[-2000:]


def test_equivalence_check_catches_a_strategy_that_does_not_sync(tmp_path):
    code, stderr, max_dw = check_equivalence(["tests/faults.py", "nosync", "none", "0"], 2, "lenet", tmp_path)
    assert code != 0 and max_dw > 1e-5
    assert "equivalence check failed" in stderr


def test_batchnorm_models_differ_from_one_process_by_design(tmp_path):
    """Per-rank batch statistics (24 images each) are not the 48-image statistics of one process."""
    code, _, max_dw = check_equivalence(["train_allreduce.py"], 2, "convnet", tmp_path)
    assert code != 0 and max_dw > 1e-5


@pytest.mark.parametrize("name", ["ddp", "allreduce", "master-update", "fsdp-optimizer"])
def test_sync_batchnorm_matches_one_process(name, tmp_path):
    code, stderr, max_dw = check_equivalence(STRATEGIES[name], 2, "convnet", tmp_path, "--sync-bn")
    assert code == 0 and max_dw <= 1e-5, stderr[-2000:]


def test_replica_check_names_the_drifting_tensor(tmp_path):
    result = run_script(["tests/faults.py", "allreduce", "drift", "3", "--dataset", "synthetic", "--model", "lenet",
                         "--batch-size", "32", "--epochs", "1", "--max-steps", "8", "--check-replicas", "2",
                         "--log-dir", str(tmp_path / "tb"), "--checkpoint-dir", str(tmp_path / "ckpt")], nproc=2, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "replica check at step 4" in errors[0] and "differs across ranks" in errors[0], result.stderr[-2000:]


@pytest.mark.parametrize("script, every", [
    (["train_master.py"], 1),
    # local steps drift apart on purpose; right after each averaging (parameters AND BatchNorm buffers) they agree
    (["train_localsgd.py", "--sync-every", "2", "--outer-optimizer", "nesterov"], 2),
])
def test_replica_check_passes_for_a_correct_strategy(script, every, tmp_path):
    result = run_script([*script, "--dataset", "synthetic", "--model", "convnet", "--batch-size", "32",
                         "--epochs", "1", "--max-steps", "6", "--check-replicas", str(every), "--log-dir",
                         str(tmp_path / "tb"), "--checkpoint-dir", str(tmp_path / "ckpt")], nproc=2, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_sharding_holds_less_training_state_per_rank_than_ddp(tmp_path):
    """SGD with momentum: DDP holds parameters + gradients + momentum (3P) on every rank; ZeRO-1 keeps
    1/W of the momentum (2.5P at W=2); FSDP2 keeps 1/W of all three (1.5P)."""
    state_mb = {}
    for name in ("ddp", "fsdp-optimizer", "fsdp-full"):
        log_dir = tmp_path / name
        result = run_script([*STRATEGIES[name], "--dataset", "synthetic", "--model", "convnet", "--batch-size", "32",
                             "--epochs", "1", "--max-steps", "2", "--log-every", "1", "--log-dir", str(log_dir),
                             "--checkpoint-dir", str(tmp_path / "ckpt" / name)], nproc=2, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        acc = EventAccumulator(str(log_dir))
        acc.Reload()
        state_mb[name] = acc.Scalars("mem/state_mb")[-1].value
    ddp = state_mb["ddp"]
    assert state_mb["fsdp-optimizer"] / ddp == pytest.approx(2.5 / 3, rel=0.02), state_mb
    assert state_mb["fsdp-full"] / ddp == pytest.approx(1.5 / 3, rel=0.02), state_mb


@pytest.mark.parametrize("script, dataset, nproc", [
    (["train_allreduce.py", "--allreduce", "ring"], "mnist", 2),
    (["train_master.py", "--master-update"], "cifar10", 2),
    (["train_dp.py"], "mnist", None),
])
def test_script_end_to_end(script, dataset, nproc, cifar_root, mnist_root, tmp_path):
    root = cifar_root if dataset == "cifar10" else mnist_root
    log_dir, ckpt = tmp_path / "tb", tmp_path / "ckpt"
    result = run_script([*script, "--dataset", dataset, "--data-dir", str(root), "--no-download", "--model", "lenet",
                         "--batch-size", "100", "--epochs", "1", "--log-every", "2", "--log-dir", str(log_dir),
                         "--checkpoint-dir", str(ckpt)], nproc=nproc, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(301 images)" in result.stdout
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    assert {"time/data_ms", "time/compute_ms", "time/sync_ms", "test/acc"} <= set(acc.Tags()["scalars"])
    state = latest_state(ckpt)
    assert not any(key.startswith("module.") for key in state["model"])


def test_data_parallel_under_torchrun_fails_cleanly_and_quickly(tmp_path):
    start = time.monotonic()
    result = run_script(["train_dp.py", "--dataset", "synthetic", "--log-dir", str(tmp_path / "tb")], nproc=2)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "run `python train_dp.py`" in errors[0], result.stderr  # every rank hits it: once
    assert time.monotonic() - start < ENDS_PROMPTLY_S
