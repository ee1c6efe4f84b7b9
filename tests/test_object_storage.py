"""Data and checkpoints in an object store: a real S3-compatible server (moto's server mode) on
127.0.0.1, real torchrun processes (gloo, CPU), the suite's own code unmocked."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
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
    run_script,
    script_command,
    split_runs,
    stop_after,
)
from tests.datagen import write_cifar10, write_mnist, write_mnist_processed
from tests.gates import Gate
from tests.s3server import S3Server

MNIST = ["--dataset", "mnist", "--model", "lenet", "--batch-size", "32", "--eval-batch-size", "301"]


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


def test_train_from_the_store_and_checkpoint_into_it(s3, tmp_path):
    """Covers, for each MNIST layout in the store (one launch, a run each): the data fetched from the
    store, the test set counted once, a checkpoint saved into the store and named on the console."""
    runs = [["train_ddp.py", *MNIST, "--epochs", "1", "--max-steps", "3", "--data-dir", f"s3://data/{layout}",
             "--checkpoint-dir", f"s3://ckpt/{layout}", "--cache-dir", str(tmp_path / f"cache-{layout}"), "--log-dir",
             str(tmp_path / f"tb-{layout}")] for layout in LAYOUTS]
    result = run_script(one_launch(runs), nproc=2, env=env(s3), timeout=400)
    ok(result)
    for layout, stdout in zip(LAYOUTS, split_runs(result.stdout)):
        assert "(301 images)" in stdout and f"s3://data/{layout}: fetched" in result.stderr
        key, state = latest_in_store(s3, "ckpt", layout)
        assert key.endswith("step-00000003.pt") and state["epoch"] == 1
        assert f"saved s3://ckpt/{layout}/" in stdout


def test_cifar_batches_from_the_store_keep_their_md5_check(s3, tmp_path):
    flags = ["--dataset", "cifar10", "--model", "lenet", "--batch-size", "100", "--epochs", "1", "--max-steps", "2",
             "--data-dir", "s3://data/cifar", "--checkpoint-dir", str(tmp_path / "ckpt")]
    refused = train(s3, tmp_path, *flags)  # generated batches are not the published files
    errors = error_lines(refused.stderr)
    assert len(errors) == 1 and "s3://data/cifar/cifar-10-batches-py/" in errors[0] and "has md5" in errors[0], \
        refused.stderr[-3000:]
    assert not list((tmp_path / "cache").rglob("data_batch_*"))  # nothing unverified was kept
    accepted = run_script(["tests/patched.py", md5_patch(s3.cifar_local), str(ROOT / "train_ddp.py"), *flags,
                           "--cache-dir", str(tmp_path / "cache"), "--log-dir", str(tmp_path / "tb")],
                          nproc=2, env=env(s3))
    ok(accepted)
    assert "(301 images)" in accepted.stdout


def test_the_cache_fetches_once_and_again_when_the_object_changes(s3, tmp_path):
    flags = [*MNIST, "--epochs", "1", "--max-steps", "1", "--data-dir", "s3://data/mnist-gz",
             "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume", "none"]
    s3.log.clear()
    first = train(s3, tmp_path, *flags)
    ok(first)
    fetched_line = next(line for line in first.stderr.splitlines() if "s3://data/mnist-gz: fetched" in line)
    assert s3.log.gets("/data/mnist-gz/") == 4  # the four files, once per node (2 ranks, 1 node)
    s3.log.clear()
    second = train(s3, tmp_path, *flags)
    ok(second)
    assert s3.log.gets("/data/mnist-gz/") == 0 and "the cached copy is current" in second.stderr
    changed = f"mnist-gz/{MNIST_DIR}/t10k-labels-idx1-ubyte.gz"
    body = objects(s3, "data", changed)[changed]
    s3.client().put_object(Bucket="data", Key=changed, Body=_relabel(body))
    s3.log.clear()
    third = train(s3, tmp_path, *flags)
    ok(third)
    assert s3.log.gets("/data/mnist-gz/") == 1 and s3.log.gets(f"/data/{changed}") == 1
    s3.client().put_object(Bucket="data", Key=changed, Body=body)
    print(f"\nfirst fetch: {fetched_line.strip()}")


def _relabel(gz_body: bytes) -> bytes:
    """The same IDX labels file with the first label changed: another object of the same size."""
    import gzip

    raw = bytearray(gzip.decompress(gz_body))
    raw[8] = (raw[8] + 1) % 10
    return gzip.compress(bytes(raw), mtime=0)


def test_a_killed_worker_resumes_from_the_store_exactly(s3, tmp_path):
    flags = [*MNIST, "--epochs", "3", "--max-steps", "8", "--data-dir", "s3://data/mnist-raw"]
    ok(train(s3, tmp_path / "ref", *flags, "--checkpoint-dir", "s3://ckpt/kill-ref"))
    _, reference = latest_in_store(s3, "ckpt", "kill-ref")
    result = run_script(["tests/faults.py", "ddp", "sigkill", "12", *flags, "--checkpoint-dir", "s3://ckpt/kill",
                         "--save-every-steps", "3", "--cache-dir", str(tmp_path / "cache"),
                         "--log-dir", str(tmp_path / "tb")], nproc=2, env=env(s3), torchrun=("--max-restarts=1",))
    ok(result)
    assert "resumed from s3://ckpt/kill/" in result.stdout
    _, final = latest_in_store(s3, "ckpt", "kill")
    assert final["epoch"] == 3
    dw = max_dw(final["model"], reference["model"])
    print(f"\nrank 1 killed at step 12, restarted, checkpoints in s3: max |dw| = {dw:.3g}")
    assert dw <= 1e-6  # the same world and the same sums in the same order: the same bits by design, on any CPU


def test_a_corrupt_newest_checkpoint_object_falls_back_to_the_previous(s3, tmp_path):
    flags = [*MNIST, "--epochs", "1", "--max-steps", "14", "--data-dir", "s3://data/mnist-raw",
             "--checkpoint-dir", "s3://ckpt/corrupt", "--save-every-steps", "2"]
    cut = run_script(["tests/faults.py", "ddp", "sigterm", "10", *flags, "--cache-dir", str(tmp_path / "cache"),
                      "--log-dir", str(tmp_path / "tb")], nproc=2, env=env(s3))
    stop = stop_after(10, save_every=2)
    assert f"stopped by SIGTERM after step {stop} " in cut.stderr, cut.stderr[-3000:]
    key, state = latest_in_store(s3, "ckpt", "corrupt")
    assert state["global_step"] == stop
    s3.client().put_object(Bucket="ckpt", Key=key, Body=os.urandom(5000))
    resumed = train(s3, tmp_path, *flags)
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
    resumed = run_script(["train_ddp.py", *flags, "--max-steps", str(state["global_step"] + 2)], nproc=2,
                         env=env(s3))
    assert "with other settings" in error_lines(resumed.stderr)[0]  # --max-steps is part of the run
    resumed = run_script(["train_ddp.py", *flags], nproc=2, env=env(s3), timeout=400)
    ok(resumed)
    assert f"resumed from s3://ckpt/{key}" in resumed.stdout


# ---------------------------------------------------------------- credentials and errors

def test_no_credential_reaches_any_output_event_file_or_checkpoint(s3, tmp_path):
    """Credentials given in --storage-options and in the environment: none may be printed or saved."""
    options = json.dumps({"key": s3.key_id, "secret": s3.secret})
    environ = env(s3)
    environ.pop("AWS_ACCESS_KEY_ID"), environ.pop("AWS_SECRET_ACCESS_KEY")
    good = train(s3, tmp_path, *MNIST, "--epochs", "1", "--max-steps", "2", "--data-dir", "s3://data/mnist-raw",
                 "--checkpoint-dir", "s3://ckpt/secrets", "--storage-options", options, environ=environ)
    ok(good)
    bad = train(s3, tmp_path, *MNIST, "--data-dir", "s3://data/no-such-prefix", "--checkpoint-dir",
                "s3://ckpt/secrets2", "--storage-options", options, environ=environ)
    assert bad.returncode != 0
    haystacks = {"stdout": good.stdout + bad.stdout, "stderr": good.stderr + bad.stderr}
    haystacks.update({f"event file {p.name}": p.read_bytes().decode("latin1") for p in (tmp_path / "tb").rglob("*")
                      if p.is_file()})
    haystacks.update({f"object {k}": v.decode("latin1") for k, v in objects(s3, "ckpt", "secrets").items()})
    for secret in (s3.key_id, s3.secret):
        leaks = [where for where, text in haystacks.items() if secret in text]
        assert not leaks, f"a credential appears in {leaks}"
    assert any(k.endswith(".pt") for k in objects(s3, "ckpt", "secrets"))


def test_credentials_from_a_file_or_a_variable_reach_the_store(s3, tmp_path):
    """No credentials anywhere but in the --storage-options file (a torchrun run) or variable (one
    process): the store is reached with them, and none is printed or saved."""
    options = json.dumps({"key": s3.key_id, "secret": s3.secret})
    (tmp_path / "store.json").write_text(options)
    environ = {**env(s3), "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
               "DP_STORE": options}
    environ.pop("AWS_ACCESS_KEY_ID"), environ.pop("AWS_SECRET_ACCESS_KEY")
    flags = [*MNIST, "--epochs", "1", "--max-steps", "1", "--data-dir", "s3://data/mnist-raw"]
    from_file = train(s3, tmp_path, *flags, "--checkpoint-dir", "s3://ckpt/from-file", "--storage-options",
                      f"@{tmp_path / 'store.json'}", environ=environ)
    ok(from_file)
    from_variable = train(s3, tmp_path, *flags, "--checkpoint-dir", "s3://ckpt/from-variable", "--storage-options",
                          "env:DP_STORE", environ=environ, nproc=None)
    ok(from_variable)
    for prefix in ("from-file", "from-variable"):
        key, state = latest_in_store(s3, "ckpt", prefix)
        assert state["global_step"] == 1 and s3.secret not in json.dumps(state["config"]), key
    printed = from_file.stdout + from_file.stderr + from_variable.stdout + from_variable.stderr
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


def test_wrong_credentials_are_named(tmp_path):
    """A server that checks signatures (moto with authentication on), a key it does not know."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        environ = {**child_env(), "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0", "AWS_SECRET_ACCESS_KEY": "wrong-secret",
                   "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_DEFAULT_REGION": "us-east-1",
                   "AWS_EC2_METADATA_DISABLED": "true"}
        deadline = time.monotonic() + 30
        while subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"], capture_output=True).returncode:
            assert time.monotonic() < deadline, "moto server did not start"
            time.sleep(0.2)  # a poll with a deadline: the server starting
        result = run_script(["train_ddp.py", *MNIST, "--data-dir", "s3://data/mnist", "--cache-dir",
                             str(tmp_path / "cache"), "--checkpoint-dir", str(tmp_path / "ckpt")], nproc=2, env=environ)
    finally:
        server.terminate()
        server.wait(timeout=30)
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "access denied, wrong or missing credentials" in errors[0], result.stderr[-3000:]
    assert "wrong-secret" not in result.stderr + result.stdout


def flag_errors(stderr: str) -> list[str]:
    """argparse's one line per bad flag: 'train_ddp.py: error: ...'."""
    return [line for line in stderr.splitlines() if ": error: " in line]


def test_without_s3fs_an_s3_url_is_refused_before_any_process_group(s3, tmp_path):
    result = run_script(["tests/patched.py", "no-module=s3fs", str(ROOT / "train_ddp.py"), *MNIST, "--data-dir",
                         "s3://data/mnist-raw", "--log-dir", str(tmp_path / "tb")], nproc=2, env=env(s3))
    errors = flag_errors(result.stderr)
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert "--data-dir s3://data/mnist-raw: s3:// URLs need a package that is not installed" in errors[0]


# ---------------------------------------------------------------- TensorBoard

def test_tensorboard_writes_to_the_store(s3, tmp_path, monkeypatch):
    result = run_script(["train_ddp.py", *MNIST, "--epochs", "1", "--max-steps", "2", "--log-every", "1",
                         "--data-dir", "s3://data/mnist-raw", "--cache-dir", str(tmp_path / "cache"),
                         "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", "s3://events/run1"],
                        nproc=2, env=env(s3))
    ok(result)
    events = [k for k in objects(s3, "events", "run1") if "tfevents" in k]
    assert len(events) == 1
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator("s3://events/run1")
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2] and [e.step for e in acc.Scalars("test/acc")] == [2]


def test_a_log_dir_url_tensorboard_cannot_write_is_refused_before_any_process_group(tmp_path):
    result = run_script(["train_ddp.py", *MNIST, "--log-dir", "nosuchprotocol://x/y"], nproc=2)
    errors = flag_errors(result.stderr)
    assert result.returncode != 0 and len(errors) == 1 and "--log-dir nosuchprotocol://x/y" in errors[0]
