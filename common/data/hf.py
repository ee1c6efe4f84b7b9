"""--dataset hf: a Hugging Face data set (common/hfsets.py: what SOURCE is, its files) as one more
own-data layout: indexed, then decoded into the node's cache or streamed like the others.

The index (common/data/index.py) is a sharded table whose groups are the files' row groups (an
Arrow file's record batches): a sample is row `offset` of group `group`. The epoch's order shuffles
the groups, then the rows within windows of SHUFFLE_WINDOW groups (loader.global_order), so a
process reads a row group only when one of its samples is in it, and holds the last
ROW_GROUPS_HELD it read.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from common.data.decoding import broken_message, header
from common.data.geometry import Stored
from common.data.index import TableWriter
from common.data.indexing import ShardSamples, Survey, parallel
from common.data.loader import SHUFFLE_WINDOW
from common.data.reading import Ragged, Reader
from common.errors import UserError
from common.hfsets import GROUP_MARK, Files, Source, check_columns, check_embedded, class_names, image_bytes

ROW_GROUPS_HELD = 2 * SHUFFLE_WINDOW  # a batch that spans two windows reads from both


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
    for split, split_files in (("train", source.train), ("test", source.test)):
        groups = [(name, group, start, label_key, image_key) for name in split_files
                  for group, start in enumerate(starts(files.row_groups(name)))]
        writer = TableWriter(folder, split, sharded=True)
        work = lambda item: read_group(files, item, skip)  # noqa: E731
        top = -1
        for number, ((name, group, *_), found) in enumerate(zip(groups, parallel(groups, work, workers))):
            writer.add_shard(f"{name}{GROUP_MARK}{group}", number, found.offsets, found.sizes, found.keys,
                             found.labels, found.dims)
            survey.merge(found.survey)
            top = max([top, *found.labels])
            check_labels(found, names, files.where(name), label_key)
        writer.close()
        tops[split] = top
    classes = names or [str(i) for i in range(tops["train"] + 1)]
    if tops["test"] >= len(classes):
        raise UserError(f"the {source.eval_split} split of {source.root} has class {tops['test']}, outside the "
                        f"{len(classes)} classes of its train split; evaluate on a split of the same classes")
    check_shuffled(folder, source, len(classes))
    return classes, survey


def starts(rows: list[int]) -> list[int]:
    """The first row (in the file) of each row group."""
    return np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(int).tolist() if rows else []


def read_group(files: Files, item: tuple[str, int, int, str, str], skip: bool) -> ShardSamples:
    """One row group's samples: each row's place in it, its image's size, (width, height) and mode."""
    name, group, start, label_key, image_key = item
    column, labels = files.columns(name, group, [image_key, label_key])
    out = ShardSamples()
    for row, (data, label) in enumerate(zip(image_bytes(column).to_pylist(), labels.to_pylist())):
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
    return out


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
    SHUFFLE_WINDOW of them at a time, so each batch would hold one or two classes."""
    labels = np.fromfile(folder / "train_labels", dtype=np.int64)
    if classes > 1 and len(np.unique(labels)) > 1 and bool(np.all(np.diff(labels) >= 0)):
        raise UserError(f"the training rows of {source.root} are sorted by class: rows are shuffled within "
                        f"{SHUFFLE_WINDOW} row groups at a time, so a batch would hold one or two classes; write the "
                        "set shuffled (ds.shuffle(seed=0).flatten_indices(), then save_to_disk or to_parquet)")


# ---------------------------------------------------------------- reading while training

class HFReader(Reader):
    """A Reader whose samples are rows of SOURCE's files: sample i is row offset[i] of row group
    group[i]; a process holds the image bytes of the last ROW_GROUPS_HELD row groups it read."""

    def __init__(self, table, root: str, view: Stored, channels: int, skip: bool, augment: str,
                 store: Ragged | None, image_key: str, options: dict[str, Any]) -> None:
        super().__init__(table, root, view, channels, skip, None, augment, store)
        self.files, self.image_key = Files(root, options), image_key
        self.held: OrderedDict[int, Any] = OrderedDict()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "held": OrderedDict()}

    def name(self, i: int) -> str:
        file = self.table.names[int(self.table.group[i])].rsplit(GROUP_MARK, 1)[0]
        return f"{self.files.where(file)}:{self.table.keys[i]}"

    def read(self, i: int) -> bytes:
        group = int(self.table.group[i])
        if group not in self.held:
            file, number = self.table.names[group].rsplit(GROUP_MARK, 1)
            (column,) = self.files.columns(file, int(number), [self.image_key])
            self.held[group] = image_bytes(column)
            if len(self.held) > ROW_GROUPS_HELD:
                self.held.popitem(last=False)
        self.held.move_to_end(group)
        data = self.held[group][int(self.table.offset[i])].as_py()
        return data or b""
