"""Recipes for every strategy: mixed precision, gradient accumulation, gradient compression,
torch.compile, the profiler. Real torchrun processes (gloo, CPU), checked against one process."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.train.equivalence import TOLERANCE, tolerance
from tests.conftest import (
    AVERAGING,
    SharedLaunch,
    equivalences,
    error_lines,
    latest_state,
    own_folders,
    refusal_in_process,
    shared_launch,
    stop_after,
)

STRATEGIES = {**AVERAGING, "dp": ["train_dp.py"]}
WEIGHTS = ["--class-weights", "1,2,3,4,5,6,7,8,9,10"]  # skewed: each rank's share has another total weight
RECIPES = {  # the recipe's flags for the multi-process strategies, and for DataParallel (no wire)
    "accumulate": (["--accumulate", "2", *WEIGHTS], ["--accumulate", "2", *WEIGHTS]),
    "bf16": (["--precision", "bf16", "--grad-compression", "bf16", "--accumulate", "2"], ["--precision", "bf16"]),
    "fp16": (["--precision", "fp16", "--grad-compression", "fp16"], ["--precision", "fp16"]),
}
SYNTHETIC = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--batch-size", "48", "--check-equivalence", "4"]
LENET = [*SYNTHETIC, "--model", "lenet"]


def world(name: str) -> int | None:
    return None if name == "dp" else 2


BATCHNORM_SCRIPTS = {"train_ddp.py": ["train_ddp.py"], "train_fsdp.py": ["train_fsdp.py", "--shard", "full"]}
COMPILED = ["ddp", "allreduce", "master-update", "dp"]
# Every --check-equivalence row of this file: (what, strategy or script[, recipe]) -> the run.
ROWS = {
    **{("recipe", name, recipe): [*STRATEGIES[name], *LENET, *both[name == "dp"]]
       for name in STRATEGIES for recipe, both in RECIPES.items()},
    **{("batchnorm", script): [*command, *SYNTHETIC, "--model", "convnet", "--sync-bn", "--precision", "bf16"]
       for script, command in BATCHNORM_SCRIPTS.items()},
    **{("compiled", name): [*STRATEGIES[name], *LENET, "--compile"] for name in COMPILED},
}


def row_world(key: tuple[str, ...]) -> int | None:
    return None if key[0] != "batchnorm" and key[1] == "dp" else 2


@pytest.fixture(scope="module")
def verdict(tmp_path_factory):
    """A row's verdict. The rows of one world size run one after another in one launch (tests/runs.py),
    made at the first test that asks: 20 at world 2, 4 in one process."""
    made: dict[tuple[str, ...], object] = {}

    def of(key: tuple[str, ...]):
        if key not in made:
            world = row_world(key)
            keys = [k for k in ROWS if row_world(k) == world]
            try:
                made.update(zip(keys, equivalences([ROWS[k] for k in keys], world,
                                                   tmp_path_factory.mktemp(f"world-{world or 1}"))))
            except AssertionError as failed:  # the launch failed: every row of it fails, none launches again
                made.update((k, failed) for k in keys)
        if isinstance(made[key], AssertionError):
            raise made[key]
        return made[key]
    return of


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_recipes_train_what_one_process_trains(name, verdict):
    """Covers, for the strategy, each recipe against one process:
    accumulate in float32, with class weights: W=2 x 2 micro-batches equals one process with one
    batch (<= 1e-5), the weighted mean over the global batch's total weight, not per rank.
    bf16 and fp16 (autocast, scaled loss, compressed gradients): within the stated tolerance."""
    for recipe in RECIPES:
        found = verdict(("recipe", name, recipe))
        print(f"\n{name} {recipe}: max |dw| = {found.max_dw:.3g} (tolerance {found.tolerance:g})")
        assert found.max_dw <= found.tolerance
        if recipe == "accumulate":
            assert found.tolerance == TOLERANCE


@pytest.mark.parametrize("script", list(BATCHNORM_SCRIPTS))
def test_bf16_batchnorm_nets_train_what_one_process_trains(script, verdict):
    """Covers, for DDP and FSDP2: bf16 with --sync-bn, the global statistics computed in float32 from
    bf16 activations. FSDP2 also wraps each BatchNorm on its own with a float32 policy, then the
    blocks around it."""
    found = verdict(("batchnorm", script))
    print(f"\n{script}, bf16, convnet with --sync-bn: max |dw| = {found.max_dw:.3g} (tolerance {found.tolerance:g})")
    assert found.max_dw <= found.tolerance


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_model_trains_what_the_eager_one_trains(name, verdict):
    found = verdict(("compiled", name))
    print(f"\n{name} --compile against eager: max |dw| = {found.max_dw:.3g} (tolerance {found.tolerance:g})")
    assert found.max_dw <= found.tolerance


@pytest.mark.quick
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_class_weights_give_torchs_weighted_loss_of_the_global_batch_at_any_split(smoothing):
    """--class-weights: the gradient of 2 ranks x 2 micro-batches (each rank's rows g = r, r + 2, ...,
    averaged as the strategies average) is that of torch's CrossEntropyLoss(weight=...) on the whole
    batch, whose mean divides by the batch's total weight; so is the logged loss."""
    import torch

    from common.data.loader import DataSpec, Split, TrainLoader
    from common.train.step import StepRecipe, backward, class_weights
    from common.train.strategy import Strategy

    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(16, 6, generator=g), torch.tensor([0, 0, 0, 1, 2, 2, 0, 0, 1, 0, 0, 2, 0, 0, 0, 1])
    weights = class_weights("balanced", labels, 3)
    assert torch.allclose(weights, 16 / (3 * torch.tensor([10.0, 3, 3], dtype=torch.float64)))  # sklearn's
    split, spec = Split(torch.zeros(16, 1, 1, 1, dtype=torch.uint8), labels), DataSpec(1, 1, 3, (0.0,), (1.0,), "none")
    loader = TrainLoader(split, spec, 16, 0, 1, 0, torch.device("cpu"))
    order = loader.order(0)
    images, labels = images[order], labels[order]  # the epoch's global batch, in the loader's order
    scale = loader.label_scale(weights, 0, 0)
    assert scale == pytest.approx(16 / float(weights[labels].sum()))
    model = torch.nn.Linear(6, 3)
    recipe = StepRecipe(accumulate=2, label_smoothing=smoothing, class_weights=weights)
    expected = torch.nn.CrossEntropyLoss(weight=weights.float(), label_smoothing=smoothing)(model(images), labels)
    reference = torch.autograd.grad(expected, list(model.parameters()))
    shares = [[], []]
    loss_sum = 0.0
    for rank in range(2):
        model.zero_grad()
        stats = backward(model, Strategy(), _Precision(), images[rank::2], labels[rank::2], recipe, 2, scale)
        shares[rank] = [p.grad.clone() for p in model.parameters()]
        loss_sum += float(stats[0])
    for mine, theirs, full in zip(*shares, reference):
        assert torch.allclose((mine + theirs) / 2, full, atol=1e-6)
    assert loss_sum / 16 == pytest.approx(expected.item(), rel=1e-5)
    mixed = torch.softmax(torch.randn(16, 3, generator=g), 1)  # mixup's class probabilities: a mean over rows
    model.zero_grad()
    backward(model, Strategy(), _Precision(), images, mixed, StepRecipe(class_weights=weights), 1, scale)
    soft = torch.nn.CrossEntropyLoss(weight=weights.float())(model(images), mixed)
    wanted = torch.autograd.grad(soft, list(model.parameters()))
    assert all(torch.allclose(p.grad, r, atol=1e-6) for p, r in zip(model.parameters(), wanted))
    with torch.no_grad():  # a per-rank weighted mean would not be it
        per_rank = torch.nn.CrossEntropyLoss(weight=weights.float(), label_smoothing=smoothing)
        assert scale != 1.0 and not torch.allclose(per_rank(model(images[::2]), labels[::2]), expected)


class _Precision:
    """float32: autocast off, a plain backward."""

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()


@pytest.mark.quick
@pytest.mark.parametrize("flag,says", [
    ("1,2,x", "neither balanced, nor a file, nor numbers"), ("1,0,2", "every weight must be > 0 and finite"),
])
def test_class_weights_flags_are_one_line(flag, says, capsys):
    from common.train.flags import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--class-weights", flag], strategy="ddp", default_dataset="synthetic", world_size=1)
    assert says in capsys.readouterr().err


@pytest.mark.quick
def test_class_weights_from_a_file_join_the_identity_as_numbers(tmp_path):
    from common.errors import UserError
    from common.train.flags import parse_args
    from common.train.step import class_weights

    file = tmp_path / "weights.txt"
    file.write_text("1\n2.5\n\n0.5\n")
    cfg = parse_args(["--class-weights", str(file)], strategy="ddp", default_dataset="synthetic", world_size=1)
    assert cfg.identity()["class_weights"] == cfg.as_plain_dict()["class_weights"] == "1.0,2.5,0.5"
    assert "class_weights" not in parse_args([], strategy="ddp", default_dataset="synthetic", world_size=1).identity()
    import torch

    with pytest.raises(UserError, match="gives 3 weight.*has 4 classes"):
        class_weights(cfg.class_weights, torch.tensor([0, 1]), 4)
    with pytest.raises(UserError, match="class.*2 have no training images"):
        class_weights("balanced", torch.tensor([0, 1, 1]), 3)


@pytest.mark.quick
def test_tolerances_loosen_only_where_rounding_differs():
    from common.train.flags import parse_args

    def bound(*flags: str) -> float:
        return tolerance(parse_args(list(flags), strategy="ddp", default_dataset="synthetic", world_size=2))
    assert bound() == bound("--accumulate", "2") == bound("--precision", "fp16") == TOLERANCE
    assert bound("--precision", "bf16") > TOLERANCE and bound("--grad-compression", "bf16") > TOLERANCE


# ---------------------------------------------------------------- fp16: every rank, the same decisions

FP16_REPLICAS = ["allreduce", "master-update"]


def test_fp16_keeps_replicas_equal_through_skipped_steps(shared):
    """Covers, for the hand-written all-reduce and master/worker's --master-update (runs of `shared`'s
    launch): a high learning rate overflows fp16 now and then: the scaler skips steps and lowers its
    scale, and every rank must do the same (checked after every step)."""
    for name in FP16_REPLICAS:
        ok(shared.launch[f"fp16 {name}"])
        scaler = latest_state(shared.folder / f"ckpt-fp16-{name}")["scaler"]
        assert scaler["scale"] < 65536.0, scaler  # the first steps overflowed and were skipped
        print(f"\n{name} fp16: replicas equal after every step; loss scale {scaler['scale']:g} after 12 steps")


# ---------------------------------------------------------------- exact resume with recipe state

# name: (strategy, the recipe's flags) of the runs stopped by SIGTERM and resumed, against uninterrupted ones
RESUMED = {"powersgd": ("ddp", ["--grad-compression", "powersgd"]),
           "fp16": ("master-update", ["--precision", "fp16", "--accumulate", "2"])}


def stop_and_resume(name: str, folder: Path) -> dict[str, list[str]]:
    """The runs of RESUMED's `name`: uninterrupted (its checkpoints in ref-NAME), stopped by SIGTERM
    at step 10 and resumed (cut-NAME), 2 epochs of 12 steps."""
    strategy, flags = RESUMED[name]
    script, extra = STRATEGIES[strategy][0], STRATEGIES[strategy][1:]
    common = [*extra, "--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--batch-size", "32",
              "--epochs", "2", "--max-steps", "12", *flags, "--log-dir", str(folder / f"tb-{name}")]
    return {"ref": [script, *common, "--checkpoint-dir", str(folder / f"ref-{name}")],
            "cut": ["tests/faults.py", strategy.split("-")[0], "sigterm", "10", *common, "--checkpoint-dir",
                    str(folder / f"cut-{name}")],
            "resume": [script, *common, "--checkpoint-dir", str(folder / f"cut-{name}")]}


def stopped_and_resumed(name: str, shared: Shared) -> float:
    """max |dw| between RESUMED's `name` run uninterrupted and stopped by SIGTERM and resumed (`shared`'s)."""
    launch, resumes, folder = shared.launch, shared.resumes, shared.folder
    ok(launch[f"ref {name}"])
    cut = launch[f"cut {name}"]
    assert f"stopped by SIGTERM after step {stop_after(10)} " in cut.stderr, cut.stderr[-3000:]
    resumed = resumes[f"resume {name}"]
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    a, b = latest_state(folder / f"ref-{name}"), latest_state(folder / f"cut-{name}")
    assert a["global_step"] == b["global_step"] == 24
    return max((a["model"][k].float() - b["model"][k].float()).abs().max().item() for k in a["model"])


def test_powersgd_state_round_trips_for_an_exact_resume(shared):
    """Error feedback is each rank's own: the checkpoint carries every rank's, and each rank resumes with its own."""
    dw = stopped_and_resumed("powersgd", shared)
    state = latest_state(shared.folder / "cut-powersgd")["strategy"]
    assert state["iter"] > 2 and state["p"], state.keys()  # compressed, with warm-start factors
    errors = state["error"]
    assert len(errors) == 2 and errors[0].keys() == errors[1].keys()
    assert any(not errors[0][n].equal(errors[1][n]) for n in errors[0]), "the ranks' error feedback should differ"
    print(f"\nddp powersgd, stopped after step {stop_after(10)} and resumed: max |dw| = {dw:.3g}")
    assert dw == 0


@pytest.mark.quick
def test_powersgd_error_feedback_is_each_ranks_own_or_the_mean_at_another_world_size():
    import torch

    from train_ddp import own_error
    saved = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}]
    assert torch.equal(own_error(saved, rank=1, world=2)["w"], torch.tensor([3.0, 6.0]))
    assert torch.equal(own_error(saved, rank=2, world=4)["w"], torch.tensor([2.0, 4.0]))
    assert own_error([], rank=0, world=2) == {}


def test_fp16_scaler_state_round_trips_for_an_exact_resume(shared):
    dw = stopped_and_resumed("fp16", shared)
    print(f"\nmaster --master-update fp16, accumulate 2, stopped and resumed: max |dw| = {dw:.3g}")
    assert dw == 0


# ---------------------------------------------------------------- bad combinations: exit 2, before any process group

BAD = {
    "accumulate not dividing": (["train_ddp.py", "--batch-size", "32", "--accumulate", "3"],
                                "--accumulate 3: each rank's batch (--batch-size 32 / 1 rank(s) = 32) does not split"),
    "powersgd, hand-written": (["train_allreduce.py", "--grad-compression", "powersgd"],
                               "--grad-compression powersgd is not available with allreduce"),
    "powersgd, master": (["train_master.py", "--grad-compression", "powersgd"],
                         "--grad-compression powersgd is not available with master"),
    "compression, per-param": (["train_allreduce.py", "--allreduce", "per-param", "--grad-compression", "fp16"],
                               "--allreduce per-param is the tutorials' uncompressed baseline"),
    "powersgd, equivalence": (["train_ddp.py", "--grad-compression", "powersgd", "--check-equivalence", "2"],
                              "--check-equivalence compares against exact gradient averaging"),
    "local sgd H>1, equivalence": (["train_localsgd.py", "--sync-every", "4", "--check-equivalence", "2"],
                                   "local SGD equals only with --sync-every 1 and plain averaging"),
    "local sgd, replicas between averagings": (["train_localsgd.py", "--sync-every", "4", "--check-replicas", "6"],
                                               "--check-replicas 6: replicas are equal only right after an averaging"),
    "fp16, local sgd": (["train_localsgd.py", "--precision", "fp16"], "use --precision bf16 (no scaler)"),
    "fp16, sharded": (["train_fsdp.py", "--precision", "fp16"], "use --precision bf16 (no scaler)"),
    # A strategy's own numbers: nan and inf trained to nan weights or ended in a traceback.
    "outer lr nan": (["train_localsgd.py", "--outer-lr", "nan"], "--outer-lr > 0 and finite (got 4, nan)"),
    "outer lr inf": (["train_localsgd.py", "--outer-lr", "inf"], "--outer-lr > 0 and finite (got 4, inf)"),
    "bucket nan": (["train_allreduce.py", "--bucket-mb", "nan"], "--bucket-mb must be > 0 and finite (got nan)"),
    "bucket inf": (["train_master.py", "--bucket-mb", "inf"], "--bucket-mb must be > 0 and finite (got inf)"),
    # train_fsdp.py picks its class by --shard before the full parser: a bad value was argparse's usage block.
    "shard unknown": (["train_fsdp.py", "--shard", "foo"], "train_fsdp.py: error: argument --shard: invalid choice"),
    "shard without value": (["train_fsdp.py", "--shard"], "train_fsdp.py: error: argument --shard: expected one"),
    # CUDA reads --gpus up to its first bad entry; --device auto then fell back to the CPU, silently.
    "gpus typo": (["train_dp.py", "--gpus", "0,l"], "--gpus 0,l: give GPU ids as nvidia-smi lists them"),
    "gpus on the cpu": (["train_dp.py", "--gpus", "0", "--device", "cpu"], "without --device cpu"),
    "gpus not there": (["train_dp.py", "--gpus", "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16"],
                       "of these 17 GPU(s) are visible on this host"),
    # Another strategy's flag is unknown here, not a prefix taken for --shard-cache-gb.
    "shard on ddp": (["train_ddp.py", "--shard", "4"], "error: unrecognized arguments: --shard 4"),
}


@pytest.mark.quick
@pytest.mark.parametrize("case", list(BAD))
def test_bad_combinations_exit_2_before_any_process_group(case, tmp_path, capsys, monkeypatch):
    """In this process, as one process: every case but the world-dependent one is refused alike at any world size."""
    args, expected = BAD[case]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # restored after: train_dp.py --gpus sets it
    code, stderr = refusal_in_process([*args, "--dataset", "synthetic", "--log-dir", str(tmp_path / "tb"),
                                       "--checkpoint-dir", str(tmp_path / "ckpt")], capsys, monkeypatch)
    lines = [line for line in stderr.splitlines() if expected in line]
    assert code == 2 and len(lines) == 1, stderr[-3000:]
    assert "/common/" not in stderr and not (tmp_path / "ckpt").exists()  # no traceback, nothing started


def test_accumulation_that_does_not_split_a_ranks_batch_is_one_line_from_two_ranks(shared):
    """`shared`'s last run (a run that fails ends its launch)."""
    result = shared.launch["accumulate 3"]
    expected = "--accumulate 3: each rank's batch (--batch-size 32 / 2 rank(s) = 16) does not split"
    assert result.returncode != 0 and len([line for line in result.stderr.splitlines() if expected in line]) == 1, \
        result.stderr[-3000:]
    assert shared.launch.result.returncode == result.returncode
    assert "/common/" not in result.stderr and not (shared.folder / "ckpt-accumulate").exists()


@pytest.mark.quick
def test_compression_with_dataparallel_and_compile_without_a_compiler_are_refused(capsys, monkeypatch):
    code, stderr = refusal_in_process(["train_dp.py", "--dataset", "synthetic", "--grad-compression", "fp16"], capsys,
                                      monkeypatch)
    assert code == 2 and "nn.DataParallel sums gradients inside one process" in error_lines(stderr)[0]
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no g++, c++ or clang++ there
    monkeypatch.setenv("CXX", "")
    code, stderr = refusal_in_process(["train_ddp.py", "--dataset", "synthetic", "--compile"], capsys, monkeypatch)
    assert code == 2 and "--compile on the CPU needs a C++ compiler" in stderr


# ---------------------------------------------------------------- the profiler

def test_profile_writes_a_trace_per_rank_and_prints_the_top_operators(shared):
    """A run of `shared`'s launch."""
    log_dir = shared.folder / "tb-profile"
    result = shared.launch["profile"]
    ok(result)
    assert "top operators:" in result.stdout and "Self CPU" in result.stdout
    for rank in (0, 1):
        events = json.loads((log_dir / "traces" / f"rank{rank}_trace.json").read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert "sync: wait for buckets" in names and any(n.startswith("sync: launch bucket") for n in names)
        assert sum(n.startswith("ProfilerStep#") for n in names) == 4  # the active steps


def test_signals_still_stop_cleanly_with_a_recipe(shared):
    """SIGTERM under bf16 with accumulation (a run of `shared`'s launch): one stop line, the checkpoint
    carries the step."""
    result = shared.launch["sigterm bf16"]
    assert result.returncode != 0 and result.stderr.count(f"stopped by SIGTERM after step {stop_after(3)} ") == 1
    assert latest_state(shared.folder / "ckpt-sigterm")["global_step"] == stop_after(3)


# ---------------------------------------------------------------- the runs at world 2 beside the rows

@dataclass(frozen=True)
class Shared:
    launch: SharedLaunch
    resumes: SharedLaunch  # RESUMED's resumes
    folder: Path  # every run's own folders


def ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Shared:
    """The runs at world 2 that are not equivalence rows, two launches (tests/runs.py). The first: the
    fp16 runs checking replicas after every step, the profiled run, RESUMED's uninterrupted runs and
    cuts (--then-after-stop: the next run starts), the SIGTERM under bf16, and last the refusal (a run
    that fails ends its launch). The second: RESUMED's resumes, in processes that did not stop (a
    resume in fresh processes: the first)."""
    folder = tmp_path_factory.mktemp("shared")
    synthetic = ["--dataset", "synthetic", "--synthetic-shape", "mnist"]
    runs = {f"fp16 {name}": [*STRATEGIES[name], *synthetic, "--model", "convnet", "--batch-size", "32", "--epochs",
                             "1", "--max-steps", "12", "--precision", "fp16", "--check-replicas", "1",
                             *own_folders(folder, f"fp16-{name}")] for name in FP16_REPLICAS}
    runs["profile"] = ["train_allreduce.py", *synthetic, "--model", "convnet", "--batch-size", "32", "--epochs", "1",
                       "--max-steps", "14", "--profile", *own_folders(folder, "profile")]
    plans = {name: stop_and_resume(name, folder) for name in RESUMED}
    runs.update({f"{run} {name}": plan[run] for name, plan in plans.items() for run in ("ref", "cut")})
    runs["sigterm bf16"] = ["tests/faults.py", "allreduce", "sigterm", "3", *synthetic, "--model", "lenet",
                            "--batch-size", "32", "--epochs", "1", "--max-steps", "16", "--precision", "bf16",
                            "--accumulate", "2", *own_folders(folder, "sigterm")]
    runs["accumulate 3"] = ["train_ddp.py", "--batch-size", "32", "--accumulate", "3", "--dataset", "synthetic",
                            *own_folders(folder, "accumulate")]
    stopping = [name for name in runs if name.startswith("cut ") or name == "sigterm bf16"]
    launch = shared_launch(runs, 2, stopping, timeout=500)
    resumes = shared_launch({f"resume {name}": plan["resume"] for name, plan in plans.items()}, 2, timeout=300)
    return Shared(launch, resumes, folder)
