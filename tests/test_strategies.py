"""Every strategy trains the same model as one process, end to end under torchrun."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import (
    AVERAGING,
    ENDS_PROMPTLY_S,
    SharedLaunch,
    equivalence,
    equivalences,
    error_lines,
    latest_state,
    own_folders,
    run_script,
    shared_launch,
)

STRATEGIES = {
    **AVERAGING,
    "fsdp-full": ["train_fsdp.py", "--shard", "full"],
    "fsdp-optimizer": ["train_fsdp.py", "--shard", "optimizer"],
    "localsgd-every-step": ["train_localsgd.py", "--sync-every", "1"],
}
SYNTHETIC = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--batch-size", "48", "--check-equivalence", "4"]


def check_equivalence(script: list[str], world: int | None, model: str, tmp_path,
                      *flags: str) -> tuple[int, str, float]:
    result = run_script([*script, *SYNTHETIC, "--model", model, "--log-dir", str(tmp_path / "tb"), "--checkpoint-dir",
                         str(tmp_path / "ckpt"), *flags], nproc=world, timeout=240)
    return result.returncode, result.stderr, equivalence(result.stdout, world).max_dw


# Each row proves what it can at once, and the rows of one world size share one launch. World 1
# runs no collective to get wrong: resume tests cover it. World 2 of the averaging strategies:
# test_recipes' accumulate rows (W=2, float32, <= 1e-5). --sync-bn rows: BatchNorm over the global
# batch (convnet) equals one process's. --transport gloo rows: the collectives through the process
# group, as on several nodes (the averaging strategies' others use shared memory between the CPU
# ranks of one node: asserted, since --transport auto would fall back to gloo where it cannot).
ROWS = [  # (strategy, world, model, flags)
    ("ddp", 4, "lenet", []),
    ("ddp", 4, "convnet", ["--sync-bn", "--transport", "gloo"]),
    ("allreduce", 4, "convnet", ["--sync-bn"]),
    ("allreduce-ring", 4, "lenet", []),
    ("master", 4, "lenet", []),
    ("master", 4, "cifar_net", ["--transport", "gloo"]),
    ("master-update", 4, "convnet", ["--sync-bn"]),
    ("fsdp-full", 2, "cifar_net", []),
    ("fsdp-full", 4, "lenet", []),
    ("fsdp-optimizer", 2, "convnet", ["--sync-bn"]),
    ("fsdp-optimizer", 4, "lenet", []),
    ("localsgd-every-step", 2, "cifar_net", []),
    ("localsgd-every-step", 4, "lenet", []),
]


def row_args(name: str, model: str, flags: list[str]) -> list[str]:
    return [*STRATEGIES[name], *SYNTHETIC, "--model", model, *flags]


@pytest.mark.parametrize("world", sorted({world for _, world, _, _ in ROWS}))
def test_strategy_equals_one_process(world, world_2, tmp_path):
    """Covers, for each row at this world size (one launch for all of them; world 2's are runs of
    `world_2`'s launch): the strategy trains what one process trains (<= 1e-5); with --sync-bn,
    BatchNorm over the global batch too; with --transport gloo, over the process group."""
    rows = [(name, model, flags) for name, w, model, flags in ROWS if w == world]
    if world == 2:
        launch, _ = world_2
        verdicts = [equivalence(ran(launch, f"row-{index}").stdout, world) for index in range(len(rows))]
    else:
        verdicts = equivalences([row_args(*row) for row in rows], world, tmp_path)
    for (name, model, flags), verdict in zip(rows, verdicts):
        print(f"\n{name} {model} {' '.join(flags)} at world {world}: max |dw| = {verdict.max_dw:.3g}")
        assert verdict.max_dw <= 1e-5 and verdict.steps == 4, (name, model, flags, verdict)
        if name in AVERAGING:  # the ring is written on the process group, the others on the transport
            wire = "gloo" if "--transport" in flags or name == "allreduce-ring" else "shm"
            assert f"gradients via {wire}" in verdict.console, (name, flags, verdict.console[:600])


@pytest.mark.quick
def test_every_strategy_has_a_row():
    assert {name for name, *_ in ROWS} == set(STRATEGIES)
    assert {name for name, _, _, flags in ROWS if "--sync-bn" in flags} >= {"ddp", "allreduce", "master-update",
                                                                         "fsdp-optimizer"}


def test_data_parallel_equals_one_process(one_process):
    run = ran(one_process[0], "equivalence")
    assert equivalence(run.stdout, None).max_dw <= 1e-5, run.stderr[-2000:]


def test_equivalence_check_catches_a_strategy_that_does_not_sync(world_2):
    """`world_2`'s last run (a run that fails ends its launch)."""
    launch, _ = world_2
    run = launch["nosync"]
    assert run.returncode != 0 and launch.result.returncode == run.returncode
    assert equivalence(run.stdout, 2).max_dw > 1e-5
    assert "equivalence check failed" in run.stderr


def test_batchnorm_models_differ_from_one_process_by_design(tmp_path):
    """Per-rank batch statistics (24 images each) are not the 48-image statistics of one process."""
    code, _, max_dw = check_equivalence(["train_allreduce.py"], 2, "convnet", tmp_path)
    assert code != 0 and max_dw > 1e-5


def test_replica_check_names_the_drifting_tensor(tmp_path):
    result = run_script(["tests/faults.py", "allreduce", "drift", "3", "--dataset", "synthetic", "--model", "lenet",
                         "--batch-size", "32", "--epochs", "1", "--max-steps", "8", "--check-replicas", "2",
                         "--log-dir", str(tmp_path / "tb"), "--checkpoint-dir", str(tmp_path / "ckpt")],
                        nproc=2, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "replica check at step 4" in errors[0] and "differs across ranks" in errors[0], \
        result.stderr[-2000:]


# Plain training runs at world 2 that the tests below only read: runs of `world_2`'s launch.
CONVNET = ["--dataset", "synthetic", "--model", "convnet", "--batch-size", "32", "--epochs", "1"]
READERS = ["--model", "lenet", "--batch-size", "100", "--epochs", "1", "--log-every", "2", "--no-download"]
TRAINED = {  # name: (script and flags, data set read from files or None)
    # local steps drift apart on purpose; right after each averaging (parameters AND BatchNorm buffers) they agree
    "replicas-master": (["train_master.py", *CONVNET, "--max-steps", "6", "--check-replicas", "1"], None),
    "replicas-localsgd": (["train_localsgd.py", "--sync-every", "2", "--outer-optimizer", "nesterov", *CONVNET,
                           "--max-steps", "6", "--check-replicas", "2"], None),
    **{f"state-{name}": ([*STRATEGIES[name], *CONVNET, "--max-steps", "2", "--log-every", "1"], None)
       for name in ("ddp", "fsdp-optimizer", "fsdp-full")},
    "e2e-ring": (["train_allreduce.py", "--allreduce", "ring", "--dataset", "mnist", *READERS], "mnist"),
    "e2e-master-update": (["train_master.py", "--master-update", "--dataset", "cifar10", *READERS], "cifar10"),
}


def trained_args(name: str, parent: Path, roots: dict[str, Path]) -> list[str]:
    args, data = TRAINED[name]
    return [*args, *(["--data-dir", str(roots[data])] if data else []), "--log-dir", str(parent / f"tb-{name}"),
            "--checkpoint-dir", str(parent / f"ckpt-{name}")]


def ran(launch: SharedLaunch, name: str) -> subprocess.CompletedProcess:
    """A run of the launch that must have ended cleanly."""
    run = launch[name]
    assert run.returncode == 0, f"{name}: exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    return run


@pytest.fixture(scope="module")
def world_2(cifar_root, mnist_root, tmp_path_factory) -> tuple[SharedLaunch, Path]:
    """Every run at world 2 that needs no process of its own, one launch (tests/runs.py), and the
    folder of their TensorBoard and checkpoint folders: the ROWS of world 2 (row-K), the TRAINED
    runs, and last the run that fails (nosync: the equivalence check catching a strategy that never
    synchronizes)."""
    parent = tmp_path_factory.mktemp("world-2")
    rows = [row for row in ROWS if row[1] == 2]
    runs = {f"row-{index}": [*row_args(name, model, flags), *own_folders(parent, f"row-{index}")]
            for index, (name, _, model, flags) in enumerate(rows)}
    runs.update({name: trained_args(name, parent, {"mnist": mnist_root, "cifar10": cifar_root}) for name in TRAINED})
    runs["nosync"] = ["tests/faults.py", "nosync", "none", "0", *SYNTHETIC, "--model", "lenet",
                      *own_folders(parent, "nosync")]
    return shared_launch(runs, 2, timeout=500), parent


@pytest.fixture(scope="module")
def trained(world_2) -> dict[str, tuple[str, Path, Path]]:
    """Each TRAINED run's console, TensorBoard folder and checkpoint folder (`world_2`'s runs)."""
    launch, parent = world_2
    return {name: (ran(launch, name).stdout, parent / f"tb-{name}", parent / f"ckpt-{name}") for name in TRAINED}


@pytest.fixture(scope="module")
def one_process(mnist_root, tmp_path_factory) -> tuple[SharedLaunch, Path]:
    """DataParallel's runs, one process for both (tests/runs.py without torchrun): its equivalence row,
    and its end-to-end run on MNIST files (e2e-dp); and the folder of their own folders."""
    parent = tmp_path_factory.mktemp("one-process")
    runs = {"equivalence": ["train_dp.py", *SYNTHETIC, "--model", "lenet", *own_folders(parent, "equivalence")],
            "e2e-dp": ["train_dp.py", "--dataset", "mnist", "--data-dir", str(mnist_root), *READERS,
                       *own_folders(parent, "e2e-dp")]}
    return shared_launch(runs, None, timeout=300), parent


def test_replica_check_passes_for_a_correct_strategy(trained):
    """Covers: --check-replicas 1 for master/worker, and right after each averaging for local SGD
    (--sync-every 2): the runs end cleanly (a drift would end them with the replica check's error)."""
    for name in ("replicas-master", "replicas-localsgd"):
        assert "epoch 1/1" in trained[name][0], trained[name][0]


def test_sharding_holds_less_training_state_per_rank_than_ddp(trained):
    """SGD with momentum: DDP holds parameters + gradients + momentum (3P) on every rank; ZeRO-1 keeps
    1/W of the momentum (2.5P at W=2); FSDP2 keeps 1/W of all three (1.5P)."""
    state_mb = {}
    for name in ("ddp", "fsdp-optimizer", "fsdp-full"):
        acc = EventAccumulator(str(trained[f"state-{name}"][1]))
        acc.Reload()
        state_mb[name] = acc.Scalars("mem/state_mb")[-1].value
    ddp = state_mb["ddp"]
    assert state_mb["fsdp-optimizer"] / ddp == pytest.approx(2.5 / 3, rel=0.02), state_mb
    assert state_mb["fsdp-full"] / ddp == pytest.approx(1.5 / 3, rel=0.02), state_mb


@pytest.mark.parametrize("name", ["e2e-ring", "e2e-master-update", "e2e-dp"])
def test_script_end_to_end(name, trained, one_process):
    """Covers: the ring all-reduce on MNIST files, master/worker's --master-update on CIFAR-10 batches
    (both from `world_2`'s launch) and DataParallel on MNIST (`one_process`'s): the test set counted
    once, the step split and accuracy in TensorBoard, an unprefixed checkpoint."""
    if name == "e2e-dp":
        launch, parent = one_process
        stdout, log_dir, ckpt = ran(launch, name).stdout, parent / f"tb-{name}", parent / f"ckpt-{name}"
    else:
        stdout, log_dir, ckpt = trained[name]
    assert "(301 images)" in stdout
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
