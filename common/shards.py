"""Your own images on disk: the two layouts the suite reads, and the converter between them.

An ImageFolder tree (torchvision's layout): DIR/train/<class>/<image> and DIR/val/<class>/<image>;
the classes are the sorted folder names of train/.

WebDataset shards: DIR/train-NNNNNN.tar and DIR/val-NNNNNN.tar, each sample two members,
KEY.<jpg|jpeg|png|webp> (the encoded image) and KEY.cls (its class index, as decimal text).
DIR/classes.txt, when present (the converter writes it), names the classes, one per line, and so
fixes their number.

    python -m common.shards SRC_IMAGEFOLDER DEST_DIR_OR_URL [--shard-mb 64] [--seed 0]
                            [--storage-options JSON|@FILE|env:VAR]

The converter writes KEY = the sample's 8-digit running index within its split (00000042). An image
keeps its file's bytes (not re-encoded: no loss, no time spent); one whose format a shard does not
hold (.bmp, .tif, .ppm, .pgm) is re-encoded losslessly as PNG. The training samples are shuffled
(--seed) before writing, since readers shuffle only within a window of shards: each shard then
holds a mix of classes. val/ keeps ImageFolder's order. A shard ends before it would pass
--shard-mb MiB (it holds at least one sample). Every tar member is a plain file with mode 0644,
mtime 0 and owner 0, so the same tree and seed give the same bytes. DEST is a folder (created) or
any fsspec URL (s3://bucket/prefix); shards of an earlier run that this one did not rewrite are deleted.

This module is the layouts' single definition: the readers in common/data/ import it.
"""
from __future__ import annotations

import argparse
import fnmatch
import io
import random
import sys
import tarfile
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from PIL import Image, UnidentifiedImageError

from common.credentials import URL_PASSWORD, read_storage_options
from common.errors import UserError, first_line
from common.storage import Storage, StorageError, storage_for

SPLITS = {"train": "train", "val": "test"}  # folder or shard prefix -> the suite's split
# What PIL reads and torchvision's ImageFolder accepts; other files in a class folder are ignored.
FOLDER_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SHARD_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # an image member's extension in a shard
CLASSES_FILE = "classes.txt"
TRAIN, VAL = "train", "val"


def shard_pattern(split: str) -> str:
    """The glob of a split's shards: train-*.tar, val-*.tar."""
    return f"{split}-*.tar"


def shard_name(split: str, index: int) -> str:
    """The name of a split's index-th shard: train-000042.tar."""
    return f"{split}-{index:06d}.tar"


def folder_classes(root: Path) -> list[str]:
    """The classes of an ImageFolder tree: the sorted folder names of its train/."""
    train = _split_folder(root, TRAIN)
    classes = sorted(p.name for p in train.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise UserError(f"{train} has no class folders; put each class's images in {train}/<class name>/")
    return classes


def folder_images(root: Path, split: str, classes: list[str]) -> list[tuple[str, int]]:
    """(path relative to root, class index) of every image of a split, in ImageFolder's order
    (class, then file name). val/ may lack a class; a class folder without an image is an error: a typo'd or half-copied
    tree would otherwise train on fewer classes than it names."""
    folder = _split_folder(root, split)
    extra = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")
                   and p.name not in classes)
    if extra:
        raise UserError(f"{folder}/{extra[0]} is a class that {root / TRAIN} lacks; add it to {root / TRAIN} "
                        f"or remove it from {folder}")
    samples = []
    for label, name in enumerate(classes):
        if not (folder / name).is_dir():  # a validation set may lack a class; train/ defines them
            continue
        files = sorted(p for p in (folder / name).glob("*") if p.is_file() and not p.name.startswith(".")
                       and p.suffix.lower() in FOLDER_EXTENSIONS)
        if not files:
            raise UserError(f"{folder / name} holds no image ({', '.join(FOLDER_EXTENSIONS)}); add its images or "
                            f"remove the class from {root / TRAIN}")
        samples += [(str(p.relative_to(root)), label) for p in files]
    return samples


def _split_folder(root: Path, split: str) -> Path:
    folder = root / split
    if not folder.is_dir():
        what = "the training images" if split == TRAIN else "the validation images (the test set)"
        raise UserError(f"{root} has no {split}/ folder: an ImageFolder tree keeps {what} in "
                        f"{folder}/<class>/<image>")
    return folder


# ---------------------------------------------------------------- the converter

PNG_MODES = ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA")  # what PIL writes as PNG without conversion
END_OF_ARCHIVE = 2 * tarfile.BLOCKSIZE


def convert(src: Path, dest: str, shard_mb: float = 64, seed: int = 0,
            storage_options: dict[str, Any] | None = None) -> dict[str, tuple[int, int, int]]:
    """Writes SRC's ImageFolder tree as shards and classes.txt to DEST; split -> (samples, shards, bytes).
    The whole tree is checked before anything is written."""
    classes = folder_classes(src)
    splits = {split: folder_images(src, split, classes) for split in (TRAIN, VAL)}
    random.Random(seed).shuffle(splits[TRAIN])
    storage = storage_for(dest, storage_options)
    written = {split: _write_split(storage, src, split, samples, int(shard_mb * 2**20))
               for split, samples in splits.items()}
    storage.write(CLASSES_FILE, "".join(f"{name}\n" for name in classes).encode())
    return written


def _write_split(storage: Storage, src: Path, split: str, samples: list[tuple[str, int]],
                 limit: int) -> tuple[int, int, int]:
    shards = _plan(src, samples, limit)
    start = 0
    for index, (count, _) in enumerate(shards):
        def produce(f: BinaryIO, start: int = start, count: int = count) -> None:  # called again on a retry
            _write_shard(f, src, samples, start, count)
        storage.write_from(shard_name(split, index), produce)
        start += count
    names = {shard_name(split, index) for index in range(len(shards))}
    for stale in (n for n in storage.list("") if fnmatch.fnmatch(n, shard_pattern(split)) and n not in names):
        storage.delete(stale)  # a reader globs the split's shards: an older, longer run's tail would join in
    return len(samples), len(shards), sum(size for _, size in shards)


def _plan(src: Path, samples: list[tuple[str, int]], limit: int) -> list[tuple[int, int]]:
    """(samples, bytes) of each shard, from the tar format's sizes: a header block per member, its
    data padded to whole blocks, two end blocks, and the whole padded to tarfile's record size."""
    def archive(content: int) -> int:
        return -(-(content + END_OF_ARCHIVE) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE

    def member(size: int) -> int:
        return tarfile.BLOCKSIZE + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE

    shards: list[tuple[int, int]] = []
    count = content = 0
    for path, label in samples:
        grow = member(_image_size(src / path)) + member(len(str(label)))
        if count and archive(content + grow) > limit:
            shards.append((count, archive(content)))
            count = content = 0
        count, content = count + 1, content + grow
    return shards + [(count, archive(content))] if count else shards


def _write_shard(f: BinaryIO, src: Path, samples: list[tuple[str, int]], start: int, count: int) -> None:
    with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for index in range(start, start + count):
            path, label = samples[index]
            ext, data = _image_member(src / path)
            for name, payload in ((f"{index:08d}.{ext}", data), (f"{index:08d}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)  # mode 0644, mtime 0, owner 0 and "": tarfile's defaults
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


def _image_member(path: Path) -> tuple[str, bytes]:
    """(extension, bytes) of an image's member: the file itself, or a lossless PNG of it."""
    ext = path.suffix.lower()[1:]
    if ext in SHARD_EXTENSIONS:
        return ext, path.read_bytes()
    try:
        with Image.open(path) as image:
            out = io.BytesIO()
            (image if image.mode in PNG_MODES else image.convert("RGB")).save(out, format="PNG")
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{path} cannot be read as an image ({first_line(e)}); replace or remove it") from None
    return "png", out.getvalue()


def _image_size(path: Path) -> int:
    if path.suffix.lower()[1:] in SHARD_EXTENSIONS:
        return path.stat().st_size
    return len(_image_member(path)[1])  # encoded twice (to plan, to write): such files are rare


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m common.shards", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, metavar="SRC_IMAGEFOLDER", help="the tree with train/ and val/")
    p.add_argument("dest", metavar="DEST_DIR_OR_URL", help="a folder, or an fsspec URL such as s3://bucket/prefix")
    p.add_argument("--shard-mb", type=float, default=64.0, help="a shard's largest size in MiB (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the training samples' shuffle (default: %(default)s)")
    p.add_argument("--storage-options", default="{}", metavar="JSON|@FILE|env:VAR",
                   help="fsspec options for a URL DEST; put credentials in @FILE or env:VAR, not inline (ps shows it)")
    a = p.parse_args(argv)
    if a.shard_mb <= 0:
        p.error(f"--shard-mb must be > 0 (got {a.shard_mb})")
    try:
        options = read_storage_options(a.storage_options)
    except ValueError as e:
        p.error(f"--storage-options {e}")
    try:
        written = convert(a.src, a.dest, a.shard_mb, a.seed, options)
    except UserError as e:
        _fail(str(e), 2)
    except StorageError as e:  # its message names the URL, credentials scrubbed
        _fail(str(e), 1)
    splits = ", ".join(f"{split} {samples} samples in {shards} shard{'s' * (shards != 1)}"
                       for split, (samples, shards, _) in written.items())
    total = sum(size for _, _, size in written.values()) / 2**20
    where = URL_PASSWORD.sub(lambda m: m.group(0).replace(m.group(1), "***"), a.dest)
    print(f"common.shards: wrote {splits}, {total:.1f} MiB, to {where}")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        _fail(f"{message} (see --help)", 2)  # one line, not the usage block


def _fail(message: str, code: int) -> NoReturn:
    sys.stderr.write(f"common.shards: error: {message}\n")
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
