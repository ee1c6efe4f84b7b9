"""The shard format's reading side (its writer is common/shards.py, in the layer below): a tar
shard's members parsed into its samples (each KEY.<image> with its KEY.cls), as WebDataset names
them, checked whole.
"""
from __future__ import annotations

import tarfile
from typing import BinaryIO

from common import shards as layout
from common.data.decoding import broken_message, header
from common.data.indexing import ShardSamples
from common.errors import UserError


def read_shard(opened: BinaryIO, name: str, skip: bool, expected: int | None) -> ShardSamples:
    """One pass over an open tar shard: each KEY.<image> with its KEY.cls. Opened once: a cache
    short of room may delete the file meanwhile, and an open file stays readable. `expected`: the
    sample count the converter's manifest gives the shard."""
    with opened as f:
        images, labels = _members(f, name)
        if expected is not None and len(images) != expected:
            raise UserError(f"{name} holds {len(images)} samples, the manifest says {expected}: it was cut or changed "
                        "since it was written; copy it again, or rerun python -m common.shards")
        return _samples(f, name, images, labels, skip)


def _members(f, name: str) -> tuple[dict[str, tuple[int, int, str]], dict[str, str]]:
    """key -> (offset, size, member name) of each image; key -> the text of each .cls. A shard must
    end with tar's end-of-archive blocks: one cut at a member boundary would otherwise pass for a
    shorter shard."""
    images: dict[str, tuple[int, int, str]] = {}
    labels: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = split_member(member.name)
                if ext == "cls" or ext in layout.SHARD_EXTENSIONS:
                    if key in (labels if ext == "cls" else images):  # else silently one sample, the last label
                        raise UserError(f"{name}: sample {key} has two {'.cls' if ext == 'cls' else 'image'} members "
                                        f"({member.name}); each key must be one sample: rewrite the shard")
                if ext == "cls":
                    labels[key] = tar.extractfile(member).read(64).decode("utf-8", "replace").strip()
                elif ext in layout.SHARD_EXTENSIONS:
                    images[key] = (member.offset_data, member.size, member.name)
            end = tar.offset
        f.seek(end)
        if f.read(tarfile.BLOCKSIZE) != bytes(tarfile.BLOCKSIZE):
            raise UserError(f"{name} ends without tar's end-of-archive blocks: it was cut (a partial copy or "
                            "download); copy it again")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UserError(f"{name} is not a readable tar shard ({first_words(e)}); replace it, or rewrite the shards "
                        "with python -m common.shards") from None
    orphans = sorted(set(labels) - set(images))
    if orphans:
        raise UserError(f"{name}: sample {orphans[0]} has {orphans[0]}.cls but no image member ("
                        f"{', '.join(layout.SHARD_EXTENSIONS)}); add it, or remove the sample")
    return images, labels


def _samples(f, name: str, images: dict[str, tuple[int, int, str]], labels: dict[str, str],
             skip: bool) -> ShardSamples:
    out = ShardSamples()
    for key, (offset, size, member) in images.items():
        if key not in labels:
            raise UserError(f"{name}: sample {key} has {member} but no {key}.cls; every image needs its class "
                            "index in KEY.cls (python -m common.shards writes both)")
        f.seek(offset)
        try:
            (w, h), mode, kind = header(f.read(size))
        except Exception as e:  # noqa: BLE001
            if not skip:
                raise UserError(broken_message(f"{name}:{member}", e)) from None
            out.survey.skip([f"{name}:{member}"])
            continue
        out.offsets.append(offset)
        out.sizes.append(size)
        out.keys.append(member)
        out.labels.append(_class_index(labels[key], name, key))
        out.dims.append((w, h))
        out.survey.saw(f"{w}x{h}", f"{name}:{member}", mode, kind)
    return out


def split_member(name: str) -> tuple[str, str]:
    """WebDataset's rule: a member's key is its path up to the first dot of its file name, the
    rest (lowercased) its extension: a/b.seg.png -> (a/b, seg.png)."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


MAX_CLASS = 2**31 - 1


def _class_index(text: str, shard: str, key: str) -> int:
    if not text.isdigit() or int(text) > MAX_CLASS:
        raise UserError(f"{shard}: {key}.cls holds {text[:20]!r}, not a class index (a whole number from 0 to "
                        f"{MAX_CLASS}); fix the shard, or rewrite the shards with python -m common.shards")
    return int(text)


def first_words(error: BaseException) -> str:
    return " ".join(str(error).split())[:160] or type(error).__name__


