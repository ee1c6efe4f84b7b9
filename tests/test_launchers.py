"""The launchers with real processes: signals reach torchrun and the workers save before they stop,
SLURM's GPU counts in all their forms, a Kubernetes manifest that keeps every argument intact, no
credential in any echo or manifest, and the grace every launcher gives the stop."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from common.interrupts import STARTUP_LINE
from tests.conftest import ENDS_PROMPTLY_S, ROOT, TORCHRUN_GRACE_S, as_from_a_terminal, child_env, free_port
from tests.gates import Gate

LAUNCH = ROOT / "launch"
PARAMETERS = {"NPROC", "NNODES", "RDZV_ENDPOINT", "RDZV_ID", "NODE_RANK", "LOCAL_ADDR", "MAX_RESTARTS", "JOIN_TIMEOUT",
              "PORT", "RDZV_PORT", "DRY_RUN", "IMAGE", "DATA_PVC", "CKPT_PVC", "WORKERS", "JOB_NAME", "BACKOFF_LIMIT",
              "SECRET_NAME", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}


def launcher_env(**env: str) -> dict[str, str]:
    """child_env() without the launchers' parameters or a Slurm job of this host, plus env."""
    base = {k: v for k, v in child_env().items() if k not in PARAMETERS and not k.startswith("SLURM_")}
    return {**base, **env}


# 1 -------------------------------------------------------------------------------------------
def ours(tag: str) -> list[int]:
    """Pids of the processes whose command line holds tag (a path unique to one test)."""
    found = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def gone_within(tag: str, seconds: float) -> float | None:
    """Seconds until no process holds tag, or None if some still do after `seconds`."""
    start = time.monotonic()
    while ours(tag):
        if time.monotonic() - start > seconds:
            return None
        time.sleep(0.1)  # a poll with a deadline
    return time.monotonic() - start


class Lines(threading.Thread):
    """Reads a pipe to its end."""

    def __init__(self, stream) -> None:
        super().__init__(daemon=True)
        self.stream, self.lines = stream, []
        self.start()

    def run(self) -> None:
        for line in self.stream:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)


LAUNCHED = {  # launcher: its environment ({port}: a free one)
    "multi_node.sh": {"NNODES": "1", "RDZV_ENDPOINT": "127.0.0.1:{port}", "NPROC": "2"},
    "local_two_nodes.sh": {"NPROC": "1"},
    "single_node.sh": {"NPROC": "2"},
}


@pytest.mark.parametrize("script, name, group, times", [
    ("multi_node.sh", "SIGTERM", False, 1), ("local_two_nodes.sh", "SIGTERM", False, 1),
    ("multi_node.sh", "SIGINT", False, 1), ("local_two_nodes.sh", "SIGINT", False, 1),
    ("local_two_nodes.sh", "SIGINT", True, 1),  # Ctrl-C in a terminal: INT to the launcher's whole process group
    ("single_node.sh", "SIGTERM", False, 1),
    ("single_node.sh", "SIGTERM", False, 2),  # `kill` twice, a second scancel: torchrun's agent is signalled again
], ids=["multi_node-TERM", "local_two_nodes-TERM", "multi_node-INT", "local_two_nodes-INT", "local_two_nodes-ctrl_c",
        "single_node-TERM", "single_node-TERM-twice"])
def test_a_signal_to_the_launcher_stops_training_with_a_checkpoint(script, name, group, times, tmp_path):
    ckpt = tmp_path / "ckpt"  # unique to this test: names its processes for pgrep
    # 312 steps: both workers are held after step 10 (tests/gates.py) until the signal reached them, so
    # the stop it asks for lands after step 11 on a host of any speed
    flags = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--batch-size", "32",
             "--epochs", "1", "--log-dir", str(tmp_path / "tb"), "--checkpoint-dir", str(ckpt)]
    gate, hold = Gate(tmp_path / "gates"), "all@10"
    env = launcher_env(**{k: v.format(port=free_port()) for k, v in LAUNCHED[script].items()}, **gate.env())
    proc = subprocess.Popen([str(LAUNCH / script), "tests/patched.py", f"gate={hold}", "train_ddp.py", *flags],
                            cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=as_from_a_terminal)
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    try:
        gate.held(hold, processes=2, timeout=120)
        sent = time.monotonic()
        for _ in range(times):
            if group:
                os.killpg(proc.pid, getattr(signal, name))
            else:
                proc.send_signal(getattr(signal, name))  # to the launcher's pid only, as `kill -TERM PID` does
            gate.signalled(hold, processes=2)  # a second signal comes while the agent waits for its workers
        gate.release(hold)
        proc.wait(timeout=60)
        exited = time.monotonic() - sent
        left_at_exit = ours(str(ckpt))
        gone = gone_within(str(ckpt), 60)
    finally:
        for pid in ours(str(ckpt)):  # a launcher that lost its children: end them, they are this test's
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    out.join(timeout=30)
    err.join(timeout=30)
    # Rank 0's stderr; local_two_nodes.sh's node 1 may hold rank 0 (c10d ranks agents by pid, which wraps),
    # and its lines arrive on stdout behind a prefix.
    rank_0 = [*err.lines, *(line.removeprefix("[node 1] ") for line in out.lines if line.startswith("[node 1] "))]
    stopped = [line for line in rank_0 if line.startswith(f"stopped by {name} after step")]
    saved = sorted(ckpt.rglob("*.pt")) if ckpt.exists() else []
    to = f"{script}'s process group" if group else script
    print(f"\n{name} to {to}: launcher exited {exited:.1f} s later (status {proc.returncode}), every process gone "
          f"{exited + (gone or 0):.1f} s later; {stopped[0].split(';')[0] if stopped else 'no stop line'}")
    assert not left_at_exit, f"the launcher exited before its children {left_at_exit}"
    assert gone is not None
    assert proc.returncode != 0  # training did not complete
    assert len(stopped) == 1 and stopped[0].startswith(f"stopped by {name} after step 11 "), err.text()[-3000:]
    if script == "single_node.sh":  # quiet_torchrun: no traceback from the agent, also after a second signal
        assert "Traceback" not in err.text(), err.text()[-3000:]
    assert saved, f"no checkpoint under {ckpt}"


def test_ctrl_c_during_start_up_is_one_line_and_status_130(tmp_path):
    """A terminal's Ctrl-C (INT to the launcher's whole process group) while both workers are held as
    they begin to prepare their data (the process group joined, nothing trained): the job ends with
    status 130, the start-up line once (local rank 0's), the launcher's line, no traceback from any
    rank or the agent, no checkpoint, and no process left."""
    ckpt = tmp_path / "ckpt"  # unique to this test: names its processes for pgrep
    flags = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--batch-size", "32",
             "--epochs", "1", "--log-dir", str(tmp_path / "tb"), "--checkpoint-dir", str(ckpt)]
    gate, hold = Gate(tmp_path / "gates"), "all@data"
    proc = subprocess.Popen([str(LAUNCH / "single_node.sh"), "tests/patched.py", f"gate={hold}", "train_ddp.py",
                             *flags], cwd=ROOT, env=launcher_env(NPROC="2", **gate.env()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=as_from_a_terminal)
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    gate.job_output = err.text
    try:
        gate.held(hold, processes=2, timeout=120)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=TORCHRUN_GRACE_S)  # below torchrun's grace: the workers ended by themselves
        exited = time.monotonic() - sent
        gone = gone_within(str(ckpt), 30)
    finally:
        for pid in ours(str(ckpt)):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    out.join(timeout=30)
    err.join(timeout=30)
    print(f"\nCtrl-C at start-up's data preparation: launcher exited {exited:.1f} s later (status {proc.returncode}), "
          f"every process gone {exited + (gone or 0):.1f} s later")
    said = err.text()
    assert proc.returncode == 128 + signal.SIGINT, said[-3000:]
    assert "Traceback" not in said + out.text(), said[-3000:]
    assert err.lines == [f"{STARTUP_LINE}\n", "launcher: SIGINT passed on to the workers; they have ended\n"], said
    assert gone is not None, f"processes left: {ours(str(ckpt))}"
    assert not list(ckpt.rglob("*.pt"))  # nothing trained, nothing saved


# 2 -------------------------------------------------------------------------------------------
def slurm(env: dict[str, str]) -> subprocess.CompletedProcess:
    job = {"DRY_RUN": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "7"}
    return subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "train_ddp.py"], cwd=ROOT,
                          env=launcher_env(**job, **env), capture_output=True, text=True, timeout=30)


SLURM_FORMS = [
    ({"SLURM_GPUS_PER_NODE": "4"}, 4),
    ({"SLURM_GPUS_PER_NODE": "a100:4"}, 4),
    ({"SLURM_GPUS_PER_NODE": "gpu:a100:8"}, 8),
    ({"SLURM_GPUS_PER_NODE": "a100:2,v100:1"}, 3),
    ({"SLURM_GPUS_ON_NODE": "2"}, 2),
    ({"SLURM_JOB_GRES": "gpu:4"}, 4),
    ({"SLURM_JOB_GRES": "gpu:a100:4"}, 4),
    ({"SLURM_JOB_GRES": "gpu:a100:4(IDX:0-3)"}, 4),
    ({"SLURM_JOB_GRES": "gpu:a100:3(IDX:0,2-3)"}, 3),
    ({"SLURM_JOB_GRES": "gpu:2,mps:100"}, 2),
    ({"SLURM_JOB_GRES": "mps:100,gpu:v100:2(S:0-1)"}, 2),
    ({"SLURM_GRES": "gpu:6"}, 6),
    ({"SLURM_GRES": "gpu"}, 1),
    # precedence: NPROC, SLURM_GPUS_PER_NODE, SLURM_GPUS_ON_NODE, SLURM_JOB_GRES, SLURM_GRES
    ({"NPROC": "3", "SLURM_GPUS_PER_NODE": "a100:4", "SLURM_JOB_GRES": "gpu:4"}, 3),
    ({"SLURM_GPUS_PER_NODE": "a100:4", "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_GRES": "gpu:8"}, 4),
    ({"SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_GRES": "gpu:8"}, 2),
    ({"SLURM_JOB_GRES": "gpu:a100:4(IDX:0-3)", "SLURM_GRES": "gpu:1"}, 4),
    ({"SLURM_JOB_GRES": "mps:100", "SLURM_GRES": "gpu:2"}, 2),
    ({"NPROC": "2"}, 2),  # a CPU-only job
]


@pytest.mark.parametrize("env, nproc", SLURM_FORMS, ids=[" ".join(map("=".join, e.items())) for e, _ in SLURM_FORMS])
def test_slurm_reads_the_gpu_count_in_each_of_its_forms(env, nproc):
    result = slurm(env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"srun --kill-on-bad-exit=1 torchrun --nnodes=2 --nproc_per_node={nproc} --rdzv-backend=c10d "
        "--rdzv-endpoint=gpu01:29400 --rdzv-id=7 --max-restarts=0 train_ddp.py")


@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_GRES": "mps:100"}, {"SLURM_GPUS_ON_NODE": "0"}],
                         ids=["nothing", "gres without gpus", "0 gpus"])
def test_slurm_without_gpus_or_nproc_is_a_clear_error(env):
    result = slurm(env)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for name in ("SLURM_GPUS_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GRES", "SLURM_GRES", "NPROC=N",
                 "--gpus-per-node"):
        assert name in lines[0]


# 3 -------------------------------------------------------------------------------------------
HOSTILE = ["--log-dir", "/logs/my run", '--note=say "hi"', "*.txt", "$(touch PWNED)", "two\nlines", "it's",
           "back\\slash", "key: value", "- item", "{a: b}", "#hash", "&anchor", "!tag", "", "null", "yes", "0x10",
           "tab\there", "ünïcode"]


def k8s(tmp: Path, env: dict[str, str], args: list[str]) -> subprocess.CompletedProcess:
    """From tmp as the working directory, where a.txt would match a glob of *.txt."""
    (tmp / "a.txt").write_text("")
    fake = tmp / "bin"  # a kubectl that records what it was given
    fake.mkdir(exist_ok=True)
    (fake / "kubectl").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {shlex.quote(str(tmp / "kubectl.args"))}\n'
                                  f'cat > {shlex.quote(str(tmp / "kubectl.stdin"))}\n')
    (fake / "kubectl").chmod(0o755)
    path = f"{fake}{os.pathsep}{child_env()['PATH']}"
    return subprocess.run(["bash", str(LAUNCH / "k8s.sh"), "train_ddp.py", *args], cwd=tmp,
                          env=launcher_env(PATH=path, **env), capture_output=True, text=True, timeout=30)


def split(stdout: str) -> tuple[str, dict]:
    """The `# each pod runs: ...` line and the manifest after it."""
    first, _, rest = stdout.partition("\n")
    assert first.startswith("# each pod runs: "), stdout
    return first.removeprefix("# each pod runs: "), yaml.safe_load(rest)


def test_k8s_manifest_keeps_every_argument_intact(tmp_path):
    pwned = tmp_path / "pwned"
    args = [arg.replace("PWNED", str(pwned)) for arg in HOSTILE]
    result = k8s(tmp_path, {"IMAGE": "registry.example/dp:1", "DATA_PVC": "data", "NPROC": "2", "DRY_RUN": "1"}, args)
    assert result.returncode == 0, result.stderr
    command, manifest = split(result.stdout)
    expected = ["bash", "launch/quiet_torchrun.sh", "--nproc_per_node=2", "--max-restarts=3", "train_ddp.py",
                "--data-dir", "/data", "--checkpoint-dir", "/checkpoints/dp-suite", *args]
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    for role in ("Master", "Worker"):
        assert specs[role]["template"]["spec"]["containers"][0]["command"] == expected
        assert specs[role]["restartPolicy"] == "OnFailure"
    assert manifest["spec"]["runPolicy"] == {"backoffLimit": 3}
    # the printed command is one line of shell that gives back the same arguments
    echoed = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], cwd=tmp_path, capture_output=True, text=True)
    assert echoed.stdout.split("\0")[:-1] == expected
    assert not pwned.exists() and not (tmp_path / "kubectl.stdin").exists()  # nothing ran, nothing applied
    print(f"\nk8s: {len(args)} hostile arguments intact; the printed command: {command[:120]}...")


def test_k8s_applies_the_manifest_it_prints(tmp_path):
    env = {"IMAGE": "img:2", "DATA_PVC": "data", "CKPT_PVC": "ckpt", "WORKERS": "3", "NPROC": "4",
           "JOB_NAME": "run7", "MAX_RESTARTS": "1", "BACKOFF_LIMIT": "5"}
    result = k8s(tmp_path, env, ["--log-dir", "/logs/my run"])
    assert result.returncode == 0, result.stderr
    command, printed = split(result.stdout)
    assert command == ("bash launch/quiet_torchrun.sh --nproc_per_node=4 --max-restarts=1 train_ddp.py "
                       "--data-dir /data --checkpoint-dir /checkpoints/run7 --log-dir '/logs/my run'")
    assert (tmp_path / "kubectl.args").read_text().split() == ["apply", "-f", "-"]
    applied = yaml.safe_load((tmp_path / "kubectl.stdin").read_text())
    assert applied == printed
    assert applied["metadata"] == {"name": "run7"} and applied["spec"]["runPolicy"] == {"backoffLimit": 5}
    specs = applied["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 3
    pod = specs["Worker"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 4}}
    assert [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"][:2]] == ["data", "ckpt"]


@pytest.mark.parametrize("env", [{"NPROC": "two"}, {"WORKERS": "-1"}, {"BACKOFF_LIMIT": "x"}], ids=lambda e: [*e][0])
def test_k8s_refuses_bad_numbers(env, tmp_path):
    result = k8s(tmp_path, {"IMAGE": "img", "DATA_PVC": "data", "DRY_RUN": "1", **env}, [])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1, result.stderr
    assert next(iter(env)) in result.stderr


# 4 -------------------------------------------------------------------------------------------
# Credentials on a launcher's command line: values unique to this session, so that a search for them
# in what the launchers print or write cannot match anything else.
KEY, SECRET, PASSWORD = (f"AKIA{os.urandom(6).hex().upper()}", f"s3cr3t-{os.urandom(8).hex()}",
                         f"pw-{os.urandom(6).hex()}")
INLINE = json.dumps({"endpoint_url": "http://minio:9000", "key": KEY, "secret": SECRET})
CREDENTIAL_ARGS = {
    "inline": ["--storage-options", INLINE],
    "inline with =": [f"--storage-options={INLINE}"],
    "abbreviated flag": ["--storage", INLINE],  # the scripts refuse a prefix, after the launcher's echo
    "URL password": ["--data-dir", f"https://reader:{PASSWORD}@data.example/mnist"],
}
ECHOED = {  # launcher: its environment for a DRY_RUN
    "single_node.sh": {"NPROC": "2"},
    "multi_node.sh": {"NNODES": "2", "RDZV_ENDPOINT": "head:29400"},
    "local_two_nodes.sh": {"PORT": "4321"},
    "slurm.sbatch": {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "7", "NPROC": "2"},
}


def leaked(text: str) -> list[str]:
    return [name for name, value in (("key", KEY), ("secret", SECRET), ("password", PASSWORD)) if value in text]


@pytest.mark.parametrize("form", list(CREDENTIAL_ARGS))
@pytest.mark.parametrize("script", list(ECHOED))
def test_no_launcher_echoes_a_credential(script, form):
    args = CREDENTIAL_ARGS[form]
    result = subprocess.run(["bash", str(LAUNCH / script), "train_ddp.py", *args, "--epochs", "2"], cwd=ROOT,
                            env=launcher_env(DRY_RUN="1", **ECHOED[script]), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert not leaked(result.stdout + result.stderr), result.stdout
    for line in result.stdout.splitlines():  # the rest of the command is intact
        assert line.endswith(("train_ddp.py --storage-options '***' --epochs 2", "'--storage-options=***' --epochs 2",
                              "--storage '***' --epochs 2",
                              "--data-dir 'https://reader:***@data.example/mnist' --epochs 2"))


ECHO_CASES = {  # an argument: how the launchers' echo shows it
    "s3://AKIA:se@cret@host/b": "'s3://AKIA:***@host/b'",  # the password up to the LAST @ before the host
    "https://tok:abc def@h/x": "'https://tok:***@h/x'",  # across a space
    "--data-dir=ftp://u:p@w@h": "'--data-dir=ftp://u:***@h'",  # no path after the host
    "https://a:b@h/ and s3://c:d@e@f/g": "'https://a:***@h/ and s3://c:***@f/g'",  # each URL of an argument
    "https://host:8080/p@x": "https://host:8080/p@x",  # a port and an @ in the path: no password, shown as is
    "/logs/my run": "'/logs/my run'",  # shell-quoted as shlex.quote does
    "it's": shlex.quote("it's"),
    "": "''",
    "$(touch PWNED)": "'$(touch PWNED)'",
}


def test_the_echo_hides_a_urls_whole_password_and_is_shell_quoted(tmp_path):
    result = subprocess.run(["bash", "-c", f"source {shlex.quote(str(LAUNCH / 'redact.sh'))}; "
                             'for a in "$@"; do shown train_ddp.py "$a"; done', "-", *ECHO_CASES],
                            cwd=tmp_path, capture_output=True, text=True, timeout=30, check=True)
    assert result.stdout.splitlines() == [f"train_ddp.py {echoed}" for echoed in ECHO_CASES.values()]
    for line, arg in zip(result.stdout.splitlines(), ECHO_CASES):
        if "***" not in line:  # pasted back, the line gives the script what it was given
            assert shlex.split(line) == ["train_ddp.py", arg]
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("value", ["@/run/secrets/store.json", "env:STORAGE_OPTIONS"])
def test_launchers_show_where_credentials_come_from(value):
    result = subprocess.run(["bash", str(LAUNCH / "single_node.sh"), "train_ddp.py", "--storage-options", value],
                            cwd=ROOT, env=launcher_env(DRY_RUN="1", NPROC="1"), capture_output=True, text=True,
                            timeout=30)
    assert result.stdout.strip() == f"torchrun --standalone --nproc_per_node=1 train_ddp.py --storage-options {value}"


K8S_CREDENTIALS = {  # case: (arguments, what the error names)
    "s3fs key and secret": (["--storage-options", INLINE], "--storage-options holds credentials (key, secret)"),
    "nested client_kwargs": (["--storage-options", json.dumps({"client_kwargs": {"aws_secret_access_key": SECRET}})],
                             "--storage-options holds credentials (client_kwargs.aws_secret_access_key)"),
    "HTTP header": ([f"--storage-options={json.dumps({'headers': {'Authorization': f'Bearer {SECRET}'}})}"],
                    "--storage-options holds credentials (headers.Authorization)"),
    "gcsfs token dict": (["--stor", json.dumps({"token": {"private_key": SECRET, "client_email": "a@b"}})],
                         "--storage-options holds credentials (token.private_key, token.client_email)"),
    "not JSON": (["--storage-options", f"{{key: {KEY}}}"], "--storage-options is not JSON (it may hold credentials)"),
    "URL password": (["--data-dir", f"s3://reader:{PASSWORD}@bucket/data"], "--data-dir holds a URL with a password"),
}


@pytest.mark.parametrize("case", list(K8S_CREDENTIALS))
def test_k8s_never_writes_a_credential_into_the_manifest(case, tmp_path):
    args, names = K8S_CREDENTIALS[case]
    result = k8s(tmp_path, {"IMAGE": "img", "DATA_PVC": "data"}, ["--epochs", "1", *args])
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert not (tmp_path / "kubectl.stdin").exists()  # nothing applied
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {names}: ") and "SECRET_NAME" in lines[0] \
        and "secretRef" in lines[0], result.stderr
    assert not leaked(result.stderr)


@pytest.mark.parametrize("options", ["env:STORAGE_OPTIONS", "@/var/run/secrets/store.json",
                                     '{"endpoint_url": "http://minio:9000"}'],
                         ids=["variable", "file", "no credential"])
def test_k8s_takes_credentials_from_a_secret(options, tmp_path):
    env = {"IMAGE": "img", "DATA_PVC": "data", "SECRET_NAME": "dp-store,dp-extra", "DRY_RUN": "1"}
    result = k8s(tmp_path, env, ["--storage-options", options])
    assert result.returncode == 0, result.stderr
    _, manifest = split(result.stdout)
    for spec in manifest["spec"]["pytorchReplicaSpecs"].values():
        container = spec["template"]["spec"]["containers"][0]
        assert container["envFrom"] == [{"secretRef": {"name": "dp-store"}}, {"secretRef": {"name": "dp-extra"}}]
        assert container["command"][-2:] == ["--storage-options", options]


def test_k8s_lets_the_users_own_folders_win(tmp_path):
    """The pods' --data-dir/--checkpoint-dir come before the user's flags: argparse keeps the last."""
    from common.train.flags import parse_args

    result = k8s(tmp_path, {"IMAGE": "img", "DATA_PVC": "data", "DRY_RUN": "1"},
                 ["--dataset", "mnist", "--data-dir", "s3://bucket/mnist", "--checkpoint-dir=/data/my-checkpoints"])
    assert result.returncode == 0, result.stderr
    command = split(result.stdout)[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
        "command"]
    assert command[4] == "train_ddp.py"
    cfg = parse_args(command[5:], strategy="ddp", default_dataset="mnist", world_size=1)
    assert (cfg.data_dir, cfg.checkpoint_dir) == ("s3://bucket/mnist", "/data/my-checkpoints")
    default = parse_args(command[5:9], strategy="ddp", default_dataset="mnist", world_size=1)
    assert (default.data_dir, default.checkpoint_dir) == ("/data", "/checkpoints/dp-suite")


@pytest.mark.parametrize("grace", [None, "600"], ids=["default", "600 s"])
def test_k8s_gives_the_stop_its_grace(grace, tmp_path):
    env = {"IMAGE": "img", "DATA_PVC": "data", "DRY_RUN": "1",
           **({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": grace} if grace else {})}
    result = k8s(tmp_path, env, [])
    assert result.returncode == 0, result.stderr
    seconds = int(grace or 120)
    for spec in split(result.stdout)[1]["spec"]["pytorchReplicaSpecs"].values():
        pod = spec["template"]["spec"]
        assert pod["containers"][0]["env"] == [{"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(seconds)}]
        assert pod["terminationGracePeriodSeconds"] == seconds + 30  # Kubernetes' SIGKILL after torchrun's


def recording(tmp: Path, program: str) -> Path:
    """A fake `program` on PATH that records the grace torchrun would read and its arguments."""
    fake = tmp / "bin"
    fake.mkdir(exist_ok=True)
    (fake / program).write_text(f'#!/bin/sh\necho "grace=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT" > {tmp}/{program}.got\n'
                                f'printf "%s\\n" "$@" >> {tmp}/{program}.got\n')
    (fake / program).chmod(0o755)
    return fake


@pytest.mark.parametrize("grace", [None, "600"], ids=["default", "600 s"])
@pytest.mark.parametrize("script, program", [("slurm.sbatch", "srun"), ("multi_node.sh", "torchrun")])
def test_launchers_raise_torchruns_grace_for_the_stop(script, program, grace, tmp_path):
    fake = recording(tmp_path, program)
    if program == "torchrun":  # run as quiet_torchrun.py by torchrun's own interpreter: record that one
        recorded = "interpreter"
        recording(tmp_path, recorded)
        (fake / "torchrun").write_text(f"#!{fake / recorded}\n")
    else:
        recorded = program
    env = {**ECHOED[script], "PATH": f"{fake}{os.pathsep}{child_env()['PATH']}"}
    if script == "multi_node.sh":
        env["RDZV_ENDPOINT"], env["NNODES"] = f"127.0.0.1:{free_port()}", "1"
    result = subprocess.run(["bash", str(LAUNCH / script), "train_ddp.py"], cwd=ROOT, capture_output=True, text=True,
                            env=launcher_env(**env, **({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": grace} if grace else {})),
                            timeout=30)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / f"{recorded}.got").read_text().splitlines()[0] == f"grace={grace or 120}"


@pytest.mark.quick
def test_slurm_signals_the_stop_early_enough_for_torchruns_grace():
    """--signal's lead over the time limit covers torchrun's grace and 30 s for torchrun to end."""
    lead = re.search(r"^#SBATCH --signal=TERM@(\d+)$", (LAUNCH / "slurm.sbatch").read_text(), re.M)
    assert lead and int(lead.group(1)) >= 120 + 30


def quiet_torchrun():
    """launch/quiet_torchrun.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("quiet_torchrun", LAUNCH / "quiet_torchrun.py")
    quiet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quiet)
    return quiet


@pytest.mark.quick
def test_quiet_torchrun_gives_the_workers_120_s_to_stop(monkeypatch):
    """The value torchrun's own configuration takes from what launch/quiet_torchrun.py sets."""
    from torch.distributed.run import config_from_args, parse_args

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    quiet = quiet_torchrun()
    quiet.give_workers_time_to_stop()
    config = config_from_args(parse_args(["--standalone", "--nproc_per_node=1", "train_ddp.py"]))[0]
    assert config.shutdown_timeout == 120
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")  # a value the caller set wins
    quiet.give_workers_time_to_stop()
    config = config_from_args(parse_args(["--standalone", "--nproc_per_node=1", "train_ddp.py"]))[0]
    assert config.shutdown_timeout == 45


@pytest.mark.quick
@pytest.mark.parametrize("flags, own", [([], True), (["--log-dir", "mine"], False), (["--redirects", "3"], False),
                                        (["--tee", "2"], False)])
def test_quiet_torchrun_gives_torchrun_a_log_folder_of_its_own_unless_the_files_are_the_callers(flags, own, tmp_path,
                                                                                              monkeypatch):
    """The agent's own folder for torchrun's error files, in TMPDIR, named for it (deleted as it ends:
    the flag-error test through every launcher); never where the caller chose the folder or asked for
    the workers' output in it."""
    from torch.distributed.run import parse_args

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = parse_args(["--standalone", "--nproc_per_node=1", *flags, "train_ddp.py"])
    folder = quiet_torchrun().own_log_dir(args)
    assert (folder is not None) == own
    if own:
        assert args.log_dir == str(folder) and folder.parent == tmp_path
        assert folder.name.startswith(f"quiet_torchrun.{socket.gethostname()}-{os.getpid()}-")
    else:
        assert args.log_dir in (None, "mine") and not list(tmp_path.iterdir())


@pytest.mark.quick
def test_a_launch_sweeps_its_hosts_dead_folders_not_those_of_a_host_whose_name_extends_its_own(tmp_path, monkeypatch):
    """Hosts "node" and "node-N" sharing a TMPDIR: quiet_torchrun.node-N-PID-RANDOM is host node-N's,
    live there; host "node" has no process N (the name's first number) and must not take it for its own."""
    from common import scratch

    ended = subprocess.Popen(["true"])
    ended.wait()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(socket, "gethostname", lambda: "node")
    dead = tmp_path / f"quiet_torchrun.node-{ended.pid}-abcdefgh"  # this host's, its agent gone
    other_hosts = tmp_path / f"quiet_torchrun.node-{ended.pid}-{os.getpid()}-abcdefgh"  # host node-PID's, live
    dead.mkdir()
    other_hosts.mkdir()
    scratch.sweep("quiet_torchrun")
    assert not dead.exists() and other_hosts.exists()


@pytest.mark.quick
@pytest.mark.parametrize("submitted_from", ["repository", "elsewhere"])
def test_slurm_finds_its_redaction_when_run_from_slurms_copy(submitted_from, tmp_path):
    """sbatch runs a copy of the script from its spool folder: redact.sh is then found through the
    submission folder, or the script stops with one line saying where to submit from."""
    spool = tmp_path / "job7"
    spool.mkdir()
    (spool / "slurm_script").write_text((LAUNCH / "slurm.sbatch").read_text())
    submit = ROOT if submitted_from == "repository" else tmp_path
    result = subprocess.run(["bash", str(spool / "slurm_script"), "train_ddp.py", *CREDENTIAL_ARGS["inline"]],
                            cwd=submit,
                            env=launcher_env(DRY_RUN="1", SLURM_SUBMIT_DIR=str(submit), **ECHOED["slurm.sbatch"]),
                            capture_output=True, text=True, timeout=30)
    assert not leaked(result.stdout + result.stderr)
    if submitted_from == "repository":
        assert result.returncode == 0 and result.stdout.rstrip().endswith("--storage-options '***'"), result.stderr
    else:
        assert result.returncode == 2 and result.stdout == "" and len(result.stderr.splitlines()) == 1
        assert "submit from the repository's root" in result.stderr


# A flag error through every launcher ------------------------------------------------------------
FLAG_ERROR = "train_ddp.py: error: --lr must be > 0 and finite (got -1.0) (see --help)"
BAD_FLAG = ["train_ddp.py", "--dataset", "synthetic", "--lr", "-1"]


def k8s_pod_command(tmp: Path) -> tuple[list[str], dict[str, str]]:
    """What k8s.sh's pods run (their container command, from the repository's root as the pods'
    /workspace) and the variables the training operator sets in a one-pod job."""
    printed = k8s(tmp, {"IMAGE": "img", "DATA_PVC": "data", "NPROC": "1", "DRY_RUN": "1"}, BAD_FLAG[1:]).stdout
    manifest = split(printed)[1]
    pod = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    return pod["command"], {"PET_NNODES": "1", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1",
                            "PET_MASTER_PORT": str(free_port())}


@pytest.mark.parametrize("launcher", ["single_node.sh", "multi_node.sh", "elastic.sh", "slurm.sbatch", "k8s.sh"])
def test_a_flag_error_is_one_line_and_status_2_through_every_launcher(launcher, tmp_path):
    """The README's promise: a bad flag is one line and exit status 2, without torchrun's failure
    dump or the launcher's traceback after it (launch/quiet_torchrun.sh runs the agent of each).
    slurm.sbatch runs as its batch step on one node (a stand-in srun for its relay step); k8s.sh's
    pod command runs here as the pod would run it."""
    scratch = tmp_path / "tmp"  # TMPDIR: torchrun's folder of error files is the agent's, deleted as it ends
    scratch.mkdir()
    env = {"NPROC": "1", "TMPDIR": str(scratch)}
    command, echoed = ["bash", str(LAUNCH / launcher), *BAD_FLAG], 1  # the launcher echoes its command
    store = None
    if launcher == "multi_node.sh":
        env.update(NNODES="1", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}")
    elif launcher == "elastic.sh":
        store = subprocess.Popen([sys.executable, str(LAUNCH / "elastic_store.py"), "--port", "0"],
                                 stdout=subprocess.PIPE, text=True, env=child_env())
        port = re.search(r"port (\d+)", store.stdout.readline())[1]
        env.update(NNODES="1:2", RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_ID=f"flag-{port}")
    elif launcher == "slurm.sbatch":
        fake = recording(tmp_path, "srun")  # the relay step's srun: nothing to relay here
        env.update(SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="39",
                   RDZV_PORT=str(free_port()), PATH=f"{fake}{os.pathsep}{child_env()['PATH']}")
    elif launcher == "k8s.sh":
        (command, env), echoed = k8s_pod_command(tmp_path), 0
        env["TMPDIR"] = str(scratch)
    try:
        result = subprocess.run(command, cwd=ROOT, env=launcher_env(**env), capture_output=True, text=True,
                                timeout=ENDS_PROMPTLY_S)
    finally:
        if store is not None:
            store.terminate()
            store.wait(timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [FLAG_ERROR], result.stderr
    assert len(result.stdout.strip().splitlines()) == echoed, result.stdout
    assert not list(scratch.iterdir()), "left in TMPDIR"


@pytest.mark.quick
def test_a_missing_script_is_one_line_and_status_2_before_any_worker_starts(monkeypatch, capsys):
    """A mistyped script name: one line naming it, not each worker's "can't open file" and torchrun's
    failure dump (exit 1) after them. A module (-m) is not a file, and is left to torchrun."""
    quiet = quiet_torchrun()
    monkeypatch.setattr(quiet, "run", lambda args: pytest.fail("a worker was started"))
    monkeypatch.setattr(sys, "argv", ["quiet_torchrun.py", "--standalone", "--nproc_per_node=2", "train_dpp.py"])
    with pytest.raises(SystemExit) as exit:
        quiet.main()
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: train_dpp.py: no such file, the script torchrun is to run; give its path from this folder "
        f"({os.getcwd()}) or an absolute one"]
    for present in (["train_ddp.py"], ["-m", "json.tool"]):
        assert quiet.missing_script(quiet.parse_args(["--nproc_per_node=1", *present])) is None


@pytest.mark.quick
def test_a_log_dir_that_is_a_file_is_one_line_and_status_2_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    """torchrun's --log-dir naming a file: one line naming the flag, not torchrun's NotADirectoryError traceback."""
    quiet = quiet_torchrun()
    monkeypatch.setattr(quiet, "run", lambda args: pytest.fail("a worker was started"))
    (tmp_path / "logs").write_text("")
    monkeypatch.setattr(sys, "argv", ["quiet_torchrun.py", "--nproc_per_node=1", "--log-dir", str(tmp_path / "logs"),
                                      "train_ddp.py"])
    with pytest.raises(SystemExit) as exit:
        quiet.main()
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --log-dir {tmp_path / 'logs'}: a file, where torchrun keeps its workers' error files (and logs); "
        "give a folder, or leave the flag out"]


@pytest.mark.quick
def test_an_elastic_restart_reads_as_a_membership_change_and_a_stop_as_a_stop(tmp_path, monkeypatch):
    """launch/elastic.sh makes its marker file before it passes on a stop of its own: a SIGTERM
    without it came from torchrun's agent, restarting the workers for a membership change."""
    from common.train.trainer import LEAVING_MARKER, membership_change

    marker = tmp_path / "leaving"
    monkeypatch.delenv(LEAVING_MARKER, raising=False)
    assert not membership_change(signal.SIGTERM)  # not under elastic.sh: a stop
    monkeypatch.setenv(LEAVING_MARKER, str(marker))
    assert membership_change(signal.SIGTERM) and not membership_change(signal.SIGINT)
    marker.touch()  # this node was told to leave
    assert not membership_change(signal.SIGTERM)
    script = (LAUNCH / "elastic.sh").read_text()
    assert "trap 'touch \"$leaving\"; forward TERM' TERM" in script and "export DP_SUITE_LEAVING_MARKER=" in script
