"""What a checkpoint holds (the schema) and how it is read back: the training state a run
continues from (also what a replica group sends a peer that heals from it), the entry predict.py
and export.py need, and the checks that refuse bytes or weights that are not this run's."""
from __future__ import annotations

import io
import pickle
import zipfile
from typing import Any

import torch

from common import __version__
from common.config import SHUFFLE_WINDOW
from common.data.loader import ORDER_VERSION
from common.errors import first_line
from common.optimizers import OPTIMIZERS
from common.train.run import Position, Run

REQUIRED = ("model", "optimizer", "scheduler", "epoch", "step_in_epoch", "global_step", "config", "world_size",
            "identity")


class InvalidCheckpoint(Exception):
    pass


def parse_checkpoint(data: bytes) -> dict[str, Any]:
    """Load with weights_only=True; raise InvalidCheckpoint saying why the bytes are unusable."""
    if not data:
        raise InvalidCheckpoint("is empty")
    if not zipfile.is_zipfile(io.BytesIO(data)):  # torch.save writes a zip; a cut write loses its directory
        raise InvalidCheckpoint(f"is truncated or not a checkpoint ({len(data)} bytes, no complete zip archive)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise InvalidCheckpoint("holds objects that are not plain data and was refused unread "
                                f"({first_line(e)})") from None
    except Exception as e:  # noqa: BLE001 - any parse failure of untrusted bytes means "unusable"
        raise InvalidCheckpoint(f"is truncated or not a checkpoint ({len(data)} bytes): {type(e).__name__}: "
                                f"{first_line(e)}") from None
    missing = [key for key in REQUIRED if not isinstance(state, dict) or key not in state]
    if missing:
        raise InvalidCheckpoint(f"lacks {', '.join(missing)} (written by another version?)")
    return state

def training_state(run: Run, at: Position) -> dict[str, Any]:
    """The checkpoint schema: everything training continues from, at `at`. The strategy gathers
    sharded state (a collective on every rank). Also what a fault-tolerant group sends a peer
    that heals from it (train_ft.py)."""
    return {
        "model": run.strategy.model_state(run.model),
        "optimizer": run.strategy.optimizer_state(run.optimizer),
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.precision.state_dict(),  # fp16's loss scale and its growth tracker
        "strategy": run.strategy.state_dict(),  # e.g. PowerSGD's error feedback
        "epoch": at.epoch, "step_in_epoch": at.step, "global_step": run.global_step(at),
        "world_size": run.ctx.world_size, "config": run.cfg.as_plain_dict(), "identity": run.cfg.identity(),
        "version": __version__, "data_content": run.data.content, "order": ORDER_VERSION, "lanes": run.loader.lanes,
        **({"ema": run.ema.state(), "ema_steps": run.ema.steps} if run.ema else {}),  # full, like "model"
    }


def order_changed(state: dict[str, Any], grouped: bool, lanes: int = SHUFFLE_WINDOW,
                  epoch_steps: int | None = None) -> str:
    """Why this run cannot continue the checkpoint's epoch, or "": one written mid-epoch, on shards
    or row groups, under another order of their samples (before ORDER_VERSION 2: none recorded;
    another --shard-lanes) would go on with other samples, some trained twice that epoch and some never.
    One written after the epoch's last step (`epoch_steps`: a stop during its evaluation) has none left."""
    step = state.get("step_in_epoch") or 0
    if not grouped or not step or (epoch_steps is not None and step >= epoch_steps):
        return ""
    where = f"was written at step {state['step_in_epoch']} of epoch {state['epoch'] + 1}"
    if state.get("order", 1) != ORDER_VERSION:
        return (f"{where} by a version that ordered a sharded set's samples otherwise: this one would train the "
                "rest of that epoch on other samples; resume from that run's checkpoint at an epoch's end "
                "(--resume PATH), or finish the epoch with the version that wrote it")
    saved = state.get("lanes", SHUFFLE_WINDOW)
    if saved == lanes:
        return ""
    return (f"{where} with --shard-lanes {saved}: --shard-lanes {lanes} deals the shards into other lanes, and the "
            f"rest of that epoch would be other samples; pass --shard-lanes {saved} to finish the epoch (the next "
            "run may change it), or resume from a checkpoint at an epoch's end (--resume PATH)")


def load_training_state(run: Run, state: dict[str, Any]) -> None:
    """training_state() into the wrapped model (through the strategy), optimizer and schedule, on every rank."""
    run.strategy.load_model_state(run.model, state["model"])
    run.strategy.load_optimizer_state(run.optimizer, state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.precision.load_state_dict(state.get("scaler", {}))
    run.strategy.load_state_dict(state.get("strategy", {}))
    if run.ema:
        run.ema.load(state["ema"], int(state["ema_steps"]))


def detached_copy(state: Any) -> Any:
    """The state with every tensor copied to the CPU: training goes on changing the originals."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):  # the same type: a model's OrderedDict keeps its _metadata (module versions)
        copy = type(state)((key, detached_copy(value)) for key, value in state.items())
        if hasattr(state, "_metadata"):
            copy._metadata = state._metadata
        return copy
    if isinstance(state, (list, tuple)):
        return type(state)(detached_copy(value) for value in state)
    return state


def data_entry(run: Run) -> dict[str, Any]:
    """What predict.py and export.py need besides the weights (common/use/): the classes' names
    and the evaluation's preprocessing: decode to `channels`, resize the short side to `resize`
    and centre-crop `size` (resize 0: the image must be size x size as it is) with the antialiased
    `interpolation` filter (`crop_pct`: the fraction that gave `resize`, None for size / 0.875),
    scale to [0, 1], normalize by `mean` and `std`. And the pretrained data config that came with --weights (timm's:
    mean, std, input size, crop fraction, interpolation, and where it came from), if any. Plain
    values: the file stays loadable with weights_only=True."""
    cfg, spec = run.cfg, run.data.spec
    return {"classes": run.data.names(),
            "channels": spec.channels, "size": spec.size, "mean": list(spec.mean), "std": list(spec.std),
            "resize": run.resampling.short(cfg.image_size) if cfg.image_size else 0,  # as geometry.choose_geometry
            "crop_pct": run.resampling.crop_pct, "interpolation": run.resampling.interpolation,
            **({"pretrained": run.pretrained} if run.pretrained else {})}


def expected_bytes(run: Run) -> int:
    """About what one checkpoint takes: the model, once more per optimizer state tensor (momentum,
    Adam's two moments) and once more for an EMA."""
    model = sum(t.numel() * t.element_size() for t in run.plain.state_dict().values())
    state = len(OPTIMIZERS[run.cfg.optimizer].state_tensors(run.cfg.momentum))
    return model * (1 + state + bool(run.ema))


def model_mismatches(saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    if missing := [k for k in expected if k not in saved]:
        problems.append(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected := [k for k in saved if k not in expected]:
        problems.append(f"unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    shapes = [f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in saved and tuple(saved[k].shape) != tuple(v.shape)]
    if shapes:
        problems.append(f"shape mismatch {shapes[:3]}")
    return problems
