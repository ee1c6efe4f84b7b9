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

from pathlib import Path

from common.errors import UserError

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
        raise UserError(f"--data-dir {root} has no {split}/ folder: an ImageFolder tree keeps {what} in "
                        f"{folder}/<class>/<image>")
    return folder
