"""Using a trained model: evaluate.py (exact, at any world size, equal to the training run's last
evaluation), predict.py (images prepared as the training run prepared its test images; a broken
file named, the others predicted), export.py (ONNX, TorchScript and safetensors files that load
back and give PyTorch's outputs), the top-5 / per-class figures a training run logs, and a Ctrl-C
in any of the three (one line, status 130, no output file cut).

One launch trains a tiny ImageFolder set (PNG and JPEG of several sizes, --image-size: resize and
centre crop, at --crop-pct 0.8 with --interpolation bicubic, which the three programs must follow)
at W=2 and evaluates its checkpoint at W=2; one plain process evaluates it at W=1.
predict.py and export.py run in-process: they are one process with no process group. So do the
Ctrl-C tests (common/interrupts.py's guard set as the program's, os._exit recording), but one: a
predict.py process held as it writes its output, then sent SIGINT."""
from __future__ import annotations

import contextlib
import csv
import errno
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from common import interrupts
from common.data import own
from common.data.decoding import decode
from common.data.formats import read_cifar10
from common.data.geometry import Resampling, Stored
from common.data.loader import Dataset, DataSpec, Expected, Normalizer, Split, make_synthetic
from common.errors import UserError
from common.interrupts import USE_PROGRAMS
from common.models import build_model
from common.output import confusion
from common.output.logger import EpochResult, _epoch_line
from common.output.report import write_report
from common.train import evaluation
from common.train.evaluation import evaluate
from common.train.precision import Precision
from common.use import evaluating, predicting
from common.use import program as use_program
from common.use.exporting import current_umask
from common.use.source import find_checkpoint
from tests.conftest import (
    ENDS_PROMPTLY_S,
    ROOT,
    as_from_a_terminal,
    child_env,
    error_lines,
    latest_checkpoint,
    one_launch,
    read_scalars,
    run_script,
    script_command,
    split_runs,
)
from tests.datagen import write_cifar10, write_imagefolder, write_shards
from tests.gates import Gate

TRAIN = ["--dataset", "imagefolder", "--image-size", "24", "--model", "lenet", "--batch-size", "16", "--epochs", "1",
         "--max-steps", "2", "--ema", "0.5", "--crop-pct", "0.8", "--interpolation", "bicubic"]
RESAMPLING = Resampling(0.8, "bicubic")  # the short side resized to floor(24 / 0.8) = 30
EPOCH_LINE = re.compile(r"test acc (\d+\.\d\d)%(?:, EMA \S+)? \((\d+) images\)  top-5 (\d+\.\d\d)%")


@dataclass(frozen=True)
class Trained:
    root: Path
    images: Path  # the ImageFolder tree
    checkpoints: Path  # the run's --checkpoint-dir
    log_dir: Path
    train_console: str
    evaluations: dict[int, tuple[str, dict]]  # world size -> (console, metrics.json)
    ema: dict  # evaluate.py --ema's metrics.json (W=2)
    folders: dict[int, Path]  # world size -> evaluate.py's output folder (W=1: its default, in the run folder)

    @property
    def checkpoint(self) -> Path:
        return latest_checkpoint(self.checkpoints)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
    """The training run (with --ema) and evaluate.py at W=2, of its weights and of its moving average,
    in one launch (evaluate.py given the --checkpoint-dir: its newest run's newest checkpoint), then
    evaluate.py at W=1 in one process (given the run folder, and a cache without the training's
    decoded copy: it streams the test split and decodes nothing into the cache)."""
    root = tmp_path_factory.mktemp("use")
    images = write_imagefolder(root / "images", train_size=100, test_size=40, shape="cifar", sizes=(20, 40))
    checkpoints, log_dir = root / "ckpt", root / "tb"
    runs = [["train_ddp.py", *TRAIN, "--data-dir", str(images), "--cache-dir", str(root / "cache"),
             "--checkpoint-dir", str(checkpoints), "--log-dir", str(log_dir)],
            ["evaluate.py", "--checkpoint", str(checkpoints), "--output-dir", str(root / "eval-w2")],
            ["evaluate.py", "--checkpoint", str(checkpoints), "--ema", "--output-dir", str(root / "eval-ema")]]
    launched = run_script(one_launch(runs), nproc=2)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    train_console, w2_console, _ = split_runs(launched.stdout)
    # Without --output-dir: evaluation/step-N in the checkpoint's run folder.
    newest = latest_checkpoint(checkpoints)
    # In a node cache of its own: the test split streamed, nothing decoded into the cache
    one = run_script(["evaluate.py", "--checkpoint", str(newest.parent), "--cache-dir", str(root / "eval-cache")],
                     cwd=root)
    assert one.returncode == 0, one.stderr[-3000:]
    assert (root / "eval-cache" / "index").is_dir() and not (root / "eval-cache" / "decoded").exists()
    step = int(re.search(r"step-(\d+)\.pt", newest.name)[1])
    folders = {1: newest.parent / "evaluation" / f"step-{step:08d}", 2: root / "eval-w2"}
    assert f"wrote {folders[1] / 'metrics.json'}" in one.stdout and not (root / "evaluation").exists()
    metrics = {name: json.loads((folder / "metrics.json").read_text())
               for name, folder in (("w1", folders[1]), ("w2", folders[2]), ("ema", root / "eval-ema"))}
    return Trained(root, images, checkpoints, log_dir, train_console,
                   {1: (one.stdout, metrics["w1"]), 2: (w2_console, metrics["w2"])}, metrics["ema"], folders)


def test_evaluate_equals_the_training_runs_last_evaluation_at_any_world_size(trained):
    """Covers: top-1, top-5, the count and the confusion matrix equal at W=1 and W=2 and equal to
    the training run's epoch line and TensorBoard (scalars, and the confusion matrix it keeps for
    the report); the loss up to summation order; per_class.csv and confusion.png written; the
    --checkpoint-dir and the run folder both lead to the run's checkpoint; without --output-dir the
    files go to evaluation/step-N in the checkpoint's run folder, not the current directory; W=1,
    from a cache of its own, streams the test split (nothing decoded into its cache) to the same
    counts as the training run's decoded copy."""
    (acc, count, top5), = EPOCH_LINE.findall(trained.train_console)
    assert "evaluation on the centre 24 of the short side resized to 30 (crop fraction 0.8), bicubic for it and for " \
        "the training crops: --crop-pct 0.8; --interpolation bicubic" in trained.train_console
    _, scalars = read_scalars(trained.log_dir)
    tb_counts, tb_names = confusion.from_json(trained_confusion_json(trained.log_dir))
    for world, (console, metrics) in trained.evaluations.items():
        assert metrics["samples"] == int(count) == 40 and metrics["world_size"] == world
        assert metrics["checkpoint"] == str(trained.checkpoint)
        assert f"top-1 {acc}% ({metrics['top1_correct']}/40)  top-5 {top5}% ({metrics['top5_correct']}/40)" in console
        assert metrics["top1"] == pytest.approx(scalars["test/acc"][-1][1], abs=1e-7)
        assert metrics["top5"] == pytest.approx(scalars["test/acc_top5"][-1][1], abs=1e-7)
        assert metrics["loss"] == pytest.approx(scalars["test/loss"][-1][1], rel=1e-5)
        assert metrics["confusion"] == tb_counts and metrics["classes"] == tb_names == [str(i) for i in range(10)]
        assert np.trace(metrics["confusion"]) == metrics["top1_correct"]
        folder = trained.folders[world]
        rows = list(csv.DictReader((folder / "per_class.csv").open()))
        assert [int(r["images"]) for r in rows] == np.sum(tb_counts, axis=1).tolist()
        with Image.open(folder / "confusion.png") as picture:
            assert picture.format == "PNG" and picture.width >= 600
    assert trained.evaluations[1][1]["confusion"] == trained.evaluations[2][1]["confusion"]


def test_evaluate_ema_scores_the_moving_average_as_the_training_run_did(trained):
    _, scalars = read_scalars(trained.log_dir)
    assert trained.ema["weights"] == "ema" and trained.ema["samples"] == 40
    assert trained.ema["top1"] == pytest.approx(scalars["test/acc_ema"][-1][1], abs=1e-7)
    assert trained.ema["loss"] != pytest.approx(trained.evaluations[2][1]["loss"], rel=1e-7)  # other weights


def trained_confusion_json(log_dir: Path) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "images": 0})
    acc.Reload()
    assert confusion.IMAGE_TAG in acc.Tags()["images"]
    assert f"{confusion.PER_CLASS_TAG}/text_summary" in acc.Tags()["tensors"]
    event = acc.Tensors(f"{confusion.JSON_TAG}/text_summary")[-1]
    return tensor_util.make_ndarray(event.tensor_proto).flatten()[0].decode()


def test_the_report_writes_each_runs_per_class_accuracy_and_confusion_matrix(trained, tmp_path):
    outputs = write_report([trained.log_dir], tmp_path / "report")
    table = (tmp_path / "report" / "report.md").read_text()
    assert "| final top-5 |" in table
    per_class = (tmp_path / "report" / "per_class.md").read_text()
    metrics = trained.evaluations[1][1]
    scores = confusion.per_class(metrics["confusion"], metrics["classes"])
    assert confusion.markdown(scores) in per_class
    assert any(p.name.startswith("confusion-") and p.suffix == ".png" for p in outputs)


def test_predict_prepares_images_as_the_evaluation_and_names_a_broken_file(trained, tmp_path, capsys):
    """Covers: the probabilities of every test image equal the model's on the pixels the training
    run's own data pipeline gave its evaluation (decoding, resize, crop, normalization), class names
    from the checkpoint, --top-k, JSON; a folder searched recursively, a file that is not an image
    named in one line (exit 3) while the others are predicted, a non-image extension left alone and
    named in a note, CSV; --skip-broken (exit 0); nothing predicted (exit 1)."""
    import predict

    predict.main(["--checkpoint", str(trained.checkpoint), str(trained.images / "val"), "--top-k", "10", "--output",
                  str(tmp_path / "preds.json")])
    found = {entry["file"]: entry["top"] for entry in json.loads((tmp_path / "preds.json").read_text())}
    files, expected = evaluation_probabilities(trained)
    assert sorted(found) == sorted(files)
    for file, row in zip(files, expected):
        top = found[file]
        assert [p["class"] for p in top] == [str(p["index"]) for p in top]
        got = torch.zeros(10)
        got[[p["index"] for p in top]] = torch.tensor([p["probability"] for p in top])
        assert torch.allclose(got, row, atol=1e-5), (file, got, row)  # one forward, printed to 6 digits: no steps

    folder = shutil.copytree(trained.images / "val", tmp_path / "val")
    (folder / "3" / "broken.jpg").write_bytes(b"not a JPEG")
    (folder / "notes.txt").write_text("not an image: left alone, and named")
    output = tmp_path / "preds.csv"
    with pytest.raises(SystemExit) as ended:
        predict.main(["--checkpoint", str(trained.checkpoint), str(folder), "--output", str(output)])
    err = capsys.readouterr().err
    assert ended.value.code == predicting.SOME_NOT_PREDICTED == 3  # some predicted and written, one not
    broken = (f"{folder / '3' / 'broken.jpg'} is not a readable image (cannot identify image file); replace or "
              "delete it")
    assert error_lines(err) == [f"error: {broken}"], err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith(f"note: {folder}: 1 file(s) not predicted, not being images (")
    assert notes[0].endswith("): notes.txt"), notes
    rows = list(csv.DictReader(output.open()))
    assert len(rows) == 40 and all(len(row) == 1 + 2 * 5 for row in rows)
    right = sum(Path(row["file"]).parent.name == row["class_1"] for row in rows)
    assert right == trained.evaluations[1][1]["top1_correct"]
    # --skip-broken: the same files, the broken one named as skipped, exit status 0
    output.unlink()
    predict.main(["--checkpoint", str(trained.checkpoint), str(folder), "--output", str(output), "--skip-broken"])
    err = capsys.readouterr().err
    assert error_lines(err) == [] and f"skipped: {broken}" in err and len(list(csv.DictReader(output.open()))) == 40
    # nothing predicted: exit status 1
    with pytest.raises(SystemExit) as ended:
        predict.main(["--checkpoint", str(trained.checkpoint), str(folder / "3" / "broken.jpg")])
    assert ended.value.code == predicting.NONE_PREDICTED == 1


def evaluation_probabilities(trained: Trained) -> tuple[list[str], torch.Tensor]:
    """The test files, in the set's order, and the checkpoint's class probabilities on the pixels
    the training run evaluated (its decoded cache, normalized by the statistics it measured)."""
    opts = own.OwnData("imagefolder", str(trained.images), str(trained.root / "cache"), {}, image_size=24, workers=0,
                       prepare_workers=0, skip_broken=False, cache_gb=20.0, shard_cache_gb=1.0, resampling=RESAMPLING)
    data = own.open_prepared(own.prepare(opts, lambda line: None), opts)
    files = [str(trained.images / name) for name in own.load_index(opts, lambda line: None).test.names]
    with torch.no_grad():
        logits = find_checkpoint(str(trained.checkpoint)).model()(Normalizer(data.spec, torch.device("cpu"),
                                                                            torch.contiguous_format)(data.test.images))
    return files, torch.softmax(logits, dim=1)


@pytest.mark.parametrize("fmt", ["onnx", "torchscript", "safetensors"])
def test_export_writes_a_file_that_gives_pytorchs_outputs_and_states_its_preprocessing(trained, tmp_path, fmt, capsys):
    """Each format loaded back by its own runtime (ONNX: onnxruntime) on real test images, prepared
    as PATH.json says, at a batch size other than the export's: within 1e-4 of the checkpoint's
    model in PyTorch."""
    import export

    path = tmp_path / f"model.{fmt}"
    export.main(["--checkpoint", str(trained.checkpoint), "--format", fmt, "--output", str(path)])
    assert f"wrote {path} and {path}.json" in capsys.readouterr().out
    about = json.loads(Path(f"{path}.json").read_text())
    saved = torch.load(trained.checkpoint, weights_only=True)
    prep = about["preprocessing"]
    assert (prep["center_crop"], prep["resize_short_side"], prep["channels"]) == (24, 30, 3)
    assert (prep["crop_pct"], prep["interpolation"]) == (0.8, "bicubic") and "BICUBIC" in prep["resample"]
    assert (prep["mean"], prep["std"], about["classes"]) == (saved["data"]["mean"], saved["data"]["std"],
                                                            [str(i) for i in range(10)])
    files = sorted((trained.images / "val").rglob("*.*"))[:5]
    stored = Stored(prep["center_crop"], prep["resize_short_side"], 0, prep["interpolation"])
    pixels = torch.stack([decode(f.read_bytes(), stored, prep["channels"]) for f in files]).float() / 255
    images = (pixels - torch.tensor(prep["mean"]).view(1, 3, 1, 1)) / torch.tensor(prep["std"]).view(1, 3, 1, 1)
    with torch.no_grad():
        expected = find_checkpoint(str(trained.checkpoint)).model()(images)
        if fmt == "onnx":
            import onnxruntime

            session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            got = torch.from_numpy(session.run(["logits"], {"images": images.numpy()})[0])
        elif fmt == "torchscript":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch.jit's deprecation notice
                got = torch.jit.load(str(path))(images)
        else:
            from safetensors.torch import load_file

            model = build_model(about["model"], 3, 24, 10, seed=1).eval()  # other initial weights: the file's count
            model.load_state_dict(load_file(str(path)))
            got = model(images)
    assert (got - expected).abs().max().item() <= 1e-4  # one forward of an exported model: rounding, never grown
    assert path.stat().st_mode & 0o777 == Path(f"{path}.json").stat().st_mode & 0o777 == 0o666 & ~current_umask()


def test_a_checkpoint_the_programs_cannot_use_is_one_line(trained, tmp_path, capsys, monkeypatch):
    """An earlier version's checkpoint (no class names or preprocessing), --ema without a moving
    average, a missing file: one line naming it, exit 2, before any process group."""
    import evaluate
    import export
    import predict

    monkeypatch.setattr("common.use.evaluating.distributed", lambda flags: pytest.fail("reached the process group"))
    state = torch.load(trained.checkpoint, weights_only=True)
    del state["ema"]
    torch.save(state, tmp_path / "no-ema.pt")
    del state["data"]
    old = tmp_path / "old.pt"
    torch.save(state, old)
    cases = [(predict.main, ["--checkpoint", str(old), str(trained.images)], f"checkpoint {old} was saved by an "
                                                                             "earlier version"),
             (evaluate.main, ["--checkpoint", str(tmp_path / "no-ema.pt"), "--ema"], "--ema: checkpoint"),
             (export.main, ["--checkpoint", str(tmp_path / "none.pt"), "--format", "onnx", "--output", "m.onnx"],
              f"--checkpoint {tmp_path / 'none.pt'}: no such file")]
    for program, argv, start in cases:
        with pytest.raises(SystemExit) as ended:
            program(argv)
        lines = capsys.readouterr().err.strip().splitlines()
        assert ended.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {start}"), lines


# ---------------------------------------------------------------- in-process, no launch

class Indexed(torch.nn.Module):
    """Logits looked up by the image's first pixel (its index in the test set)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.table[(images[:, 0, 0, 0] * 255).round().long()]


@pytest.mark.quick
def test_evaluate_counts_top1_top5_and_the_confusion_matrix(monkeypatch):
    """Six classes, five images: top-1 counts the argmax, top-5 the label among the five highest
    (so only a label scored lowest misses), the matrix's row is the label and its column the
    prediction; above CONFUSION_MAX_CLASSES classes the same counts without a matrix."""
    labels = torch.tensor([0, 1, 2, 3, 3])
    table = torch.tensor([[9., 1, 2, 3, 4, 5],  # label 0 predicted 0
                          [9., 0, 2, 3, 4, 5],  # label 1 predicted 0, scored lowest: not in the top 5
                          [1., 2, 9, 3, 4, 5],  # label 2 predicted 2
                          [1., 2, 3, 4, 9, 5],  # label 3 predicted 4
                          [1., 2, 3, 9, 4, 5]])  # label 3 predicted 3
    images = torch.arange(5, dtype=torch.uint8).view(5, 1, 1, 1).expand(5, 1, 2, 2).contiguous()
    data = Dataset("indexed", DataSpec(1, 2, 6, (0.0,), (1.0,), "none"), Split(images, labels), Split(images, labels))
    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), all_reduce_sum=lambda t: t.clone())
    metrics = evaluate(Indexed(table), data, ctx, 2, Precision("fp32", ctx.device), torch.contiguous_format)
    assert (metrics.acc, metrics.acc_top5, metrics.samples) == (3 / 5, 4 / 5, 5)
    expected = torch.zeros(6, 6, dtype=torch.int64)
    for label, predicted in [(0, 0), (1, 0), (2, 2), (3, 4), (3, 3)]:
        expected[label, predicted] += 1
    assert torch.equal(metrics.confusion, expected)
    monkeypatch.setattr(evaluation, "CONFUSION_MAX_CLASSES", 5)
    fewer = evaluate(Indexed(table), data, ctx, 2, Precision("fp32", ctx.device), torch.contiguous_format)
    assert (fewer.acc, fewer.acc_top5, fewer.confusion) == (3 / 5, 4 / 5, None)


@pytest.mark.quick
def test_no_top5_is_shown_with_five_classes_or_fewer(tmp_path, capsys):
    """Every label is among the 5 highest scores of 5 classes: the epoch line, TensorBoard,
    evaluate.py's line and metrics.json show no top-5 (not a 100% that says nothing)."""
    labels = torch.tensor([0, 1, 2, 3, 4])
    images = torch.arange(5, dtype=torch.uint8).view(5, 1, 1, 1).expand(5, 1, 2, 2).contiguous()
    table = torch.eye(5)[[1, 1, 2, 0, 4]]  # 3 of 5 right
    data = Dataset("five", DataSpec(1, 2, 5, (0.0,), (1.0,), "none"), Split(images, labels), Split(images, labels))
    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), all_reduce_sum=lambda t: t.clone())
    metrics = evaluate(Indexed(table), data, ctx, 2, Precision("fp32", ctx.device), torch.contiguous_format)
    assert metrics.acc == 3 / 5 and math.isnan(metrics.acc_top5)
    line = _epoch_line(EpochResult(1, 3, math.nan, math.nan, metrics.loss, metrics.acc, 5, 0.0, 0.0, None,
                                   test_acc_top5=metrics.acc_top5), 1)
    assert line.endswith("test acc 60.00% (5 images)") and "top-5" not in line
    saved = SimpleNamespace(path="ckpt.pt", step=3)
    evaluating.report(SimpleNamespace(ema=False, output_dir=str(tmp_path)), saved, data, list("abcde"), metrics, 1)
    assert "top-1 60.00% (3/5)  loss" in capsys.readouterr().out
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["top5"] is None and written["top5_correct"] is None and written["top1_correct"] == 3


@pytest.mark.quick
def test_evaluate_writes_beside_the_checkpoints_run_by_default_and_takes_image_size(tmp_path):
    local = SimpleNamespace(path=str(tmp_path / "ckpt" / "run1" / "step-00000042.pt"), step=42)
    run = tmp_path / "ckpt" / "run1"
    assert evaluating.default_output_dir(local, ema=False) == run / "evaluation" / "step-00000042"
    assert evaluating.default_output_dir(local, ema=True).name == "step-00000042-ema"
    stored = SimpleNamespace(path="s3://bucket/ckpt/run1/step-00000042.pt", step=42)
    assert evaluating.default_output_dir(stored, ema=False) == Path("evaluation") / "run1-step-00000042"
    flags = evaluating.parse_flags(["--checkpoint", "c.pt", "--image-size", "32"])
    assert (flags.image_size, flags.output_dir) == (32, None)  # the default is resolved once the checkpoint is read


@pytest.mark.quick
def test_per_class_tables_picture_and_json():
    counts, names = [[3, 1, 0], [2, 2, 0], [0, 0, 0]], ["cat", "dog", "emu"]
    scores = confusion.per_class(counts, names)
    assert [(s.images, s.correct) for s in scores] == [(4, 3), (4, 2), (0, 0)]
    table = confusion.markdown(scores)
    assert "| cat | 4 | 3 | 75.00% |" in table and "| emu | 0 | 0 | - |" in table
    assert confusion.csv_text(scores).splitlines()[1] == "cat,4,3,0.750000"
    assert confusion.from_json(confusion.to_json(counts, names)) == (counts, names)
    assert confusion.png(counts, names, "t").startswith(b"\x89PNG") and confusion.rgb(counts, names, "t").shape[2] == 3


@pytest.mark.quick
def test_class_names_come_from_the_set_and_are_read_once_when_it_is_indexed(tmp_path, monkeypatch):
    """Fixed for CIFAR-10; an ImageFolder tree's class folders; a shard set's manifest; classes.txt
    without one; the class indices where the set names none. The index keeps them: a later start
    reads neither the manifest nor classes.txt again."""
    from tests.test_own_data import dataset, handmade, options

    tree = write_imagefolder(tmp_path / "tree", train_size=30, test_size=10)
    shards = write_shards(tree, tmp_path / "shards", shard_mb=1)
    assert read_cifar10(write_cifar10(tmp_path / "cifar", per_batch=10, test_size=10)).names()[:2] == \
        ["airplane", "automobile"]
    assert make_synthetic("mnist", 20, 20).names() == [str(i) for i in range(10)]
    assert dataset(options(tree, tmp_path / "c1")).names() == sorted(p.name for p in (tree / "train").iterdir())
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["classes"] = [f"c{i}" for i in range(10)]
    (shards / "manifest.json").write_text(json.dumps(manifest))
    assert dataset(options(shards, tmp_path / "c2", kind="shards")).names() == [f"c{i}" for i in range(10)]
    listed = handmade(shutil.copytree(shards, tmp_path / "listed"))
    (listed / "classes.txt").write_text("".join(f"name {i}\n" for i in range(10)))
    assert dataset(options(listed, tmp_path / "c3", kind="shards")).names()[9] == "name 9"
    monkeypatch.setattr(own, "read_from_data_dir", lambda *_: pytest.fail("the set was read again"))
    assert dataset(options(listed, tmp_path / "c3", kind="shards")).names()[9] == "name 9"


@pytest.mark.quick
def test_evaluate_decodes_only_the_test_split_and_checks_the_classes_before_decoding(tmp_path, monkeypatch):
    """evaluate.py's own set (OwnData.evaluated): no statistics of the training split, no decoded copy
    of the set (a copy training left is used), the test split streamed with the checkpoint's
    normalization; a set of other classes or image size is one line once indexed, before any image
    is decoded."""
    from tests.test_own_data import options

    tree = write_imagefolder(tmp_path / "tree", train_size=30, test_size=10, shape="cifar")
    names = tuple(sorted(p.name for p in (tree / "train").iterdir()))
    model = Expected("ckpt.pt", DataSpec(3, 32, len(names), (0.5, 0.4, 0.3), (0.2, 0.2, 0.2), "none"), names)
    fresh = options(tree, tmp_path / "fresh", evaluated=model)
    monkeypatch.setattr(own, "statistics", lambda *_: pytest.fail("statistics of the training split measured"))
    monkeypatch.setattr(own, "decode_split", lambda source, *_: pytest.fail(f"{source.table.split} split decoded"))
    report = own.prepare(fresh, lambda line: None)
    assert "decoded" not in report and not (tmp_path / "fresh" / "decoded").exists()
    data = own.open_prepared(report, fresh)
    assert (data.spec.mean, data.spec.std, data.names()) == (model.spec.mean, model.spec.std, list(names))
    assert len(data.test) == 10 and data.held.endswith("(evaluated once: no decoded copy is made)")
    for other in (replace(model, classes=names[:-1] + ("zebra",)), replace(model, spec=replace(model.spec, size=24))):
        with pytest.raises(UserError, match=r"^imagefolder \S+ does not fit checkpoint ckpt\.pt: its images are "
                                            r"3x32x32 in 10 classes .* give a set of the same classes and shape$"):
            own.prepare(options(tree, tmp_path / "other", evaluated=other), lambda line: None)
    monkeypatch.undo()
    trained = own.prepare(options(tree, tmp_path / "fresh"), lambda line: None)  # training decodes the set
    monkeypatch.setattr(own, "decode_split", lambda source, *_: pytest.fail(f"{source.table.split} decoded again"))
    assert own.prepare(fresh, lambda line: None)["decoded"] == trained["decoded"]  # and evaluate.py reads that copy


@pytest.mark.quick
@pytest.mark.parametrize("trained_with, lanes", [({"shard_lanes": 1}, 1), ({}, 4)])
def test_evaluate_reads_a_streamed_set_with_the_lanes_it_was_trained_with(trained_with, lanes, monkeypatch):
    """The node's shard cache holds two windows of the training's --shard-lanes: a run trained with 1
    on a budget of two row groups is evaluated under the same budget (evaluate.py has no
    --shard-cache-gb to raise it); a checkpoint from before the flag, with the default."""
    config = {"dataset": "hf", "data_dir": "d", "cache_dir": "c", "image_size": 0, "cache_gb": 0.0,
              "shard_cache_gb": 1e-4, "verify_data": False, "synthetic_shape": "", **trained_with}
    saved = SimpleNamespace(path="ckpt.pt", config=config)
    preprocessing = SimpleNamespace(spec=DataSpec(1, 28, 10, (0.5,), (0.2,), "none"), classes=tuple("0123456789"),
                                    resampling=Resampling())
    opened = []
    monkeypatch.setattr(evaluating, "load_dataset", lambda *args, own_data, **kwargs: opened.append(own_data) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        evaluating.load_data(evaluating.parse_flags(["--checkpoint", "ckpt.pt"]), saved, preprocessing,
                             SimpleNamespace(local_world_size=1, devices=(), is_node_primary=True))
    assert [opts.lanes for opts in opened] == [lanes]


EIGEN_NET = '''
import torch

class EigenNet(torch.nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.head = torch.nn.Linear(4, classes)

    def forward(self, images):
        x = images.flatten(1)[:, :4]
        return self.head(x + torch.linalg.eigvals(torch.outer(x[0], x[0])).real.sum())

def build(channels, size, classes):
    return EigenNet(classes)
'''


@pytest.mark.slow
@pytest.mark.quick
def test_export_of_a_model_that_does_not_export_names_the_operator(tmp_path, capsys, monkeypatch):
    import export

    monkeypatch.chdir(tmp_path)
    (tmp_path / "eigen_net_for_export.py").write_text(EIGEN_NET)
    model = build_model("eigen_net_for_export:build", 1, 4, 3, seed=0)
    state = {"model": model.state_dict(), "optimizer": {}, "scheduler": {}, "epoch": 1, "step_in_epoch": 0,
             "global_step": 1, "world_size": 1, "identity": {}, "config": {"model": "eigen_net_for_export:build",
                                                                               "seed": 0},
             "data": {"classes": ["a", "b", "c"], "channels": 1, "size": 4, "mean": [0.5], "std": [0.25], "resize": 0}}
    torch.save(state, tmp_path / "eigen.pt")
    with pytest.raises(SystemExit) as ended:
        export.main(["--checkpoint", "eigen.pt", "--format", "onnx", "--output", "eigen.onnx"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: --format onnx: the model does not export to ONNX: operator aten.linalg_eig "
                               "has no ONNX translation"), lines
    assert not (tmp_path / "eigen.onnx").exists() and not (tmp_path / "eigen.onnx.json").exists()


@pytest.mark.quick
@pytest.mark.parametrize("argv, message", [
    (["predict.py", "--checkpoint", "c.pt", "x.png", "--output", "preds.txt"], "--output preds.txt: name a .csv"),
    (["predict.py", "--checkpoint", "c.pt", "x.png", "--top-k", "0"], "--top-k and --batch-size must be >= 1"),
    (["evaluate.py", "--checkpoint", "c.pt", "--batch-size", "0"], "--batch-size and --image-size must be >= 1"),
    (["evaluate.py", "--checkpoint", "c.pt", "--dataset", "imagenet"], "--dataset 'imagenet' is unknown"),
    (["export.py", "--checkpoint", "c.pt", "--format", "tflite", "--output", "m"], "argument --format: invalid choice"),
    (["predict.py", "--checkpoint", "c.pt", "x.png", "--output", "/proc/none/p.csv"],
     "--output /proc/none/p.csv: cannot create the folder /proc/none"),
    (["evaluate.py", "--checkpoint", "c.pt", "--output-dir", "/proc/none"], "--output-dir /proc/none: cannot create"),
    (["export.py", "--checkpoint", "c.pt", "--format", "onnx", "--output", "/proc/none/m.onnx"],
     "--output /proc/none/m.onnx: cannot create the folder"),
    (["export.py", "--checkpoint", "c.pt", "--format", "onnx", "--output", "tests"], "--output tests: is a folder"),
    # a folder that exists and refuses the file (root passes os.access's check of /proc)
    (["export.py", "--checkpoint", "c.pt", "--format", "onnx", "--output", "/proc/m.onnx"],
     "--output /proc/m.onnx: not writable"),
    (["export.py", "--checkpoint", "c.pt", "--format", "torchscript", "--output", "/proc/m.pt"],
     "--output /proc/m.pt: not writable"),
    (["export.py", "--checkpoint", "c.pt", "--format", "safetensors", "--output", "/proc/m.st"],
     "--output /proc/m.st: not writable"),
    (["evaluate.py", "--checkpoint", "c.pt", "--output-dir", "/proc"], "--output-dir /proc: not writable"),
    (["predict.py", "--checkpoint", "c.pt", "x.png", "--output", "/proc/p.csv"], "--output /proc/p.csv: not writable"),
    (["predict.py", "--checkpoint", "c.pt", "x.png", "--storage-timeout-s", "nan"], "--storage-timeout-s must be > 0"),
], ids=["predict-output", "predict-top-k", "evaluate-batch", "evaluate-dataset", "export-format", "predict-path",
        "evaluate-path", "export-path", "export-folder", "export-onnx-proc", "export-torchscript-proc",
        "export-safetensors-proc", "evaluate-proc", "predict-proc", "timeout"])
def test_bad_flags_are_one_line_exit_2(argv, message, capsys):
    import importlib

    with pytest.raises(SystemExit) as ended:
        importlib.import_module(Path(argv[0]).stem).main(argv[1:])
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1 and message in lines[0], lines


@pytest.mark.quick
@pytest.mark.parametrize("argv, there, message", [
    (["predict.py", "x.png", "--output", "{t}/p.csv"], "p.csv FIFO", "--output {t}/p.csv: is not a regular file"),
    (["export.py", "--format", "onnx", "--output", "{t}/m.onnx"], "m.onnx.json folder",
     "--output {t}/m.onnx: {t}/m.onnx.json is a folder"),
    (["evaluate.py", "--output-dir", "{t}"], "metrics.json folder", "--output-dir {t}: {t}/metrics.json is a folder"),
], ids=["predict-fifo", "export-json-folder", "evaluate-metrics-folder"])
def test_an_output_no_rename_should_replace_is_refused_before_the_work(argv, there, message, tmp_path, capsys):
    """The output is renamed into place: a folder of an output file's name would fail the rename after
    the work (evaluate.py then had two files of three in place, a traceback, status 1), and a device
    or a FIFO would be replaced by a file (as root, --output /dev/null replaced /dev/null; a FIFO
    hung the check of --output). Refused first, in one line naming the flag, exit 2, left as it is."""
    import importlib

    name, kind = there.split()
    path = tmp_path / name
    path.mkdir() if kind == "folder" else os.mkfifo(path)
    # A reader of the FIFO, open: a writer's open (the former check) would otherwise wait for one for ever
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK) if kind == "FIFO" else None
    try:
        with pytest.raises(SystemExit) as ended:
            importlib.import_module(Path(argv[0]).stem).main(
                ["--checkpoint", "c.pt", *(arg.replace("{t}", str(tmp_path)) for arg in argv[1:])])
    finally:
        if reader is not None:
            os.close(reader)
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1 and message.replace("{t}", str(tmp_path)) in lines[0], lines
    assert path.is_dir() if kind == "folder" else path.is_fifo()


@pytest.mark.slow
@pytest.mark.quick
def test_a_checkpoint_store_that_never_answers_ends_the_program_at_its_deadline(tmp_path):
    """A server that accepts and never replies: one line naming --storage-timeout-s, within it."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}/run/step-00000001.pt"
        started = time.monotonic()
        done = subprocess.run([sys.executable, "predict.py", "--checkpoint", url, "--storage-timeout-s", "2", "x.png"],
                              cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60)
        seconds = time.monotonic() - started
    print(f"\nunanswered checkpoint read: ended after {seconds:.1f} s (deadline 2 s)")
    assert done.returncode == 2 and error_lines(done.stderr) == [
        f"error: --checkpoint {url}: no answer within 2 s (--storage-timeout-s); check the URL and that the store is "
        "up"], done.stderr[-2000:]


@pytest.mark.quick
def test_a_forward_that_branches_on_its_input_is_refused_as_torchscript_and_fifos_are_not_read(tmp_path):
    from common.errors import UserError
    from common.use.exporting import to_torchscript
    from common.use.predicting import Failures, image_files

    class Branching(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.flatten(1)[:, :3] if x.mean() > 0 else -x.flatten(1)[:, :3]
    with pytest.raises(UserError) as refused:
        to_torchscript(Branching(), torch.ones(2, 1, 4, 4), tmp_path / "m.pt")
    assert "the model's forward depends on its inputs' values" in str(refused.value)
    os.mkfifo(tmp_path / "pipe.png")
    failed = Failures(skip=False)
    assert list(image_files([str(tmp_path), str(tmp_path / "pipe.png")], failed)) == []
    assert any("pipe.png: not a regular file" in line for line in failed.files)


# Ctrl-C ---------------------------------------------------------------------------------------
class Ended(BaseException):
    """os._exit in a test's process: the process would end here."""


def guarded_as(program: str, folder: Path, monkeypatch) -> list[tuple[int, list[str]]]:
    """common/interrupts.py's guard as `program` holds it, in this process but without its signal
    handler (pytest keeps its Ctrl-C), and os._exit recording the exit status and what `folder` holds
    as the process would end, then raising Ended; the console is left as it is (no _silence)."""
    ended = []

    def exit_here(status: int) -> None:
        ended.append((status, sorted(p.name for p in folder.iterdir())))
        raise Ended(status)
    monkeypatch.setattr(interrupts._Guard, "program", program)
    monkeypatch.setattr(interrupts._Guard, "line", interrupts.ctrl_c_line(program))
    monkeypatch.setattr(interrupts._Guard, "leftovers", [])
    monkeypatch.setattr(interrupts, "_ENDING", threading.Lock())  # one that no ended test left held
    monkeypatch.setattr(interrupts, "_silence", lambda: None)
    monkeypatch.setattr(os, "_exit", exit_here)
    return ended


def ctrl_c() -> None:
    """A Ctrl-C as the main thread's handler takes it (the watcher's own acts alike, waiting for the lock)."""
    interrupts.end_now(signal.SIGINT)


@pytest.mark.quick
def test_one_place_decides_which_programs_end_on_ctrl_c_with_one_line():
    """common/interrupts.py's rule by file name, asked by the package's import, the test programs (for
    the program they stand for) and launch/quiet_torchrun.py (for the script it starts)."""
    from launch.quiet_torchrun import workers_line
    from tests.training_program import stands_for

    for name in USE_PROGRAMS:
        assert interrupts.ctrl_c_line(name) == f"interrupted (Ctrl-C): {name} stopped and wrote no file; the same " \
                                               "command starts again"
    assert interrupts.ctrl_c_line("train_ddp.py") == interrupts.STARTUP_LINE
    assert [interrupts.ctrl_c_line(p) for p in ("pytest", "", "runs.py", "quiet_torchrun.py", "my_evaluate.py")] == \
        [None] * 5
    assert stands_for("patched.py", ["patched.py", "gate=all@output", "predict.py", "--top-k", "3"]) == "predict.py"
    assert interrupts.ctrl_c_line(stands_for("patched.py", ["patched.py", "no-rename", "tests/runs.py"])) == \
        interrupts.ctrl_c_line(stands_for("faults.py", ["faults.py", "ddp"])) == interrupts.STARTUP_LINE
    assert stands_for("pytest", ["pytest"]) == "pytest"
    assert workers_line(["quiet_torchrun.py", "--nproc_per_node=2", "tests/patched.py", "gate=all@data", "evaluate.py",
                         "--checkpoint", "run"]) == interrupts.ctrl_c_line("evaluate.py")
    assert workers_line(["quiet_torchrun.py", "--rdzv-id", "train_x", "-m", "mymodule"]) == interrupts.STARTUP_LINE


@pytest.mark.quick
def test_a_ctrl_c_while_the_output_is_put_in_place_waits_for_it_then_says_it_is_whole(tmp_path, monkeypatch, capfd):
    """The renames that put staged files in place (evaluate.py's three) are not cut: the main thread's
    handler passes over a Ctrl-C then, and the watcher waits for the renames and ends the process
    with the line that says the output is whole; before them, the staging folder is removed and the
    line says that no file was written."""
    ended = guarded_as("evaluate.py", tmp_path, monkeypatch)
    renamed, real_move = [], use_program.move

    def watch() -> None:  # the watcher thread's own handling of the same Ctrl-C
        with contextlib.suppress(Ended):
            ctrl_c()
    watcher = threading.Thread(target=watch, daemon=True)

    def move(staged_file: Path, final: Path) -> None:
        if not renamed:  # a Ctrl-C lands as the first rename begins: both threads see it
            ctrl_c()  # the main thread's handler: returns, the renames go on
            watcher.start()
            watcher.join(timeout=0.5)
            assert watcher.is_alive(), "the watcher did not wait for the renames"
        real_move(staged_file, final)
        renamed.append(final.name)
    monkeypatch.setattr(use_program, "move", move)
    with use_program.staged(tmp_path, evaluating.OUTPUT_FILES) as staging:
        for name in evaluating.OUTPUT_FILES:
            (staging / name).write_text(name)
    watcher.join(timeout=30)
    assert renamed == list(evaluating.OUTPUT_FILES)
    assert ended == [(130, sorted(evaluating.OUTPUT_FILES))]  # every file in place, no staging folder left
    assert capfd.readouterr().err == f"{interrupts.written_line('evaluate.py')}\n"

    before = guarded_as("evaluate.py", tmp_path / "again", monkeypatch)
    (tmp_path / "again").mkdir()
    with pytest.raises(Ended), use_program.staged(tmp_path / "again", ["metrics.json"]) as staging:
        (staging / "metrics.json").write_text("{")
        ctrl_c()
    assert before == [(130, [])] and capfd.readouterr().err == f"{interrupts.ctrl_c_line('evaluate.py')}\n"


@pytest.mark.quick
def test_predictions_to_a_pipe_whose_reader_stopped_reading_end_without_a_traceback(monkeypatch):
    """`predict.py ... | head -1`: head reads its line and exits, and the next line meets a closed pipe.
    The predictions' lines stop there, quietly (it was a BrokenPipeError's traceback and status 1,
    "during joining or leaving the process group"); the exit status stays the predictions' own."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        predicting.write([predicting.Prediction(f"{i}.png", [("a", 0, 0.75)]) for i in range(3)], None)
        print("after", flush=True)  # a later print goes nowhere, without an error


@pytest.mark.quick
def test_a_prediction_of_nothing_leaves_the_output_file_as_it_was(tmp_path, capsys):
    """A mistyped image path: nothing predicted, exit 1, and the --output of an earlier run is kept
    (it was replaced by a file of no prediction)."""
    import predict

    output = tmp_path / "preds.csv"
    output.write_text("before\n")
    with pytest.raises(SystemExit) as ended:
        predict.main(["--checkpoint", str(lenet_checkpoint(tmp_path / "lenet.pt")), str(tmp_path / "typo"),
                      "--output", str(output)])
    assert ended.value.code == predicting.NONE_PREDICTED and output.read_text() == "before\n"
    assert error_lines(capsys.readouterr().err) == [f"error: {tmp_path / 'typo'}: no such file or folder"]


def lenet_checkpoint(path: Path) -> Path:
    """A checkpoint of an untrained lenet for 1x28x28 images in 10 classes, as the programs read it."""
    model = build_model("lenet", 1, 28, 10, seed=0)
    torch.save({"model": model.state_dict(), "optimizer": {}, "scheduler": {}, "epoch": 1, "step_in_epoch": 0,
                "global_step": 1, "world_size": 1, "identity": {}, "config": {"model": "lenet", "seed": 0},
                "data": {"classes": [str(i) for i in range(10)], "channels": 1, "size": 28, "mean": [0.5],
                         "std": [0.25], "resize": 0}}, path)
    return path


def interrupted_evaluation(folder: Path, monkeypatch) -> None:
    """evaluate.py's report, interrupted once metrics.json and per_class.csv are written."""
    labels = torch.tensor([0, 1])
    images = torch.zeros(2, 1, 2, 2, dtype=torch.uint8)
    data = Dataset("two", DataSpec(1, 2, 2, (0.0,), (1.0,), "none"), Split(images, labels), Split(images, labels))
    monkeypatch.setattr(confusion, "png", lambda *_: ctrl_c())
    evaluating.report(SimpleNamespace(ema=False, output_dir=str(folder)), SimpleNamespace(path="c.pt", step=1), data,
                      ["a", "b"], evaluation.Metrics(0.7, 0.5, 2, confusion=torch.eye(2, dtype=torch.int64)), 1)


def interrupted_prediction(folder: Path, monkeypatch) -> None:
    """predict.py writing its CSV file, interrupted after the first row."""
    real = predicting.write_csv

    def write_csv(predictions: list, path: Path) -> None:
        real(predictions[:1], path)
        ctrl_c()
    monkeypatch.setattr(predicting, "write_csv", write_csv)
    rows = [predicting.Prediction(f"{i}.png", [("a", 0, 0.75)]) for i in range(3)]
    predicting.write(rows, str(folder / "preds.csv"))


def interrupted_export(folder: Path, monkeypatch) -> None:
    """export.py, interrupted once the TorchScript file is written, before its check and PATH.json."""
    import export
    from common.use import exporting

    real = exporting.to_torchscript

    def to_torchscript(*args):
        real(*args)
        ctrl_c()
    monkeypatch.setattr(exporting, "to_torchscript", to_torchscript)
    export.main(["--checkpoint", str(lenet_checkpoint(folder.parent / "lenet.pt")), "--format", "torchscript",
                 "--output", str(folder / "model.pt")])


@pytest.mark.quick
@pytest.mark.parametrize("program, interrupted", [("evaluate.py", interrupted_evaluation),
                                                  ("predict.py", interrupted_prediction),
                                                  ("export.py", interrupted_export)])
def test_a_ctrl_c_while_a_program_writes_its_output_leaves_no_file(program, interrupted, tmp_path, monkeypatch,
                                                                      capfd):
    """A Ctrl-C mid-way through the writing (evaluate.py's second file of three, predict.py's CSV
    file after its first row, export.py's model before its check and PATH.json): the process ends
    with status 130 and the program's line alone, and its output folder holds nothing, not even a
    staging name (each program writes through common/use/program.py staged)."""
    folder = tmp_path / "output"
    folder.mkdir()
    ended = guarded_as(program, folder, monkeypatch)
    with pytest.raises(Ended):
        interrupted(folder, monkeypatch)
    assert ended == [(130, [])]
    assert capfd.readouterr().err == f"{interrupts.ctrl_c_line(program)}\n"


def test_ctrl_c_while_predict_writes_its_output_is_one_line_and_leaves_no_file(trained, tmp_path):
    """The use programs' one launch for Ctrl-C: predict.py as a user runs it (plain python; through
    tests/patched.py, set up as predict.py itself), held as its --output CSV file has its first line
    written and flushed (tests/gates.py's `output`), then SIGINT: status 130, its line alone on stderr,
    nothing on stdout, and neither the file nor a staging folder left."""
    gate, hold = Gate(tmp_path / "gates"), "all@output"
    output = tmp_path / "out" / "preds.csv"
    proc = subprocess.Popen(script_command(["tests/patched.py", f"gate={hold}", "predict.py", "--checkpoint",
                                            str(trained.checkpoint), str(trained.images / "val"), "--output",
                                            str(output)]),
                            cwd=ROOT, env={**child_env(), **gate.env()}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_terminal)
    try:
        gate.held(hold, timeout=120)
        being_written = [f.read_text() for f in output.parent.rglob("*") if f.is_file()]
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=ENDS_PROMPTLY_S)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    print(f"\nCtrl-C as predict.py wrote its output: ended {took:.2f} s later, status {proc.returncode}")
    assert len(being_written) == 1 and being_written[0].startswith("file,class_1,") and \
        being_written[0].count("\n") == 1, being_written  # held mid-write: the header alone
    assert proc.returncode == 128 + signal.SIGINT and err == f"{interrupts.ctrl_c_line('predict.py')}\n", err[-3000:]
    assert out == "" and list(output.parent.iterdir()) == []


@pytest.mark.quick
@pytest.mark.parametrize("command, ends", [
    (["python", "-u", "{root}/predict.py", "--checkpoint", "c.pt"], True),  # a shell's, torchrun's workers'
    (["python", "-W", "ignore", "predict.py", "x.png"], True),  # the cwd the root
    (["python", "-m", "predict", "x.png"], True),
    (["python", "driver.py", "{root}/predict.py"], False),  # runpy.run_path(predict.py) in a user's driver
    (["python", "-m", "ipykernel_launcher", "-f", "k.json"], False),  # IPython's %run predict.py
], ids=["python", "options", "module", "runpy-driver", "ipython-run"])
def test_a_finished_use_program_ends_the_process_only_where_it_is_the_interpreters_own(command, ends, monkeypatch):
    """A finished evaluate.py, predict.py or export.py ends its process at once (no teardown) only where
    the interpreter was started with it: a user's driver running it through runpy, or a notebook's
    %run, gets control back (the driver was ended after its first run, status 0, its own work undone)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "orig_argv", [arg.replace("{root}", str(ROOT)) for arg in command])
    spec = SimpleNamespace(name="predict") if "predict" in command else None  # python -m predict's
    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__file__=str(ROOT / "predict.py"), __spec__=spec))
    monkeypatch.setattr(interrupts._Guard, "watch", object())  # the guard, as predict.py's import installed it
    monkeypatch.setattr(interrupts._Guard, "program", "predict.py")
    ended = []
    monkeypatch.setattr(interrupts, "end_without_teardown", ended.append)
    interrupts.finished(3)
    assert ended == ([3] if ends else [])


@pytest.mark.quick
def test_a_ctrl_c_with_stderr_closed_still_ends_the_program_and_removes_its_staging(tmp_path, monkeypatch):
    """`predict.py ... 2>&1 | head -1`, then a Ctrl-C: stderr's reader is gone and the line cannot be
    written (EPIPE); the process ends all the same, status 130, its staging folder removed (the thread
    that took the Ctrl-C died of the write, holding the lock: the Ctrl-C was lost, and the renames
    then waited for that lock for ever)."""
    ended = guarded_as("predict.py", tmp_path, monkeypatch)
    read_end, write_end = os.pipe()
    os.close(read_end)
    stderr = os.dup(2)
    try:
        with pytest.raises(Ended), use_program.staged(tmp_path, ["preds.csv"]) as staging:
            (staging / "preds.csv").write_text("file,class_1\n")
            os.dup2(write_end, 2)
            ctrl_c()
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(write_end)
    assert ended == [(130, [])]


# predict.py's guard, its output staged, waiting in native code (a forward, an ONNX export: no Python
# handler runs there) when a SIGTERM comes (kill, timeout, docker stop, torchrun stopping its workers);
# a DataLoader worker forked before says how it takes a SIGTERM.
TERMINATED = """
import ctypes, os, signal, sys
from pathlib import Path
from common.interrupts import end_on_ctrl_c, removed_on_ctrl_c
end_on_ctrl_c("predict.py")
if os.fork() == 0:
    print("worker", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
    os._exit(0)
os.wait()
staging = Path(sys.argv[1])
staging.mkdir()
with removed_on_ctrl_c(staging):
    (staging / "preds.csv").write_text("file,class_1")
    mutex = ctypes.create_string_buffer(64)  # zeroed: glibc's PTHREAD_MUTEX_INITIALIZER
    ctypes.CDLL(None).pthread_mutex_lock(mutex)
    print("waiting", flush=True)
    ctypes.CDLL(None).pthread_mutex_lock(mutex)
"""


@pytest.mark.quick
def test_a_sigterm_removes_a_use_programs_staged_output_and_ends_it_as_the_signal_does(tmp_path):
    """A SIGTERM to evaluate.py, predict.py or export.py removes what they staged (it was left
    behind as a hidden .output.tmp-* folder), and the process ends by the signal, silent, as
    without the guard: its parent (torchrun) sees the signal, not an exit status. A data worker
    keeps SIGTERM's default action."""
    proc = subprocess.Popen([sys.executable, "-c", TERMINATED, str(tmp_path / ".output.tmp-here")], cwd=ROOT,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert [proc.stdout.readline() for _ in range(2)] == ["worker True\n", "waiting\n"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=ENDS_PROMPTLY_S)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (-signal.SIGTERM, "", "")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.quick
def test_a_full_disk_as_the_output_is_staged_is_one_line_and_leaves_the_previous_file(tmp_path):
    """A full disk mid-way through the writing: the file there before is kept, the staging folder
    removed, and the error is one line naming the folder (it was a traceback, "failed with OSError
    during joining or leaving the process group")."""
    (tmp_path / "preds.csv").write_text("before\n")
    with pytest.raises(UserError) as refused, use_program.staged(tmp_path, ["preds.csv"]) as staging:
        (staging / "preds.csv").write_text("file,class_1\n")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(refused.value) == f"{tmp_path}: no room for the output (No space left on device (ENOSPC)); free " \
                                 "space there or write it elsewhere: no file was written, those there are as they were"
    assert [p.name for p in tmp_path.iterdir()] == ["preds.csv"] and (tmp_path / "preds.csv").read_text() == "before\n"


@pytest.mark.quick
def test_an_output_that_is_a_symbolic_link_is_written_through(tmp_path):
    """--output results/latest.csv, a link to run-42.csv: the file it names gets the output, as before
    the output was staged (open() writes through a link), and the link stays (a rename replaced it)."""
    (tmp_path / "run-42.csv").write_text("before\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "latest.csv").symlink_to(tmp_path / "run-42.csv")
    with use_program.staged(tmp_path / "results", ["latest.csv"]) as staging:
        (staging / "latest.csv").write_text("file,class_1\n")
    assert (tmp_path / "results" / "latest.csv").is_symlink() and [p.name for p in (tmp_path / "results").iterdir()] \
        == ["latest.csv"] and (tmp_path / "run-42.csv").read_text() == "file,class_1\n"


@pytest.mark.quick
def test_output_is_copied_into_place_where_the_file_system_renames_nothing(tmp_path, monkeypatch):
    """S3 Mountpoint refuses rename(2) (EPERM, as tests/patched.py's no-rename): each staged file is
    copied under its final name, and the staging folder removed."""
    def refused(*args):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))
    monkeypatch.setattr(os, "replace", refused)
    with use_program.staged(tmp_path, ["preds.csv"]) as staging:
        (staging / "preds.csv").write_text("file,class_1\n")
    assert [p.name for p in tmp_path.iterdir()] == ["preds.csv"] and (tmp_path / "preds.csv").read_text() == \
        "file,class_1\n"
