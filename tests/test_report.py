"""What people look at: TensorBoard served for real, the comparison report, the console."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

from common.output.logger import SUMMARY_METRICS
from common.output.report import write_report
from tests.conftest import ROOT, SharedLaunch, child_env, free_port, shared_launch

STEP_TAGS = {"train/loss", "train/acc", "lr", "train/images_per_s", "time/data_ms", "time/compute_ms",
             "time/sync_ms", "train/grad_norm", "mem/rss_mb"}
EPOCH_TAGS = {"test/loss", "test/acc", "test/samples", "time/epoch_s"}
FLAGS = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--batch-size", "64",
         "--epochs", "2", "--max-steps", "10", "--log-every", "5"]


RUNS = {"ddp": ["train_ddp.py"], "allreduce": ["train_allreduce.py", "--log-all-ranks"]}


# 31 steps, --log-every left at its default, a Python warning raised on rank 1 only (at step 3)
WARNED = ["tests/faults.py", "ddp", "warn", "3", "--dataset", "synthetic", "--synthetic-shape", "mnist", "--model",
          "lenet", "--batch-size", "64", "--epochs", "1", "--max-steps", "31"]


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[Path, Path, SharedLaunch]:
    """One launch (tests/runs.py): the warned run first (its start-up is the processes' own), into a
    folder of its own, then RUNS' runs under one --log-dir parent. Returns the parent, the warned
    run's folder and the launch."""
    parent, warned = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("warned")
    runs = {"warned": [*WARNED, "--log-dir", str(warned / "tb"), "--checkpoint-dir", str(warned / "ckpt")]}
    runs.update({name: [script, *FLAGS, *extra, "--log-dir", str(parent / name), "--checkpoint-dir",
                        str(parent.parent / f"ckpt-{name}")] for name, (script, *extra) in RUNS.items()})
    return parent, warned, shared_launch(runs, 2)


@pytest.fixture(scope="module")
def launched(launch) -> tuple[Path, dict[str, str]]:
    """Two strategies' runs under one --log-dir parent, as the comparison run leaves them (`launch`'s);
    the allreduce one asks for every rank's console (which changes nothing else). Returns the parent
    and each run's console."""
    parent, _, runs = launch
    for name in RUNS:
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    return parent, {name: runs[name].stdout for name in RUNS}


@pytest.fixture(scope="module")
def runs(launched) -> Path:
    return launched[0]


def test_only_rank_0_writes_events_and_the_console_unless_asked(launched):
    """Covers: one event file per run (--log-all-ranks included: it is the console's flag only); the
    console is rank 0's (one epoch line), every rank's with --log-all-ranks (one per rank, prefixed);
    the sync share is on the epoch line."""
    runs, results = launched
    for name in RUNS:
        assert len(list((runs / name).glob("events.out.tfevents.*"))) == 1
    quiet, loud = results["ddp"], results["allreduce"]
    assert quiet.count("epoch 1/2") == 1 and "[rank 1]" not in quiet
    assert loud.count("epoch 1/2") == 2 and "[rank 1] epoch 1/2" in loud
    assert "sync)" in quiet


def test_step_points_carry_the_time_of_their_step_not_of_the_batched_write(runs):
    """Step-level points are reduced and written in batches; each keeps the wall time its interval
    ended at, so curves against wall time are not staircases."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs / "ddp"))
    acc.Reload()
    points = acc.Scalars("train/loss")
    assert [p.step for p in points] == [5, 10, 15, 20]
    step_ms = [sum(acc.Scalars(f"time/{phase}_ms")[i].value for phase in ("data", "compute", "sync"))
               for i in range(len(points))]
    for i in (1, 3):  # steps 6-10 and 16-20 ran between the two points of an epoch, flushed together
        gap = points[i].wall_time - points[i - 1].wall_time
        assert gap >= 0.8 * 5 * step_ms[i] / 1000, (gap, step_ms[i])


def test_a_short_run_with_the_default_interval_logs_a_curve_its_start_up_and_a_ranks_warning_once(launch):
    """Covers (WARNED: `launch`'s first run): 31 steps, --log-every left at its default: at least 10
    step-level points, said in the banner, and the start-up time in TensorBoard; a Python warning
    raised on rank 1 only (at step 3) reaches the console once, through rank 0, named as rank 1's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, warned, runs = launch
    result = runs["warned"]
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "injected warning on rank 1" in line]
    assert len(lines) == 1 and lines[0].startswith("warning (rank 1): UserWarning"), lines
    assert "step-level points every 3 step(s)" in result.stdout, result.stdout
    acc = EventAccumulator(str(warned / "tb"))
    acc.Reload()
    assert STEP_TAGS | {"time/startup_s"} <= set(acc.Tags()["scalars"])
    assert len(acc.Scalars("train/loss")) >= 10
    assert 0 < acc.Scalars("time/startup_s")[0].value < 120


def _get(url: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _session_groups(base: str) -> list[dict]:
    return _get(f"{base}/data/plugin/hparams/session_groups", {
        "experimentName": "", "allowedStatuses": ["STATUS_SUCCESS", "STATUS_UNKNOWN", "STATUS_RUNNING",
                                                  "STATUS_FAILURE"], "colParams": [], "startIndex": 0,
        "sliceSize": 100})["sessionGroups"]


def test_tensorboard_server_serves_scalars_and_hparams(runs):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(runs), "--host", "127.0.0.1",
                               "--port", str(port), "--reload_interval", "1"], cwd=ROOT, env=child_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        tags: dict = {}
        groups: list = []
        # Until both runs are loaded to their last events (the summary scalars, then the hparams
        # summary): a reload can serve a run read only in part.
        while time.monotonic() < deadline and not (
                set(tags) == {"ddp", "allreduce"}
                and all(STEP_TAGS | EPOCH_TAGS | set(SUMMARY_METRICS) <= set(run_tags) for run_tags in tags.values())
                and len(groups) == 2 and all(len(g.get("metricValues", [])) == len(SUMMARY_METRICS) for g in groups)):
            time.sleep(1)  # a poll with a deadline: TensorBoard loading the finished runs
            try:
                tags, groups = _get(f"{base}/data/plugin/scalars/tags"), _session_groups(base)
            except OSError:
                continue
        assert set(tags) == {"ddp", "allreduce"}, tags
        for run in tags:
            assert STEP_TAGS | EPOCH_TAGS <= set(tags[run]), sorted(tags[run])
        points = _get(f"{base}/data/plugin/scalars/scalars?run=ddp&tag=test/acc")
        assert [step for _, step, _ in points] == [10, 20]  # one point per epoch, x axis the global step
        sync_points = _get(f"{base}/data/plugin/scalars/scalars?run=ddp&tag=time/sync_ms")
        assert [step for _, step, _ in sync_points] == [5, 10, 15, 20]
        experiment = _get(f"{base}/data/plugin/hparams/experiment", {"experimentName": ""})
        names = {h["name"] for h in experiment["hparamInfos"]}
        assert {"strategy", "world_size", "nodes", "backend", "device", "model", "dataset", "batch_size", "lr",
                "epochs"} <= names
        metrics = {m["name"]["tag"] for m in experiment["metricInfos"]}
        assert {"summary/final_test_acc", "summary/best_test_acc", "summary/wall_time_s",
                "summary/mean_images_per_s"} <= metrics
        assert {g["hparams"]["strategy"] for g in groups} == {"ddp", "allreduce/torch"}
        for group in groups:
            assert {m["name"]["tag"] for m in group["metricValues"]} == metrics
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_report_writes_a_table_row_per_run_and_readable_plots(runs, tmp_path):
    outputs = write_report([runs], tmp_path / "report")
    table = (tmp_path / "report" / "report.md").read_text().strip().splitlines()
    assert len(table) == 2 + 2  # header, separator, one row per run
    assert any("| ddp | 2 |" in row for row in table) and any("| allreduce/torch | 2 |" in row for row in table)
    for png in [p for p in outputs if p.suffix == ".png"]:
        with Image.open(png) as image:
            image.verify()
        with Image.open(png) as image:
            assert image.format == "PNG" and image.width >= 600 and image.height >= 150, image.size


def test_report_command_line(runs, tmp_path):
    result = subprocess.run([sys.executable, "-m", "common.output.report", str(runs), "--out", str(tmp_path / "r")],
                            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "| run | strategy | world |" in result.stdout
