"""Several nodes: two torchrun agents on one machine (and in two network namespaces), launchers,
rendezvous and configuration errors, device lists."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from common.errors import ConfigError
from common.parallel.context import device_list, resolve_backend, resolve_device
from tests.conftest import ENDS_PROMPTLY_S, ROOT, child_env, free_port, latest_state, one_launch, run_script, split_runs
from tests.runs import MARK

FLAGS = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--batch-size", "32",
         "--epochs", "1", "--max-steps", "6"]
SCRIPTS = ["train_ddp.py", "train_allreduce.py", "train_master.py", "train_fsdp.py", "train_localsgd.py"]


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return latest_state(ckpt)["model"]


def max_dw(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def launcher(script: str, env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", f"launch/{script}", *args], cwd=ROOT, env={**child_env(), **env},
                          capture_output=True, text=True, timeout=timeout)


def flags(tmp: Path, name: str, *extra: str) -> list[str]:
    return [*FLAGS, "--checkpoint-dir", str(tmp / f"ckpt-{name}"), "--log-dir", str(tmp / f"tb-{name}"), *extra]


def rank_0_consoles(stdout: str) -> list[str]:
    """Each run's console (rank 0's lines) from local_two_nodes.sh's output, on whichever agent
    rank 0 is: c10d's rendezvous ranks the agents by (host, pid), and pids wrap (pid_max is 32768
    on a CI host: node 1 held rank 0 there once). Node 1's stdout and stderr arrive merged behind a
    prefix, each run's mark on both: its parts are joined by run."""
    prefix = "[node 1] "
    node_1 = "\n".join(line[len(prefix):] for line in stdout.splitlines() if line.startswith(prefix))
    if not re.search(f"^{MARK}", node_1, flags=re.MULTILINE):
        return split_runs(stdout)
    runs: dict[str, str] = {}
    for part in re.split(f"^{MARK}", node_1, flags=re.MULTILINE)[1:]:
        index, _, rest = part.partition(":")
        runs[index] = runs.get(index, "") + rest.partition("\n")[2]
    return list(runs.values())


@pytest.mark.quick
def test_rank_0s_consoles_are_found_on_either_agent():
    on_node_0 = "=== run 0: a\nworld 2 = 2 node(s) x 1\n[node 1] warning\n=== run 1: b\nworld 2 b\n"
    assert rank_0_consoles(on_node_0) == ["world 2 = 2 node(s) x 1\n[node 1] warning\n", "world 2 b\n"]
    on_node_1 = ("[node 1] === run 0: a\n[node 1] world 2 = 2\n[node 1] === run 0: a\n[node 1] saved 0\n"
                 "[node 1] === run 1: b\n[node 1] === run 1: b\n[node 1] world 2 b\n")
    assert rank_0_consoles(on_node_1) == ["world 2 = 2\nsaved 0\n", "world 2 b"]


# 1 -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """Each script at world 2 on one node (the references of the two-node runs), and train_allreduce.py
    over `--device cpu,cpu`, made one after another in one launch (tests/runs.py: torch is imported
    once, not once a run). Their checkpoints: ckpt-one-SCRIPT and ckpt-cpus under the folder returned."""
    tmp = tmp_path_factory.mktemp("one-node")
    runs = [[script, *flags(tmp, f"one-{script}")] for script in SCRIPTS]
    result = run_script(one_launch([*runs, ["train_allreduce.py", *flags(tmp, "cpus"), "--device", "cpu,cpu"]]),
                        nproc=2, timeout=400)
    assert result.returncode == 0 and len(split_runs(result.stdout)) == len(runs) + 1, \
        result.stdout[-2000:] + result.stderr[-3000:]
    return tmp


def test_two_local_nodes_train_what_one_node_trains(one_node, tmp_path):
    """Every script, its runs made one after another in one launch of the two agents."""
    runs = [[script, *flags(tmp_path, f"two-{script}")] for script in SCRIPTS]
    two = launcher("local_two_nodes.sh", {"NPROC": "1"}, *one_launch(runs), timeout=400)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    consoles = rank_0_consoles(two.stdout)
    assert len(consoles) == len(SCRIPTS), two.stdout[-3000:]
    for script, console in zip(SCRIPTS, consoles):
        assert "world 2 = 2 node(s) x 1" in console, console  # rank 0's rendezvous facts
        dw = max_dw(weights(tmp_path / f"ckpt-two-{script}"), weights(one_node / f"ckpt-one-{script}"))
        print(f"\n{script}: two agents on 127.0.0.1 vs one node with two ranks: max |dw| = {dw:.3g}")
        assert dw <= 1e-6  # world 2 either way, the same sums in the same order: the same bits by design, on any CPU


# 2 -------------------------------------------------------------------------------------------
class Namespaces:
    """Two network namespaces joined by a veth pair, 10.213.<n>.1 and .2: two hosts on one machine."""

    def __init__(self) -> None:
        tag = os.getpid() % 10000
        self.names = (f"dpa{tag}", f"dpb{tag}")
        self.links = (f"va{tag}", f"vb{tag}")
        self.addrs = (f"10.213.{tag % 250}.1", f"10.213.{tag % 250}.2")

    def sh(self, *cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)

    def __enter__(self) -> "Namespaces":
        (a, b), (la, lb), (ia, ib) = self.names, self.links, self.addrs
        for ns in self.names:
            self.sh("ip", "netns", "add", ns)
            self.sh("ip", "-n", ns, "link", "set", "lo", "up")
        self.sh("ip", "link", "add", la, "netns", a, "type", "veth", "peer", "name", lb, "netns", b)
        for ns, link, addr in ((a, la, ia), (b, lb, ib)):
            self.sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            self.sh("ip", "-n", ns, "link", "set", link, "up")
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = subprocess.run(["ip", "netns", "add", "dpprobe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", "dpprobe"], capture_output=True)
    return None if probe.returncode == 0 else f"ip netns add failed: {probe.stderr.strip()}"


def test_two_nodes_in_separate_network_namespaces(one_node, tmp_path):
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    port = 29400 + os.getpid() % 1000
    try:
        with Namespaces() as net:
            procs = []
            for rank, (ns, link, addr) in enumerate(zip(net.names, net.links, net.addrs)):
                env = {"GLOO_SOCKET_IFNAME": link, "NNODES": "2", "RDZV_ENDPOINT": f"{net.addrs[0]}:{port}",
                       "RDZV_ID": "netns", "NODE_RANK": str(rank), "LOCAL_ADDR": addr, "NPROC": "1",
                       "JOIN_TIMEOUT": "60"}
                cmd = ["ip", "netns", "exec", ns, "bash", "launch/multi_node.sh", "train_ddp.py",
                       *flags(tmp_path, "two")]
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**child_env(), **env}, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True))
                time.sleep(1)  # not a point in training: node 0, the store's host, starts first
            outputs = [p.communicate(timeout=240) for p in procs]
    except subprocess.CalledProcessError as e:
        pytest.skip(f"could not build the namespaces: {' '.join(e.cmd)}: {e.stderr.strip()}")
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert f"master {net.addrs[0]}" in outputs[0][0]  # traffic went to the other namespace's address
    dw = max_dw(weights(tmp_path / "ckpt-two"), weights(one_node / "ckpt-one-train_ddp.py"))
    print(f"\ntwo nodes in two network namespaces over a veth pair: max |dw| = {dw:.3g}")
    assert dw <= 1e-6  # world 2 either way and the same sums in the same order: the same bits by design, on any CPU


# 3 -------------------------------------------------------------------------------------------
def test_missing_node_is_a_clear_error_within_the_join_timeout(tmp_path):
    start = time.monotonic()
    result = launcher("multi_node.sh", {"NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
                                        "JOIN_TIMEOUT": "10", "NPROC": "1"}, "train_ddp.py", *flags(tmp_path, "x"))
    seconds = time.monotonic() - start
    assert result.returncode != 0
    assert "did not complete within 10 s: start this command on all 2 nodes" in result.stderr
    print(f"\none of two nodes started: error after {seconds:.1f} s (join timeout 10 s)")
    assert seconds < 10 + ENDS_PROMPTLY_S  # not torchrun's own 600 s join timeout


def test_occupied_port_is_named_with_a_way_out(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = launcher("multi_node.sh", {"NNODES": "1", "RDZV_ENDPOINT": f"127.0.0.1:{port}", "NPROC": "1"},
                          "train_ddp.py", *flags(tmp_path, "x"), timeout=60)
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use (EADDRINUSE)" in result.stderr
    assert "single_node.sh" in result.stderr and "--standalone" in result.stderr


# 4 -------------------------------------------------------------------------------------------
def test_flags_that_differ_between_nodes_are_named(tmp_path):
    port = free_port()
    procs = []
    for rank, model in enumerate(["lenet", "cifar_net"]):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=mismatch",
               f"--node-rank={rank}", "train_ddp.py", *flags(tmp_path, f"n{rank}"), "--model", model]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode != 0 for p in procs)
    errors = [line for _, err in outputs for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert "different flags (model: rank 0 'lenet', rank 1 'cifar_net')" in errors[0]


# 5 -------------------------------------------------------------------------------------------
def dry(script: str, env: dict[str, str], *args: str) -> str:
    result = launcher(script, {"DRY_RUN": "1", **env}, *args, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_launchers_print_the_torchrun_command():
    assert dry("single_node.sh", {"NPROC": "3"}, "train_ddp.py", "--epochs", "2").strip() == \
        "torchrun --standalone --nproc_per_node=3 train_ddp.py --epochs 2"
    assert dry("multi_node.sh", {"NNODES": "4", "RDZV_ENDPOINT": "head:29400", "RDZV_ID": "job7", "NPROC": "8",
                                 "MAX_RESTARTS": "3", "NODE_RANK": "2"}, "train_master.py").strip() == (
        "torchrun --nnodes=4 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=head:29400 --rdzv-id=job7 "
        "--rdzv-conf=join_timeout=600,is_host=false --max-restarts=3 --node-rank=2 train_master.py")
    two = dry("local_two_nodes.sh", {"PORT": "4321"}, "train_ddp.py").splitlines()
    assert two[0].startswith("torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d "
                             "--rdzv-endpoint=127.0.0.1:4321") and two[0].endswith("--node-rank=0 train_ddp.py")
    assert "is_host=true" in two[0] and "is_host=false" in two[1]
    assert two[1].startswith("[node 1] torchrun") and two[1].endswith("--node-rank=1 train_ddp.py")
    slurm = dry("slurm.sbatch", {"SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "gpu[07-09]",
                                 "SLURM_JOB_ID": "4242", "SLURM_GPUS_PER_NODE": "8"},
                "train_ddp.py", "--dataset", "cifar10")
    assert slurm.strip() == ("srun --kill-on-bad-exit=1 torchrun --nnodes=3 --nproc_per_node=8 --rdzv-backend=c10d "
                             "--rdzv-endpoint=gpu07:29400 --rdzv-id=4242 --max-restarts=0 "
                             "train_ddp.py --dataset cifar10")
    k8s = dry("k8s.sh", {"IMAGE": "registry.example/dp:1", "DATA_PVC": "cifar", "WORKERS": "3", "NPROC": "4"},
              "train_ddp.py", "--epochs", "5")
    command, _, manifest = k8s.partition("\n")
    assert command == ("# each pod runs: bash launch/quiet_torchrun.sh --nproc_per_node=4 --max-restarts=3 "
                       "train_ddp.py --data-dir /data --checkpoint-dir /checkpoints/dp-suite --epochs 5")
    pod = {"containers": [{"name": "pytorch", "image": "registry.example/dp:1", "workingDir": "/workspace",
                           "command": command.removeprefix("# each pod runs: ").split(),
                           "env": [{"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "120"}],
                           "resources": {"limits": {"nvidia.com/gpu": 4}},
                           "volumeMounts": [{"name": "data", "mountPath": "/data"},
                                            {"name": "checkpoints", "mountPath": "/checkpoints"},
                                            {"name": "shm", "mountPath": "/dev/shm"}]}],
           "terminationGracePeriodSeconds": 150,
           "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "cifar"}},
                       {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "cifar"}},
                       {"name": "shm", "emptyDir": {"medium": "Memory"}}]}
    assert yaml.safe_load(manifest) == {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "dp-suite"},
        "spec": {"nprocPerNode": "4", "runPolicy": {"backoffLimit": 3}, "pytorchReplicaSpecs": {
            role: {"replicas": n, "restartPolicy": "OnFailure", "template": {"spec": pod}}
            for role, n in (("Master", 1), ("Worker", 3))}}}


def test_launchers_are_valid_shell():
    scripts = sorted((ROOT / "launch").glob("*.sh")) + [ROOT / "launch" / "slurm.sbatch"]
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        result = subprocess.run(["shellcheck", "-x", *map(str, scripts)], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


def test_launchers_refuse_missing_parameters():
    assert launcher("multi_node.sh", {}, "train_ddp.py", timeout=30).returncode == 2
    assert launcher("k8s.sh", {"IMAGE": "x"}, "train_ddp.py", timeout=30).returncode == 2


# 6 -------------------------------------------------------------------------------------------
@pytest.mark.quick
def test_device_lists_and_backend_resolution():
    assert device_list("cpu,cpu", 2) == ["cpu", "cpu"]
    assert device_list("cpu", 3) == ["cpu"] * 3
    assert resolve_device("cpu,cpu", 1, 2) == torch.device("cpu")
    assert resolve_backend("auto", "cpu,cpu", torch.device("cpu")) == "gloo"
    assert resolve_backend("auto", "cpu,cuda", torch.device("cuda", 0)) == "gloo"  # mixed: gloo
    assert resolve_backend("auto", "cuda,cuda", torch.device("cuda", 1)) == "nccl"
    with pytest.raises(ConfigError, match="lists 3 devices for 2"):
        device_list("cpu,cpu,cpu", 2)
    with pytest.raises(ConfigError, match="'tpu' is unknown"):
        device_list("cpu,tpu", 2)
    with pytest.raises(ConfigError, match="--backend nccl needs every rank on a CUDA GPU"):
        resolve_backend("nccl", "cpu,cuda", torch.device("cuda", 0))
    if not torch.cuda.is_available():
        assert resolve_device("cpu,cuda", 0, 2) == torch.device("cpu")
        with pytest.raises(ConfigError, match="needs 1 GPU"):
            resolve_device("cpu,cuda", 1, 2)


def test_device_list_runs_and_cuda_on_a_cpu_host_fails_cleanly(one_node, tmp_path):
    assert latest_state(one_node / "ckpt-cpus")["global_step"] == 6  # trained over cpu,cpu (one_node's last run)
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    bad = run_script(["train_ddp.py", *flags(tmp_path, "gpu"), "--device", "cuda"], nproc=2, timeout=60)
    assert bad.returncode != 0
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert errors and all("--device cuda needs 2 GPU(s) on this node, found 0" in e for e in errors)
    assert "/common/" not in bad.stderr and 'train_ddp.py", line' not in bad.stderr  # no rank's traceback
