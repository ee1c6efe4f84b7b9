"""Your own images on disk: the two layouts the suite reads, and the converter between them.

An ImageFolder tree (torchvision's layout): DIR/train/<class>/<image> and DIR/val/<class>/<image>;
the classes are the sorted folder names of train/.

WebDataset shards: DIR/train-NNNNNN.tar and DIR/val-NNNNNN.tar, each sample two members,
KEY.<jpg|jpeg|png|webp> (the encoded image) and KEY.cls (its class index, as decimal text).
DIR/classes.txt, when present (the converter writes it), names the classes, one per line, and so
fixes their number.

    python -m common.shards SRC_IMAGEFOLDER DEST_DIR_OR_URL [--shard-mb 64]

This module is the layouts' single definition: the readers in common/data/ import it.
"""
from __future__ import annotations

import argparse
import io
import random
import sys
import tarfile
from pathlib import Path
from typing import BinaryIO, Iterator

from common.credentials import read_storage_options
from common.errors import UserError
from common.storage import StorageError, storage_for

SPLITS = {"train": "train", "val": "test"}  # folder or shard prefix -> the suite's split
# What PIL reads and torchvision's ImageFolder accepts; other files in a class folder are ignored.
FOLDER_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SHARD_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # an image member's extension in a shard
CLASSES_FILE = "classes.txt"
TRAIN, VAL = "train", "val"


def shard_pattern(split: str) -> str:
    """The glob of a split's shards: train-*.tar, val-*.tar."""
    return f"{split}-*.tar"


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

def convert(source: Path, dest: str, shard_mb: float = 64.0, seed: int = 0,
            storage_options: dict | None = None) -> dict[str, tuple[int, int]]:
    """Write `source`'s ImageFolder tree as shards into the folder or URL `dest`: per split
    (samples, shards). Training samples are shuffled first (seeded), so every shard mixes the
    classes: readers shuffle only within a window of shards. Images keep their encoded bytes; a
    format shards do not carry (.bmp, .tif, ...) becomes a lossless PNG. The tar headers carry no
    owner or date: the same tree gives the same bytes."""
    classes = folder_classes(source)
    store = storage_for(dest, storage_options or {})
    written = {}
    for split in (TRAIN, VAL):
        samples = folder_images(source, split, classes)
        if split == TRAIN:
            random.Random(seed).shuffle(samples)
        shards = 0
        for shards, members in enumerate(_shards(source, samples, shard_mb), start=1):
            store.write_from(f"{split}-{shards - 1:06d}.tar", lambda out, members=members: _write_tar(out, members))
        written[split] = (len(samples), shards)
    store.write(CLASSES_FILE, "".join(f"{name}\n" for name in classes).encode())
    return written


def _shards(source: Path, samples: list[tuple[str, int]], shard_mb: float) -> Iterator[list[tuple[str, bytes]]]:
    """The members of each shard: a shard closes before it would pass shard_mb (it holds at least one sample)."""
    members: list[tuple[str, bytes]] = []
    size = 0
    for n, (rel, label) in enumerate(samples):
        ext, data = _encoded(source / rel)
        if members and size + len(data) > shard_mb * 2**20:
            yield members
            members, size = [], 0
        members += [(f"{n:08d}.{ext}", data), (f"{n:08d}.cls", str(label).encode())]
        size += len(data) + 1024  # two 512-byte headers, and the class
    if members:
        yield members


def _encoded(path: Path) -> tuple[str, bytes]:
    ext = path.suffix.lower().lstrip(".")
    if ext in SHARD_EXTENSIONS:
        return ext, path.read_bytes()
    from PIL import Image

    buffer = io.BytesIO()
    with Image.open(path) as image:
        image.save(buffer, format="PNG")
    return "png", buffer.getvalue()


def _write_tar(out: BinaryIO, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m common.shards", description="Write an ImageFolder tree as "
                                "WebDataset shards (train-NNNNNN.tar, val-NNNNNN.tar, classes.txt).")
    p.add_argument("source", type=Path, help="the ImageFolder tree: SOURCE/train/<class>/*, SOURCE/val/<class>/*")
    p.add_argument("dest", help="a folder, or an object-store URL (s3://bucket/prefix, any fsspec URL)")
    p.add_argument("--shard-mb", type=float, default=64.0, help="target shard size in MB (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the training samples' shuffle (default: %(default)s)")
    p.add_argument("--storage-options", default="{}", metavar="JSON|@FILE|env:VAR",
                   help="fsspec options for a URL DEST, as the training scripts take them")
    a = p.parse_args(argv)
    if a.shard_mb <= 0:
        p.error(f"--shard-mb must be > 0 (got {a.shard_mb})")
    try:
        options = read_storage_options(a.storage_options)
    except ValueError as e:
        p.error(f"--storage-options {e}")
    try:
        written = convert(a.source, a.dest, a.shard_mb, a.seed, options)
    except (UserError, StorageError, OSError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(f"{a.dest}: " + "; ".join(f"{split} {samples} samples in {shards} shard(s)"
                                    for split, (samples, shards) in written.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
