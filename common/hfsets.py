"""Hugging Face's data set formats (the layout side of --dataset hf; its reader is common/data/hf.py,
in the layer above): what a SOURCE is, and its files opened with pyarrow.

SOURCE is a folder written by DatasetDict.save_to_disk (Arrow files), a folder of parquet files in
the Hub's layout ([CONFIG/][data/]SPLIT-00000-of-00003.parquet, or SPLIT/*.parquet), the name of a
Hub data set whose snapshot is in the local Hugging Face cache (read from there only: nothing is
downloaded), or an fsspec URL of parquet files. Each row holds an image (datasets' Image feature:
a struct of {bytes, path}; or plain bytes) and a class index; the class names are those of the
label column's ClassLabel feature. pyarrow (and huggingface_hub, for a Hub name) are optional
dependencies: requirements-hf.txt.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from common.errors import UserError
from common.storage import StorageError, is_url, storage_for

INSTALL = "pip install -r requirements-hf.txt"
PARQUET, ARROW = "parquet", "arrow"
TRAIN_SPLIT = "train"
EVAL_SPLITS = ("validation", "valid", "val", "dev", "test")  # the evaluation split: the first one present
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
GROUP_MARK = "#"  # a group's name: FILE#ROW_GROUP


def pyarrow_modules() -> tuple[Any, Any]:
    """pyarrow and pyarrow.parquet, or one line naming the install command."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise UserError(f"--dataset hf needs pyarrow, which is not installed here: {INSTALL}") from None
    return pyarrow, pyarrow.parquet


# ---------------------------------------------------------------- what SOURCE is

@dataclass(frozen=True)
class Source:
    """The files of SOURCE's training and evaluation splits, relative to `root` (a folder or URL)."""

    root: str
    train: list[str]
    test: list[str]
    eval_split: str  # the split evaluated on: validation, test, ...
    versions: dict[str, str]  # each file -> size and date (or ETag): what the index is named by

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps([self.root, self.train, self.test, self.versions],
                                         sort_keys=True).encode()).hexdigest()


def resolve(data_dir: str, options: dict[str, Any], version: Callable[[Path], str], flag: str = "--data-dir",
            ) -> Source:
    """SOURCE as files: a save_to_disk folder, a folder or URL of parquet files, or a Hub name in
    the local cache. `version` is a local file's version (size and date, or its bytes' hash);
    `flag` what the caller calls SOURCE (the converter: SRC), in the error lines."""
    pyarrow_modules()
    if is_url(data_dir):
        return parquet_source(data_dir, remote_files(data_dir, options, flag), flag)
    path = Path(data_dir)
    if not path.exists() and HUB_NAME.fullmatch(data_dir):
        path = hub_snapshot(data_dir, flag)
    if not path.is_dir():
        raise UserError(f"{flag} {data_dir} is not a folder; give a folder written by save_to_disk, a folder of "
                        "parquet files, a Hub data set's name in the local Hugging Face cache, or an fsspec URL")
    if (path / "state.json").is_file():
        raise UserError(f"{flag} {data_dir} holds one split (a Dataset saved with save_to_disk); save a "
                        "DatasetDict with a train and a validation (or test) split, e.g. "
                        "ds.train_test_split(test_size=0.1, seed=0).save_to_disk(DIR)")
    if (path / "dataset_dict.json").is_file():
        return saved_source(path, version, flag)
    files = {str(p.relative_to(path)): version(p) for p in sorted(path.rglob("*.parquet"))
             if not any(part.startswith(".") for part in p.relative_to(path).parts)}
    return parquet_source(str(path), files, flag)


def hub_snapshot(name: str, flag: str) -> Path:
    """The newest snapshot of Hub data set `name` in the local cache (HF_HOME, HF_HUB_CACHE honoured);
    never a download."""
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise UserError(f"{flag} {name}: reading a Hub data set by its name needs huggingface_hub: "
                        f"{INSTALL}") from None
    try:
        return Path(snapshot_download(name, repo_type="dataset", local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache, whatever huggingface_hub calls it
        owner_name = name.replace("/", "--")
        raise UserError(f"{flag} {name}: no folder of that name, and no snapshot of the Hub data set {name} in "
                        f"the Hugging Face cache {constants.HF_HUB_CACHE}; on a machine with network run "
                        f"`hf download {name} --repo-type dataset` and copy its datasets--{owner_name} folder into "
                        f"that cache (or `--local-dir DIR` and pass {flag} DIR)") from None


def remote_files(url: str, options: dict[str, Any], flag: str) -> dict[str, str]:
    try:
        return {name: version for name, version in storage_for(url, options).files().items()
                if name.endswith(".parquet")}
    except StorageError as e:
        raise UserError(f"{flag} {e}; check the URL and the credentials") from None


def split_of(name: str) -> tuple[str, str] | None:
    """(config, split) of a parquet file in the Hub's layouts, or None: [CONFIG/][data/]SPLIT-*.parquet,
    [CONFIG/][data/]SPLIT.parquet, [CONFIG/]SPLIT/*.parquet."""
    *folders, base = name.split("/")
    splits = (TRAIN_SPLIT, *EVAL_SPLITS)
    stem = re.split(r"[-.]", base, maxsplit=1)[0]
    if folders and folders[-1] in splits:
        split, folders = folders[-1], folders[:-1]
    elif stem in splits:
        split = stem
    else:
        return None
    config = "/".join(folder for folder in folders if folder != "data")
    return config, split


def parquet_source(root: str, files: dict[str, str], flag: str) -> Source:
    found: dict[str, dict[str, list[str]]] = {}
    for name in sorted(files):
        if (place := split_of(name)) is not None:
            found.setdefault(place[0], {}).setdefault(place[1], []).append(name)
    configs = sorted(config for config, splits in found.items() if TRAIN_SPLIT in splits)
    if not configs:
        raise UserError(f"{flag} {root} holds no training parquet file in the Hub's layout "
                        "(data/train-00000-of-00001.parquet, ...); write one with ds.to_parquet, or give the folder "
                        "that save_to_disk wrote")
    if len(configs) > 1:
        raise UserError(f"{flag} {root} holds several configurations ({', '.join(configs)}); pass the folder of "
                        f"one: {flag} {root.rstrip('/')}/{configs[0]}")
    splits = found[configs[0]]
    eval_split = next((split for split in EVAL_SPLITS if split in splits), None)
    if eval_split is None:
        raise UserError(f"{flag} {root} has a train split but no {' or '.join(EVAL_SPLITS[:2])} or test split to "
                        "evaluate on; write one (e.g. ds.train_test_split(test_size=0.1, seed=0))")
    used = splits[TRAIN_SPLIT] + splits[eval_split]
    return Source(root, splits[TRAIN_SPLIT], splits[eval_split], eval_split, {n: files[n] for n in used})


def saved_source(path: Path, version: Callable[[Path], str], flag: str) -> Source:
    """A DatasetDict.save_to_disk folder: dataset_dict.json names the splits, each split's
    state.json its Arrow files."""
    try:
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        if TRAIN_SPLIT not in splits:
            raise UserError(f"{flag} {path} has no train split (its splits: {', '.join(splits)}); save the "
                            "training rows as the split named train")
        eval_split = next((split for split in EVAL_SPLITS if split in splits), None)
        if eval_split is None:
            raise UserError(f"{flag} {path} has no validation or test split to evaluate on (its splits: "
                            f"{', '.join(splits)}); add one (e.g. ds.train_test_split(test_size=0.1, seed=0))")
        chosen = {split: [f"{split}/{entry['filename']}" for entry in
                          json.loads((path / split / "state.json").read_text())["_data_files"]]
                  for split in (TRAIN_SPLIT, eval_split)}
        versions = {name: version(path / name) for names in chosen.values() for name in names}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{flag} {path} is not a whole save_to_disk folder ({type(e).__name__}: {e}); save it "
                        "again") from None
    return Source(str(path), chosen[TRAIN_SPLIT], chosen[eval_split], eval_split, versions)


# ---------------------------------------------------------------- opening files

class Files:
    """SOURCE's files open in this process (a forked worker opens its own): parquet files by
    their footers, Arrow files memory-mapped; each row group's image bytes read on demand."""

    def __init__(self, root: str, options: dict[str, Any], flag: str = "--data-dir") -> None:
        self.root, self.options, self.flag = root, options, flag  # flag: what the caller calls SOURCE
        self._open: dict[str, Any] = {}
        self._pid = 0

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}, "_pid": 0}

    def where(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def opened(self, name: str) -> Any:
        """A pyarrow.parquet.ParquetFile, or an Arrow file's record batches."""
        if self._pid != os.getpid():
            self._open, self._pid = {}, os.getpid()
        if name not in self._open:
            self._open[name] = self.guarded(name, lambda: self._opening(name))
        return self._open[name]

    def _opening(self, name: str) -> Any:
        pa, pq = pyarrow_modules()
        if is_url(self.root):
            return pq.ParquetFile(storage_for(self.root, self.options).open(name))
        path = Path(self.root) / name
        if fmt_of(name) == PARQUET:
            return pq.ParquetFile(path, memory_map=True)
        source = pa.memory_map(str(path))
        try:
            return list(pa.ipc.open_stream(source))
        except pa.ArrowInvalid:  # an Arrow file in the IPC file format, not the stream format
            reader = pa.ipc.open_file(source)
            return [reader.get_batch(i) for i in range(reader.num_record_batches)]

    def guarded(self, name: str, read: Callable[[], Any]) -> Any:
        """read(), with a file cut short or not in its format said in one line naming it."""
        pa, _ = pyarrow_modules()
        try:
            return read()
        except StorageError as e:
            raise UserError(f"{self.flag} {e}; check the URL and the credentials") from None
        except PermissionError:  # not a damaged file: copying it again would not help
            raise UserError(f"{self.where(name)} is not readable by this user (permission denied); make it readable "
                            "(chmod a+r), or run as a user that may read it") from None
        except (pa.ArrowException, OSError, ValueError) as e:
            detail = " ".join(str(e).split())[:160]
            raise UserError(f"{self.where(name)} is not a readable {fmt_of(name)} file ({detail}): a partial copy or "
                            "download, or another format; copy it again") from None

    def schema(self, name: str) -> Any:
        opened = self.opened(name)
        if fmt_of(name) == PARQUET:
            return opened.schema_arrow
        if not opened:
            raise UserError(f"{self.where(name)} holds no record batch; save the set again")
        return opened[0].schema

    def row_groups(self, name: str) -> list[int]:
        """The rows of each row group (record batch) of the file."""
        opened = self.opened(name)
        if fmt_of(name) == PARQUET:
            return [opened.metadata.row_group(g).num_rows for g in range(opened.metadata.num_row_groups)]
        return [batch.num_rows for batch in opened]

    def columns(self, name: str, group: int, keys: list[str]) -> list[Any]:
        """The given columns of one row group, as pyarrow arrays."""
        opened = self.opened(name)
        if fmt_of(name) == PARQUET:
            table = self.guarded(name, lambda: opened.read_row_group(group, columns=keys))
            return [table.column(key).combine_chunks() for key in keys]
        return [opened[group].column(key) for key in keys]

    def column_batches(self, name: str, group: int, key: str, most_bytes: int) -> Iterator[Any]:
        """One column of a parquet row group in pieces of about `most_bytes` (as stored: uncompressed),
        read one after another: what the pieces hold is not all in memory at once."""
        opened = self.opened(name)
        meta = opened.metadata.row_group(group)
        rows = max(1, most_bytes * meta.num_rows // max(meta.total_byte_size, 1))
        pieces = opened.iter_batches(batch_size=rows, row_groups=[group], columns=[key], use_threads=False)
        while (piece := self.guarded(name, lambda: next(pieces, None))) is not None:
            yield piece.column(0)


def fmt_of(name: str) -> str:
    return ARROW if name.endswith(".arrow") else PARQUET


def image_bytes(column: Any) -> Any:
    """The encoded images of an image column: datasets' {bytes, path} struct's bytes, or the column."""
    pa, _ = pyarrow_modules()
    return column.field("bytes") if pa.types.is_struct(column.type) else column


def check_embedded(column: Any, row: int, where: str) -> None:
    """A row of datasets' Image column that names a file instead of holding its bytes, said in one
    line with the way out: `datasets` keeps only the paths of a set made from image files when it
    writes parquet (to_parquet), and those files are not part of the set."""
    pa, _ = pyarrow_modules()
    if pa.types.is_struct(column.type) and column.type.get_field_index("path") >= 0 and \
            (path := column.field("path")[row].as_py()):
        raise UserError(f"{where} holds the path {path!r} of an image, not its bytes (datasets' to_parquet writes a "
                        "set made from image files so); write the set with the images in it: ds.save_to_disk(DIR), or "
                        "ds.with_format('arrow').map(datasets.table.embed_table_storage, batched=True)"
                        ".with_format(None).to_parquet(FILE)")


# ---------------------------------------------------------------- the same rows under two names

NO_ROWS = hashlib.sha256().digest()  # the digest of a row group without rows


def rows_digest(images: list[bytes | None], labels: list[Any]) -> bytes:
    """A row group's rows (image bytes and label, in order), hashed: a file's digest is its groups'."""
    digest = hashlib.sha256()
    for data, label in zip(images, labels):
        data = data or b""
        digest.update(len(data).to_bytes(8, "little") + data + str(label).encode() + b"\0")
    return digest.digest()


def check_distinct(files: Files, digests: dict[str, list[bytes]]) -> None:
    """Refuses two files of SOURCE that hold the same rows (a copy under another name, e.g.
    train-00000-of-00002.parquet beside train-00000-of-00002 (1).parquet): each row would be
    trained twice an epoch, or evaluated on after being trained on. `digests`: each file's
    rows_digest per row group; a file without rows is no copy of anything."""
    seen: dict[bytes, str] = {}
    for name, groups in digests.items():
        groups = [digest for digest in groups if digest != NO_ROWS]
        if not groups:
            continue
        key = hashlib.sha256(b"".join(groups)).digest()
        if key in seen:
            raise UserError(f"{files.where(seen[key])} and {files.where(name)} hold the same rows (a copy under "
                            "another name?): each would be read twice; remove one of them")
        seen[key] = name


# ---------------------------------------------------------------- the columns and classes

def features(files: Files, name: str, root: Path | None) -> dict[str, Any]:
    """datasets' features of the file (its schema's metadata; a save_to_disk split's dataset_info.json)."""
    metadata = files.schema(name).metadata or {}
    if b"huggingface" in metadata:
        return json.loads(metadata[b"huggingface"]).get("info", {}).get("features", {}) or {}
    info = root / name.rsplit("/", 1)[0] / "dataset_info.json" if root else None
    return json.loads(info.read_text()).get("features", {}) if info and info.is_file() else {}


def check_columns(files: Files, name: str, image_key: str, label_key: str) -> None:
    pa, _ = pyarrow_modules()
    schema = files.schema(name)
    for key, flag, what in ((image_key, "--hf-image-key", "images"), (label_key, "--hf-label-key", "class indices")):
        if key not in schema.names:
            raise UserError(f"{files.where(name)} has no column {key!r} ({flag}); its columns: "
                            f"{', '.join(schema.names)}: pass {flag} NAME for the column of {what}")
    image, label = schema.field(image_key).type, schema.field(label_key).type
    if not (pa.types.is_binary(image) or pa.types.is_large_binary(image) or
            (pa.types.is_struct(image) and image.get_field_index("bytes") >= 0)):
        raise UserError(f"{files.where(name)}: column {image_key!r} (--hf-image-key) is {image}, not images (datasets' "
                        "Image feature, or bytes); pass --hf-image-key NAME for the column of images")
    if not pa.types.is_integer(label):
        raise UserError(f"{files.where(name)}: column {label_key!r} (--hf-label-key) is {label}, not class indices "
                        "(a ClassLabel or an integer); pass --hf-label-key NAME, or cast it: ds.class_encode_column")


def class_names(files: Files, source: Source, label_key: str) -> list[str] | None:
    """The ClassLabel feature's names, or None when the label column is a plain integer."""
    feature = features(files, source.train[0], None if is_url(source.root) else Path(source.root)).get(label_key, {})
    if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" and feature.get("names"):
        return [str(name) for name in feature["names"]]
    return None


