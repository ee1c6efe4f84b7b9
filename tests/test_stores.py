"""Stores never start a run over: a store that does not answer at resume, a cut or odd pointer, and
jobs that share a --checkpoint-dir. Real torchrun processes (gloo, CPU); the object store is the
test S3 server (moto) behind a proxy on 127.0.0.1 that fails chosen requests for a while."""
from __future__ import annotations

import asyncio
import errno
import gc
import json
import logging
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import torch

from common.errors import UserError
from common.storage import DENIED, FAILED, MISSING, TRANSIENT, FsspecStorage, LocalStorage, StorageError, error_kind
from common.train.checkpoint import BackgroundWriter, CheckpointFolder, new_run_name
from tests.conftest import ROOT, SharedLaunch, child_env, error_lines, free_port, one_launch, run_script, shared_launch
from tests.flaky_proxy import Fault, FlakyProxy
from tests.s3server import S3Server
from tests.save_loop import IDENTITY
from tests.save_loop import state as loop_state

# 1 epoch of 4 steps, saved at steps 2 and 4: the run is complete, so a resume that finds it ends
# at once with "training already complete: <its checkpoint>", and one that misses it trains anew.
RUN = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--batch-size", "32",
       "--epochs", "1", "--max-steps", "4", "--save-every-steps", "2"]
NEWEST = "step-00000004.pt"
SHORT_BOUND_S = 3  # DP_STORE_RETRY_S where the store stays away: two retries (after 1 s and 2 s), then the end


def train_args(ckpt: str, tmp_path: Path, *extra: str) -> list[str]:
    return ["train_ddp.py", *RUN, "--checkpoint-dir", ckpt, "--log-dir", str(tmp_path / "tb"), *extra]


def train(ckpt: str, tmp_path: Path, environ: dict[str, str] | None = None, *extra: str):
    return run_script(train_args(ckpt, tmp_path, *extra), nproc=2, env=environ or child_env(), timeout=300)


def ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def run_folders(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


# ---------------------------------------------------------------- a store that does not answer

@dataclass(frozen=True)
class Saved:
    server: S3Server
    proxy: FlakyProxy  # in front of the server: fails chosen requests for a while
    local: Path  # a --checkpoint-dir on the local disk


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Iterator[Saved]:
    """The S3 server, a proxy in front of it, and one complete run saved in each kind of store, one
    launch for both (tests/runs.py): directly under s3://ckpt/base, and in a local folder."""
    server = S3Server(free_port())
    server.start()
    server.client().create_bucket(Bucket="ckpt")
    proxy = FlakyProxy(int(server.endpoint.rsplit(":", 1)[1]))
    folder = tmp_path_factory.mktemp("saved")
    runs = [["train_ddp.py", *RUN, "--checkpoint-dir", ckpt, "--log-dir", str(folder / f"tb-{index}")]
            for index, ckpt in enumerate(("s3://ckpt/base", str(folder / "ckpt")))]
    ok(run_script(one_launch(runs), nproc=2, env={**child_env(), **server.env()}, timeout=300))
    yield Saved(server, proxy, folder / "ckpt")
    proxy.shutdown()
    server.stop()


def keys(server: S3Server, prefix: str) -> list[str]:
    listed = server.client().list_objects_v2(Bucket="ckpt", Prefix=f"{prefix}/").get("Contents", [])
    return sorted(o["Key"].removeprefix(f"{prefix}/") for o in listed)


def copy_run(server: S3Server, prefix: str) -> list[str]:
    """The base run under another prefix (a pointer names its checkpoint relative to the folder)."""
    client = server.client()
    for key in keys(server, "base"):
        client.copy_object(Bucket="ckpt", Key=f"{prefix}/{key}", CopySource={"Bucket": "ckpt", "Key": f"base/{key}"})
    return keys(server, prefix)


# (what fails: a path part, how, for how long from the first failure; None: until the job has ended)
OUTAGES = {  # back in 3 s: after the retry of 1 s, at the retry of 2 s or the next (1 s, doubling)
    "pointer 503, back in 3 s": ("latest.json", "503", 3),
    "checkpoint dropped, back in 3 s": (".pt", "drop", 3),
    "checkpoint 503 throughout": (".pt", "503", None),
    "pointer dropped throughout": ("latest.json", "drop", None),
}
# One botocore attempt per request (the suite's default is 3, with up to 6 s of backoff). What is
# left is s3fs's two tries, nested twice, with fixed pauses (0.1, 0.17 s), and aiohttp's second try
# on a dropped kept-alive connection: 8 requests in 0.5 s a read, well inside the 3 s outage, so it
# meets the resume's own retries. ("max_attempts": 1 would be botocore's legacy mode, one retry
# more with a random pause: 16 requests in 2.4 s, and the read outlasted the outage on a loaded host.)
ONE_ATTEMPT = json.dumps({"config_kwargs": {"connect_timeout": 5, "read_timeout": 20,
                                            "retries": {"total_max_attempts": 1}}})


CAME_BACK = [case for case, (_, _, seconds) in OUTAGES.items() if seconds is not None]


def prefix_of(case: str) -> str:
    return case.replace(" ", "-").replace(",", "")


def through_proxy(saved: Saved) -> dict[str, str]:
    return {**child_env(), **saved.server.env(), "AWS_ENDPOINT_URL": saved.proxy.endpoint}


def arm(saved: Saved, case: str, seconds: float) -> tuple[list[str], Fault]:
    """The base run copied under the case's prefix (its keys), and the case's fault on that prefix's requests."""
    match, how, _ = OUTAGES[case]
    prefix = prefix_of(case)
    return copy_run(saved.server, prefix), saved.proxy.fail((f"/{prefix}/", match), how, seconds)


@dataclass(frozen=True)
class Resumed:
    """`resumed`'s launch, and for each case the store came back in: the keys before it, its fault."""
    launch: SharedLaunch
    before: dict[str, list[str]]
    faults: dict[str, Fault]
    folder: Path  # the cut pointer's --checkpoint-dir (a copy of `saved`'s local run)


@pytest.fixture(scope="module")
def resumed(saved, tmp_path_factory) -> Resumed:
    """The resumes that find the run, one launch (tests/runs.py): each CAME_BACK case under its own
    prefix with its own fault at the proxy, then the local run with its pointer cut (a rename refused,
    S3 Mountpoint and some FUSE mounts, and a kill leave a latest.json that does not parse)."""
    folder = tmp_path_factory.mktemp("resumed")
    before, faults, runs = {}, {}, {}
    for case in CAME_BACK:
        before[case], faults[case] = arm(saved, case, OUTAGES[case][2])
        runs[case] = train_args(f"s3://ckpt/{prefix_of(case)}", folder / prefix_of(case), "--storage-options",
                                ONE_ATTEMPT)
    ckpt = folder / "ckpt"
    shutil.copytree(saved.local, ckpt)
    [run] = run_folders(ckpt)
    pointer = ckpt / run / "latest.json"
    pointer.write_bytes(pointer.read_bytes()[:40])
    runs["cut pointer"] = train_args(str(ckpt), folder)
    try:
        launch = shared_launch(runs, 2, env=through_proxy(saved), timeout=400)
    finally:
        saved.proxy.clear()
    return Resumed(launch, before, faults, ckpt)


@pytest.mark.parametrize("case", list(OUTAGES))
def test_a_store_that_does_not_answer_at_resume_never_starts_the_run_over(case, saved, resumed, tmp_path):
    """The cases the store comes back in are runs of `resumed`'s launch; a store that stays away
    ends its launch (a launch each)."""
    server, seconds, prefix = saved.server, OUTAGES[case][2], prefix_of(case)
    if seconds is not None:  # the store came back within the bound: the run goes on where it was
        before, fault, result = resumed.before[case], resumed.faults[case], resumed.launch[case]
        elapsed = None
    else:
        environ = {**through_proxy(saved), "DP_STORE_RETRY_S": str(SHORT_BOUND_S)}
        before, fault = arm(saved, case, float("inf"))
        started = time.monotonic()
        try:
            result = train(f"s3://ckpt/{prefix}", tmp_path, environ, "--storage-options", ONE_ATTEMPT)
        finally:
            saved.proxy.clear()
        elapsed = time.monotonic() - started
    assert fault.failed > 0, "the proxy failed no request: the case tests nothing"
    assert keys(server, prefix) == before, "the job wrote into the store: it started something"
    if elapsed is None:
        ok(result)
        run = before[0].split("/")[0]
        assert f"training already complete: s3://ckpt/{prefix}/{run}/{NEWEST}" in result.stdout, result.stdout
        assert "warning: the store did not answer at first" in result.stderr, result.stderr[-3000:]
    else:
        errors = error_lines(result.stderr)
        assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
        assert f"the store did not answer reading s3://ckpt/{prefix}/" in errors[0]
        assert "nothing was started" in errors[0] and "/common/" not in result.stderr
        assert elapsed < SHORT_BOUND_S + 60  # start-up, the bound, and one last request's own retries
    print(f"\n{case}: {fault.failed} requests failed; exit {result.returncode}"
          + (f" after {elapsed:.1f} s" if elapsed is not None else ""))


# ---------------------------------------------------------------- pointers

def test_a_cut_pointer_is_recovered_in_a_real_resume(resumed):
    """What a pointer rewritten in place (rename refused: S3 Mountpoint, some FUSE mounts) and cut
    by a kill leaves: a latest.json that does not parse (`resumed`'s last run, on a copy of `saved`'s
    complete local run). The run stays visible through its step files."""
    ckpt = resumed.folder
    [run] = run_folders(ckpt)
    pointer = ckpt / run / "latest.json"
    result = resumed.launch["cut pointer"]
    ok(result)
    assert f"the pointer {pointer} does not parse" in result.stderr, result.stderr[-3000:]
    assert f"training already complete: {ckpt / run / NEWEST}" in result.stdout, result.stdout
    assert run_folders(ckpt) == [run]


def _three_checkpoints(folder: CheckpointFolder) -> None:
    for step in (3, 6, 9):
        folder.write("run", loop_state(step, torch.zeros(4)))


POINTERS = {  # damage -> what the warning says
    "cut": (lambda raw: raw[: len(raw) // 2], "does not parse"),
    "empty": (lambda raw: b"", "does not parse"),
    "not an object": (lambda raw: b"[1, 2]", "does not parse"),
    "unexpected name": (lambda raw: raw.replace(b"step-00000009.pt", b"weights.pt"), "names an unexpected file"),
    "another folder's file": (lambda raw: raw.replace(b"run/", b"other/"), "names an unexpected file"),
    "missing": (None, "is missing"),
}


@pytest.mark.quick
@pytest.mark.parametrize("damage", list(POINTERS))
def test_a_damaged_pointer_is_a_warning_and_the_run_resumes_from_its_newest_step_file(damage, tmp_path):
    folder = CheckpointFolder(LocalStorage(str(tmp_path)), keep=3)
    _three_checkpoints(folder)
    change, why = POINTERS[damage]
    pointer = tmp_path / "run" / "latest.json"
    if change is None:
        pointer.unlink()
    else:
        pointer.write_bytes(change(pointer.read_bytes()))
    choice = folder.choose("auto", IDENTITY)
    assert choice.run == "run" and choice.state["global_step"] == 9
    assert any(f"the pointer {pointer} {why}" in w for w in choice.warnings), choice.warnings


@pytest.mark.quick
def test_a_run_none_of_whose_checkpoints_loads_is_an_error_not_a_fresh_start(tmp_path):
    folder = CheckpointFolder(LocalStorage(str(tmp_path)), keep=3)
    _three_checkpoints(folder)
    for step_file in (tmp_path / "run").glob("step-*.pt"):
        step_file.write_bytes(step_file.read_bytes()[:100])
    with pytest.raises(UserError, match="none of its 3 checkpoint.s. loads .* pass --resume none"):
        folder.choose("auto", IDENTITY)
    (tmp_path / "run" / "latest.json").write_bytes(b"{")  # and no pointer to tell whose run it is
    with pytest.raises(UserError, match="holds 3 step file.s. of which none loads, and its pointer does not parse"):
        folder.choose("auto", IDENTITY)


class Unreachable(LocalStorage):
    """A store whose reads time out while `down` is set."""

    down = True

    def read(self, name: str) -> bytes:
        if self.down:
            raise StorageError(self.url(name), "the store is unreachable (timed out)", TRANSIENT)
        return super().read(name)


@pytest.mark.quick
def test_a_pointer_read_that_times_out_is_retried_then_ends_the_start(tmp_path, monkeypatch):
    monkeypatch.setattr("common.storage.RESUME_RETRY_S", 0.65)  # 0.35 s for the failing reads themselves
    monkeypatch.setattr("common.storage.FIRST_PAUSE_S", 0.1)
    _three_checkpoints(CheckpointFolder(LocalStorage(str(tmp_path)), keep=3))
    folder = CheckpointFolder(Unreachable(str(tmp_path)), keep=3)
    with pytest.raises(UserError, match=f"did not answer reading {tmp_path}/run/latest.json .*nothing was started"):
        folder.choose("auto", IDENTITY)
    assert folder.patience.retries == 2  # after 0.1 s and 0.2 s; a third pause would pass the bound


# ---------------------------------------------------------------- errors told apart

@pytest.mark.quick
@pytest.mark.parametrize("error, kind", [
    (FileNotFoundError(errno.ENOENT, "No such file"), MISSING),
    (PermissionError(errno.EACCES, "Permission denied"), DENIED),
    (OSError(errno.EBUSY, "Please reduce your request rate."), TRANSIENT),  # s3fs's 503 SlowDown
    (OSError(errno.EIO, "Input/output error"), TRANSIENT),  # a FUSE mount's failed request
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), TRANSIENT),
    (TimeoutError("read timed out"), TRANSIENT),
    (OSError(errno.EINVAL, "Invalid argument"), FAILED),
])
def test_store_errors_are_told_apart(error, kind):
    assert error_kind(error) == kind


@pytest.mark.quick
def test_a_request_orphaned_by_a_store_outage_prints_no_traceback_and_other_errors_still_do(caplog):
    """A store going down in a save can leave aiohttp's request task failed and never awaited: asyncio
    would print "Task exception was never retrieved" and a traceback after the save's one line
    (bench chaos, S3 kinds). Orphaned connection errors are dropped on fsspec's loop; others are not."""
    import aiohttp
    from fsspec.asyn import get_loop, sync

    async def orphan(error: Exception) -> None:
        async def request() -> None:
            raise error
        task = asyncio.ensure_future(request())
        await asyncio.sleep(0.01)  # it fails; nobody awaits it
        del task
        gc.collect()  # collected: asyncio reports what it raised

    loop = get_loop()
    loop.set_exception_handler(None)  # asyncio's own: it logs to the "asyncio" logger
    store = FsspecStorage("memory://chaos/run", {})
    store.write("a", b"1")  # the handler is installed by the store's first request
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        sync(loop, orphan, aiohttp.ClientConnectionResetError("Cannot write to closing transport"))
        sync(loop, orphan, aiohttp.ServerDisconnectedError())
        sync(loop, orphan, ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"))
        assert not caplog.records
        sync(loop, orphan, ValueError("not a connection's error"))
    [record] = caplog.records
    assert record.getMessage().startswith("Task exception was never retrieved")
    assert isinstance(record.exc_info[1], ValueError)

    seen: list[BaseException] = []  # a handler the program set: it still gets everything else
    loop.set_exception_handler(lambda _, context: seen.append(context["exception"]))
    store.read("a")
    sync(loop, orphan, aiohttp.ClientConnectionResetError("Cannot write to closing transport"))
    sync(loop, orphan, KeyError("not a connection's error"))
    assert [type(error) for error in seen] == [KeyError]
    loop.set_exception_handler(None)


# ---------------------------------------------------------------- jobs sharing a folder

@pytest.mark.quick
def test_run_names_of_parallel_starts_never_collide():
    names = [new_run_name() for _ in range(20000)]  # far more than start in one second
    assert len(set(names)) == len(names)
    assert names[0][:15] <= names[-1][:15]  # the prefix sorts by start time


def test_jobs_saving_every_step_into_one_folder_finish_while_others_start_there(tmp_path):
    ckpt, stop = tmp_path / "ckpt", tmp_path / "stop"
    loops = [subprocess.Popen([sys.executable, "tests/save_loop.py", str(ckpt), run, "0", str(stop)], cwd=ROOT,
                              env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for run in ("job-a", "job-b")]
    try:
        for loop in loops:
            assert loop.stdout.readline().strip(), "a save loop did not start"
        refused = run_script(["train_ddp.py", *RUN, "--checkpoint-dir", str(ckpt), "--log-dir", str(tmp_path / "tb")],
                             timeout=300)  # other settings than the loops' runs: refused (one process: at any world)
        assert "with other settings" in error_lines(refused.stderr)[0], refused.stderr[-3000:]
        ok(train(str(ckpt), tmp_path, None, "--resume", "none"))  # a new run beside them
    finally:
        stop.touch()
    outcomes = [loop.communicate(timeout=60) for loop in loops]
    for loop, (_, err) in zip(loops, outcomes):
        assert loop.returncode == 0, err[-3000:]
    steps = [len(out.split()) for out, _ in outcomes]
    print(f"\ntwo jobs saved {steps} times while two commands started in their folder")


class Full(LocalStorage):
    """A disk that fills up: step files fail, as a save in the background would."""

    def write_from(self, name, produce) -> None:
        raise StorageError(self.url(name), "No space left on device (ENOSPC)", FAILED)


@pytest.mark.quick
def test_the_end_of_a_job_names_a_failed_last_save(tmp_path, capsys):
    CheckpointFolder(LocalStorage(str(tmp_path)), keep=3).write("run", loop_state(3, torch.zeros(4)))
    writer = BackgroundWriter()
    writer.start(CheckpointFolder(Full(str(tmp_path)), keep=3), "run", loop_state(6, torch.zeros(4)),
                 str(tmp_path / "run" / "step-00000003.pt"), lambda path, seconds: None)
    writer.close()  # what the end of a job does: on an error exit, nobody asked for the save's outcome
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"warning: the job's last save did not complete: saving checkpoint "
                           f"{tmp_path}/run/step-00000006.pt failed (No space left on device"), line
    assert f"the previous checkpoint {tmp_path}/run/step-00000003.pt is intact and the same command resumes" in line
    assert "\n" not in line
