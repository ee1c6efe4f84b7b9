"""--dataset hf: a Hugging Face data set (common/hfsets.py: what SOURCE is, its files) as one more
own-data layout: indexed, then decoded into the node's cache or streamed like the others.

The index (common/data/index.py) is a sharded table whose groups are the files' row groups (an
Arrow file's record batches): a sample is row `offset` of group `group`. The epoch's order shuffles
the groups and deals each window of K groups into K lanes (--shard-lanes K; loader.global_order);
a node's ranks read only their places' lanes (loader.rank_places), but on a node each rank uses
about 1/W of a window's rows, and a parquet row group's pages decompress only whole (pyarrow
writes pages of up to 1,024 rows), so a row group is decompressed once per node into the node's
row-group cache (RowGroupCache), and every rank and worker reads only its own rows from there. An
Arrow file is memory-mapped: its rows are read where they are.
"""
from __future__ import annotations

import errno
import hashlib
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from common.config import SHUFFLE_WINDOW
from common.data.decoding import broken_message, header
from common.data.geometry import Stored
from common.data.index import SetIndex, Table, TableWriter
from common.data.indexing import ShardSamples, Survey, parallel
from common.data.reading import Ragged, Reader
from common.data.shardcache import GONE, ShardCache
from common.errors import UserError
from common.hfsets import (
    ARROW,
    GROUP_MARK,
    Files,
    Source,
    check_columns,
    check_distinct,
    check_embedded,
    class_names,
    fmt_of,
    image_bytes,
    rows_digest,
)

COPY_PIECE_BYTES = 16 * 2**20  # a row group is copied into the cache in pieces of this size (and pyarrow holds
# the page it decodes: a process that copies holds about its largest page, one that reads holds no image)


# ---------------------------------------------------------------- indexing

def index_into(source: Source, folder: Path, options: dict[str, Any], image_key: str, label_key: str,
               workers: int, skip: bool) -> tuple[list[str], Survey]:
    """Both splits' rows indexed into `folder` (the headers of every image read: its size and mode):
    the classes' names and what the pass saw."""
    files = Files(source.root, options)
    for name in source.train + source.test:
        check_columns(files, name, image_key, label_key)
    names = class_names(files, source, label_key)
    survey, tops = Survey(), {}
    digests: dict[str, list[bytes]] = {name: [] for name in source.train + source.test}
    for split, split_files in (("train", source.train), ("test", source.test)):
        groups = [(name, group, start, label_key, image_key) for name in split_files
                  for group, start in enumerate(starts(files.row_groups(name)))]
        writer = TableWriter(folder, split, sharded=True)
        work = lambda item: read_group(files, item, skip)  # noqa: E731
        top = -1
        for number, ((name, group, *_), (found, digest)) in enumerate(zip(groups, parallel(groups, work, workers))):
            writer.add_shard(f"{name}{GROUP_MARK}{group}", number, found.offsets, found.sizes, found.keys,
                             found.labels, found.dims)
            survey.merge(found.survey)
            top = max([top, *found.labels])
            check_labels(found, names, files.where(name), label_key)
            digests[name].append(digest)
        writer.close()
        tops[split] = top
    check_distinct(files, digests)
    classes = names or [str(i) for i in range(tops["train"] + 1)]
    if tops["test"] >= len(classes):
        raise UserError(f"the {source.eval_split} split of {source.root} has class {tops['test']}, outside the "
                        f"{len(classes)} classes of its train split; evaluate on a split of the same classes")
    check_shuffled(folder, source, len(classes))
    return classes, survey


def starts(rows: list[int]) -> list[int]:
    """The first row (in the file) of each row group."""
    return np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(int).tolist() if rows else []


def read_group(files: Files, item: tuple[str, int, int, str, str], skip: bool) -> tuple[ShardSamples, bytes]:
    """One row group's samples (each row's place in it, its image's size, (width, height) and
    mode), and its rows' digest."""
    name, group, start, label_key, image_key = item
    column, labels = files.columns(name, group, [image_key, label_key])
    images, labels = image_bytes(column).to_pylist(), labels.to_pylist()
    out = ShardSamples()
    for row, (data, label) in enumerate(zip(images, labels)):
        key = f"row {start + row}"
        where = f"{files.where(name)}:{key}"
        if not data:
            check_embedded(column, row, where)
        if label is None:
            raise UserError(f"{where} has no label (column {label_key!r}, --hf-label-key); label it or drop the row")
        try:
            if not data:
                raise ValueError("the row holds no image bytes")
            (width, height), mode, kind = header(data)
        except Exception as e:  # noqa: BLE001 - any decoder failure is this row's problem, said in one line
            if not skip:
                raise UserError(broken_message(where, e)) from None
            out.survey.skip([where])
            continue
        out.offsets.append(row)
        out.sizes.append(len(data))
        out.keys.append(key)
        out.labels.append(int(label))
        out.dims.append((width, height))
        out.survey.saw(f"{width}x{height}", where, mode, kind)
    return out, rows_digest(images, labels)


def check_labels(found: ShardSamples, names: list[str] | None, where: str, label_key: str) -> None:
    """Every label a class index: >= 0, and below the ClassLabel's count where there is one."""
    bad = next(((key, label) for key, label in zip(found.keys, found.labels)
                if label < 0 or (names is not None and label >= len(names))), None)
    if bad is not None:
        key, label = bad
        limit = f"the {len(names)} classes of its ClassLabel feature (0 to {len(names) - 1})" if names else \
            "the class indices (0 or more)"
        unlabelled = " (-1: datasets' mark for a row without a label)" if label == -1 else ""
        raise UserError(f"{where}:{key} has label {label}{unlabelled} in column {label_key!r} (--hf-label-key), "
                        f"outside {limit}; fix the rows, or train on a split whose rows are labelled")


def check_shuffled(folder: Path, source: Source, classes: int) -> None:
    """Refuses training rows sorted by class: the stream shuffles row groups and the rows of
    a few of them at a time (--shard-lanes), so each batch would hold one or two classes."""
    labels = np.fromfile(folder / "train_labels", dtype=np.int64)
    if classes > 1 and len(np.unique(labels)) > 1 and bool(np.all(np.diff(labels) >= 0)):
        raise UserError(f"the training rows of {source.root} are sorted by class: rows are shuffled within "
                        f"a few row groups at a time (--shard-lanes, {SHUFFLE_WINDOW} by default), so a batch would "
                        "hold one or two classes; write the set shuffled (ds.shuffle(seed=0).flatten_indices(), then "
                        "save_to_disk or to_parquet)")


# ---------------------------------------------------------------- reading while training

class RowGroupCache(ShardCache):
    """The image bytes of a parquet set's row groups, each copied once per node into --cache-dir by
    the first process that needs it (under the cache's lock, in pieces of COPY_PIECE_BYTES): the
    bytes of its rows end to end, then each row's start and the end (int64), then the row count.
    Every rank and worker of the node reads its own rows from that copy; the copies are bounded by
    --shard-cache-gb as shards from a URL are, the least recently used deleted beyond it."""

    SUFFIX = ".rows"
    WHAT = "row group"
    SMALLER = "write smaller row groups (row_group_size), or convert the set to shards (python -m common.shards)"

    def __init__(self, root: str, options: dict[str, Any], folder: Path, budget_bytes: int,
                 versions: dict[str, str], image_key: str, lanes: int = SHUFFLE_WINDOW) -> None:
        super().__init__(root, options, folder, budget_bytes, versions, lanes)
        self.files, self.image_key = Files(root, options), image_key

    def local(self, name: str) -> Path:
        tag = hashlib.sha256(f"{self.url}\0{name}\0{self.versions[name]}".encode()).hexdigest()[:16]
        return self.folder / f"{name.rsplit('/', 1)[-1]}.{tag}{self.SUFFIX}"

    def _fill(self, name: str, part: Path) -> None:
        file, group = name.rsplit(GROUP_MARK, 1)
        ends = [0]
        with open(part, "wb") as out:
            for piece in self.files.column_batches(file, int(group), self.image_key, COPY_PIECE_BYTES):
                rows = [data or b"" for data in image_bytes(piece).to_pylist()]
                out.write(b"".join(rows))  # one write a piece: a row group of small images has hundreds of rows
                ends.extend((ends[-1] + np.cumsum([len(data) for data in rows], dtype=np.int64)).tolist())
            out.write(np.asarray(ends, dtype="<i8").tobytes() + (len(ends) - 1).to_bytes(8, "little"))

    def opened(self, name: str) -> tuple[np.ndarray, BinaryIO]:
        """The copy of row group `name` open for reading (made if the cache lacks it), and each
        row's start in it, then the end. Open, it stays readable when another process evicts it.
        A copy whose layout does not add up to its size (cut short or zeroed: a crash before its
        bytes reached the disk, or an edit) is deleted and made again, never read as rows."""
        def open_copy(path: Path) -> tuple[np.ndarray, BinaryIO]:
            copy = open(path, "rb")
            try:
                starts = row_starts(copy)
                if starts is None:
                    self.discard(path)
                    raise FileNotFoundError(errno.ENOENT, "a damaged copy of a row group, deleted", str(path))
                return starts, copy
            except BaseException:
                copy.close()
                raise
        return self._retrying(name, open_copy)


def row_starts(copy: BinaryIO) -> np.ndarray | None:
    """Each row's start in an open copy (RowGroupCache's layout), then the end of the rows; None
    when the row count, the starts and the file's size disagree."""
    size = os.fstat(copy.fileno()).st_size
    if size < 16:
        return None
    copy.seek(size - 8)
    rows = int.from_bytes(copy.read(8), "little")
    table = 8 * (rows + 1)
    if table + 8 > size:
        return None
    copy.seek(size - 8 - table)
    starts = np.frombuffer(copy.read(table), dtype="<i8")
    if starts[0] != 0 or starts[-1] != size - 8 - table or bool(np.any(np.diff(starts) < 0)):
        return None
    return starts


def row_group_cache(index: SetIndex, folder: Path, options: dict[str, Any], budget_bytes: int,
                    image_key: str, lanes: int = SHUFFLE_WINDOW) -> RowGroupCache | None:
    """The node's cache of the set's parquet row groups (None for Arrow files: those are mapped),
    each named by the set's fingerprint and sized by its rows' bytes as indexed."""
    sizes = {name: int(size) for table in (index.train, index.test) for name, size in group_bytes(table).items()}
    if not sizes or all(fmt_of(name.rsplit(GROUP_MARK, 1)[0]) == ARROW for name in sizes):
        return None
    versions = {name: f"{size}-{index.fingerprint}" for name, size in sizes.items()}
    return RowGroupCache(index.root, options, folder, budget_bytes, versions, image_key, lanes)


def group_bytes(table: Table) -> dict[str, float]:
    """Each row group's bytes of images, as indexed (a row --skip-broken passed over is not counted)."""
    total = np.bincount(np.asarray(table.group), weights=np.asarray(table.size), minlength=len(table.names))
    return dict(zip(table.names, total.tolist()))


class HFReader(Reader):
    """A Reader whose samples are rows of SOURCE's files: sample i is row offset[i] of row group
    group[i], read from the node's copy of the row group (RowGroupCache), or from the mapped Arrow
    file; a process holds the copies of the last row groups it read open (as many as a node may read
    at once: shardcache.least_held), with their row starts (8 bytes a row), and no image."""

    def __init__(self, table, root: str, view: Stored, channels: int, skip: bool, augment: str,
                 store: Ragged | None, image_key: str, options: dict[str, Any], cache: RowGroupCache | None) -> None:
        super().__init__(table, root, view, channels, skip, cache, augment, store)
        self.files, self.image_key = Files(root, options), image_key
        self.held: OrderedDict[int, tuple[np.ndarray, BinaryIO]] = OrderedDict()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "held": OrderedDict()}

    def name(self, i: int) -> str:
        file = self.table.names[int(self.table.group[i])].rsplit(GROUP_MARK, 1)[0]
        return f"{self.files.where(file)}:{self.table.keys[i]}"

    def read(self, i: int) -> bytes:
        group, row = int(self.table.group[i]), int(self.table.offset[i])
        name = self.table.names[group]
        file, number = name.rsplit(GROUP_MARK, 1)
        if fmt_of(file) == ARROW:
            (column,) = self.files.columns(file, int(number), [self.image_key])
            return image_bytes(column)[row].as_py() or b""
        try:
            return self.row_bytes(group, row)
        except OSError as e:  # on NFS a copy another node evicted fails even while open here: a fresh one
            if e.errno not in GONE or group not in self.held:
                raise
            self.held.pop(group)[1].close()
            return self.row_bytes(group, row)

    def row_bytes(self, group: int, row: int) -> bytes:
        if group not in self.held:
            self.held[group] = self.cache.opened(self.table.names[group])
            if len(self.held) > self.cache.least:
                self.held.popitem(last=False)[1][1].close()
        self.held.move_to_end(group)
        starts, copy = self.held[group]
        start, end = int(starts[row]), int(starts[row + 1])
        return os.pread(copy.fileno(), end - start, start)
