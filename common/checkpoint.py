"""Crash-safe checkpoints: rank 0 writes atomically and keeps the last few; every rank resumes
from the newest one that loads.

Files in CHECKPOINT_DIR: step-00000123.pt (one per save, the newest --keep kept) and last.pt, a
hard link to the newest. A checkpoint holds only tensors and plain types, so
torch.load(weights_only=True) reads it and a file carrying pickled code is refused unread.
"""
from __future__ import annotations

import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common import __version__
from common.errors import UserError

LAST = "last.pt"
REQUIRED = ("model", "optimizer", "scheduler", "epoch", "step_in_epoch", "global_step", "config", "world_size")
# A checkpoint from another run shape cannot continue this one.
MUST_MATCH = ("dataset", "synthetic_shape", "model", "batch_size")


def step_path(folder: Path, global_step: int) -> Path:
    return folder / f"step-{global_step:08d}.pt"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_save(state: dict[str, Any], path: Path) -> None:
    """A reader sees the old file or the new one, never half of one, even if we die mid-write."""
    tmp = _temp_name(path)
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _atomic_link(target: Path, link: Path) -> None:
    tmp = _temp_name(link)
    tmp.unlink(missing_ok=True)
    os.link(target, tmp)
    os.replace(tmp, link)
    _fsync_dir(link.parent)


class CheckpointWriter:
    """Saving is a rank-0 side effect: other ranks hold a writer that does nothing."""

    def __init__(self, folder: str, keep: int, enabled: bool) -> None:
        self.folder, self.keep, self.enabled = Path(folder), keep, enabled
        if enabled:
            self.folder.mkdir(parents=True, exist_ok=True)
            remove_leftovers(self.folder)

    def save(self, state: dict[str, Any]) -> Path | None:
        if not self.enabled:
            return None
        path = step_path(self.folder, state["global_step"])
        atomic_save({**state, "version": __version__}, path)
        _atomic_link(path, self.folder / LAST)
        for old in sorted(self.folder.glob("step-*.pt"))[:-self.keep]:
            old.unlink()
        return path


def remove_leftovers(folder: Path) -> None:
    """Temp files of a writer that was killed mid-save; never a complete checkpoint."""
    for path in folder.glob(".*.tmp-*"):
        path.unlink(missing_ok=True)


def candidates(folder: Path) -> list[Path]:
    """Newest first: last.pt, then the step files by step."""
    last = folder / LAST
    return ([last] if last.is_file() else []) + sorted(folder.glob("step-*.pt"), reverse=True)


class InvalidCheckpoint(Exception):
    pass


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load with weights_only=True; raise InvalidCheckpoint saying why a file is unusable."""
    size = path.stat().st_size
    if size == 0:
        raise InvalidCheckpoint("is empty")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip; a cut write loses its directory at the end
        raise InvalidCheckpoint(f"is truncated or not a checkpoint ({size} bytes, no complete zip archive)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise InvalidCheckpoint(f"holds objects that are not plain data and was refused unread ({_first_line(e)})") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as e:
        raise InvalidCheckpoint(f"is truncated or not a checkpoint ({size} bytes): {type(e).__name__}: "
                                f"{_first_line(e)}") from None
    missing = [key for key in REQUIRED if not isinstance(state, dict) or key not in state]
    if missing:
        raise InvalidCheckpoint(f"lacks {', '.join(missing)}")
    return state


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [""])[0][:120]


@dataclass(frozen=True)
class Found:
    path: Path
    state: dict[str, Any]


def newest_valid(folder: Path) -> tuple[Found | None, list[str]]:
    """The newest checkpoint that loads, and a warning for each newer one that did not."""
    warnings = []
    for path in candidates(folder):
        try:
            return Found(path, read_checkpoint(path)), warnings
        except InvalidCheckpoint as e:
            warnings.append(f"warning: checkpoint {path} {e}; falling back to the previous one")
    if warnings:
        warnings.append(f"warning: no usable checkpoint in {folder}; starting fresh")
    return None, warnings


def find_checkpoint(resume: str, folder: str) -> tuple[Found | None, list[str]]:
    """'none' -> fresh start; 'auto' -> the newest valid checkpoint in folder, if any; else that file."""
    if resume == "none":
        return None, []
    if resume == "auto":
        return newest_valid(Path(folder))
    path = Path(resume)
    if not path.is_file():
        raise UserError(f"--resume {resume}: no such file; give a checkpoint path, 'auto' or 'none'")
    try:
        return Found(path, read_checkpoint(path)), []
    except InvalidCheckpoint as e:
        raise UserError(f"--resume {path}: the checkpoint {e}") from None


def check_compatible(state: dict[str, Any], config: dict[str, Any], model: nn.Module, path: Path) -> None:
    """One error listing every difference: run shape, missing/unexpected keys, shapes."""
    saved = state["config"]
    problems = [f"{key} is {saved.get(key)!r} in the checkpoint, {config[key]!r} now"
                for key in MUST_MATCH if saved.get(key) != config[key]]
    expected = model.state_dict()
    got = state["model"]
    if missing := [k for k in expected if k not in got]:
        problems.append(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected := [k for k in got if k not in expected]:
        problems.append(f"unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    shapes = [f"{k} {tuple(got[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in got and tuple(got[k].shape) != tuple(v.shape)]
    if shapes:
        problems.append(f"shape mismatch {shapes[:3]}")
    if problems:
        raise UserError(f"checkpoint {path} does not fit this run: {'; '.join(problems)}; "
                        "use another --checkpoint-dir or --resume none")
