"""Damaged data files, fuzzed: whatever the bytes, a reader returns well-formed data (a mutation can
be harmless, e.g. in pixel bytes) or raises one UserError, on one line, that names the file.
Any other exception fails. Seeded and small, so every run tries the same few hundred files fast."""
from __future__ import annotations

import gzip
import random
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from common.data.formats import (
    CIFAR_DIR,
    CIFAR_TEST,
    CIFAR_TRAIN,
    MNIST_DIR,
    MNIST_FILES,
    MNIST_PROCESSED,
    MNIST_PROCESSED_DIR,
    read_cifar10,
    read_mnist,
)
from common.data.loader import Dataset
from common.errors import UserError
from tests.datagen import write_cifar10, write_mnist, write_mnist_processed

pytestmark = pytest.mark.quick  # no launch: the quick tier (pytest -m quick)

CASES = 200  # mutations per format
SEED = 1234


@dataclass(frozen=True)
class Format:
    name: str
    write: Callable[[Path], Path]  # a small valid data set under the given root
    files: tuple[str, ...]  # the files the fuzz damages, relative to the root
    read: Callable[[Path], Dataset]
    image_shape: tuple[int, int, int]
    header: int  # leading bytes that hold the format's structure (IDX header, pickle opcodes, zip's data.pkl)
    gz: bool = False  # also damage the decompressed bytes, so header mutations reach the reader through gzip


FORMATS = [
    Format("cifar-pickle", lambda root: write_cifar10(root, per_batch=10, test_size=10),
           tuple(f"{CIFAR_DIR}/{name}" for name in CIFAR_TRAIN + CIFAR_TEST), read_cifar10, (3, 32, 32), header=320),
    Format("mnist-idx", lambda root: write_mnist(root, train_size=40, test_size=20),
           tuple(f"{MNIST_DIR}/{stem}" for stem in MNIST_FILES), read_mnist, (1, 28, 28), header=16),
    Format("mnist-idx-gz", lambda root: write_mnist(root, train_size=40, test_size=20, gz=True),
           tuple(f"{MNIST_DIR}/{stem}.gz" for stem in MNIST_FILES), read_mnist, (1, 28, 28), header=16, gz=True),
    Format("mnist-processed-pt", lambda root: write_mnist_processed(root, train_size=40, test_size=20),
           tuple(f"{MNIST_PROCESSED_DIR}/{name}" for name in MNIST_PROCESSED), read_mnist, (1, 28, 28), header=330),
]


def _offset(rng: random.Random, size: int, header: int) -> int:
    """Half the hits land in the header, where a byte changes structure rather than one pixel."""
    return rng.randrange(min(header, size) if rng.random() < 0.5 else size)


def _mutate(raw: bytes, rng: random.Random, header: int) -> tuple[str, bytes]:
    kind = rng.choice(("flip", "flip", "truncate", "truncate", "empty", "append", "swap"))
    data = bytearray(raw)
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            at = _offset(rng, len(data), header)
            data[at] = rng.choice((data[at] ^ (1 << rng.randrange(8)), rng.randrange(256)))
    elif kind == "truncate":
        del data[_offset(rng, len(data), header):]
    elif kind == "empty":
        data.clear()
    elif kind == "append":
        data += rng.randbytes(rng.randint(1, 64))
    else:  # swap two 4-byte header fields (in IDX: magic, count, rows, columns)
        i, j = rng.sample(range(0, min(header, len(data)) - 3, 4), 2)
        data[i:i + 4], data[j:j + 4] = data[j:j + 4], data[i:i + 4]
    return kind, bytes(data)


def _damaged(raw: bytes, rng: random.Random, fmt: Format) -> tuple[str, bytes]:
    if fmt.gz and rng.random() < 0.5:
        kind, inner = _mutate(gzip.decompress(raw), rng, fmt.header)
        return f"{kind} (inside the gzip)", gzip.compress(inner, mtime=0)
    return _mutate(raw, rng, fmt.header)


def _assert_well_formed(data: Dataset, image_shape: tuple[int, int, int]) -> None:
    for split in (data.train, data.test):
        assert split.images.dtype == torch.uint8 and split.images.shape[1:] == image_shape
        assert split.labels.dtype == torch.int64 and split.labels.shape == (len(split.images),)
        assert len(split.labels) > 0 and 0 <= int(split.labels.min()) and int(split.labels.max()) <= 9


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_damaged_files_read_or_fail_in_one_line(fmt: Format, tmp_path: Path):
    root = fmt.write(tmp_path / "data")
    originals = {name: (root / name).read_bytes() for name in fmt.files}
    rng = random.Random(f"{SEED}:{fmt.name}")
    outcomes: Counter[str] = Counter()
    for case in range(CASES):
        name = rng.choice(fmt.files)
        path = root / name
        kind, damaged = _damaged(originals[name], rng, fmt)
        path.write_bytes(damaged)
        try:
            _assert_well_formed(fmt.read(root), fmt.image_shape)
            outcomes[f"harmless {kind.split()[0]}"] += 1
        except UserError as e:
            message = str(e)
            assert "\n" not in message and str(path) in message, f"case {case}, {kind} of {name}: {message!r}"
            outcomes[f"rejected {kind.split()[0]}"] += 1
        except Exception as e:  # noqa: BLE001 - the point: anything else is the bug
            pytest.fail(f"case {case}, {kind} of {name} escaped as {type(e).__name__}: {e}")
        finally:
            path.write_bytes(originals[name])
    rejected = sum(n for key, n in outcomes.items() if key.startswith("rejected"))
    print(f"\n{fmt.name}: {CASES} mutations, {rejected} rejected with a one-line UserError, "
          f"{CASES - rejected} harmless; {dict(sorted(outcomes.items()))}")
    assert outcomes["rejected empty"] > 0 and outcomes["harmless empty"] == 0
    assert rejected > CASES // 4  # the fuzz reaches the checks, not just the pixels


def test_the_fuzz_starts_from_readable_files(tmp_path: Path):
    """A fuzz of files the reader already refuses would prove nothing."""
    for fmt in FORMATS:
        _assert_well_formed(fmt.read(fmt.write(tmp_path / fmt.name)), fmt.image_shape)
        shutil.rmtree(tmp_path / fmt.name)
