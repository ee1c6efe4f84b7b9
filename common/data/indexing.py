"""Indexing own images (a preparing phase, on the node's local rank 0): ImageFolder trees by their
files' headers, shards by their members (common/shardformat.py parses the tar), into the tables of
common/data/index.py, with what the pass saw (sizes, modes, files skipped or ignored).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from common import shards as layout
from common.data.decoding import broken_message, header
from common.data.index import SAMPLES_NAMED, TableWriter
from common.errors import UserError


@dataclass
class Survey:
    """What an index pass saw besides the samples: image sizes and modes (they fix the geometry),
    formats (whether a GPU rank can decode them all), and the files left out: skipped (the header
    did not read, --skip-broken) and ignored (not an image the suite reads). Bounded: names are
    kept for the first SAMPLES_NAMED of each."""

    sizes: dict[str, str] = field(default_factory=dict)
    modes: set[str] = field(default_factory=set)
    formats: set[str] = field(default_factory=set)
    skipped: list[str] = field(default_factory=list)
    skipped_count: int = 0
    ignored: list[str] = field(default_factory=list)
    ignored_count: int = 0

    def saw(self, dims: str, example: str, mode: str, kind: str) -> None:
        if len(self.sizes) < 2:  # two sizes are enough to say the set is mixed, and to name both
            self.sizes.setdefault(dims, example)
        self.modes.add(mode)
        self.formats.add(kind)

    def skip(self, names: list[str], count: int | None = None) -> None:
        self.skipped += names[:SAMPLES_NAMED - len(self.skipped)]
        self.skipped_count += len(names) if count is None else count

    def ignore(self, names: list[str], count: int | None = None) -> None:
        self.ignored += names[:SAMPLES_NAMED - len(self.ignored)]
        self.ignored_count += len(names) if count is None else count

    def merge(self, other: "Survey") -> None:
        for dims, example in other.sizes.items():
            if len(self.sizes) < 2:
                self.sizes.setdefault(dims, example)
        self.modes |= other.modes
        self.formats |= other.formats
        self.skip(other.skipped, other.skipped_count)
        self.ignore(other.ignored, other.ignored_count)

    def meta(self) -> dict:
        return {"sizes": self.sizes, "modes": sorted(self.modes), "formats": sorted(self.formats),
                "skipped": self.skipped, "skipped_count": self.skipped_count, "ignored": self.ignored,
                "ignored_count": self.ignored_count}


# ---------------------------------------------------------------- indexing an ImageFolder tree

HEADER_CHUNK = 256  # images per worker task while reading headers
HEADER_GROUP = 65536  # images listed at a time: the listing's memory is bounded, not the set's size


def index_folder(root: Path, folder: Path, workers: int, skip: bool) -> tuple[list[str], Survey]:
    """Writes the tree's tables into `folder`; its classes' names and what the pass saw."""
    classes = layout.folder_classes(root)
    survey = Survey()
    for split in (layout.TRAIN, layout.VAL):
        writer = TableWriter(folder, "train" if split == layout.TRAIN else "test", sharded=False)
        for group in _groups(layout.class_images(root, split, classes, survey.ignore)):
            chunks = [(label, paths[i:i + HEADER_CHUNK]) for label, paths in group
                      for i in range(0, len(paths), HEADER_CHUNK)]
            for label, found in parallel(chunks, lambda chunk: _folder_headers(root, *chunk, skip), workers):
                kept = [(rel, seen[0]) for rel, seen in found if seen is not None]
                writer.add_images([rel for rel, _ in kept], [label] * len(kept), [dims for _, dims in kept])
                survey.skip([str(root / rel) for rel, seen in found if seen is None])
                for rel, seen in found:
                    if seen is not None:
                        (w, h), mode, kind = seen
                        survey.saw(f"{w}x{h}", str(root / rel), mode, kind)
        writer.close()
    return classes, survey


def _groups(classes: Iterator[tuple[int, list[str]]]) -> Iterator[list[tuple[int, list[str]]]]:
    """Classes gathered into groups of about HEADER_GROUP images."""
    group, count = [], 0
    for label, paths in classes:
        group.append((label, paths))
        count += len(paths)
        if count >= HEADER_GROUP:
            yield group
            group, count = [], 0
    if group:
        yield group


def _folder_headers(root: Path, label: int, paths: list[str], skip: bool) -> tuple[int, list[tuple[str, tuple | None]]]:
    return label, [(rel, _folder_header(root, rel, skip)) for rel in paths]


def _folder_header(root: Path, rel: str, skip: bool) -> tuple | None:
    try:
        return header(root / rel)
    except Exception as e:  # noqa: BLE001 - one line naming the file
        if skip:
            return None
        raise UserError(broken_message(str(root / rel), e)) from None


# ---------------------------------------------------------------- indexing shards

@dataclass
class ShardSamples:
    """What one shard holds: per sample its image member's (offset, size), key and class."""

    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    dims: list[tuple[int, int]] = field(default_factory=list)  # (width, height)
    survey: Survey = field(default_factory=Survey)


def index_shards(names: list[str], read: Callable[[str], ShardSamples], writer: TableWriter, workers: int,
                 survey: Survey) -> tuple[int, str]:
    """Each shard's samples, read by `workers` processes, appended to the split's table in order;
    the largest class met, and where (-1 and "" for no sample)."""
    top = (-1, "")
    for group, (name, found) in enumerate(zip(names, parallel(names, read, workers))):
        writer.add_shard(name, group, found.offsets, found.sizes, found.keys, found.labels, found.dims)
        survey.merge(found.survey)
        if found.labels and max(found.labels) > top[0]:
            top = (max(found.labels), f"{name}: {found.keys[found.labels.index(max(found.labels))]}")
    writer.close()
    return top


def check_classes(top: tuple[int, str], classes: int, where: str) -> None:
    if top[0] >= classes:
        raise UserError(f"{top[1]} has class {top[0]}, outside the {classes} classes {where}; fix its .cls")


def parallel(items: list, work: Callable, workers: int) -> Iterator:
    """work(item) for each item, in order, on `workers` DataLoader processes (0: here). A worker's
    UserError or OSError comes back as a value and is raised here, as one line (the loader would
    re-raise it with the worker's traceback in its message)."""
    loader = torch.utils.data.DataLoader(_Calls(items, work), batch_size=None, num_workers=workers,
                                         collate_fn=as_is, prefetch_factor=2 if workers else None)
    for result in loader:
        if isinstance(result, _Failed):
            raise UserError(result.message)
        yield result


@dataclass(frozen=True)
class _Failed:
    message: str


class _Calls(torch.utils.data.Dataset):
    def __init__(self, items: list, work: Callable) -> None:
        self.items, self.work = items, work

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> object:
        try:
            return self.work(self.items[i])
        except UserError as e:
            return _Failed(str(e))
        except OSError as e:  # a file gone or unreadable since it was listed
            return _Failed(f"{e.filename or self.items[i]}: {e.strerror or e}; check that it is readable and that "
                           "the data does not change while it is indexed")


def as_is(batch: object) -> object:
    """The DataLoader's collate: Reader.__getitems__ already made the batch (a Batch)."""
    return batch
