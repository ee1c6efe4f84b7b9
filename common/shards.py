"""Your own images on disk: the two layouts the suite reads, and the converter between them.

An ImageFolder tree (torchvision's layout): DIR/train/<class>/<image> and DIR/val/<class>/<image>;
the classes are the sorted folder names of train/, an image is a file with one of FOLDER_EXTENSIONS
(jpg jpeg png webp gif bmp tif tiff ppm pgm, any case).

WebDataset shards: DIR/train-*.tar and DIR/val-*.tar, each sample two members, KEY.<ext> (the
encoded image, ext one of SHARD_EXTENSIONS) and KEY.cls (its class index, as decimal text). The
converter names a run's shards train-GEN-NNNNNN.tar and val-GEN-NNNNNN.tar, GEN the run's
generation (12 hex digits, new each run), and writes DIR/manifest.json last:

    {"format": 1, "generation": GEN, "classes": [NAME, ...],
     "splits": {"train": [{"name": SHARD, "bytes": SIZE, "samples": COUNT}, ...], "val": [...]}}

A set with a manifest is exactly the manifest's shards, in its order; a shard missing or of another
size is refused (resolve). A set without one is made by other tools: its shards are named like
train-000000.tar and read by the globs, sorted; generation-named shards without a manifest are an
interrupted conversion, refused. DIR/classes.txt names the classes, one per line (for people and
other tools; the converter writes it too).

    python -m common.shards SRC DEST_DIR_OR_URL [--shard-mb 64] [--seed 0]
                            [--max-side N] [--quality Q] [--storage-options JSON|@FILE|env:VAR]
                            [--hf-image-key image] [--hf-label-key label]

SRC is an ImageFolder tree, or a Hugging Face data set as --dataset hf reads it (common/hfsets.py: a
save_to_disk folder, parquet files in the Hub's layout, a Hub name in the local cache, an fsspec URL
of parquet files): its train split and its validation (or test) split become train and val, each
row's image bytes a sample (verbatim, named by their format), the ClassLabel's names the classes.

The converter checks the whole tree before it writes anything: every image must decode (a JPEG at
1/8 scale, which is cheap) and have at most MAX_PIXELS pixels, or it stops naming the file. Each
image is then copied into its shard verbatim (unless --max-side or --quality, below), as KEY.<its
suffix, lowercased>: no re-encoding, no loss (16-bit PNGs and TIFFs, float TIFFs included), no time
spent. KEY is the sample's 8-digit running index within its split (00000042). The training samples
are shuffled (--seed) before writing, since readers shuffle only within a window of shards: each
shard then holds a mix of classes. val/ keeps ImageFolder's order. A shard ends before it would pass
--shard-mb MiB (it holds at least one sample).

--max-side N and --quality Q store smaller photos, as FFCV does: every image is decoded, scaled down
(antialiased, aspect kept) so that its long side is at most N pixels, and re-encoded as a JPEG of
quality Q (defaults: no scaling, quality 90), KEY.jpg; grayscale images stay grayscale, all others
become 8-bit RGB (what the readers make of them anyway; an alpha channel is dropped as they drop it);
16-bit and float images are refused (convert such a set without these flags).
Decoding costs in proportion to the pixels: see docs/data.md for when the lost detail is worth it.
Every tar member is a plain file with mode 0644, mtime 0 and owner 0, so the same tree and
seed give the same shard bytes (under a new generation's names). DEST is a folder (created) or any
fsspec URL (s3://bucket/prefix). Only once the manifest is written are DEST's other train-*.tar and
val-*.tar deleted (an earlier generation's, an interrupted run's, hand-named ones), with the temp
files of a local write killed midway: a run killed midway leaves the earlier set whole, and its
readers keep reading it.

This module is the layouts' single definition: the readers in common/data/ import it.
"""
from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import json
import math
import os
import random
import re
import shutil
import sys
import tarfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, NoReturn

from PIL import Image

from common import hfsets, scratch
from common.credentials import URL_PASSWORD, read_storage_options
from common.errors import UserError, first_line
from common.storage import Storage, StorageError, is_url, os_cause, storage_for

SPLITS = {"train": "train", "val": "test"}  # folder or shard prefix -> the suite's split
# What PIL reads and torchvision's ImageFolder accepts; other files in a class folder are ignored.
FOLDER_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".ppm", ".pgm")
SHARD_EXTENSIONS = tuple(ext[1:] for ext in FOLDER_EXTENSIONS)  # a shard holds the source file verbatim
CLASSES_FILE = "classes.txt"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
SCRATCH_PREFIX = "common.shards"  # a conversion's local scratch: common.shards.HOST-PID-RANDOM in TMPDIR
BROKEN_NAMED = 5  # broken images a refused conversion names (it counts them all)
MAX_PIXELS = 89_478_485  # PIL's decompression-bomb threshold: past it, PIL warns, and past twice it refuses
TRAIN, VAL = "train", "val"
GENERATION_DIGITS = 12  # hex digits of a conversion's id
GENERATION_SHARD = re.compile(rf"(?:{TRAIN}|{VAL})-[0-9a-f]{{{GENERATION_DIGITS}}}-[0-9]{{6}}\.tar")


def shard_pattern(split: str) -> str:
    """The glob of a split's shards: train-*.tar, val-*.tar."""
    return f"{split}-*.tar"


def shard_name(split: str, generation: str, index: int) -> str:
    """The name of a conversion's index-th shard of a split: train-GEN-000042.tar."""
    return f"{split}-{generation}-{index:06d}.tar"


def new_generation() -> str:
    """A conversion's id: random, so that no run writes over another run's shards."""
    return os.urandom(GENERATION_DIGITS // 2).hex()


@dataclass(frozen=True)
class ShardSet:
    """The shards of each split a reader reads, in order; the classes and each shard's sample count
    where a manifest gives them."""
    train: list[str]
    val: list[str]
    classes: list[str] | None = None
    samples: dict[str, int] = field(default_factory=dict)
    manifest: bool = False


def resolve(listing: dict[str, str], read: Callable[[str], bytes], where: str) -> ShardSet:
    """The shards of DEST, from its listing (file name -> "SIZE-TAG") and `read` (a file's bytes):
    exactly its manifest's, each checked against the listing; without a manifest, the hand-named
    shards by glob, sorted (a split may come back empty: the caller refuses). `where` is DEST as
    the user wrote it, for messages."""
    where = where.rstrip("/")
    if MANIFEST in listing:
        return _manifest_set(_read_manifest(read, where), listing, where)
    started = sorted(name for name in listing if GENERATION_SHARD.fullmatch(name))
    if started:
        raise UserError(f"{where} holds {started[0]} but no {MANIFEST}: a conversion into {where} was interrupted "
                        f"before it finished; {_rerun(where)}")
    train, val = ([name for name in sorted(listing) if fnmatch.fnmatchcase(name, shard_pattern(split))]
                  for split in (TRAIN, VAL))
    return ShardSet(train, val)


def _rerun(where: str) -> str:
    return f"run python -m common.shards SRC {where} again"


def _read_manifest(read: Callable[[str], bytes], where: str) -> dict[str, Any]:
    name = f"{where}/{MANIFEST}"
    try:
        manifest = json.loads(read(MANIFEST))
    except (StorageError, OSError) as e:
        cause = e.cause if isinstance(e, StorageError) else os_cause(e)
        raise UserError(f"{name} cannot be read ({cause}); check its access, or {_rerun(where)}") from None
    except ValueError as e:  # not UTF-8, not JSON
        problem = f"not JSON: {first_line(e)}"
    else:
        problem = _manifest_problem(manifest)
    if problem:
        raise UserError(f"{name} is not a valid shard manifest ({problem}); {_rerun(where)}")
    return manifest


def _manifest_problem(manifest: Any) -> str | None:
    """What makes a parsed manifest unusable, or None: readers open the names it gives."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    if manifest.get("format") != MANIFEST_FORMAT:
        return f"format {manifest.get('format')!r}; this version reads format {MANIFEST_FORMAT}"
    classes, splits = manifest.get("classes"), manifest.get("splits")
    if not isinstance(classes, list) or not all(isinstance(name, str) for name in classes):
        return "its classes are not a list of names"
    if not isinstance(splits, dict) or not all(isinstance(splits.get(split), list) for split in (TRAIN, VAL)):
        return f"its splits lack a {TRAIN} or {VAL} list"
    for split in (TRAIN, VAL):
        for entry in splits[split]:
            if not _is_shard_entry(entry, split):
                return f"{split} lists {str(entry)[:80]}, not a {{name, bytes, samples}} of a {shard_pattern(split)}"
        names = [entry["name"] for entry in splits[split]]
        if len(set(names)) != len(names):
            return f"{split} lists a shard twice ({next(n for n in names if names.count(n) > 1)})"
    return None


def _is_shard_entry(entry: Any, split: str) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("name"), str) and "/" not in entry["name"]
            and fnmatch.fnmatchcase(entry["name"], shard_pattern(split))
            and all(type(entry.get(key)) is int and entry[key] >= 0 for key in ("bytes", "samples")))


def _manifest_set(manifest: dict[str, Any], listing: dict[str, str], where: str) -> ShardSet:
    splits = manifest["splits"]
    for entry in splits[TRAIN] + splits[VAL]:
        _check_listed(entry["name"], entry["bytes"], listing, where)
    return ShardSet([entry["name"] for entry in splits[TRAIN]], [entry["name"] for entry in splits[VAL]],
                    manifest["classes"], {entry["name"]: entry["samples"] for entry in splits[TRAIN] + splits[VAL]},
                    manifest=True)


def _check_listed(name: str, size: int, listing: dict[str, str], where: str) -> None:
    way_out = f"copy it again from where the shards were converted, or {_rerun(where)}"
    if name not in listing:
        raise UserError(f"{where}/{name} is missing ({MANIFEST} lists it, {size} bytes); {way_out}")
    found = int(listing[name].split("-", 1)[0])
    if found != size:
        raise UserError(f"{where}/{name} is {found} bytes but {MANIFEST} says {size}: it was cut short or changed; "
                        f"{way_out}")


# ---------------------------------------------------------------- the ImageFolder tree

def folder_classes(root: Path) -> list[str]:
    """The classes of an ImageFolder tree: the sorted folder names of its train/."""
    train = _split_folder(root, TRAIN)
    dangling = sorted(p for p in train.iterdir() if p.is_symlink() and not p.exists())
    if dangling:  # a class whose folder is on a volume that is not mounted: the classes would silently change
        raise UserError(f"{dangling[0]} is a link to {os.readlink(dangling[0])}, which does not exist; mount or "
                        "restore it, or remove the link")
    classes = sorted(p.name for p in train.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise UserError(f"{train} has no class folders; put each class's images in {train}/<class name>/")
    return classes


def class_images(root: Path, split: str, classes: list[str],
                 ignore: Callable[[list[str]], None]) -> Iterator[tuple[int, list[str]]]:
    """Per class (in order), its images' paths relative to root: every file with an image extension
    in the class folder and its subfolders, symlinked ones included (torchvision's ImageFolder rule),
    by walk_files' order. Other files, and files beside the class folders (an image there has no class),
    go to `ignore` (by path), hidden ones nowhere. val/ may lack
    a class; a class folder without an image is an error: a typo'd or half-copied tree would
    otherwise train on fewer classes than it names."""
    folder = _split_folder(root, split)
    extra = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")
                   and p.name not in classes)
    if extra:
        raise UserError(f"{folder}/{extra[0]} is a class that {root / TRAIN} lacks; add it to {root / TRAIN} "
                        f"or remove it from {folder}")
    above = frozenset(_identity(path) for path in (root, folder))  # a link back up would add other classes' images
    ignore(sorted(str(p.relative_to(root)) for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")))
    for label, name in enumerate(classes):
        if not (folder / name).is_dir():  # a validation set may lack a class; train/ defines them
            continue
        images, others = [], []
        for path in walk_files(folder / name, above):
            is_image = path.suffix.lower() in FOLDER_EXTENSIONS and path.is_file()
            (images if is_image else others).append(str(path.relative_to(root)))
        ignore(others)
        if not images:
            fix = f"remove the class folder from {root / TRAIN}" if split == TRAIN else \
                "delete the empty folder (val/ may lack a class)"
            raise UserError(f"{folder / name} holds no image ({', '.join(FOLDER_EXTENSIONS)}); add its images or {fix}")
        yield label, images


def walk_files(folder: Path, above: frozenset = frozenset()) -> Iterator[Path]:
    """Every entry under `folder` that is neither hidden nor a folder (a file, or a link to a missing
    one, a pipe...), following symlinks: its entries by name, then each subfolder's by name. A link
    back to a folder above it, or in `above` (device, inode), is not followed (no loop); memory
    is one folder's listing per level."""
    above = above | {_identity(folder)}
    entries = sorted((entry for entry in os.scandir(folder) if not entry.name.startswith(".")), key=lambda e: e.name)
    yield from (Path(entry.path) for entry in entries if not entry.is_dir())
    for entry in entries:
        if entry.is_dir() and _identity(Path(entry.path)) not in above:
            yield from walk_files(Path(entry.path), above)


def _identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_dev, stat.st_ino


def _split_folder(root: Path, split: str) -> Path:
    folder = root / split
    if not folder.is_dir():
        what = "the training images" if split == TRAIN else "the validation images (the test set)"
        raise UserError(f"{root} has no {split}/ folder: an ImageFolder tree keeps {what} in "
                        f"{folder}/<class>/<image>")
    return folder


def pixels_problem(width: int, height: int) -> str | None:
    """Why an image of this size is refused (to follow its name), or None: decoding one larger than
    PIL's decompression-bomb threshold takes gigabytes, and PIL refuses twice that."""
    if width * height <= MAX_PIXELS:
        return None
    return (f"is {width} x {height} = {width * height} pixels, more than the {MAX_PIXELS} an image may have "
            "(PIL's decompression-bomb limit); shrink it")


def verify(path: Path) -> None:
    """Refuses, in one line naming `path`, an image that does not fully decode or has more than
    MAX_PIXELS pixels. A JPEG decodes at 1/8 scale (draft mode): every pixel's data is still read."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below, in one line
            with Image.open(path) as image:
                problem = pixels_problem(*image.size)
                if problem is None:
                    image.draft(None, (1, 1))  # a no-op for formats other than JPEG
                    image.load()
    except Image.DecompressionBombError as e:  # past twice the limit: PIL's open refuses, size unread
        problem = f"is too large to decode ({first_line(e)}); shrink it to at most {MAX_PIXELS} pixels"
    except Exception as e:  # noqa: BLE001 - PIL's decoders raise OSError, SyntaxError, ValueError, struct.error...
        problem = f"does not decode as an image ({first_line(e)}); replace or remove it"
    if problem:
        raise UserError(f"{path} {problem}")


def verify_all(paths: Iterable[Path]) -> None:
    """Every image checked before DEST is touched, the broken ones named together (the first
    BROKEN_NAMED and their count): one run lists what to repair, not one file per run."""
    broken = []
    for path in paths:
        try:
            verify(path)
        except UserError as e:
            broken.append(str(e))
    if len(broken) > 1:
        raise UserError(f"{len(broken)} images do not decode or are too large: {'; '.join(broken[:BROKEN_NAMED])}"
                        f"{'; ...' * (len(broken) > BROKEN_NAMED)}")
    if broken:
        raise UserError(broken[0])


# ---------------------------------------------------------------- the converter

END_OF_ARCHIVE = 2 * tarfile.BLOCKSIZE
DEFAULT_QUALITY = 90  # FFCV's default, and ImageNet's photos' typical quality


@dataclass(frozen=True)
class Reencode:
    """Smaller stored photos: the long side at most `max_side` (None: as it is), JPEG of `quality`."""
    max_side: int | None = None
    quality: int = DEFAULT_QUALITY

    def problem(self) -> str | None:
        """What makes these settings unusable (naming the flag), or None."""
        if self.max_side is not None and self.max_side < 1:
            return f"--max-side must be a number of pixels >= 1 (got {self.max_side})"
        if not 1 <= self.quality <= 100:
            return f"--quality must be a JPEG quality from 1 to 100 (got {self.quality})"
        return None


def scaled_size(width: int, height: int, max_side: int | None) -> tuple[int, int]:
    """The size an image is stored at under --max-side: the long side at most max_side, the aspect
    kept (each side rounded, at least 1 pixel); an image already that small is kept as it is."""
    if max_side is None or max(width, height) <= max_side:
        return width, height
    scale = max_side / max(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def reencoded(path: Path, settings: Reencode) -> bytes:
    """The image at `path` as --max-side / --quality store it: a JPEG's bytes. A 16-bit or float
    image is refused, naming it: an 8-bit JPEG would lose what the readers' own scaling keeps."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # verify() refused the ones past MAX_PIXELS
        with Image.open(path) as image:
            if image.mode == "F" or image.mode.startswith("I"):
                raise UserError(f"{path} is a {image.mode} (16-bit, 32-bit or float) image, and --max-side/--quality "
                                "store 8-bit JPEGs; convert this set without them (its files are then copied "
                                "verbatim), or save its images as 8-bit first")
            image = image.convert("L" if image.mode in ("1", "L") else "RGB")
    size = scaled_size(*image.size, settings.max_side)
    if size != image.size:  # LANCZOS over the whole footprint: antialiased, as the readers' own resize
        image = image.resize(size, Image.Resampling.LANCZOS)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=settings.quality)
    return out.getvalue()


def convert(src: Path, dest: str, shard_mb: float = 64, seed: int = 0,
            storage_options: dict[str, Any] | None = None,
            say: Callable[[str], None] = lambda line: None,
            reencode: Reencode | None = None) -> dict[str, tuple[int, int, int]]:
    """Writes SRC's ImageFolder tree to DEST as a new generation's shards, classes.txt and, last,
    manifest.json, then deletes DEST's other shards; split -> (samples, shards, bytes). The whole
    tree is checked before anything is written; files that are not images are named to `say`.
    With `reencode`, the images are stored as its smaller JPEGs instead of verbatim."""
    check_reencode(reencode)
    classes = folder_classes(src)
    ignored: list[str] = []
    splits = {split: [(rel, label) for label, paths in class_images(src, split, classes, ignored.extend)
                      for rel in paths] for split in (TRAIN, VAL)}
    if ignored:
        say(f"common.shards: left out {len(ignored)} file(s) that are not images ({', '.join(FOLDER_EXTENSIONS)}) in a "
            f"class folder: {', '.join(ignored[:5])}{', ...' * (len(ignored) > 5)}")
    return write_set(src, classes, splits, dest, shard_mb, seed, storage_options, reencode)


def check_reencode(reencode: Reencode | None) -> None:
    if reencode is not None and (problem := reencode.problem()):
        raise UserError(problem)


SRC = "SRC"  # what the converter's error lines call its source (--dataset hf's call it --data-dir)


def convert_hf(src: str, dest: str, image_key: str = "image", label_key: str = "label", shard_mb: float = 64,
               seed: int = 0, storage_options: dict[str, Any] | None = None,
               reencode: Reencode | None = None) -> dict[str, tuple[int, int, int]]:
    """A Hugging Face data set (common/hfsets.py) written to DEST as convert writes a tree: each row's
    image bytes first saved to local scratch as a file named by its format."""
    check_reencode(reencode)
    options = storage_options or {}
    source = hfsets.resolve(src, options, lambda path: "", flag=SRC)
    with scratch_folder() as scratch:
        classes, splits = _extract(source, scratch, options, image_key, label_key)
        return write_set(scratch, classes, splits, dest, shard_mb, seed, storage_options, reencode)


IMAGE_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff",
                 "PPM": "ppm"}  # PIL's format -> the extension a shard member gets


def _extract(source: hfsets.Source, folder: Path, options: dict[str, Any], image_key: str,
             label_key: str) -> tuple[list[str], dict[str, list[tuple[str, int]]]]:
    """The rows of both splits as files folder/SPLIT/NNNNNNNN.EXT, with their labels; the classes."""
    files = hfsets.Files(source.root, options, flag=SRC)
    for name in source.train + source.test:
        hfsets.check_columns(files, name, image_key, label_key)
    rows = {TRAIN: [], VAL: []}
    digests: dict[str, list[bytes]] = {name: [] for name in source.train + source.test}
    for split, names in ((TRAIN, source.train), (VAL, source.test)):
        (folder / split).mkdir()
        for name in names:
            start = 0  # the group's first row in the file: a row is named as --dataset hf names it
            for group, count in enumerate(files.row_groups(name)):
                images, labels = files.columns(name, group, [image_key, label_key])
                datas, label_list = hfsets.image_bytes(images).to_pylist(), labels.to_pylist()
                digests[name].append(hfsets.rows_digest(datas, label_list))
                for row, (data, label) in enumerate(zip(datas, label_list)):
                    where = f"{files.where(name)}:row {start + row}"
                    if not data:
                        hfsets.check_embedded(images, row, where)
                    rel = f"{split}/{len(rows[split]):08d}.{_extension(data, where)}"
                    (folder / rel).write_bytes(data)
                    rows[split].append((rel, _label(label, where)))
                start += count
    hfsets.check_distinct(files, digests)
    classes = hfsets.class_names(files, source, label_key) or \
        [str(i) for i in range(max(label for _, label in rows[TRAIN]) + 1)]
    for split in (TRAIN, VAL):
        if bad := next(((rel, label) for rel, label in rows[split] if label >= len(classes)), None):
            raise UserError(f"{source.root}: the {split} row {bad[0]} has label {bad[1]}, outside the {len(classes)} "
                            f"classes (--hf-label-key {label_key}); fix the rows")
    return classes, rows


def _extension(data: bytes | None, where: str) -> str:
    try:
        with Image.open(io.BytesIO(data or b"")) as image:
            return IMAGE_FORMATS[image.format]
    except Exception:  # noqa: BLE001 - not an image, or a format shards do not hold: one line
        raise UserError(f"{where} is not an image in {', '.join(IMAGE_FORMATS)}; replace the row or remove it"
                        ) from None


def _label(label: int | None, where: str) -> int:
    if label is None or label < 0:
        raise UserError(f"{where} has label {label}, not a class index; label the row or remove it")
    return int(label)


def write_set(src: Path, classes: list[str], splits: dict[str, list[tuple[str, int]]], dest: str, shard_mb: float,
              seed: int, storage_options: dict[str, Any] | None, reencode: Reencode | None,
              ) -> dict[str, tuple[int, int, int]]:
    """The samples (paths under `src`, labels) of each split, checked whole, then written to DEST as a
    new generation's shards, classes.txt and, last, manifest.json; DEST's other shards deleted."""
    verify_all(src / path for path, _ in splits[TRAIN] + splits[VAL])
    random.Random(seed).shuffle(splits[TRAIN])
    with scratch_folder() as scratch:
        # to local scratch first, before DEST is touched: the shards are planned from the sizes
        if reencode is not None:
            src, splits = scratch, _reencode_tree(src, splits, reencode, scratch)
        storage = storage_for(dest, storage_options)
        generation = new_generation()
        shards = {split: _write_split(storage, src, split, generation, samples, int(shard_mb * 2**20))
                  for split, samples in splits.items()}
    storage.write(CLASSES_FILE, "".join(f"{name}\n" for name in classes).encode())
    _check_still_there(storage, [entry["name"] for entries in shards.values() for entry in entries], dest)
    manifest = {"format": MANIFEST_FORMAT, "generation": generation, "classes": classes, "splits": shards}
    storage.write(MANIFEST, json.dumps(manifest, indent=1).encode())
    _delete_other_shards(storage, {entry["name"] for entries in shards.values() for entry in entries})
    return {split: (len(splits[split]), len(entries), sum(entry["bytes"] for entry in entries))
            for split, entries in shards.items()}


@contextlib.contextmanager
def scratch_folder() -> Iterator[Path]:
    """Local scratch for one conversion (in TMPDIR; common/scratch.py: those of conversions killed
    mid-way are deleted first): a re-encoded copy of a set can be gigabytes."""
    folder = scratch.make(SCRATCH_PREFIX)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _reencode_tree(src: Path, splits: dict[str, list[tuple[str, int]]], settings: Reencode,
                   scratch: Path) -> dict[str, list[tuple[str, int]]]:
    """Each image re-encoded into `scratch` under its relative path + ".jpg" (a.png and a.jpg of
    one folder stay apart); the samples renamed to match."""
    renamed: dict[str, list[tuple[str, int]]] = {}
    for split, samples in splits.items():
        renamed[split] = []
        for path, label in samples:
            target = scratch / f"{path}.jpg"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(reencoded(src / path, settings))
            renamed[split].append((f"{path}.jpg", label))
    return renamed


def _write_split(storage: Storage, src: Path, split: str, generation: str, samples: list[tuple[str, int]],
                 limit: int) -> list[dict[str, Any]]:
    """Writes a split's shards; returns the manifest's entry of each: name, bytes, samples."""
    entries: list[dict[str, Any]] = []
    start = 0
    for index, count in enumerate(_plan(src, samples, limit)):
        entry = {"name": shard_name(split, generation, index), "bytes": 0, "samples": count}

        def produce(f: BinaryIO, start: int = start, entry: dict[str, Any] = entry) -> None:  # called again on a retry
            _write_shard(f, src, samples, start, entry["samples"])
            entry["bytes"] = f.tell()  # what was written: a reader's copy must have that size
        storage.write_from(entry["name"], produce)
        entries.append(entry)
        start += count
    return entries


def _check_still_there(storage: Storage, names: list[str], dest: str) -> None:
    """A second converter into the same DEST deletes the first one's shards when it ends: the
    manifest must not name shards that are gone (one converter per DEST at a time)."""
    present = set(storage.list(""))
    missing = [name for name in names if name not in present]
    if missing:
        raise UserError(f"{dest}/{missing[0]} was deleted while this conversion ran (another converter into "
                        f"{dest}?); run one converter per destination at a time, then run this one again")


def _delete_other_shards(storage: Storage, keep: set[str]) -> None:
    """Only once the manifest names the new set: a reader that globs would mix the two sets, and a
    run killed before this point must leave the earlier set whole."""
    for name in storage.list(""):
        if name not in keep and any(fnmatch.fnmatchcase(name, shard_pattern(split)) for split in (TRAIN, VAL)):
            storage.delete(name)
    storage.remove_leftovers("")  # the temp files of a run killed mid-write (a local DEST)


def _plan(src: Path, samples: list[tuple[str, int]], limit: int) -> list[int]:
    """The sample count of each shard, from the tar format's sizes: a header block per member, its
    data padded to whole blocks, two end blocks, and the whole padded to tarfile's record size."""
    def archive(content: int) -> int:
        return -(-(content + END_OF_ARCHIVE) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE

    def member(size: int) -> int:
        return tarfile.BLOCKSIZE + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE

    shards: list[int] = []
    count = content = 0
    for path, label in samples:
        grow = member((src / path).stat().st_size) + member(len(str(label)))
        if count and archive(content + grow) > limit:
            shards.append(count)
            count = content = 0
        count, content = count + 1, content + grow
    return shards + [count] if count else shards


def _write_shard(f: BinaryIO, src: Path, samples: list[tuple[str, int]], start: int, count: int) -> None:
    with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for index in range(start, start + count):
            path, label = samples[index]
            image = (f"{index:08d}.{Path(path).suffix.lower()[1:]}", (src / path).read_bytes())  # verbatim
            for name, payload in (image, (f"{index:08d}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)  # mode 0644, mtime 0, owner 0 and "": tarfile's defaults
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m common.shards", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar=SRC, help="the ImageFolder tree with train/ and val/, or a Hugging Face data set "
                                              "(as --dataset hf reads it)")
    p.add_argument("dest", metavar="DEST_DIR_OR_URL", help="a folder, or an fsspec URL such as s3://bucket/prefix")
    p.add_argument("--shard-mb", type=float, default=64.0, help="a shard's largest size in MiB (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the training samples' shuffle (default: %(default)s)")
    p.add_argument("--max-side", type=int, default=None, metavar="N",
                   help="store each image scaled down to at most N pixels on its long side, as a JPEG (--quality)")
    p.add_argument("--quality", type=int, default=None, metavar="Q",
                   help=f"store each image re-encoded as a JPEG of quality Q, 1-100 (default with --max-side: "
                        f"{DEFAULT_QUALITY}; without both: the files verbatim)")
    p.add_argument("--storage-options", default="{}", metavar="JSON|@FILE|env:VAR",
                   help="fsspec options for a URL DEST; put credentials in @FILE or env:VAR, not inline (ps shows it)")
    p.add_argument("--hf-image-key", default="image", metavar="COLUMN", help="a Hugging Face SRC: the images' column")
    p.add_argument("--hf-label-key", default="label", metavar="COLUMN", help="a Hugging Face SRC: the labels' column")
    a = p.parse_args(argv)
    if not 0 < a.shard_mb < math.inf:
        p.error(f"--shard-mb must be a number > 0 (got {a.shard_mb})")
    reencode = None
    if a.max_side is not None or a.quality is not None:
        reencode = Reencode(a.max_side, DEFAULT_QUALITY if a.quality is None else a.quality)
        if problem := reencode.problem():
            p.error(problem)
    try:
        options = read_storage_options(a.storage_options)
    except ValueError as e:
        p.error(f"--storage-options {e}")
    if not is_url(a.dest) and Path(a.dest).exists() and not Path(a.dest).is_dir():
        p.error(f"DEST {a.dest} is a file: give a folder (made if missing) or a URL such as s3://bucket/prefix")
    try:
        if is_tree(a.src):
            written = convert(Path(a.src), a.dest, a.shard_mb, a.seed, options, say=print, reencode=reencode)
        else:
            written = convert_hf(a.src, a.dest, a.hf_image_key, a.hf_label_key, a.shard_mb, a.seed, options, reencode)
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


def is_tree(src: str) -> bool:
    """An ImageFolder tree (train/ of class folders), not a Hugging Face set: a save_to_disk folder
    has train/ too, beside its dataset_dict.json."""
    path = Path(src)
    return (path / TRAIN).is_dir() and not (path / "dataset_dict.json").is_file() and \
        not any((path / TRAIN).glob("*.parquet"))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        _fail(f"{message} (see --help)", 2)  # one line, not the usage block


def _fail(message: str, code: int) -> NoReturn:
    sys.stderr.write(f"common.shards: error: {message}\n")
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
