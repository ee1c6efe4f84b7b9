"""Data sets as in-memory uint8 tensors, per-batch normalization and augmentation, sharding.

Readers parse the standard on-disk formats (CIFAR-10 python batches, MNIST IDX files) directly;
images stay uint8 until a batch is on its device, where it is cropped, flipped and normalized
with tensor ops (no per-sample PIL work).
"""
from __future__ import annotations

import gzip
import hashlib
import pickle
import socket
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch.utils.data.distributed import DistributedSampler

from common.errors import PeerFailed, UserError

CIFAR_DIR = "cifar-10-batches-py"
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST = ["test_batch"]
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR_MD5 = "c58f30108f718f92721af3b95e74349a"

MNIST_DIR = "MNIST/raw"
MNIST_FILES = {  # stem -> md5 of the .gz as published
    "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
}
MNIST_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")

DOWNLOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DataSpec:
    channels: int
    size: int
    classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool  # random 4-px-padded crop + horizontal flip


CIFAR_SPEC = DataSpec(3, 32, 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), augment=True)
MNIST_SPEC = DataSpec(1, 28, 10, (0.1307,), (0.3081,), augment=False)


@dataclass(frozen=True)
class Split:
    images: torch.Tensor  # uint8, (N, C, H, W)
    labels: torch.Tensor  # int64, (N,)

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class Dataset:
    name: str
    spec: DataSpec
    train: Split
    test: Split


# ---------------------------------------------------------------- CIFAR-10 python batches

class _ArrayUnpickler(pickle.Unpickler):
    """CIFAR batches are pickles; allow only what a numpy array needs, so a file cannot run code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
        ("copy_reg", "_reconstructor"), ("copyreg", "_reconstructor"), ("__builtin__", "object"),
    }

    def find_class(self, module: str, name: str):  # type: ignore[override]
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _read_cifar_batch(path: Path) -> Split:
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="latin1").load()
        data = torch.as_tensor(batch["data"], dtype=torch.uint8)
        labels = torch.as_tensor(batch["labels"], dtype=torch.int64)
    except (OSError, EOFError, KeyError, TypeError, ValueError, pickle.UnpicklingError) as e:
        raise UserError(f"{path} is not a CIFAR-10 python batch ({type(e).__name__}: {e}); "
                        f"delete {path.parent} and rerun to download it again, or extract {CIFAR_URL} there") from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data) or not _labels_ok(labels):
        raise UserError(f"{path} has shape {tuple(data.shape)} with {len(labels)} labels; expected (N, 3072) "
                        f"uint8 and N labels in 0..9; replace it with the file from {CIFAR_URL}")
    return Split(data.reshape(-1, 3, 32, 32).contiguous(), labels)


def _labels_ok(labels: torch.Tensor) -> bool:
    return len(labels) > 0 and int(labels.min()) >= 0 and int(labels.max()) <= 9


def _concat(splits: Sequence[Split]) -> Split:
    return Split(torch.cat([s.images for s in splits]), torch.cat([s.labels for s in splits]))


def read_cifar10(root: Path) -> Dataset:
    folder = root / CIFAR_DIR
    train = _concat([_read_cifar_batch(folder / name) for name in CIFAR_TRAIN])
    test = _concat([_read_cifar_batch(folder / name) for name in CIFAR_TEST])
    return Dataset("cifar10", CIFAR_SPEC, train, test)


# ---------------------------------------------------------------- MNIST IDX files

def _mnist_file(root: Path, stem: str) -> Path | None:
    """The plain file if present, else its .gz (torchvision keeps both after a download)."""
    for path in (root / MNIST_DIR / stem, root / MNIST_DIR / f"{stem}.gz"):
        if path.is_file():
            return path
    return None


def _read_idx(path: Path, ndim: int) -> torch.Tensor:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
        zero, dtype_code, dims = struct.unpack(">HBB", raw[:4])
        shape = struct.unpack(f">{dims}I", raw[4:4 + 4 * dims])
    except (OSError, EOFError, struct.error) as e:
        raise UserError(f"{path} is not a readable IDX file ({e}); delete it and rerun to download it again") from None
    expected = 4 + 4 * dims + int(torch.tensor(shape).prod()) if shape else -1
    if zero != 0 or dtype_code != 0x08 or dims != ndim or len(raw) != expected:
        raise UserError(f"{path} is not an IDX file of {ndim}-d uint8 data of the size its header gives "
                        f"(header {zero:#x} {dtype_code:#x} dims={dims} shape={shape}, {len(raw)} bytes); "
                        "delete it and rerun to download it again")
    return torch.frombuffer(bytearray(raw[4 + 4 * dims:]), dtype=torch.uint8).reshape(shape)


def _read_mnist_split(root: Path, prefix: str) -> Split:
    images = _read_idx(_mnist_file(root, f"{prefix}-images-idx3-ubyte"), 3)
    labels_path = _mnist_file(root, f"{prefix}-labels-idx1-ubyte")
    labels = _read_idx(labels_path, 1).long()
    if len(labels) != len(images) or not _labels_ok(labels):
        raise UserError(f"{labels_path} holds {len(labels)} labels for {len(images)} images, or labels outside 0..9")
    return Split(images.unsqueeze(1).contiguous(), labels)


def read_mnist(root: Path) -> Dataset:
    return Dataset("mnist", MNIST_SPEC, _read_mnist_split(root, "train"), _read_mnist_split(root, "t10k"))


# ---------------------------------------------------------------- synthetic

def make_synthetic(shape: str, train_size: int = 10000, test_size: int = 2000, seed: int = 1234) -> Dataset:
    """Deterministic, learnable images: one smooth random template per class, randomly shifted,
    scaled in contrast and covered in noise, so a net must learn shapes, not single pixels."""
    spec = CIFAR_SPEC if shape == "cifar" else MNIST_SPEC
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(spec.classes, spec.channels, 4, 4, generator=g)
    templates = torch.nn.functional.interpolate(coarse, size=spec.size, mode="bilinear", align_corners=False)

    def split(n: int) -> Split:
        labels = torch.randint(0, spec.classes, (n,), generator=g)
        shifts = torch.randint(-3, 4, (n, 2), generator=g)
        images = torch.stack([t.roll((int(dy), int(dx)), dims=(1, 2)) for t, (dy, dx) in zip(templates[labels], shifts)])
        contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=g)
        noisy = 0.5 + 0.3 * (images - 0.5) * contrast + 0.35 * torch.randn(images.shape, generator=g)
        return Split((noisy.clamp(0, 1) * 255).round().to(torch.uint8), labels)

    return Dataset(f"synthetic-{shape}", spec, split(train_size), split(test_size))


# ---------------------------------------------------------------- download, once per node

@contextmanager
def _socket_timeout(seconds: float) -> Iterator[None]:
    """torchvision's download helpers have no timeout; a black-holed network must not hang the job."""
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(old)


def _missing(name: str, root: Path) -> list[Path]:
    if name == "cifar10":
        return [root / CIFAR_DIR / f for f in CIFAR_TRAIN + CIFAR_TEST if not (root / CIFAR_DIR / f).is_file()]
    return [root / MNIST_DIR / stem for stem in MNIST_FILES if _mnist_file(root, stem) is None]


def _offline_message(name: str, root: Path, missing: list[Path], why: str) -> str:
    if name == "cifar10":
        how = f"download {CIFAR_URL} and extract it into {root}/ (it unpacks to {root / CIFAR_DIR}/)"
    else:
        how = f"download {', '.join(s + '.gz' for s in MNIST_FILES)} from {MNIST_MIRRORS[0]} into {root / MNIST_DIR}/"
    return f"{name} is missing {', '.join(str(p) for p in missing)} and {why}; {how}"


def _download(name: str, root: Path, cifar_url: str, mnist_mirrors: Sequence[str]) -> None:
    from torchvision.datasets.utils import download_and_extract_archive

    with _socket_timeout(DOWNLOAD_TIMEOUT_S):
        if name == "cifar10":
            download_and_extract_archive(cifar_url, str(root), md5=CIFAR_MD5)
            return
        for stem, md5 in MNIST_FILES.items():
            if _mnist_file(root, stem) is None:
                _download_from_mirrors(f"{stem}.gz", md5, root / MNIST_DIR, mnist_mirrors)


def _download_from_mirrors(filename: str, md5: str, folder: Path, mirrors: Sequence[str]) -> None:
    from torchvision.datasets.utils import download_and_extract_archive

    errors = []
    for mirror in mirrors:
        try:
            download_and_extract_archive(mirror + filename, str(folder), filename=filename, md5=md5)
            return
        except (OSError, RuntimeError) as e:
            errors.append(f"{mirror}: {e}")
    raise OSError("; ".join(errors))


def ensure_files(name: str, root: Path, allow_download: bool, cifar_url: str = CIFAR_URL,
                 mnist_mirrors: Sequence[str] = MNIST_MIRRORS) -> None:
    """Download what is missing (archive checksums verified) or raise one clear UserError."""
    missing = _missing(name, root)
    if not missing:
        return
    if not allow_download:
        raise UserError(_offline_message(name, root, missing, "--no-download is set"))
    try:
        root.mkdir(parents=True, exist_ok=True)
        _download(name, root, cifar_url, mnist_mirrors)
    except (OSError, RuntimeError) as e:  # URLError and socket timeouts are OSErrors; md5 mismatch is RuntimeError
        raise UserError(_offline_message(name, root, missing, f"the download failed ({e})")) from None
    still = _missing(name, root)
    if still:
        raise UserError(_offline_message(name, root, still, "the download did not produce them"))


def load_dataset(name: str, data_dir: str, synthetic_shape: str, allow_download: bool, ctx) -> Dataset:
    """One download per node: its local rank 0 fetches while the others wait, then all ranks read.
    Every rank takes part in the agreement, so a failed download ends all of them, never hangs them."""
    if name == "synthetic":
        return make_synthetic(synthetic_shape)
    root = Path(data_dir)
    error: UserError | None = None
    if ctx.is_node_primary:
        try:
            ensure_files(name, root, allow_download)
        except UserError as e:
            error = e
    if not ctx.all_ok(error is None):
        raise error or PeerFailed("data preparation failed on another rank")
    return read_cifar10(root) if name == "cifar10" else read_mnist(root)


# ---------------------------------------------------------------- batches on the device

def _normalize(images: torch.Tensor, spec: DataSpec) -> torch.Tensor:
    mean = torch.tensor(spec.mean, device=images.device).view(1, -1, 1, 1)
    std = torch.tensor(spec.std, device=images.device).view(1, -1, 1, 1)
    return (images.float() / 255.0 - mean) / std


def _batch_generator(seed: int, epoch: int, step: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{epoch}:{step}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def crop_and_flip(images: torch.Tensor, shifts: torch.Tensor, flips: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """Random-crop from a zero-padded image (shift in 0..2*pad per axis) and mirror, for a whole batch."""
    n, c, h, w = images.shape
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    rows = (shifts[:, 0, None] + torch.arange(h, device=images.device))[:, None, :, None]
    cols = shifts[:, 1, None] + torch.arange(w, device=images.device)
    cols = torch.where(flips[:, None], cols.flip(1), cols)[:, None, None, :]
    batch = torch.arange(n, device=images.device)[:, None, None, None]
    chans = torch.arange(c, device=images.device)[None, :, None, None]
    return padded[batch, chans, rows, cols]


class TrainLoader:
    """This rank's share of each global batch, in DistributedSampler order.

    Rank r of W takes perm[r::W], so per-rank batches of B/W make global batch k exactly
    perm[k*B:(k+1)*B] at every W. Augmentation is drawn for the whole global batch from
    (seed, epoch, step) and sliced the same way, so every sample is cropped and flipped the same
    whatever the world size: training is one sample stream, independent of W.
    """

    def __init__(self, split: Split, spec: DataSpec, global_batch: int, rank: int, world_size: int,
                 seed: int, device: torch.device, max_steps: int = 0) -> None:
        self.split, self.spec, self.device = split, spec, device
        self.global_batch, self.rank, self.world_size, self.seed = global_batch, rank, world_size, seed
        self.per_rank = global_batch // world_size
        self.sampler = DistributedSampler(range(len(split)), num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=seed, drop_last=True)
        full_steps = len(split) // global_batch
        if full_steps == 0:
            raise UserError(f"--batch-size {global_batch} is larger than the training set ({len(split)} images)")
        self.steps_per_epoch = min(full_steps, max_steps) if max_steps else full_steps

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.sampler.set_epoch(epoch)  # without it every epoch repeats the same shuffle
        order = torch.tensor(list(self.sampler), dtype=torch.int64)
        for step in range(start_step, self.steps_per_epoch):
            index = order[step * self.per_rank:(step + 1) * self.per_rank]
            images = self.split.images[index].to(self.device, non_blocking=True)
            labels = self.split.labels[index].to(self.device, non_blocking=True)
            yield self._transform(images, epoch, step), labels

    def _transform(self, images: torch.Tensor, epoch: int, step: int) -> torch.Tensor:
        if self.spec.augment:
            g = _batch_generator(self.seed, epoch, step)
            shifts = torch.randint(0, 9, (self.global_batch, 2), generator=g)[self.rank::self.world_size]
            flips = (torch.rand(self.global_batch, generator=g) < 0.5)[self.rank::self.world_size]
            images = crop_and_flip(images, shifts.to(images.device), flips.to(images.device))
        return _normalize(images, self.spec)


def eval_shard(size: int, rank: int, world_size: int) -> torch.Tensor:
    """Contiguous, unpadded shard: every test sample belongs to exactly one rank
    (DistributedSampler would pad with duplicates and skew the accuracy)."""
    return torch.tensor_split(torch.arange(size), world_size)[rank]


def eval_batches(split: Split, spec: DataSpec, rank: int, world_size: int, batch: int,
                 device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for index in eval_shard(len(split), rank, world_size).split(batch):
        images = split.images[index].to(device, non_blocking=True)
        yield _normalize(images, spec), split.labels[index].to(device, non_blocking=True)
