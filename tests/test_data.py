"""The real readers on generated files in the real formats; sharding; batched augmentation."""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from common.data import (CIFAR_DIR, MNIST_DIR, DataSpec, Split, TrainLoader, crop_and_flip, ensure_files,
                         eval_shard, make_synthetic, read_cifar10, read_mnist)
from common.errors import UserError
from tests.conftest import free_port


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


@pytest.mark.parametrize("name, expected", [("cifar10", "cifar-10-python.tar.gz"), ("mnist", "train-images-idx3-ubyte")])
def test_offline_download_message(name, expected, tmp_path):
    closed = f"http://127.0.0.1:{free_port()}/"  # nothing listens: the download fails at once, as offline
    with pytest.raises(UserError) as exc:
        ensure_files(name, tmp_path, allow_download=True, cifar_url=closed + "cifar-10-python.tar.gz",
                     mnist_mirrors=[closed])
    message = str(exc.value)
    assert "\n" not in message
    assert "the download failed" in message and expected in message and str(tmp_path) in message


def test_no_download_message_lists_expected_files(tmp_path):
    with pytest.raises(UserError) as exc:
        ensure_files("cifar10", tmp_path, allow_download=False)
    message = str(exc.value)
    assert "data_batch_1" in message and "test_batch" in message and "--no-download" in message
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in message


def test_present_files_need_no_download(cifar_root):
    ensure_files("cifar10", cifar_root, allow_download=False)  # must not raise


# ---------------------------------------------------------------- sharding

def _tiny_split(n: int) -> Split:
    images = torch.arange(n, dtype=torch.int64).view(n, 1, 1, 1).expand(n, 1, 2, 2).to(torch.uint8)
    return Split(images, torch.arange(n) % 10)


SPEC = DataSpec(1, 2, 10, (0.0,), (1 / 255,), augment=False)  # normalization leaves pixel = sample id


def _ranks_batches(n: int, batch: int, world: int, epoch: int = 0) -> list[list[torch.Tensor]]:
    split = _tiny_split(n)
    loaders = [TrainLoader(split, SPEC, batch, rank, world, seed=3, device=torch.device("cpu")) for rank in range(world)]
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
    assert not torch.equal(torch.cat(_ranks_batches(120, 12, 2, epoch=0)[0]), torch.cat(_ranks_batches(120, 12, 2, epoch=1)[0]))


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
            for images, labels in loader.epoch(1):
                for image in images:
                    out[image.numpy().tobytes()] = image
        return out
    assert set(by_sample(1)) == set(by_sample(2))
    augmented = TrainLoader(data.train, data.spec, 32, 0, 1, seed=5, device=torch.device("cpu"))
    plain = next(iter(augmented.epoch(1)))[0]
    assert plain.shape == (32, 3, 32, 32) and plain.dtype == torch.float32
