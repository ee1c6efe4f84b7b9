"""Data and checkpoints in an object store: a real S3-compatible server (moto's server mode) on
127.0.0.1, real torchrun processes (gloo, CPU), the suite's own code unmocked."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from common.data.formats import CIFAR_DIR, MNIST_DIR
from tests.conftest import (
    ENDS_PROMPTLY_S,
    ROOT,
    child_env,
    error_lines,
    free_port,
    one_launch,
    refusal_in_process,
    run_script,
    script_command,
    split_runs,
    stop_after,
)
from tests.datagen import write_cifar10, write_mnist, write_mnist_processed
from tests.gates import Gate
from tests.runs import launched_runs
from tests.s3server import S3Server

MNIST = ["--dataset", "mnist", "--model", "lenet", "--batch-size", "32", "--eval-batch-size", "301"]
CIFAR = ["--dataset", "cifar10", "--model", "lenet", "--batch-size", "100", "--epochs", "1", "--max-steps", "2",
         "--data-dir", "s3://data/cifar"]
KILLED = [*MNIST, "--epochs", "3", "--max-steps", "8", "--data-dir", "s3://data/mnist-raw"]  # 3 epochs of 8 steps


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> S3Server:
    """One server for the module, with the data set uploaded in every layout."""
    server = S3Server(free_port())
    server.start()
    client = server.client()
    for bucket in ("data", "ckpt", "events"):
        client.create_bucket(Bucket=bucket)
    made = tmp_path_factory.mktemp("layouts")
    server.upload_tree("data", "mnist-raw", write_mnist(made / "raw"))
    server.upload_tree("data", "mnist-gz", write_mnist(made / "gz", gz=True))
    server.upload_tree("data", "mnist-processed", write_mnist_processed(made / "processed"))
    server.upload_tree("data", "cifar", write_cifar10(made / "cifar"))
    server.cifar_local = made / "cifar"
    yield server
    server.stop()


@dataclass(frozen=True)
class Launch:
    """One launch of several runs (tests/runs.py): how it ended and each run's rank-0 console by name."""
    result: subprocess.CompletedProcess
    consoles: dict[str, str]
    folder: Path

    def output(self) -> str:
        return self.result.stdout + self.result.stderr

    def run(self, name: str) -> subprocess.CompletedProcess:
        """The run's own stdout, stderr and exit status (launched_runs)."""
        return dict(zip(self.consoles, launched_runs(self.result)))[name]


def launch_runs(runs: dict[str, list[str]], folder: Path, environ: dict[str, str], patches: tuple[str, ...] = ()
                ) -> Launch:
    """The runs (a name: SCRIPT and its flags) one after another in one launch, each with its own cache
    and TensorBoard folder under `folder` unless it names one; `patches`: tests/patched.py's, for every
    run of the launch."""
    own = {"--cache-dir": "cache", "--log-dir": "tb"}
    made = [[*run, *(arg for flag, stem in own.items() if flag not in run
                     for arg in (flag, str(folder / f"{stem}-{name}")))] for name, run in runs.items()]
    command = one_launch(made)
    if patches:
        command = ["tests/patched.py", ",".join(patches), str(ROOT / command[0]), *command[1:]]
    result = run_script(command, nproc=2, env=environ, timeout=500)
    return Launch(result, dict(zip(runs, split_runs(result.stdout))), folder)


@pytest.fixture(scope="module")
def stored(s3, tmp_path_factory) -> Launch:
    """The runs that only read and write the store and succeed, one launch for them all: each MNIST
    layout trained from the store and checkpointed into it, the CIFAR-10 batches from the store (with
    tests/patched.py's checksums of the generated batches: the MNIST runs read none), the killed
    worker's uninterrupted reference, TensorBoard writing into the store."""
    runs = {layout: ["train_ddp.py", *MNIST, "--epochs", "1", "--max-steps", "3", "--data-dir", f"s3://data/{layout}",
                     "--checkpoint-dir", f"s3://ckpt/{layout}"] for layout in LAYOUTS}
    runs["cifar"] = ["train_ddp.py", *CIFAR, "--checkpoint-dir", str(tmp_path_factory.mktemp("cifar-ckpt"))]
    runs["kill-ref"] = ["train_ddp.py", *KILLED, "--checkpoint-dir", "s3://ckpt/kill-ref"]
    runs["tensorboard"] = ["train_ddp.py", *MNIST, "--epochs", "1", "--max-steps", "2", "--log-every", "1",
                           "--data-dir", "s3://data/mnist-raw", "--checkpoint-dir",
                           str(tmp_path_factory.mktemp("tb-ckpt")), "--log-dir", "s3://events/run1"]
    runs["corrupt-cut"] = CORRUPT_CUT  # stopped and saved: its status ends the launch, so it comes last
    launched = launch_runs(runs, tmp_path_factory.mktemp("stored"), env(s3), patches=(md5_patch(s3.cifar_local),))
    assert len(launched.consoles) == len(runs), launched.output()[-4000:]
    for name in runs:
        if name != "corrupt-cut":
            ok(launched.run(name))
    return launched


def env(server: S3Server, **extra: str) -> dict[str, str]:
    return {**child_env(), **server.env(), **extra}


def train(server: S3Server, tmp_path: Path, *flags: str, script: str = "train_ddp.py", nproc: int = 2,
          environ: dict[str, str] | None = None, torchrun: tuple[str, ...] = (), timeout: float = 240):
    args = [script, *flags, "--cache-dir", str(tmp_path / "cache"), "--log-dir", str(tmp_path / "tb")]
    return run_script(args, nproc=nproc, env=environ or env(server), torchrun=torchrun, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def keys(server: S3Server, bucket: str, prefix: str) -> list[str]:
    return [o["Key"] for o in server.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]


def objects(server: S3Server, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object's bytes: only once the run is over (a running job deletes pruned checkpoints)."""
    client = server.client()
    return {key: client.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys(server, bucket, prefix)}


def latest_in_store(server: S3Server, bucket: str, prefix: str) -> tuple[str, dict]:
    """(key, state) of the checkpoint named by the most recently saved run's pointer."""
    found = objects(server, bucket, prefix)
    pointers = [json.loads(body) for key, body in found.items() if key.endswith("/latest.json")]
    assert pointers, sorted(found)
    key = f"{prefix}/{max(pointers, key=lambda p: p['saved_at'])['checkpoint']}"
    return key, torch.load(io.BytesIO(found[key]), weights_only=True)


def max_dw(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def md5_patch(folder: Path) -> str:
    """tests/patched.py's patch that accepts the generated CIFAR batches' checksums."""
    return "cifar-batch-md5=" + str(folder / CIFAR_DIR)


# ---------------------------------------------------------------- training from and into the store

LAYOUTS = ["mnist-raw", "mnist-gz", "mnist-processed"]


def test_train_from_the_store_and_checkpoint_into_it(s3, stored):
    """Covers, for each MNIST layout in the store (a run each of `stored`'s launch): the data fetched
    from the store, the test set counted once, a checkpoint saved into the store and named on the console."""
    for layout in LAYOUTS:
        console = stored.consoles[layout]
        assert "(301 images)" in console and f"s3://data/{layout}: fetched" in stored.result.stderr
        key, state = latest_in_store(s3, "ckpt", layout)
        assert key.endswith("step-00000003.pt") and state["epoch"] == 1
        assert f"saved s3://ckpt/{layout}/" in console


def test_cifar_batches_from_the_store_keep_their_md5_check(s3, stored, tmp_path):
    """Generated batches are not the published files: refused, and nothing unverified kept; with their
    own checksums patched in (`stored`'s launch) the same batches train."""
    refused = train(s3, tmp_path, *CIFAR, "--checkpoint-dir", str(tmp_path / "ckpt"))
    errors = error_lines(refused.stderr)
    assert len(errors) == 1 and "s3://data/cifar/cifar-10-batches-py/" in errors[0] and "has md5" in errors[0], \
        refused.stderr[-3000:]
    assert not list((tmp_path / "cache").rglob("data_batch_*"))  # nothing unverified was kept
    assert "(301 images)" in stored.consoles["cifar"]


def test_the_cache_fetches_once_and_again_when_the_object_changes(s3, tmp_path):
    """Three runs in one launch, the first two held after their last step (tests/gates.py) while the test
    reads the store's log: the first fetches every file, the second none, the third the one object
    changed while the second was held."""
    flags = [*MNIST, "--epochs", "1", "--data-dir", "s3://data/mnist-gz", "--checkpoint-dir", str(tmp_path / "ckpt"),
             "--resume", "none", "--cache-dir", str(tmp_path / "cache"), "--log-dir", str(tmp_path / "tb")]
    runs = [["train_ddp.py", *flags, "--max-steps", str(steps)] for steps in (1, 2, 3)]  # run K reaches step K
    gate, first, second = Gate(tmp_path / "gates"), "all@1", "all@2"  # a released gate stays open for later runs
    changed = f"mnist-gz/{MNIST_DIR}/t10k-labels-idx1-ubyte.gz"
    body = objects(s3, "data", changed)[changed]
    launch = one_launch(runs)
    s3.log.clear()
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:  # files: no pipe fills
        proc = subprocess.Popen(script_command(["tests/patched.py", f"gate={first},gate={second}",
                                                str(ROOT / launch[0]), *launch[1:]], nproc=2),
                                cwd=ROOT, env={**env(s3), **gate.env()}, stdout=out, stderr=err)
    gate.job_output = (tmp_path / "stderr").read_text
    try:
        gate.held(first, processes=2)
        assert s3.log.gets("/data/mnist-gz/") == 4  # the four files, once per node (2 ranks, 1 node)
        s3.log.clear()
        gate.release(first)
        gate.held(second, processes=2)
        assert s3.log.gets("/data/mnist-gz/") == 0
        s3.client().put_object(Bucket="data", Key=changed, Body=_relabel(body))
        s3.log.clear()
        gate.release(second)
        proc.wait(timeout=2 * ENDS_PROMPTLY_S)
    finally:
        proc.kill()  # only if a wait above failed: the job is over otherwise
        s3.client().put_object(Bucket="data", Key=changed, Body=body)
    ok(subprocess.CompletedProcess(proc.args, proc.returncode, (tmp_path / "stdout").read_text(), gate.job_output()))
    assert s3.log.gets("/data/mnist-gz/") == 1 and s3.log.gets(f"/data/{changed}") == 1
    fetched = [line.strip() for line in gate.job_output().splitlines() if "s3://data/mnist-gz: fetched" in line]
    assert len(fetched) == 3 and "fetched 4 of 4 file(s)" in fetched[0], fetched  # local rank 0's, one a run
    assert "the cached copy is current" in fetched[1] and "fetched 1 of 4 file(s)" in fetched[2], fetched
    print(f"\nfirst fetch: {fetched[0]}")


def _relabel(gz_body: bytes) -> bytes:
    """The same IDX labels file with the first label changed: another object of the same size."""
    import gzip

    raw = bytearray(gzip.decompress(gz_body))
    raw[8] = (raw[8] + 1) % 10
    return gzip.compress(bytes(raw), mtime=0)


def test_a_killed_worker_resumes_from_the_store_exactly(s3, stored, tmp_path):
    """Against the uninterrupted run of the same flags (`stored`'s launch)."""
    _, reference = latest_in_store(s3, "ckpt", "kill-ref")
    result = run_script(["tests/faults.py", "ddp", "sigkill", "12", *KILLED, "--checkpoint-dir", "s3://ckpt/kill",
                         "--save-every-steps", "3", "--cache-dir", str(tmp_path / "cache"),
                         "--log-dir", str(tmp_path / "tb")], nproc=2, env=env(s3), torchrun=("--max-restarts=1",))
    ok(result)
    assert "resumed from s3://ckpt/kill/" in result.stdout
    _, final = latest_in_store(s3, "ckpt", "kill")
    assert final["epoch"] == 3
    dw = max_dw(final["model"], reference["model"])
    print(f"\nrank 1 killed at step 12, restarted, checkpoints in s3: max |dw| = {dw:.3g}")
    assert dw == 0  # the same world and the same sums in the same order: the same bits by design, on any CPU


CORRUPTED = [*MNIST, "--epochs", "1", "--max-steps", "14", "--data-dir", "s3://data/mnist-raw",
             "--checkpoint-dir", "s3://ckpt/corrupt", "--save-every-steps", "2"]
CORRUPT_CUT = ["tests/faults.py", "ddp", "sigterm", "10", *CORRUPTED]  # `stored`'s last run


def test_a_corrupt_newest_checkpoint_object_falls_back_to_the_previous(s3, stored, tmp_path):
    """The cut is `stored`'s last run; the resume, after its newest checkpoint is overwritten, a launch
    of its own (fresh processes find the fallback)."""
    cut = stored.run("corrupt-cut")
    stop = stop_after(10, save_every=2)
    assert cut.returncode != 0 and f"stopped by SIGTERM after step {stop} " in cut.stderr, cut.stderr[-3000:]
    key, state = latest_in_store(s3, "ckpt", "corrupt")
    assert state["global_step"] == stop
    s3.client().put_object(Bucket="ckpt", Key=key, Body=os.urandom(5000))
    resumed = train(s3, tmp_path, *CORRUPTED)
    ok(resumed)
    assert f"warning: checkpoint s3://ckpt/{key} is truncated or not a checkpoint" in resumed.stderr
    before = (stop - 1) // 2 * 2  # the save before the stop's (every 2 steps)
    previous = key.replace(f"step-{stop:08d}", f"step-{before:08d}")
    assert f"resumed from s3://ckpt/{previous}: epoch 1, step {before}" in resumed.stdout


def test_the_store_going_away_ends_the_job_clearly_and_the_run_resumes_when_it_is_back(s3, tmp_path):
    flags = [*MNIST, "--epochs", "1", "--max-steps", "0", "--data-dir", "s3://data/mnist-raw",
             "--checkpoint-dir", "s3://ckpt/outage", "--save-every-steps", "4", "--cache-dir", str(tmp_path / "cache"),
             "--log-dir", str(tmp_path / "tb")]
    gate, hold = Gate(tmp_path / "gates"), "all@9"  # held mid-run, past the save of step 8, until the store is gone
    proc = subprocess.Popen(script_command(["tests/patched.py", f"gate={hold}", "train_ddp.py", *flags], nproc=2),
                            cwd=ROOT, env={**env(s3), **gate.env()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    gate.held(hold, processes=2)
    deadline = time.monotonic() + 120
    while not any(k.endswith("latest.json") for k in keys(s3, "ckpt", "outage")):  # names only: pruning goes on
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint reached the store"
        time.sleep(0.2)  # a poll with a deadline: the background writer's upload, the ranks held meanwhile
    s3.stop()
    gone = time.monotonic()
    gate.release(hold)
    try:
        out, err = proc.communicate(timeout=2 * ENDS_PROMPTLY_S)
        seconds = time.monotonic() - gone
    finally:
        s3.start()  # the store is back, with everything it held
    errors = error_lines(err)
    assert proc.returncode != 0 and len(errors) == 1, err[-3000:]
    assert "saving checkpoint s3://ckpt/outage/" in errors[0] and "the store is unreachable" in errors[0]
    assert "the same command resumes from it" in errors[0]
    key, state = latest_in_store(s3, "ckpt", "outage")  # the last good checkpoint, whole
    if "failed at the run's pointer" in errors[0]:  # the store went away between a step file and its pointer
        key = errors[0].split("saving checkpoint s3://ckpt/")[1].split()[0]  # that file is whole and newer
    print(f"\nstore stopped with the job held after step 9: every process ended {seconds:.1f} s later; "
          f"last good checkpoint step {state['global_step']} intact")
    assert seconds < ENDS_PROMPTLY_S
    resumed = run_script(["train_ddp.py", *flags, "--max-steps", str(state["global_step"] + 2)], env=env(s3))
    assert "with other settings" in error_lines(resumed.stderr)[0]  # --max-steps is part of the run (any world)
    resumed = run_script(["train_ddp.py", *flags], nproc=2, env=env(s3), timeout=400)
    ok(resumed)
    assert f"resumed from s3://ckpt/{key}" in resumed.stdout


# ---------------------------------------------------------------- credentials and errors

@pytest.fixture(scope="module")
def optioned(s3, tmp_path_factory) -> Launch:
    """No credentials in the environment (nor an AWS file), only in --storage-options, one launch: given
    inline (a run of 2 steps), in a file (1 step), and inline for a data set the store does not hold
    (the run that fails, so the last)."""
    folder = tmp_path_factory.mktemp("optioned")
    options = json.dumps({"key": s3.key_id, "secret": s3.secret})
    (folder / "store.json").write_text(options)
    runs = {"inline": ["train_ddp.py", *MNIST, "--epochs", "1", "--max-steps", "2", "--data-dir", "s3://data/mnist-raw",
                       "--checkpoint-dir", "s3://ckpt/secrets", "--storage-options", options],
            "file": ["train_ddp.py", *MNIST, "--epochs", "1", "--max-steps", "1", "--data-dir", "s3://data/mnist-raw",
                     "--checkpoint-dir", "s3://ckpt/from-file", "--storage-options", f"@{folder / 'store.json'}"],
            "bad": ["train_ddp.py", *MNIST, "--data-dir", "s3://data/no-such-prefix", "--checkpoint-dir",
                    "s3://ckpt/secrets2", "--storage-options", options]}
    launched = launch_runs(runs, folder, without_credentials(s3))
    errors = error_lines(launched.result.stderr)
    assert launched.result.returncode != 0 and len(launched.consoles) == len(runs), launched.output()[-4000:]
    assert len(errors) == 1 and "s3://data/no-such-prefix" in errors[0], errors  # the last run's, the others ended 0
    return launched


def without_credentials(s3: S3Server, **extra: str) -> dict[str, str]:
    environ = {**env(s3), "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent", **extra}
    environ.pop("AWS_ACCESS_KEY_ID"), environ.pop("AWS_SECRET_ACCESS_KEY")
    return environ


def test_no_credential_reaches_any_output_event_file_or_checkpoint(s3, optioned):
    """Credentials given in --storage-options (`optioned`'s runs, one of which fails): none may be
    printed or saved."""
    haystacks = {"output": optioned.output()}
    haystacks.update({f"event file {p.name}": p.read_bytes().decode("latin1") for tb in optioned.folder.glob("tb-*")
                      for p in tb.rglob("*") if p.is_file()})
    for prefix in ("secrets", "from-file"):
        haystacks.update({f"object {k}": v.decode("latin1") for k, v in objects(s3, "ckpt", prefix).items()})
    assert any("tfevents" in where for where in haystacks), sorted(haystacks)  # the runs' event files searched
    for secret in (s3.key_id, s3.secret):
        leaks = [where for where, text in haystacks.items() if secret in text]
        assert not leaks, f"a credential appears in {leaks}"
    assert any(k.endswith(".pt") for k in objects(s3, "ckpt", "secrets"))


def test_credentials_from_a_file_or_a_variable_reach_the_store(s3, optioned, tmp_path):
    """No credentials anywhere but in the --storage-options file (`optioned`'s torchrun run) or variable
    (one process): the store is reached with them, and none is printed or saved."""
    options = json.dumps({"key": s3.key_id, "secret": s3.secret})
    from_variable = train(s3, tmp_path, *MNIST, "--epochs", "1", "--max-steps", "1", "--data-dir",
                          "s3://data/mnist-raw", "--checkpoint-dir", "s3://ckpt/from-variable", "--storage-options",
                          "env:DP_STORE", environ=without_credentials(s3, DP_STORE=options), nproc=None)
    ok(from_variable)
    for prefix in ("from-file", "from-variable"):
        key, state = latest_in_store(s3, "ckpt", prefix)
        assert state["global_step"] == 1 and s3.secret not in json.dumps(state["config"]), key
    printed = optioned.output() + from_variable.stdout + from_variable.stderr
    assert s3.key_id not in printed and s3.secret not in printed


# Every credential-bearing option of fsspec's common back ends, at the depths they take: (options,
# values that must be scrubbed, values that must stay readable).
BACK_ENDS = {
    "s3fs": ({"key": "AKIAS3FSKEY", "secret": "s3fs-secret", "token": "s3fs-session-token",
              "client_kwargs": {"endpoint_url": "http://minio:9000", "aws_access_key_id": "AKIACLIENTKEY",
                                "aws_secret_access_key": "client-secret", "aws_session_token": "client-token"},
              "config_kwargs": {"proxies": {"https": "http://proxyuser:proxy%40pass@proxy:3128"}}},
             ["AKIAS3FSKEY", "s3fs-secret", "s3fs-session-token", "AKIACLIENTKEY", "client-secret", "client-token",
              "proxy%40pass", "proxy@pass"], ["http://minio:9000", "proxyuser"]),
    "gcsfs": ({"project": "my-project", "token": {"type": "service_account", "private_key_id": "pkid-1234",
                                                  "private_key": "-----BEGIN PRIVATE KEY-----abc",
                                                  "client_secret": "gcs-client-secret",
                                                  "refresh_token": "gcs-refresh"}},
              ["pkid-1234", "-----BEGIN PRIVATE KEY-----abc", "gcs-client-secret", "gcs-refresh"], ["my-project"]),
    "gcsfs token file": ({"token": "/secrets/service-account.json"}, ["/secrets/service-account.json"], []),
    "adlfs": ({"account_name": "myaccount", "account_key": "adls-account-key", "sas_token": "sv=2024&sig=abcd",
               "connection_string": "DefaultEndpointsProtocol=https;AccountName=myaccount;AccountKey=cs-key",
               "tenant_id": "tenant-1", "client_id": "client-1", "client_secret": "adls-client-secret",
               "credential": "adls-credential"},
              ["adls-account-key", "sv=2024&sig=abcd", "DefaultEndpointsProtocol=https;AccountName=myaccount;"
               "AccountKey=cs-key", "adls-client-secret", "adls-credential"], ["myaccount", "tenant-1", "client-1"]),
    "http": ({"headers": {"Authorization": "Bearer http-bearer", "Cookie": "session=http-cookie",
                          "X-Api-Key": "http-api-key", "Accept": "application/json"},
              "client_kwargs": {"auth": ["httpuser", "http-password"], "timeout": 30}},
             ["Bearer http-bearer", "session=http-cookie", "http-api-key", "httpuser", "http-password"],
             ["application/json"]),
    "ftp, sftp, smb": ({"host": "files.example", "username": "ftpuser", "password": "ftp-password",
                        "passphrase": "sftp-passphrase", "pkey": "sftp-private-key"},
                       ["ftp-password", "sftp-passphrase", "sftp-private-key"], ["files.example", "ftpuser"]),
    "nested in lists": ({"fo": [{"protocol": "s3", "target_options": {"secret": "listed-secret"}}],
                         "mirrors": ["https://mirroruser:mirror-password@mirror.example/data"]},
                        ["listed-secret", "mirror-password"], ["mirroruser", "mirror.example"]),
}


@pytest.mark.quick
@pytest.mark.parametrize("back_end", list(BACK_ENDS))
def test_store_errors_are_scrubbed_of_every_credential_option(back_end):
    from common.storage import FsspecStorage

    options, secret, public = BACK_ENDS[back_end]
    store = FsspecStorage("memory://scrubbed", options)  # the memory file system takes any options
    message = store.scrub(f"error while using {json.dumps(options)} and {' / '.join(secret)}")
    assert not [s for s in secret if s in message], message
    assert all(value in message for value in public), message


def _closed_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"


ERRORS = {  # case -> (flags, environment changes, expected part of the one error line)
    "unknown bucket (data)": (["--data-dir", "s3://no-such-bucket/mnist"], {},
                              "--data-dir s3://no-such-bucket/mnist"),
    "unknown bucket (checkpoints)": (["--data-dir", "s3://data/mnist-raw", "--checkpoint-dir", "s3://no-such-bucket/r"],
                                     {}, "--checkpoint-dir s3://no-such-bucket/r: not found (The specified bucket"),
    "wrong layout": (["--data-dir", "s3://data/cifar"], {},
                     "mnist is missing s3://data/cifar/MNIST/raw/train-images-idx3-ubyte"),
    "missing credentials": (["--data-dir", "s3://data/mnist-raw"],
                            {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None,
                             "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"},
                            "no credentials found"),
    "unreachable endpoint": (["--data-dir", "s3://data/mnist-raw"], {"AWS_ENDPOINT_URL": "closed"},
                             "the store is unreachable"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_store_errors_are_one_line_on_every_rank_in_bounded_time(case, s3, tmp_path):
    flags, changes, expected = ERRORS[case]
    environ = env(s3)
    for name, value in changes.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = _closed_endpoint() if value == "closed" else value
    defaults = ["--checkpoint-dir", str(tmp_path / "ckpt")] if "--checkpoint-dir" not in flags else []
    start = time.monotonic()
    result = train(s3, tmp_path, *MNIST, *flags, *defaults, environ=environ)
    seconds = time.monotonic() - start
    errors = error_lines(result.stderr)
    assert result.returncode != 0 and len(errors) == 1 and expected in errors[0], result.stderr[-3000:]
    assert "/common/" not in result.stderr  # no rank's traceback
    print(f"\n{case}: exit {result.returncode} after {seconds:.1f} s: {errors[0][:160]}")
    assert seconds < ENDS_PROMPTLY_S


def test_wrong_credentials_are_named(s3, tmp_path):
    """The store checking signatures (moto's authentication, on for this test), a key it does not know,
    for a data set it holds."""
    environ = {**env(s3), "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0", "AWS_SECRET_ACCESS_KEY": "wrong-secret"}
    with s3.authenticating():
        result = train(s3, tmp_path, *MNIST, "--data-dir", "s3://data/mnist-raw", "--checkpoint-dir",
                       str(tmp_path / "ckpt"), environ=environ)
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "access denied, wrong or missing credentials" in errors[0], result.stderr[-3000:]
    assert "wrong-secret" not in result.stderr + result.stdout


def flag_errors(stderr: str) -> list[str]:
    """argparse's one line per bad flag: 'train_ddp.py: error: ...'."""
    return [line for line in stderr.splitlines() if ": error: " in line]


@pytest.mark.quick
def test_without_s3fs_an_s3_url_is_refused_before_any_process_group(tmp_path, capsys, monkeypatch):
    from fsspec import registry  # noqa: F401 - the module, which fsspec's package shadows with its mapping

    monkeypatch.setitem(sys.modules, "s3fs", None)  # `import s3fs` fails, as if it were not installed
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)  # kept by an earlier import
    code, stderr = refusal_in_process(["train_ddp.py", *MNIST, "--data-dir", "s3://data/mnist-raw", "--log-dir",
                                       str(tmp_path / "tb")], capsys, monkeypatch)
    errors = flag_errors(stderr)
    assert code == 2 and len(errors) == 1, stderr[-3000:]
    assert "--data-dir s3://data/mnist-raw: s3:// URLs need a package that is not installed" in errors[0]


# ---------------------------------------------------------------- TensorBoard

def test_tensorboard_writes_to_the_store(s3, stored, monkeypatch):
    events = [k for k in objects(s3, "events", "run1") if "tfevents" in k]
    assert len(events) == 1
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator("s3://events/run1")
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2] and [e.step for e in acc.Scalars("test/acc")] == [2]


@pytest.mark.quick
def test_a_log_dir_url_tensorboard_cannot_write_is_refused_before_any_process_group(capsys, monkeypatch):
    code, stderr = refusal_in_process(["train_ddp.py", *MNIST, "--log-dir", "nosuchprotocol://x/y"], capsys,
                                      monkeypatch)
    errors = flag_errors(stderr)
    assert code == 2 and len(errors) == 1 and "--log-dir nosuchprotocol://x/y" in errors[0]


@pytest.mark.quick
def test_a_log_dir_tensorboard_cannot_make_is_one_line_naming_it(tmp_path):
    """Found as rank 0's TensorBoard makes its folder, after the process group: a local folder that cannot
    be made, or a store without credentials, was a traceback (30 and 69 lines)."""
    from botocore.exceptions import NoCredentialsError
    from torch.utils.tensorboard import SummaryWriter

    from common.errors import UserError
    from common.output.logger import open_writer

    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"^--log-dir \S+/file/tb: TensorBoard cannot write there \(Not a directory "
                                        r"\(ENOTDIR\)\); pass a --log-dir this user can write to$"):
        open_writer(SummaryWriter, str(tmp_path / "file" / "tb"), None)

    def without_credentials(log_dir: str, purge_step: int | None) -> None:
        raise NoCredentialsError()
    with pytest.raises(UserError, match=r"^--log-dir s3://b/x: TensorBoard cannot write there \(no credentials found: "
                                        r".*\); check the URL and the store, or pass a local --log-dir$"):
        open_writer(without_credentials, "s3://b/x", None)
