"""The checkpoint a program uses: found from a file, a run folder or a --checkpoint-dir (local
folders or object-store URLs), read with weights_only=True, and its model rebuilt with the saved
weights. What the data needs besides the weights (class names, the evaluation's preprocessing) is
the checkpoint's "data" entry (common/train/checkpoint.py data_entry)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from common.data.geometry import Resampling, Stored
from common.data.loader import DataSpec
from common.errors import ConfigError, UserError
from common.models import build_model
from common.storage import MISSING, StorageError, is_url, split, storage_for
from common.train.checkpoint import POINTER, STEP_FILE, CheckpointFolder
from common.train.state import InvalidCheckpoint, model_mismatches, parse_checkpoint

WHAT_TO_GIVE = "give a checkpoint file (step-*.pt), a run folder, or a --checkpoint-dir of a training run"


@dataclass(frozen=True)
class Preprocessing:
    """How an image becomes the model's input, as the training run evaluated: decoded to `channels`
    (L or RGB), the short side resized to `resize` and the centre `size` x `size` cropped with the
    antialiased `interpolation` filter (resize 0: the image must be size x size already), scaled to
    [0, 1], normalized by mean and std. `crop_pct`: the fraction that gave `resize` (None: size /
    0.875), what another --image-size is resized by."""

    classes: tuple[str, ...]
    channels: int
    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resize: int
    pretrained: dict[str, Any] = field(default_factory=dict)  # the data config that came with --weights (timm's)
    crop_pct: float | None = None
    interpolation: str = "bilinear"  # a checkpoint of an earlier version: what it evaluated with

    @property
    def stored(self) -> Stored:
        """The decoder's geometry (common/data/decoding.py decode)."""
        return Stored(self.size, self.resize, 0, self.interpolation)

    @property
    def resampling(self) -> Resampling:
        """The training run's crop fraction and filter, for the evaluation of another --image-size."""
        return Resampling(self.crop_pct, self.interpolation, "the checkpoint's")

    @property
    def spec(self) -> DataSpec:
        """The evaluation's spec: its normalization, no augmentation."""
        return DataSpec(self.channels, self.size, len(self.classes), self.mean, self.std, augment="none")

    def plain(self) -> dict[str, Any]:
        """For PATH.json: enough to reproduce the input exactly, the resampling included (a
        Resize then CenterCrop of another library rounds and filters differently)."""
        resample = ("the centre square of center_crop * min(width, height) / resize_short_side source pixels, "
                    f"resized to center_crop x center_crop in one antialiased {self.interpolation} step: PIL's "
                    f"image.resize((s, s), Image.{self.interpolation.upper()}, box=(left, top, left + extent, top + "
                    "extent), reducing_gap=None), the box in "
                    "fractional pixels; a JPEG is first decoded with image.draft(mode, (resize_short_side,) * 2)"
                    if self.resize else "none: the images must be center_crop x center_crop")
        return {"channels": self.channels, "mode": "L" if self.channels == 1 else "RGB",
                "resize_short_side": self.resize or None, "center_crop": self.size, "interpolation": self.interpolation,
                **({"crop_pct": self.crop_pct} if self.crop_pct is not None else {}), "resample": resample,
                "scale": "pixel / 255", "mean": list(self.mean), "std": list(self.std),
                **({"pretrained": self.pretrained} if self.pretrained else {})}


@dataclass(frozen=True)
class Saved:
    path: str  # as shown to people
    state: dict[str, Any]

    @property
    def config(self) -> dict[str, Any]:
        """The training run's flags (Config.as_plain_dict)."""
        return self.state["config"]

    @property
    def step(self) -> int:
        return int(self.state["global_step"])

    def preprocessing(self) -> Preprocessing:
        data = self.state.get("data")
        if data is None:
            raise ConfigError(f"checkpoint {self.path} was saved by an earlier version of the suite: it lacks the "
                              "class names and the preprocessing that evaluate.py, predict.py and export.py use; "
                              "train the model again with this version")
        return Preprocessing(tuple(data["classes"]), int(data["channels"]), int(data["size"]), tuple(data["mean"]),
                             tuple(data["std"]), int(data["resize"]), data.get("pretrained", {}), data.get("crop_pct"),
                             data.get("interpolation", "bilinear"))

    def weights(self, ema: bool = False) -> dict[str, Any]:
        """The saved weights, or with ema the moving average's (the training run's --ema)."""
        if ema and "ema" not in self.state:
            raise ConfigError(f"--ema: checkpoint {self.path} holds no moving average of the weights (its run "
                              "trained without --ema); leave --ema out")
        return self.state["ema" if ema else "model"]

    def build(self) -> nn.Module:
        """The run's model as built before training (its initial weights), on the CPU."""
        p = self.preprocessing()
        return build_model(self.config["model"], p.channels, p.size, len(p.classes), int(self.config["seed"]),
                           float(self.config.get("drop_path", 0.0)))

    def model(self, ema: bool = False) -> nn.Module:
        """The trained model with weights(ema), in evaluation mode, on the CPU."""
        weights, name, model = self.weights(ema), self.config["model"], self.build()
        if problems := model_mismatches(weights, model.state_dict()):
            raise ConfigError(f"checkpoint {self.path}: its weights do not fit the model --model {name} builds "
                              f"now ({'; '.join(problems)}); use the code it was trained with")
        model.load_state_dict(weights)
        return model.eval()


def find_checkpoint(ref: str, options: dict[str, Any] | None = None) -> Saved:
    """--checkpoint: a checkpoint file; a run folder (its newest checkpoint that loads); or a
    --checkpoint-dir (the newest checkpoint that loads of its most recently saved run). A URL
    ending in .pt is a file, any other URL a folder. Raises ConfigError in one line."""
    options = options or {}
    try:
        if (is_url(ref) and not ref.endswith(".pt")) or (not is_url(ref) and Path(ref).is_dir()):
            return newest_in(ref, options)
        parent, name = split(ref)
        return Saved(ref, parse_checkpoint(storage_for(parent, options).read(name)))
    except StorageError as e:
        raise ConfigError(f"--checkpoint {ref}: {e.cause}; {WHAT_TO_GIVE}") from None
    except InvalidCheckpoint as e:
        raise ConfigError(f"--checkpoint {ref}: the checkpoint {e}; {WHAT_TO_GIVE}") from None
    except ConfigError:
        raise
    except UserError as e:  # a store that did not answer, a run folder none of whose files loads
        raise ConfigError(str(e)) from None  # found on every rank alike: said once a node, as the rest


def newest_in(folder: str, options: dict[str, Any]) -> Saved:
    """The newest checkpoint that loads of a run folder, or of the most recently saved run of a
    --checkpoint-dir: CheckpointFolder's choice for --resume auto, without its identity check."""
    names = storage_for(folder, options).list("")
    is_run = POINTER in names or any(STEP_FILE.match(name) for name in names)
    parent, wanted = split(folder) if is_run else (folder, None)
    checkpoints = CheckpointFolder(storage_for(parent, options), keep=2, options=options)
    runs = [run for run in checkpoints.runs() if wanted in (None, run.name)]
    if not runs:
        raise ConfigError(f"--checkpoint {folder} holds no checkpoint; {WHAT_TO_GIVE}")
    problems = []
    for name in (candidates := checkpoints.candidates(runs[0])):
        try:
            return Saved(checkpoints.storage.url(name), parse_checkpoint(checkpoints.storage.read(name)))
        except InvalidCheckpoint as e:
            problems.append(f"{name.rsplit('/', 1)[-1]} {e}")
        except StorageError as e:
            if e.kind != MISSING:
                raise
            problems.append(f"{name.rsplit('/', 1)[-1]} {e.cause}")
    raise ConfigError(f"--checkpoint {folder}: none of the {len(candidates)} checkpoint(s) of run {runs[0].name} "
                      f"loads ({problems[0]}); {WHAT_TO_GIVE}")
