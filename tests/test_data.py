"""The real readers on generated files in the real formats; sharding; batched augmentation."""
from __future__ import annotations

import gzip
import os
import pickle
import shutil
import struct
import tracemalloc
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from common.data.fetch import ensure_local
from common.data.formats import CIFAR_DIR, MNIST_DIR, MNIST_PROCESSED_DIR, read_cifar10, read_mnist
from common.data.loader import DataSpec, Split, TrainLoader, crop_and_flip, eval_shard, make_synthetic
from common.errors import UserError
from tests.conftest import free_port
from tests.datagen import write_mnist, write_mnist_processed

pytestmark = pytest.mark.quick  # no launch: the quick tier (pytest -m quick)


def quiet(message: str) -> None:
    pass


def test_cifar10_reader_returns_what_was_written(cifar_root):
    data = read_cifar10(cifar_root)
    expected = make_synthetic("cifar", train_size=1000, test_size=301)
    assert data.train.images.dtype == torch.uint8 and data.train.images.shape == (1000, 3, 32, 32)
    assert torch.equal(data.train.images, expected.train.images)
    assert torch.equal(data.test.labels, expected.test.labels)


@pytest.mark.parametrize("root_fixture", ["mnist_root", "mnist_gz_root"])
def test_mnist_reader_plain_and_gz(root_fixture, request):
    data = read_mnist(request.getfixturevalue(root_fixture))
    expected = make_synthetic("mnist", train_size=1200, test_size=301)
    assert data.train.images.shape == (1200, 1, 28, 28) and data.test.images.shape == (301, 1, 28, 28)
    assert torch.equal(data.train.images, expected.train.images)
    assert torch.equal(data.test.labels, expected.test.labels)


def _copy(root: Path, tmp_path: Path) -> Path:
    """A private copy of a session-wide generated data set, safe to damage."""
    shutil.copytree(root, tmp_path / "copy")
    return tmp_path / "copy"


def test_truncated_cifar_batch_names_the_file(cifar_root, tmp_path):
    root = _copy(cifar_root, tmp_path)
    bad = root / CIFAR_DIR / "data_batch_3"
    bad.write_bytes(bad.read_bytes()[:1000])
    with pytest.raises(UserError, match="data_batch_3 is not a CIFAR-10 python batch"):
        read_cifar10(root)


def test_cifar_batch_with_code_payload_is_refused(cifar_root, tmp_path):
    root = _copy(cifar_root, tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (root / CIFAR_DIR / "test_batch").write_bytes(pickle.dumps({"data": Payload(), "labels": [0]}, protocol=2))
    with pytest.raises(UserError, match="refusing to load"):
        read_cifar10(root)
    assert not marker.exists()


def test_corrupt_idx_header_names_the_file(mnist_root, tmp_path):
    root = _copy(mnist_root, tmp_path)
    bad = root / MNIST_DIR / "t10k-images-idx3-ubyte"
    bad.write_bytes(bad.read_bytes()[:-10])
    with pytest.raises(UserError, match="t10k-images-idx3-ubyte is not an IDX file"):
        read_mnist(root)


@pytest.mark.parametrize("name, expected", [("cifar10", "cifar-10-python.tar.gz"),
                                            ("mnist", "train-images-idx3-ubyte")])
def test_offline_download_message(name, expected, tmp_path):
    closed = f"http://127.0.0.1:{free_port()}/"  # nothing listens: the download fails at once, as offline
    with pytest.raises(UserError) as exc:
        ensure_local(name, tmp_path, allow_download=True, download_from=closed, say=quiet)
    message = str(exc.value)
    assert "\n" not in message
    assert "the download failed" in message and expected in message and str(tmp_path) in message


def test_no_download_message_lists_expected_files(tmp_path):
    with pytest.raises(UserError) as exc:
        ensure_local("cifar10", tmp_path, allow_download=False, download_from="", say=quiet)
    message = str(exc.value)
    assert "data_batch_1" in message and "test_batch" in message and "--no-download" in message
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in message


def test_present_files_need_no_download(cifar_root):
    ensure_local("cifar10", cifar_root, allow_download=False, download_from="", say=quiet)  # must not raise


# ---------------------------------------------------------------- sharding

def _tiny_split(n: int) -> Split:
    images = torch.arange(n, dtype=torch.int64).view(n, 1, 1, 1).expand(n, 1, 2, 2).to(torch.uint8)
    return Split(images, torch.arange(n) % 10)


SPEC = DataSpec(1, 2, 10, (0.0,), (1 / 255,), augment="none")  # normalization leaves pixel = sample id


def _ranks_batches(n: int, batch: int, world: int, epoch: int = 0) -> list[list[torch.Tensor]]:
    split = _tiny_split(n)
    loaders = [TrainLoader(split, SPEC, batch, rank, world, seed=3, device=torch.device("cpu"))
               for rank in range(world)]
    return [[x[:, 0, 0, 0].round().long() for x, _ in loader.epoch(epoch)] for loader in loaders]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_training_shards_cover_the_data_set(world):
    seen = torch.cat([torch.cat(b) for b in _ranks_batches(240, 12, world)])
    assert sorted(seen.tolist()) == list(range(240))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_incomplete_global_batch_is_dropped(world):
    seen = torch.cat([torch.cat(b) for b in _ranks_batches(250, 12, world)])  # 250 = 20 * 12 + 10
    assert len(seen) == 240 and len(set(seen.tolist())) == 240


@pytest.mark.parametrize("world", [2, 3, 4])
def test_global_batches_do_not_depend_on_world_size(world):
    single = _ranks_batches(240, 12, 1)[0]
    per_rank = _ranks_batches(240, 12, world)
    for step, reference in enumerate(single):
        union = torch.cat([batches[step] for batches in per_rank])
        assert sorted(union.tolist()) == sorted(reference.tolist())


def test_epochs_are_shuffled_differently():
    first, second = (torch.cat(_ranks_batches(120, 12, 2, epoch=e)[0]) for e in (0, 1))
    assert not torch.equal(first, second)


@pytest.mark.parametrize("size", [301, 1000, 7])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_eval_shards_count_every_sample_once(size, world):
    shards = torch.cat([eval_shard(size, rank, world) for rank in range(world)])
    assert sorted(shards.tolist()) == list(range(size))


def test_batch_larger_than_training_set_is_a_clear_error():
    with pytest.raises(UserError, match="--batch-size 512 is larger than the training set"):
        TrainLoader(_tiny_split(100), SPEC, 512, 0, 1, seed=0, device=torch.device("cpu"))


# ---------------------------------------------------------------- augmentation

def test_crop_and_flip_matches_per_image_reference():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 3, 8, 8), generator=g, dtype=torch.uint8)
    shifts = torch.randint(0, 9, (6, 2), generator=g)
    flips = torch.tensor([True, False, True, False, False, True])
    out = crop_and_flip(images, shifts, flips)
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    for i in range(6):
        dy, dx = shifts[i].tolist()
        expected = padded[i, :, dy:dy + 8, dx:dx + 8]
        assert torch.equal(out[i], expected.flip(-1) if flips[i] else expected)


def test_augmentation_follows_the_sample_not_the_rank():
    """Each sample is cropped and flipped the same at world 1 and world 2."""
    data = make_synthetic("cifar", train_size=96, test_size=10)
    def by_sample(world: int) -> dict[bytes, torch.Tensor]:
        out = {}
        for rank in range(world):
            loader = TrainLoader(data.train, data.spec, 32, rank, world, seed=5, device=torch.device("cpu"))
            for images, _ in loader.epoch(1):
                for image in images:
                    out[image.numpy().tobytes()] = image
        return out
    assert set(by_sample(1)) == set(by_sample(2))
    augmented = TrainLoader(data.train, data.spec, 32, 0, 1, seed=5, device=torch.device("cpu"))
    plain = next(iter(augmented.epoch(1)))[0]
    assert plain.shape == (32, 3, 32, 32) and plain.dtype == torch.float32


# ---------------------------------------------------------------- damaged files, in one line

def _one_line_naming(exc: pytest.ExceptionInfo, path: Path) -> str:
    message = str(exc.value)
    assert "\n" not in message and str(path) in message, message
    return message


def test_corrupt_gz_names_the_file(mnist_gz_root, tmp_path):
    """zlib.error used to escape as a traceback."""
    root = _copy(mnist_gz_root, tmp_path)
    bad = root / MNIST_DIR / "t10k-images-idx3-ubyte.gz"
    data = bytearray(bad.read_bytes())
    data[40:48] = b"\xff" * 8  # inside the deflate stream, past gzip's header and file name
    bad.write_bytes(bytes(data))
    with pytest.raises(UserError) as exc:
        read_mnist(root)
    assert "zlib.error" in _one_line_naming(exc, bad)


@contextmanager
def peak_memory_below(limit: int) -> Iterator[None]:
    """Python allocations inside the block (tensors' storage included) peak under `limit` bytes."""
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"peak {peak / 2**20:.0f} MB"


@pytest.mark.parametrize("gz", [False, True])
def test_idx_header_promising_more_than_the_file_allocates_nothing_big(gz, tmp_path):
    root = write_mnist(tmp_path / "data", train_size=40, test_size=20, gz=gz)
    bad = root / MNIST_DIR / ("train-images-idx3-ubyte" + (".gz" if gz else ""))
    header = struct.pack(">HBB3I", 0, 0x08, 3, 2_000_000, 28, 28)  # promises 1.5 GB
    payload = header + bytes(1000)
    bad.write_bytes(gzip.compress(payload) if gz else payload)
    with peak_memory_below(16 * 2**20), pytest.raises(UserError, match="needs 1568000000 bytes of data, "
                                                                   "the file has 1000") as exc:
        read_mnist(root)
    _one_line_naming(exc, bad)


def test_pickle_length_fields_are_not_trusted(cifar_root, tmp_path):
    """A bytes opcode claiming 2 GB in a small file: refused before the unpickler allocates the 2 GB."""
    root = _copy(cifar_root, tmp_path)
    bad = root / CIFAR_DIR / "test_batch"
    bad.write_bytes(b"\x80\x03B" + struct.pack("<I", 2**31) + bytes(100))
    with peak_memory_below(64 * 2**20), pytest.raises(UserError, match="is not a CIFAR-10 python batch") as exc:
        read_cifar10(root)
    _one_line_naming(exc, bad)


def test_malformed_numpy_dtype_state_does_not_crash_the_reader(cifar_root, tmp_path):
    """numpy's dtype.__setstate__ segfaults on this state (found by the fuzz); the reader never hands a
    file's dtype to numpy, and the name 'u1' is all it needs, so the batch still reads."""
    root = _copy(cifar_root, tmp_path)
    bad = root / CIFAR_DIR / "data_batch_2"
    raw = bad.read_bytes()
    state = b"K\x03X\x01\x00\x00\x00|q\x15NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t"  # (3, '|', None x3, -1, -1, 0)
    assert raw.count(state) == 1
    bad.write_bytes(raw.replace(state, b"K\x03X\x01\x00\x00\x00|q\x15NJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t"))
    assert torch.equal(read_cifar10(root).train.images, read_cifar10(cifar_root).train.images)


def test_cifar_batch_saved_column_major_with_label_array_reads_the_same(cifar_root, tmp_path):
    """Re-saved batches: a Fortran-order data array and int64 label arrays are still the same images."""
    root = _copy(cifar_root, tmp_path)
    path = root / CIFAR_DIR / "test_batch"
    expected = read_cifar10(root).test
    images = expected.images.reshape(len(expected), -1).numpy()
    path.write_bytes(pickle.dumps({"data": np.asfortranarray(images), "labels": expected.labels.numpy()}, protocol=2))
    again = read_cifar10(root).test
    assert torch.equal(again.images, expected.images) and torch.equal(again.labels, expected.labels)


# ---------------------------------------------------------------- torchvision's processed MNIST layout

def test_processed_mnist_reads_the_same_images_as_raw(mnist_root, tmp_path):
    processed = read_mnist(write_mnist_processed(tmp_path / "processed"))
    raw = read_mnist(mnist_root)
    for a, b in ((processed.train, raw.train), (processed.test, raw.test)):
        assert a.images.dtype == torch.uint8 and a.labels.dtype == torch.int64
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)


def test_raw_mnist_is_preferred_when_both_layouts_are_present(mnist_root, tmp_path):
    root = _copy(mnist_root, tmp_path)
    write_mnist_processed(root, train_size=40, test_size=20)  # other sizes: tells which layout was read
    assert len(read_mnist(root).train) == 1200
    (root / MNIST_DIR / "t10k-labels-idx1-ubyte").unlink()  # raw incomplete: the processed pair is read
    assert len(read_mnist(root).train) == 40
    ensure_local("mnist", root, allow_download=False, download_from="", say=quiet)  # nothing missing


def test_half_a_processed_layout_is_missing_files(tmp_path):
    root = write_mnist_processed(tmp_path / "data", train_size=40, test_size=20)
    (root / MNIST_PROCESSED_DIR / "test.pt").unlink()
    with pytest.raises(UserError) as exc:
        ensure_local("mnist", root, allow_download=False, download_from="", say=quiet)
    message = str(exc.value)
    assert "\n" not in message and "train-images-idx3-ubyte" in message
    assert "training.pt and test.pt" in message and MNIST_PROCESSED_DIR in message


@pytest.mark.parametrize("save", [torch.save, lambda obj, path: path.write_bytes(pickle.dumps(obj, protocol=2))],
                         ids=["torch.save", "plain-pickle"])
def test_processed_mnist_with_a_code_payload_is_refused_unrun(save, tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    root = write_mnist_processed(tmp_path / "data", train_size=40, test_size=20)
    bad = root / MNIST_PROCESSED_DIR / "training.pt"
    save(Payload(), bad)
    with pytest.raises(UserError, match="training.pt is not torchvision's processed MNIST") as exc:
        read_mnist(root)
    _one_line_naming(exc, bad)
    assert not marker.exists()


_IMAGES = torch.zeros(5, 28, 28, dtype=torch.uint8)
_LABELS = torch.arange(5)


@pytest.mark.parametrize("contents, expected", [
    ((torch.zeros(5, 32, 32, dtype=torch.uint8), _LABELS), r"images are uint8 \(5, 32, 32\), expected"),
    ((_IMAGES.float(), _LABELS), r"images are float32 \(5, 28, 28\), expected contiguous uint8 \(N, 28, 28\)"),
    ((torch.zeros(1, 28, 28, dtype=torch.uint8).expand(5, 28, 28), _LABELS), "non-contiguous"),
    ((_IMAGES, torch.arange(4)), r"labels are int64 \(4,\) for 5 images"),
    ((_IMAGES, torch.arange(5) + 6), "expected as many integers in 0..9"),
    ((_IMAGES, _LABELS.float()), r"labels are float32 \(5,\)"),
    ((_LABELS, _IMAGES), r"images are int64 \(5,\)"),
    (_IMAGES, r"it holds uint8 \(5, 28, 28\)"),
    ((_IMAGES, _LABELS, _LABELS), "it holds tuple of 3"),
], ids=["28x32", "float-images", "stride-0-view", "too-few-labels", "label-out-of-range", "float-labels",
        "swapped", "no-tuple", "triple"])
def test_processed_mnist_of_the_wrong_contents_is_a_clear_error(contents, expected, tmp_path):
    root = write_mnist_processed(tmp_path / "data", train_size=40, test_size=20)
    bad = root / MNIST_PROCESSED_DIR / "test.pt"
    torch.save(contents, bad)
    with pytest.raises(UserError, match=expected) as exc:
        read_mnist(root)
    assert "test.pt is not torchvision's processed MNIST" in _one_line_naming(exc, bad)
