from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.datagen import write_cifar10, write_mnist  # noqa: E402


def child_env() -> dict[str, str]:
    """One thread per rank: several ranks share 2 cores. No torchrun variables leak in."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")  # torchrun of this venv
    return env


def run_script(args: list[str], nproc: int | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N script ...`, or plain python when nproc is None."""
    if nproc is None:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory) -> Path:
    return write_cifar10(tmp_path_factory.mktemp("cifar"))


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory) -> Path:
    return write_mnist(tmp_path_factory.mktemp("mnist"))


@pytest.fixture(scope="session")
def mnist_gz_root(tmp_path_factory) -> Path:
    return write_mnist(tmp_path_factory.mktemp("mnist_gz"), gz=True)
