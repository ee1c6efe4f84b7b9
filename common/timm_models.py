"""--model timm:NAME: timm's image classifiers, their pretrained weights and data config, and their
grouping by depth (--layer-decay).

NAME is any name timm.list_models() knows, with a pretrained tag or without (timm:resnet50,
timm:vit_small_patch16_224.augreg_in21k). The model is built for the data set's classes and
channels (timm's num_classes, in_chans), a fixed-size model (a ViT) for its image size too, and is
checked on a dummy batch as every model is (common/models.py).

Its pretrained weights (--weights DEFAULT) are the Hugging Face Hub file timm's registry names for
that tag (timm/NAME.TAG, model.safetensors), read from the Hugging Face cache ($HF_HUB_CACHE,
by default $HF_HOME/hub), downloaded into it when missing unless HF_HUB_OFFLINE or --no-download
says not to. `local-dir:FOLDER` reads a folder as `hf download REPO --local-dir FOLDER` writes it
(the weights file and timm's config.json). The weights' pretrained data config (mean, std, input
size, crop fraction, interpolation) comes with them: the registry's for DEFAULT, config.json's for
a folder; its mean and std normalize the images (common/weights.py).

timm is optional: without it, every flag that needs it ends with one line naming `pip install timm`.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from common.errors import UserError, first_line

TIMM = "timm:"
LOCAL_DIR = "local-dir:"
INSTALL = "pip install timm"
# The files a local-dir folder may hold the weights in, in the order timm prefers them
# (timm.models._hub._PREFERRED_FILES' plain-data ones first).
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth")
# What of timm's pretrained config a run keeps: how the weights' images were prepared.
DATA_CONFIG = ("mean", "std", "input_size", "crop_pct", "crop_mode", "interpolation")
HUB_FILE = "model.safetensors"  # what timm's Hub repositories hold their weights in


def add_timm_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flag of timm_builder."""
    group.add_argument("--drop-path", type=float, default=0.0, metavar="P",
                       help="stochastic depth of a timm:NAME model: each residual block skipped with probability up "
                            "to P (timm's drop_path_rate; 0.1 is usual for fine-tuning a ViT) (0: off)")


def check_timm_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--drop-path's range, and the fine-tuning flags that only a timm model has the structure for."""
    if not 0 <= a.drop_path < 1:
        p.error(f"--drop-path must be in [0, 1), 0 for off (got {a.drop_path:g})")
    needs_timm = [flag for flag, value in (("--layer-decay", a.layer_decay), ("--drop-path", a.drop_path)) if value]
    if needs_timm and not is_timm(a.model):
        p.error(f"{' and '.join(needs_timm)} need{'s' if len(needs_timm) == 1 else ''} a timm model (timm's grouping "
                f"by depth, its stochastic depth); --model {a.model} is not one: give --model timm:NAME or drop it")


def import_timm(flag: str) -> Any:
    """timm, or a UserError naming `flag` and the install command."""
    try:
        import timm
    except ImportError:
        raise UserError(f"{flag} needs timm, which is not installed: {INSTALL}") from None
    return timm


def is_timm(model: str) -> bool:
    return model.startswith(TIMM)


# --- building --------------------------------------------------------------------------------------------

def timm_builder(name: str, drop_path: float = 0.0) -> Callable[[int, int, int], nn.Module]:
    """A builder of timm's NAME[.TAG], untrained (pretrained=False: nothing is downloaded)."""
    timm = import_timm(f"--model {TIMM}{name}")
    check_name(timm, name)
    config = pretrained_config(name)
    options: dict[str, Any] = {"drop_path_rate": drop_path} if drop_path else {}

    def build(channels: int, size: int, classes: int) -> nn.Module:
        fixed = config.get("fixed_input_size") and tuple(config.get("input_size", ()))[-1:] != (size,)
        try:
            return timm.create_model(name, pretrained=False, num_classes=classes, in_chans=channels, **options,
                                     **({"img_size": size} if fixed else {}))
        except TypeError as e:
            if "drop_path_rate" in str(e):
                raise UserError(f"--drop-path: --model {TIMM}{name} takes no drop-path rate (its blocks have no "
                                "stochastic depth); drop the flag") from None
            raise

    return build


def check_name(timm: Any, name: str) -> None:
    """UserError for a name timm does not know, with the close ones; for a tag, its model's tags."""
    arch, _, tag = name.partition(".")
    known = timm.list_models()
    if arch not in known:
        close = difflib.get_close_matches(arch, known, n=4, cutoff=0.6)
        hint = f"close names: {', '.join(close)}" if close else "see timm.list_models() (or timm.list_models('*vit*'))"
        raise UserError(f"--model {TIMM}{name}: not a timm model; {hint}")
    if tag:
        tags = timm.list_pretrained(f"{arch}.*")
        if name not in tags:
            raise UserError(f"--model {TIMM}{name}: timm has no pretrained tag {tag!r} for {arch}; "
                            f"{'its tags: ' + ', '.join(tags) if tags else 'it has none: give ' + TIMM + arch}")


def pretrained_config(name: str) -> dict[str, Any]:
    """timm's registry's pretrained config of NAME[.TAG] (its default tag without one); {} where it has none."""
    from timm.models import get_pretrained_cfg

    config = get_pretrained_cfg(name)
    return config.to_dict() if config is not None else {}


def data_config(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The part of a pretrained config that says how the weights' images were prepared, and where
    it came from: plain values, for the banner, the checkpoint and export.py's JSON."""
    kept = {key: list(config[key]) if isinstance(config[key], (tuple, list)) else config[key]
            for key in DATA_CONFIG if config.get(key) is not None}
    return {**kept, "source": source} if kept else {}


# --- the weights' files ------------------------------------------------------------------------------------

def hub_file(name: str) -> tuple[str, str]:
    """The Hub repository and file of NAME[.TAG]'s pretrained weights, as timm's registry names them."""
    config = pretrained_config(name)
    repo = config.get("hf_hub_id")
    if not repo:
        raise UserError(f"--weights DEFAULT: timm has no Hugging Face Hub weights for {TIMM}{name}"
                        f"{' (only ' + config['url'] + ')' if config.get('url') else ''}; download them and give "
                        "the file (--weights FILE)")
    return repo, config.get("hf_hub_filename") or HUB_FILE


def offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def read_hub_weights(name: str, allow_download: bool, say: Callable[[str], None]) -> bytes:
    """NAME[.TAG]'s Hub file from the Hugging Face cache, downloaded into it first when it is missing
    and both HF_HUB_OFFLINE and --no-download allow it. Raises UserError naming the file and where
    to put it."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    repo, file = hub_file(name)
    cached = try_to_load_from_cache(repo, file)
    if not isinstance(cached, str):
        cache = constants.HF_HUB_CACHE
        why = "HF_HUB_OFFLINE is set" if offline() else "--no-download is set" if not allow_download else ""
        way_out = (f"on a machine with network run `hf download {repo} {file}` and copy its "
                   f"{Path(cache) / ('models--' + repo.replace('/', '--'))} folder into {cache} here (or set "
                   f"HF_HUB_CACHE to a folder that holds it), or `hf download {repo} --local-dir DIR` and give "
                   "--weights local-dir:DIR")
        if why:
            raise UserError(f"--weights DEFAULT: {file} of {repo} is not in the Hugging Face cache {cache} and {why}; "
                            f"{way_out}")
        say(f"downloading {file} of {repo} into the Hugging Face cache {cache}")
        try:
            cached = hf_hub_download(repo, file)
        except Exception as e:  # noqa: BLE001 - the network, the Hub, the file system: the same way out
            raise UserError(f"--weights DEFAULT: {file} of {repo} is not in the Hugging Face cache {cache} and "
                            f"downloading it failed ({first_line(e)}); {way_out}") from None
    return read_file(Path(cached), "DEFAULT", f"delete it and download it again (`hf download {repo} {file} "
                     "--force-download`)")


def read_file(path: Path, flag: str, again: str) -> bytes:
    """The weights file's bytes; a safetensors file whose header does not cover it (a download cut
    short) is refused here, naming the file, where the way out (`again`: how to download it again) is
    known. Raises UserError naming --weights FLAG."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"--weights {flag}: reading {path} failed ({first_line(e)}); make it readable") from None
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            safe_open(str(path), framework="pt").keys()
        except (SafetensorError, OSError) as e:
            raise UserError(f"--weights {flag}: {path} is truncated or not a safetensors file ({first_line(e)}); "
                            f"{again}") from None
    return data


def local_dir_file(folder: str) -> Path:
    """The weights file of a local-dir folder (the first of WEIGHT_FILES it holds)."""
    root = Path(os.path.expanduser(folder))
    if not root.is_dir():
        raise UserError(f"--weights {LOCAL_DIR}{folder}: no such folder; give the folder `hf download REPO "
                        "--local-dir FOLDER` wrote (its model.safetensors and config.json)")
    found = next((root / name for name in WEIGHT_FILES if (root / name).is_file()), None)
    if found is None:
        raise UserError(f"--weights {LOCAL_DIR}{folder}: the folder holds none of {', '.join(WEIGHT_FILES)}; put the "
                        "weights file there (`hf download REPO --local-dir FOLDER` writes model.safetensors)")
    return found


def local_dir_config(folder: str, arch: str = "") -> dict[str, Any]:
    """The pretrained config in a local-dir folder's config.json (timm's layout: its "pretrained_cfg"
    entry, or the file itself); {} without the file. arch: --model's timm architecture (no tag), which
    the file's "architecture" must name where it names one; "" for another kind of model."""
    path = Path(os.path.expanduser(folder)) / "config.json"
    if not path.is_file():
        return {}
    way_out = "give timm's config.json, or delete it to normalize with the data set's statistics"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--weights {LOCAL_DIR}{folder}: {path} does not read as JSON ({first_line(e)}); "
                        f"{way_out}") from None
    pretrained = config.get("pretrained_cfg", config) if isinstance(config, dict) else None
    if not isinstance(pretrained, dict):
        raise UserError(f"--weights {LOCAL_DIR}{folder}: {path} holds no pretrained config; give timm's config.json")
    named = config.get("architecture")
    if arch and isinstance(named, str) and named != arch:
        raise UserError(f"--weights {LOCAL_DIR}{folder}: {path} is the config of {named}, not of --model {TIMM}{arch}: "
                        f"its mean and std are not this model's; give the folder of {arch}'s weights, or --model "
                        f"{TIMM}{named} if they are {named}'s")
    if problem := data_config_problem(pretrained):
        raise UserError(f"--weights {LOCAL_DIR}{folder}: {path}: {problem}; {way_out}")
    return pretrained


def data_config_problem(config: dict[str, Any]) -> str | None:
    """What makes a config.json's data config unusable (it normalizes every image), or None: a mean
    without a std, either not 1 or 3 finite numbers, a std that is not positive (a division by zero),
    an input size that is not 3 positive integers, a crop fraction that is not a positive number."""
    def numbers(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               and math.isfinite(v) for v in value)
    mean, std = config.get("mean"), config.get("std")
    if (mean is None) != (std is None):
        return f"its {'mean' if std is None else 'std'} comes without its {'std' if std is None else 'mean'}"
    if mean is not None and not (numbers(mean) and numbers(std) and len(mean) == len(std) in (1, 3)):
        return f"mean {json.dumps(mean)} and std {json.dumps(std)} are not two lists of 1 or 3 numbers"
    if std is not None and min(std) <= 0:
        return f"std {json.dumps(std)} is not positive (images are divided by it)"
    size = config.get("input_size")
    if size is not None and not (numbers(size) and len(size) == 3 and all(isinstance(v, int) and v > 0 for v in size)):
        return f"input_size {json.dumps(size)} is not [channels, height, width]"
    crop = config.get("crop_pct")
    if crop is not None and not (numbers([crop]) and crop > 0):
        return f"crop_pct {json.dumps(crop)} is not a positive fraction"
    return None


def filtered(weights: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights as timm itself would load them into this model: its model family's
    checkpoint_filter_fn (a ViT's position embeddings resampled to this image size, older layouts
    renamed), where the family has one."""
    module = sys.modules.get(type(model).__module__)
    filter_fn = getattr(module, "checkpoint_filter_fn", None)
    if filter_fn is None or not type(model).__module__.startswith("timm."):
        return weights
    try:
        return filter_fn(dict(weights), model)
    except Exception as e:  # noqa: BLE001 - weights of another architecture: fit() names the first tensor
        raise UserError(f"--weights: timm's conversion of the weights for {type(model).__name__} failed "
                        f"({first_line(e, with_type=True)}); give weights of this model") from None


# --- layer decay --------------------------------------------------------------------------------------------

def layer_scales(model: nn.Module, decay: float) -> dict[str, float]:
    """Each parameter's multiple of the lr under timm's layer-wise decay (BEiT's rule, timm's
    param_groups_layer_decay): decay ** (layers - 1 - depth), the head at 1. Names as
    model.named_parameters() gives them. Raises UserError for a model timm cannot group by depth."""
    from timm.models import group_parameters
    from timm.optim._param_groups import auto_group_layers

    if hasattr(model, "group_matcher"):
        layers = group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    else:
        layers = auto_group_layers(model)
    last = max(layers.values(), default=0)
    if last == 0:
        raise UserError(f"--layer-decay: timm puts every parameter of {type(model).__name__} in one layer, so the "
                        "decay would change nothing; drop the flag")
    return {name: decay ** (last - layers.get(name, last)) for name, _ in model.named_parameters()}
