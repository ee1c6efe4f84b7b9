"""Downloads, once per node and never half: a slow server that outlasts --timeout-s, two nodes
sharing one data folder, a download cut in the middle. Real torchrun processes, a real HTTP
server on 127.0.0.1 serving a generated CIFAR-10 archive in the real format."""
from __future__ import annotations

import hashlib
import tarfile
import time
from pathlib import Path

import pytest

from common.data.fetch import ensure_local
from common.data.formats import CIFAR_ARCHIVE, CIFAR_DIR, CIFAR_TEST, CIFAR_TRAIN
from common.errors import UserError
from tests.conftest import ROOT, run_script
from tests.datagen import write_cifar10
from tests.httpserver import FileServer
from tests.test_multinode import launcher

TRAIN = ["--dataset", "cifar10", "--model", "lenet", "--batch-size", "32", "--epochs", "1", "--max-steps", "2",
         "--eval-batch-size", "200"]


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> tuple[Path, str]:
    """A folder holding a generated cifar-10-python.tar.gz (~1.9 MB), and its md5."""
    source = write_cifar10(tmp_path_factory.mktemp("cifar-src"), per_batch=100, test_size=101)
    folder = tmp_path_factory.mktemp("mirror")
    with tarfile.open(folder / CIFAR_ARCHIVE, "w:gz") as tar:
        tar.add(source / CIFAR_DIR, arcname=CIFAR_DIR)
    return folder, hashlib.md5((folder / CIFAR_ARCHIVE).read_bytes()).hexdigest()


def complete(data: Path) -> bool:
    return all((data / CIFAR_DIR / name).is_file() for name in CIFAR_TRAIN + CIFAR_TEST)


def leftovers(data: Path) -> list[Path]:
    return [p for p in data.rglob(".*") if ".part-" in p.name or p.name.startswith(".extract-")]


def test_a_download_slower_than_the_timeout_completes(mirror, tmp_path):
    """Before: the other ranks waited in a collective bounded by --timeout-s, which a slow
    download outlasts every time."""
    folder, md5 = mirror
    size = (folder / CIFAR_ARCHIVE).stat().st_size
    with FileServer(folder, bytes_per_s=size / 8) as server:  # about 8 s, against a 3 s process-group timeout
        start = time.monotonic()
        result = run_script(["tests/patched.py", f"cifar-md5={md5}", str(ROOT / "train_ddp.py"), *TRAIN,
                             "--data-dir", str(tmp_path / "data"), "--download-from", server.url, "--timeout-s", "3",
                             "--checkpoint-dir", str(tmp_path / "ckpt")], nproc=2)
        seconds = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    assert server.gets[f"/{CIFAR_ARCHIVE}"] == 1 and complete(tmp_path / "data") and not leftovers(tmp_path / "data")
    assert "(101 images)" in result.stdout
    print(f"\n{size / 2**20:.1f} MB at {size / 8 / 2**10:.0f} KB/s with --timeout-s 3: trained, {seconds:.1f} s in all")


def test_two_nodes_sharing_one_data_folder_download_once(mirror, tmp_path):
    """Before: both nodes' local rank 0 downloaded into the same final path at once."""
    folder, md5 = mirror
    size = (folder / CIFAR_ARCHIVE).stat().st_size
    with FileServer(folder, bytes_per_s=size / 4) as server:
        result = launcher("local_two_nodes.sh", {"NPROC": "1"}, "tests/patched.py", f"cifar-md5={md5}", "train_ddp.py",
                          *TRAIN, "--data-dir", str(tmp_path / "shared"), "--download-from", server.url,
                          "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "world 2 = 2 node(s) x 1" in result.stdout
    assert server.gets[f"/{CIFAR_ARCHIVE}"] == 1, server.gets
    assert complete(tmp_path / "shared") and not leftovers(tmp_path / "shared")


@pytest.mark.quick
def test_a_cut_download_leaves_nothing_that_passes_for_complete(mirror, tmp_path, monkeypatch):
    folder, md5 = mirror
    monkeypatch.setattr("common.data.formats.CIFAR_MD5", md5)
    data = tmp_path / "data"
    with FileServer(folder, cut=True) as server, pytest.raises(UserError) as failed:
        ensure_local("cifar10", data, allow_download=True, download_from=server.url, say=print)
    message = str(failed.value)
    assert "the download failed" in message and "\n" not in message
    assert not complete(data) and not (data / CIFAR_DIR).exists() and not leftovers(data)
    assert not (data / ".download.lock").exists()  # no debris in the user's data folder
    with FileServer(folder) as server:  # the next run starts clean and completes
        ensure_local("cifar10", data, allow_download=True, download_from=server.url, say=print)
    assert complete(data) and not leftovers(data)
