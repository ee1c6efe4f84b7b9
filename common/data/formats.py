"""The data sets' on-disk formats: CIFAR-10 python batches, MNIST IDX files (plain or gzipped) and
torchvision's older processed MNIST pair, read into uint8 tensors; which files make a data set.

Every reader parses untrusted bytes: a damaged file ends in one line naming it and what to do,
never a traceback, and a CIFAR pickle or a processed .pt cannot run code.
"""
from __future__ import annotations

import codecs
import copyreg
import gzip
import hashlib
import io
import math
import pickle
import pickletools
import struct
import warnings
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Sequence

import torch

from common.data.loader import CIFAR_SPEC, MNIST_SPEC, Dataset, Split
from common.errors import UserError

CIFAR_DIR = "cifar-10-batches-py"
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST = ["test_batch"]
CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR_URL = f"https://www.cs.toronto.edu/~kriz/{CIFAR_ARCHIVE}"
CIFAR_MD5 = "c58f30108f718f92721af3b95e74349a"  # of the archive
CIFAR_BATCH_MD5 = {  # of each batch file as published (torchvision checks the same), for copies from a store
    "data_batch_1": "c99cafc152244af753f735de768cd75f", "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751", "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb", "test_batch": "40351d587109b95175f43aff81a1287e",
}

MNIST_DIR = "MNIST/raw"
MNIST_FILES = {  # stem -> md5 of the .gz as published
    "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
}
MNIST_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")



# ---------------------------------------------------------------- damaged files

# What a parser of untrusted bytes may raise on a damaged file; each reader turns these into one line.
# Subclasses come along: gzip.BadGzipFile is an OSError, UnicodeDecodeError a ValueError, KeyError and
# IndexError are LookupErrors, RecursionError is a RuntimeError, as is torch.load's error for a bad zip.
_MALFORMED = (OSError, EOFError, zlib.error, struct.error, pickle.UnpicklingError, AttributeError, LookupError,
              ValueError, TypeError, MemoryError, RecursionError, OverflowError, RuntimeError)
_BRIEF_LIMIT = 120  # characters of the parser's own message kept in ours


def _brief(e: BaseException) -> str:
    """The exception on one short line: torch.load's messages span lines, parsers' can run long."""
    name = type(e).__name__
    if name == "error":  # struct.error, zlib.error: the module says more than the name
        name = f"{type(e).__module__}.error"
    text = " ".join(str(e).split())
    text = text if len(text) <= _BRIEF_LIMIT else text[:_BRIEF_LIMIT] + "..."
    return f"{name}: {text}" if text else name


@dataclass(frozen=True)
class _FileKind:
    """What a data file should be and how to get a good copy: the two halves of every reader error."""

    what: str  # "a CIFAR-10 python batch": completes "<path> is not ..."
    fix: str  # what the user should do; may name {path} and {folder}

    def error(self, path: Path, detail: str) -> UserError:
        return UserError(f"{path} is not {self.what} ({detail}); {self.fix.format(path=path, folder=path.parent)}")

    @contextmanager
    def parsing(self, path: Path) -> Iterator[None]:
        """Whatever parsing `path` raises ends as this kind's one-line error; UserErrors pass unchanged.
        Parsers' warnings are silenced: on a damaged file they only repeat (over lines) what the error says."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        except _MALFORMED as e:
            raise self.error(path, _brief(e)) from None


_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            return f"{x.layout} {tuple(x.shape)}"
        return f"{str(x.dtype).removeprefix('torch.')} {tuple(x.shape)}{'' if x.is_contiguous() else ' non-contiguous'}"
    return f"{type(x).__name__} of {len(x)}" if isinstance(x, (tuple, list, dict)) else type(x).__name__


def _labels_ok(labels: torch.Tensor) -> bool:
    return len(labels) > 0 and int(labels.min()) >= 0 and int(labels.max()) <= 9


def _split_problem(images: object, labels: object, image_shape: tuple[int, ...]) -> str | None:
    """Why images and labels are not a split (contiguous uint8 (N, *image_shape), N integer labels in 0..9),
    or None. Contiguity matters: a stride-0 view of a tiny storage would otherwise blow up when copied."""
    shape = ", ".join(["N", *map(str, image_shape)])
    if not (isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and images.layout == torch.strided
            and images.is_contiguous() and images.ndim == 1 + len(image_shape)
            and tuple(images.shape[1:]) == image_shape):
        return f"images are {_describe(images)}, expected contiguous uint8 ({shape})"
    if not (isinstance(labels, torch.Tensor) and labels.dtype in _INT_DTYPES and labels.layout == torch.strided
            and labels.shape == (len(images),) and _labels_ok(labels)):
        return f"labels are {_describe(labels)} for {len(images)} images, expected as many integers in 0..9"
    return None


def _check_split(kind: _FileKind, path: Path, images: object, labels: object, image_shape: tuple[int, ...]) -> None:
    if problem := _split_problem(images, labels, image_shape):
        raise kind.error(path, problem)


def _read_upto(f: BinaryIO, n: int, chunk: int = 1 << 20) -> bytearray:
    """Up to n bytes, in chunks: a size taken from a damaged header can cost no more memory than the
    file really holds (a plain read(n) allocates all n up front)."""
    out = bytearray()
    while len(out) < n:
        data = f.read(min(chunk, n - len(out)))
        if not data:
            break
        out += data
    return out


# ---------------------------------------------------------------- CIFAR-10 python batches

class _PickledDtype:
    """numpy.dtype as a pickle describes it, recorded but never built: numpy's own dtype.__setstate__
    kills the process (a segfault, not an exception) on some malformed states, so no numpy code may
    see a file's bytes."""

    def __init__(self, name: object = None, align: object = False, copy: object = False) -> None:
        self.name, self.state = name, ()

    def __setstate__(self, state: object) -> None:
        self.state = state


# The numpy types a CIFAR batch or a re-saved label array can hold; wider ones must be little-endian.
_NUMPY_DTYPES = {"u1": torch.uint8, "i1": torch.int8, "i2": torch.int16, "i4": torch.int32, "i8": torch.int64}


class _PickledArray:
    """numpy.ndarray as pickled: _reconstruct(ndarray, (0,), b'b'), then
    __setstate__(([version,] shape, dtype, is_fortran, raw bytes)); we build the tensor ourselves."""

    def __init__(self, *_: object) -> None:
        self.state: object = ()

    def __setstate__(self, state: object) -> None:
        self.state = state

    def to_tensor(self) -> torch.Tensor:
        *_, shape, dtype, fortran, raw = self.state  # type: ignore[misc]
        if not (isinstance(dtype, _PickledDtype) and dtype.name in _NUMPY_DTYPES):
            raise ValueError(f"unsupported array dtype {getattr(dtype, 'name', dtype)!r}")
        torch_dtype = _NUMPY_DTYPES[dtype.name]
        byteorder = dtype.state[1] if isinstance(dtype.state, tuple) and len(dtype.state) > 1 else "|"
        if torch_dtype.itemsize > 1 and byteorder not in ("<", "="):
            raise ValueError(f"unsupported byte order {byteorder!r} for {dtype.name}")
        raw = raw.encode("latin1") if isinstance(raw, str) else raw  # Python 2 pickles hold str
        shape = tuple(shape)
        if not (isinstance(raw, bytes) and all(type(n) is int and n >= 0 for n in shape)):
            raise ValueError(f"array of shape {shape} holds {type(raw).__name__} data")
        if len(raw) != math.prod(shape) * torch_dtype.itemsize:
            raise ValueError(f"array of shape {shape} and dtype {dtype.name} holds {len(raw)} bytes")
        flat = torch.frombuffer(bytearray(raw), dtype=torch_dtype) if raw else torch.empty(0, dtype=torch_dtype)
        if fortran:  # column-major data: the reversed shape, transposed back
            return flat.reshape(shape[::-1]).permute(*reversed(range(len(shape)))).contiguous()
        return flat.reshape(shape)


def _as_tensor(x: object) -> torch.Tensor:
    return x.to_tensor() if isinstance(x, _PickledArray) else torch.as_tensor(x)


class _ArrayUnpickler(pickle.Unpickler):
    """CIFAR batches are pickles. Only the globals an array needs resolve, and to stand-ins, so a file
    can neither run code nor reach numpy's C code with its bytes."""

    GLOBALS = {
        ("numpy.core.multiarray", "_reconstruct"): _PickledArray,
        ("numpy._core.multiarray", "_reconstruct"): _PickledArray,
        ("numpy", "ndarray"): _PickledArray, ("numpy", "dtype"): _PickledDtype, ("_codecs", "encode"): codecs.encode,
        ("copy_reg", "_reconstructor"): copyreg._reconstructor, ("copyreg", "_reconstructor"): copyreg._reconstructor,
        ("__builtin__", "object"): object,
    }

    def find_class(self, module: str, name: str) -> object:  # type: ignore[override]
        try:
            return self.GLOBALS[(module, name)]
        except (KeyError, TypeError):  # TypeError: a damaged file can name an unhashable "module"
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}") from None


_CIFAR_BATCH = _FileKind("a CIFAR-10 python batch",
                         f"delete {{folder}} and rerun to download it again, or extract {CIFAR_URL} there")


def _unpickle_batch(raw: bytes) -> object:
    # Walk the opcodes first (pure Python, nothing built, every read bounded by the bytes at hand): the C
    # unpickler allocates what a bytes opcode's length field claims before reading, up to gigabytes.
    for _ in pickletools.genops(raw):
        pass
    return _ArrayUnpickler(io.BytesIO(raw), encoding="latin1").load()


def _read_cifar_batch(path: Path) -> Split:
    with _CIFAR_BATCH.parsing(path):
        batch = _unpickle_batch(path.read_bytes())
        images, labels = _as_tensor(batch["data"]), _as_tensor(batch["labels"])
    _check_split(_CIFAR_BATCH, path, images, labels, (3 * 32 * 32,))
    return Split(images.reshape(-1, 3, 32, 32), labels.long())


def _concat(splits: Sequence[Split]) -> Split:
    return Split(torch.cat([s.images for s in splits]), torch.cat([s.labels for s in splits]))


def read_cifar10(root: Path) -> Dataset:
    folder = root / CIFAR_DIR
    train = _concat([_read_cifar_batch(folder / name) for name in CIFAR_TRAIN])
    test = _concat([_read_cifar_batch(folder / name) for name in CIFAR_TEST])
    return Dataset("cifar10", CIFAR_SPEC, train, test, class_names=CIFAR10_CLASSES)


# ---------------------------------------------------------------- MNIST: raw IDX files, or torchvision's processed pair

MNIST_PROCESSED_DIR = "MNIST/processed"
MNIST_PROCESSED = ("training.pt", "test.pt")  # older torchvision: each a torch.save'd (uint8 N x 28 x 28, int64 N)
MNIST_IMAGE = (28, 28)

_IDX_HEADER = struct.Struct(">HBB")  # two zero bytes, element type (0x08: unsigned byte), number of dimensions
_IDX_UBYTE = 0x08
_REDOWNLOAD = "delete it and rerun to download it again"
_MNIST_PROCESSED_KIND = _FileKind("torchvision's processed MNIST (a torch.save'd tuple of uint8 images N x 28 x 28 "
                                  "and int64 labels N)", "delete it and rerun to download the raw IDX files instead")


def mnist_file(root: Path, stem: str) -> Path | None:
    """The plain file if present, else its .gz (torchvision keeps both after a download)."""
    for path in (root / MNIST_DIR / stem, root / MNIST_DIR / f"{stem}.gz"):
        if path.is_file():
            return path
    return None


def _mnist_raw_complete(root: Path) -> bool:
    return all(mnist_file(root, stem) for stem in MNIST_FILES)


def _mnist_processed(root: Path) -> list[Path]:
    """The processed pair when both files are there, else nothing: half a layout is no layout."""
    paths = [root / MNIST_PROCESSED_DIR / name for name in MNIST_PROCESSED]
    return paths if all(p.is_file() for p in paths) else []


def _read_idx(path: Path, item_shape: tuple[int, ...], items: str) -> torch.Tensor:
    """An IDX file of uint8 items of item_shape. The header is checked before the data is read, and
    the data is read in chunks, so dims that promise more than the file holds allocate nothing big."""
    kind = _FileKind(f"an IDX file of {items}", _REDOWNLOAD)
    opener = gzip.open if path.suffix == ".gz" else open
    with kind.parsing(path), opener(path, "rb") as f:
        zero, dtype_code, dims = _IDX_HEADER.unpack(_read_upto(f, _IDX_HEADER.size))
        shape = struct.unpack(f">{dims}I", _read_upto(f, 4 * dims))
        if zero != 0 or dtype_code != _IDX_UBYTE or dims != 1 + len(item_shape) or shape[1:] != item_shape:
            raise kind.error(path, f"header {zero:#x} {dtype_code:#x} dims={dims} shape={shape}")
        size = math.prod(shape)
        data = _read_upto(f, size + 1)  # one byte more, to catch trailing data
    if len(data) != size:
        raise kind.error(path, f"header shape {shape} needs {size} bytes of data, the file has "
                               f"{'more' if len(data) > size else len(data)}")
    if size == 0:  # frombuffer refuses an empty buffer; the split check reports the empty set
        return torch.empty(shape, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8).reshape(shape)


def _read_mnist_split(root: Path, prefix: str) -> Split:
    images = _read_idx(mnist_file(root, f"{prefix}-images-idx3-ubyte"), MNIST_IMAGE, "N x 28 x 28 uint8 images")
    labels_path = mnist_file(root, f"{prefix}-labels-idx1-ubyte")
    labels = _read_idx(labels_path, (), "N uint8 labels")
    _check_split(_FileKind("the labels for its images file", _REDOWNLOAD), labels_path, images, labels, MNIST_IMAGE)
    return Split(images.unsqueeze(1), labels.long())


def _read_mnist_processed(path: Path) -> Split:
    with _MNIST_PROCESSED_KIND.parsing(path):
        # weights_only: tensors and plain containers only; any other global is refused before it is called
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    if not (isinstance(loaded, (tuple, list)) and len(loaded) == 2):
        raise _MNIST_PROCESSED_KIND.error(path, f"it holds {_describe(loaded)}")
    images, labels = loaded
    _check_split(_MNIST_PROCESSED_KIND, path, images, labels, MNIST_IMAGE)
    return Split(images.unsqueeze(1), labels.long())


def read_mnist(root: Path) -> Dataset:
    """From the four raw IDX files when all are there, else from the processed pair."""
    if missing := missing_files("mnist", root):  # fetch.py made them present before a training run gets here
        raise UserError(offline_message("mnist", root, missing, "read_mnist does not download"))
    if _mnist_raw_complete(root):
        train, test = _read_mnist_split(root, "train"), _read_mnist_split(root, "t10k")
    else:
        train, test = (_read_mnist_processed(path) for path in _mnist_processed(root))
    return Dataset("mnist", MNIST_SPEC, train, test)


# ---------------------------------------------------------------- layouts: which files make a data set

def _layouts(name: str) -> list[list[tuple[str, ...]]]:
    """The supported layouts, preferred first: each a list of required files, each file given as
    alternatives (MNIST's raw files plain or gzipped), paths relative to the data folder."""
    if name == "cifar10":
        return [[(f"{CIFAR_DIR}/{batch}",) for batch in CIFAR_TRAIN + CIFAR_TEST]]
    raw = [(f"{MNIST_DIR}/{stem}", f"{MNIST_DIR}/{stem}.gz") for stem in MNIST_FILES]
    return [raw, [(f"{MNIST_PROCESSED_DIR}/{file}",) for file in MNIST_PROCESSED]]


def choose_files(name: str, exists: Callable[[str], bool]) -> list[str] | None:
    """The files of the first complete layout, or None."""
    for layout in _layouts(name):
        picks = [next((alt for alt in alternatives if exists(alt)), None) for alternatives in layout]
        if all(picks):
            return picks
    return None


def layout_folders(name: str) -> list[str]:
    return sorted({alt.rsplit("/", 1)[0] for layout in _layouts(name) for alts in layout for alt in alts})


def missing_in(name: str, exists: Callable[[str], bool]) -> list[str]:
    """What the preferred layout lacks (what a message should tell the user to add)."""
    return [alternatives[0] for alternatives in _layouts(name)[0] if not any(map(exists, alternatives))]


def missing_files(name: str, root: Path) -> list[Path]:
    def exists(rel: str) -> bool:
        return (root / rel).is_file()
    return [] if choose_files(name, exists) else [root / rel for rel in missing_in(name, exists)]


def offline_message(name: str, root: Path | str, missing: Sequence[Path | str], why: str) -> str:
    """`root` is a folder or a URL: the same layouts, the same advice."""
    where = str(root).rstrip("/")
    if name == "cifar10":
        how = f"download {CIFAR_URL} and extract it into {where}/ (it unpacks to {where}/{CIFAR_DIR}/)"
    else:
        how = (f"download {', '.join(s + '.gz' for s in MNIST_FILES)} from {MNIST_MIRRORS[0]} into "
               f"{where}/{MNIST_DIR}/ (torchvision's older {' and '.join(MNIST_PROCESSED)} in "
               f"{where}/{MNIST_PROCESSED_DIR}/ work too)")
    return (f"{name} is missing {', '.join(str(p) for p in missing)} and {why}; {how}; or try the suite right "
            "now without it: --dataset synthetic")


def checksum_problem(rel: str, path: Path) -> str | None:
    """A CIFAR-10 batch copied from a store must be the published file (torchvision checks the same)."""
    expected = CIFAR_BATCH_MD5.get(rel.rsplit("/", 1)[-1]) if rel.startswith(CIFAR_DIR) else None
    if expected is None:
        return None
    actual = hashlib.md5(path.read_bytes()).hexdigest()
    return None if actual == expected else f"has md5 {actual}, the published file {expected}: a damaged or other file"


def read_dataset(name: str, root: Path) -> Dataset:
    return read_cifar10(root) if name == "cifar10" else read_mnist(root)
