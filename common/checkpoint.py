"""Checkpoints: rank 0 writes atomically, every rank reads before the model is wrapped.

A checkpoint holds only tensors and plain types so torch.load(weights_only=True) reads it
without unpickling code.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common import __version__
from common.errors import UserError

LAST = "last.pt"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(state: dict[str, Any], path: Path) -> None:
    """A reader sees the old file or the new one, never half of one, even if we die mid-write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class CheckpointWriter:
    """Saving is a rank-0 side effect: other ranks hold a writer that does nothing."""

    def __init__(self, folder: str, enabled: bool) -> None:
        self.folder, self.enabled = Path(folder), enabled

    def save(self, state: dict[str, Any]) -> None:
        if self.enabled:
            atomic_save({**state, "version": __version__}, self.folder / LAST)


def resume_path(resume: str, checkpoint_dir: str) -> Path | None:
    """'none' -> fresh start; 'auto' -> CHECKPOINT_DIR/last.pt if it exists; else that exact file."""
    if resume == "none":
        return None
    if resume == "auto":
        last = Path(checkpoint_dir) / LAST
        return last if last.is_file() else None
    path = Path(resume)
    if not path.is_file():
        raise UserError(f"--resume {resume}: no such file; give a checkpoint path, 'auto' or 'none'")
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise UserError(f"cannot load checkpoint {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def restore_model(model: nn.Module, state: dict[str, Any], path: Path) -> None:
    try:
        result = model.load_state_dict(state["model"], strict=False)
    except RuntimeError as e:  # shape mismatches
        detail = " ".join(line.strip() for line in str(e).splitlines()[1:4])
        raise UserError(f"checkpoint {path} does not fit this model: {detail}; check --model and --dataset") from None
    if result.missing_keys or result.unexpected_keys:
        raise UserError(f"checkpoint {path} does not fit this model: missing keys {result.missing_keys[:5]}, "
                        f"unexpected keys {result.unexpected_keys[:5]}; check --model and --dataset")
