"""A set's index as files of flat arrays, written once per node and memory-mapped by every rank
and DataLoader worker: the page cache holds it once per node, whatever the set's size.

A split's table is its samples' classes, where each image's bytes are, and (for shards) which
shard and member hold them. Strings (image paths, member names) are one uint8 blob with int64 end
offsets, not Python objects: 1.28 M paths as a list of str cost ~190 MB in every process, and a
forked worker's reference counting copies their pages one by one.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable, Sequence

import numpy as np
import torch

from common.data.cache import META, map_tensors, staging_path

INDEX_FORMAT = 6  # in each index's folder name: a later layout is never read as an earlier one
SAMPLES_NAMED = 100  # skipped or ignored files whose names the index keeps (all are counted)


class Strings:
    """Many strings as one utf-8 blob and the end offset of each (a name's bytes that are not
    UTF-8 kept as they are, Python's file-name convention)."""

    def __init__(self, blob: torch.Tensor, ends: torch.Tensor) -> None:
        self.blob, self.ends = blob, ends
        self._blob, self._ends = blob.numpy(), ends.numpy()  # views: a lookup in numpy costs a tenth of torch's

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: int) -> str:
        start = int(self._ends[i - 1]) if i else 0
        return self._blob[start:int(self._ends[i])].tobytes().decode("utf-8", "surrogateescape")

    def __iter__(self):
        return (self[i] for i in range(len(self)))


@dataclass
class Table:
    """One split's samples. ImageFolder: `names` are the image paths relative to the data folder.
    Shards: `names` are the shard files, and sample i is bytes [offset, offset + size) of shard
    group[i], its image member named keys[i]."""

    folder: Path  # the index's folder, and the split's name in it
    split: str
    labels: torch.Tensor  # int64
    names: Strings
    keys: Strings | None = None
    group: torch.Tensor | None = None  # int64
    offset: torch.Tensor | None = None  # int64
    size: torch.Tensor | None = None  # int64
    height: torch.Tensor | None = None  # int64, each image's size as its header gives it: a training crop
    width: torch.Tensor | None = None  # is drawn on the whole image, before (or instead of) decoding it whole

    def __len__(self) -> int:
        return len(self.labels)

    def __reduce__(self) -> tuple:
        """A worker started by spawn maps the files again instead of receiving a pickled copy."""
        return map_table, (self.folder, self.split)

    @property
    def sharded(self) -> bool:
        return self.group is not None


@dataclass
class SetIndex:
    kind: str  # imagefolder | shards
    root: str  # the data folder or URL
    class_names: list[str]  # in class-index order (the class indices where the set names none)
    train: Table
    test: Table
    sizes: dict[str, str]  # "WxH" -> an image of that size (at most two: enough to say the set is mixed)
    modes: list[str]
    fingerprint: str
    folder: Path  # where its arrays are
    versions: dict[str, str] = field(default_factory=dict)  # shards: name -> version, as indexed
    skipped: list[str] = field(default_factory=list)  # the first SAMPLES_NAMED files whose header did not read
    skipped_count: int = 0
    ignored: list[str] = field(default_factory=list)  # files in the tree that are not images the suite reads
    ignored_count: int = 0
    formats: list[str] = field(default_factory=list)  # the images' formats, as PIL names them ("JPEG", "PNG")
    content: str = ""  # a hash of the index's arrays: what samples the set streams, in what order (content_of)

    @property
    def classes(self) -> int:
        return len(self.class_names)

    @property
    def jpeg_only(self) -> bool:
        """Every image a JPEG: a GPU rank can decode the whole set with nvJPEG (--decode gpu)."""
        return self.formats == ["JPEG"]


class _ArrayFile:
    """An int64 or uint8 array appended to a raw file chunk by chunk."""

    def __init__(self, path: Path, dtype: type) -> None:
        self.dtype = dtype
        self.handle: BinaryIO = open(path, "wb")

    def append(self, values: Sequence[int] | np.ndarray | bytes) -> None:
        array = np.frombuffer(values, np.uint8) if isinstance(values, bytes) else np.asarray(values, self.dtype)
        self.handle.write(array.tobytes())  # not tofile: a full disk is then OSError(ENOSPC), not numpy's wording

    def close(self) -> None:
        self.handle.close()


class _StringsFile:
    def __init__(self, folder: Path, name: str) -> None:
        self.blob = _ArrayFile(folder / f"{name}_blob", np.uint8)
        self.ends = _ArrayFile(folder / f"{name}_ends", np.int64)
        self.length = 0

    def append(self, texts: Iterable[str]) -> None:
        encoded = [text.encode("utf-8", "surrogateescape") for text in texts]  # a file name need not be UTF-8
        self.blob.append(b"".join(encoded))
        self.ends.append(np.cumsum([len(e) for e in encoded], dtype=np.int64) + self.length)
        self.length += sum(len(e) for e in encoded)

    def close(self) -> None:
        self.blob.close()
        self.ends.close()


class TableWriter:
    """A split's table, written chunk by chunk (memory bounded by a chunk, not the set)."""

    def __init__(self, folder: Path, split: str, sharded: bool) -> None:
        self.split = split
        self.labels = _ArrayFile(folder / f"{split}_labels", np.int64)
        self.names = _StringsFile(folder, f"{split}_names")
        self.columns = {name: _ArrayFile(folder / f"{split}_{name}", np.int64)
                        for name in ("group", "offset", "size")} if sharded else {}
        self.keys = _StringsFile(folder, f"{split}_keys") if sharded else None
        self.dims = {name: _ArrayFile(folder / f"{split}_{name}", np.int64) for name in ("height", "width")}

    def add_images(self, paths: list[str], labels: list[int], dims: list[tuple[int, int]]) -> None:
        """Images by path, with their classes and (width, height)s."""
        self.names.append(paths)
        self.labels.append(labels)
        self._add_dims(dims)

    def add_shard(self, name: str, group: int, offsets: list[int], sizes: list[int], keys: list[str],
                  labels: list[int], dims: list[tuple[int, int]]) -> None:
        self.names.append([name])
        self.labels.append(labels)
        self.keys.append(keys)
        for column, values in (("group", [group] * len(labels)), ("offset", offsets), ("size", sizes)):
            self.columns[column].append(values)
        self._add_dims(dims)

    def _add_dims(self, dims: list[tuple[int, int]]) -> None:
        self.dims["width"].append([w for w, _ in dims])
        self.dims["height"].append([h for _, h in dims])

    def close(self) -> None:
        for array in (self.labels, self.names, self.keys, *self.columns.values(), *self.dims.values()):
            if array:
                array.close()


def staging_for(target: Path) -> Path:
    """A fresh staging folder beside `target`, its name unique across processes and hosts."""
    staging = staging_path(target)
    staging.mkdir(parents=True)
    return staging


def shapes_of(folder: Path) -> dict[str, dict]:
    """The raw arrays TableWriters left in `folder`: name -> shape and dtype, as map_tensors reads
    them (a string blob is uint8, every other array int64)."""
    shapes = {}
    for path in sorted(folder.iterdir()):
        dtype = np.dtype(np.uint8 if path.name.endswith("_blob") else np.int64)
        shapes[path.name] = {"shape": [path.stat().st_size // dtype.itemsize], "dtype": str(dtype)}
    return shapes


def publish(staging: Path, target: Path, meta: dict) -> None:
    """meta.json last, then the folder renamed into place: a reader sees a whole index or none.
    Another process (on another node sharing the cache) may have published the same index first."""
    (staging / META).write_text(json.dumps({**meta, "content": content_of(staging)}))
    try:
        os.rename(staging, target)
    except OSError:
        if not (target / META).is_file():
            raise
        shutil.rmtree(staging, ignore_errors=True)


def content_of(folder: Path) -> str:
    """A hash of the index's arrays (every sample's file or row, label and dimensions, and a shard's
    or row group's byte sizes, in the set's order): a checkpoint records it, so that a run is never
    resumed on another sample stream. Unlike the fingerprint it ignores the files' dates: a set
    copied anew (cp without -p) resumes."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def map_index(folder: Path) -> SetIndex:
    """The index in `folder`, mapped."""
    meta = json.loads((folder / META).read_text())
    return SetIndex(meta["kind"], meta["root"], meta["classes"], map_table(folder, "train"), map_table(folder, "test"),
                    meta["sizes"], meta["modes"], meta["fingerprint"], folder, meta["versions"], meta["skipped"],
                    meta["skipped_count"], meta["ignored"], meta["ignored_count"], meta["formats"], meta["content"])


def map_table(folder: Path, split: str) -> Table:
    arrays = map_tensors(folder, prefix=f"{split}_")
    strings = lambda name: Strings(arrays[f"{split}_{name}_blob"], arrays[f"{split}_{name}_ends"])  # noqa: E731
    dims = {"height": arrays[f"{split}_height"], "width": arrays[f"{split}_width"]}
    if f"{split}_group" not in arrays:
        return Table(folder, split, arrays[f"{split}_labels"], strings("names"), **dims)
    return Table(folder, split, arrays[f"{split}_labels"], strings("names"), strings("keys"), arrays[f"{split}_group"],
                 arrays[f"{split}_offset"], arrays[f"{split}_size"], **dims)
