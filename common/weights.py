"""--weights SOURCE: a run that starts from trained weights instead of a fresh initialization.

SOURCE is one of:
- for --model torchvision:NAME, a weights name of torchvision's registry (all capitals: DEFAULT,
  IMAGENET1K_V1, ...), read from the torch hub cache ($TORCH_HOME/hub/checkpoints/<its file name>,
  where torchvision keeps it), and downloaded into it first when it is missing (not with --no-download);
- for --model timm:NAME[.TAG], DEFAULT: timm's pretrained weights of that tag (its default tag
  without one), read from the Hugging Face cache, and downloaded into it first when missing (not with
  HF_HUB_OFFLINE or --no-download) (common/timm_models.py);
- for any model, `local-dir:FOLDER`: a folder as `hf download REPO --local-dir FOLDER` writes it
  (model.safetensors, and timm's config.json, whose pretrained config comes with the weights);
- for any model, a file or URL (s3:// and every store --data-dir takes) of a state dict or of a
  checkpoint of this suite (its model only: the optimizer and the schedule start fresh).

How a run takes them (load_weights, common/train/app.py):
1. Rank 0 reads the file, within --storage-timeout-s, while the other ranks wait on the store; the
   bytes are then broadcast to every rank, as a resumed checkpoint's are. So the file is fetched once
   per job (never once per rank), the other nodes need neither the file nor a network, and every
   rank loads the same bytes.
2. Every rank loads them with torch.load(weights_only=True) (a file that carries pickled code is
   refused unread), strips the prefixes that DDP ('module.') and torch.compile ('_orig_mod.') add,
   and fits them to the model built for this data set: every tensor must fit, except the classifier
   head (the layer that makes the logits), which is left whole as the model built it, seeded by
   --seed and the same on every rank, when the weights' head has another shape (another number of
   classes) or the weights have none.
   For torchvision's and timm's models on images of another channel count, the RGB first
   convolution's weights are spread over the channels as the model's own were (common/models.py,
   adapt_first_conv). timm's weights first pass timm's own conversion for their model family (a
   ViT's position embeddings resampled to this image size).
3. The weights go into the plain model before the strategy wraps it: wrap() starts every rank from
   rank 0's weights and shards them (ZeRO-1, FSDP2) as it does a fresh model's.
4. Weights that carry their own input normalization are fed images normalized their way, not with
   the data set's measured statistics: torchvision's, given by name or as a file of its registry
   (a path such as resnet18-f37072fd.pth, what an offline cluster downloads: recognized by its file
   name, or by its content's sha256 when renamed, as torch.hub's file names carry its first digits).
   --normalization chooses otherwise: data (the set's statistics) or imagenet (ImageNet's mean and
   std, for weights trained on ImageNet elsewhere). timm's weights (DEFAULT, or a local-dir folder
   with timm's config.json) bring their pretrained data config: its mean and std normalize the
   images, and the whole config (input size, crop fraction, interpolation too) is kept in the
   checkpoint and export.py's JSON. The banner says which was used.

The file's content joins the run's identity: --weights becomes SOURCE@sha256:HEX (the first
DIGEST_CHARS hex digits of its sha256), so a changed file starts a new run instead of resuming one
trained from other weights. SOURCE@sha256:HEX may be given too: the file must then have that content.

A cached hub file is trusted as torch.hub trusts it (its hash prefix, the file name's '-HEX.', is
checked when it is downloaded, not at every use): a file put there by hand, such as weights built
for a test, is read as it is.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

import torch
from torch import nn

from common.errors import UserError, first_line
from common.models import AUXILIARY_HEADS, TORCHVISION, spread_rgb
from common.storage import StorageError, is_url, split, storage_for, url_problem
from common.timm_models import (
    LOCAL_DIR,
    TIMM,
    data_config,
    filtered,
    local_dir_config,
    local_dir_file,
    pretrained_config,
    read_file,
    read_hub_weights,
)

Say = Callable[[str], None]

NAME = re.compile(r"[A-Z][A-Z0-9_]*")  # torchvision's weights names; a file of such a name is ./NAME
PIN = re.compile(r"(?P<source>.+)@sha256:(?P<digest>[0-9a-f]{8,64})")
DIGEST_CHARS = 16  # of the sha256 in the run's identity: 64 bits tell any two files apart
PREFIXES = ("module.", "_orig_mod.")  # DDP's and DataParallel's wrapper, torch.compile's
# torchvision builds these with transform_input=True when it loads their weights: the weights expect
# pixels normalized by 0.5 and 0.5, which is what that transform turns ImageNet's normalization into.
HALF_NORMALIZED = ("googlenet", "inception_v3")
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # torchvision's and timm's ImageNet statistics
NORMALIZATIONS = ("auto", "data", "imagenet")  # --normalization
Stats = tuple[tuple[float, ...], tuple[float, ...]]


@dataclass(frozen=True)
class Source:
    """A --weights flag: where the weights are, and the content they must have if it says."""

    text: str  # as given, without the pin
    pin: str  # "" or the leading hex digits of the sha256 the file must have
    model: str  # --model

    @classmethod
    def parse(cls, flag: str, model: str) -> Source:
        pinned = PIN.fullmatch(flag)
        return cls(pinned["source"], pinned["digest"], model) if pinned else cls(flag, "", model)

    @property
    def where(self) -> str:
        """The source as the run's identity names it: a local file by its absolute path, so the same
        file given from another folder is the same run."""
        if self.is_name or is_url(self.text):
            return self.text
        if self.is_local_dir:
            return LOCAL_DIR + os.path.abspath(os.path.expanduser(self.folder))
        return os.path.abspath(os.path.expanduser(self.text))

    @property
    def is_name(self) -> bool:
        return bool(NAME.fullmatch(self.text))

    @property
    def is_local_dir(self) -> bool:
        return self.text.startswith(LOCAL_DIR)

    @property
    def folder(self) -> str:
        return self.text.removeprefix(LOCAL_DIR)

    @property
    def timm_model(self) -> str:
        return self.model.removeprefix(TIMM) if self.model.startswith(TIMM) else ""

    @property
    def adapts_rgb(self) -> bool:
        """Whether RGB weights are spread over another channel count, as the model's builder does."""
        return bool(self.torchvision_model or self.timm_model)

    @property
    def torchvision_model(self) -> str:
        return self.model.removeprefix(TORCHVISION) if self.model.startswith(TORCHVISION) else ""

    def problem(self) -> str | None:
        """What is wrong with the flag, found from the flags alone (torchvision's registry for a
        name), or None. The file itself is read only when the run starts."""
        if not self.is_name:
            return f"cannot be read here: {problem}" if (problem := url_problem(self.text)) else None
        if self.timm_model:
            return None if self.text == "DEFAULT" else (
                f"is not a timm weights name: timm chooses weights by the model's tag; give --model "
                f"{TIMM}NAME.TAG --weights DEFAULT (timm.list_pretrained('{self.timm_model.partition('.')[0]}.*') "
                "lists the tags)")
        if not self.torchvision_model:
            return (f"is a torchvision weights name, for --model torchvision:NAME; for --model {self.model} give the "
                    "file or URL of a state dict or of a checkpoint of this suite (./NAME for a file of that name)")
        names = weights_names(self.torchvision_model)
        if names is not None and self.text not in names:  # an unknown model: --model's own error names it
            return f"is not a weights name of {self.model}; choose one of {', '.join(names)}"
        return None

    def registry_entry(self) -> Any:
        """torchvision's weights enum member for a name."""
        import torchvision.models as tv

        return tv.get_model_weights(self.torchvision_model)[self.text]

    def torchvision_entry(self, digest: str) -> Any | None:
        """torchvision's registry entry these weights are, or None: a name's own entry, or for a file
        the entry whose file name it has (torch.hub's, e.g. resnet18-f37072fd.pth) or whose file name's
        hash prefix its content's sha256 (`digest`) starts with (the same file renamed)."""
        if self.is_name and self.torchvision_model:
            return self.registry_entry()
        if not self.torchvision_model or weights_names(self.torchvision_model) is None:
            return None
        import torchvision.models as tv

        name = Path(urlparse(self.text).path).name
        for entry in tv.get_model_weights(self.torchvision_model):
            file = Path(urlparse(entry.url).path).name
            prefix = torch.hub.HASH_REGEX.search(file)
            if file == name or (prefix and digest.startswith(prefix[1])):
                return entry
        return None

    def read(self, options: dict[str, Any], allow_download: bool, say: Say) -> bytes:
        """The file's bytes (rank 0's work). Raises UserError naming --weights."""
        if self.is_name and self.timm_model:
            return read_hub_weights(self.timm_model, allow_download, say)
        if self.is_name:
            return self._read_hub_file(allow_download, say)
        if self.is_local_dir:
            return read_file(local_dir_file(self.folder), self.text, "download it again (`hf download REPO "
                             f"--local-dir {self.folder}`)")
        parent, name = split(self.text)
        try:
            return storage_for(parent, options).read(name)
        except StorageError as e:
            raise UserError(f"--weights {e}; give the path or URL of a weights file (and for a store, check "
                            "the credentials)") from None

    def data_config(self) -> dict[str, Any]:
        """The pretrained data config that comes with the weights (rank 0's work, with read()): timm's
        registry's for DEFAULT, a local-dir folder's config.json; {} for other sources."""
        if self.is_name and self.timm_model:
            config = pretrained_config(self.timm_model)
            return data_config(config, f"timm's pretrained config of {config.get('hf_hub_id') or self.timm_model}")
        if self.is_local_dir:
            path = os.path.join(self.where.removeprefix(LOCAL_DIR), "config.json")
            arch = self.timm_model.partition(".")[0]
            return data_config(local_dir_config(self.folder, arch), f"the pretrained config in {path}")
        return {}

    def _read_hub_file(self, allow_download: bool, say: Say) -> bytes:
        entry = self.registry_entry()
        path = hub_path(entry.url)
        if not path.is_file():
            fetch_into_hub(self.text, entry.url, path, allow_download, say)
        try:
            return path.read_bytes()
        except OSError as e:
            raise UserError(f"--weights {self.text}: reading {path} failed ({first_line(e)}); make it readable or "
                            f"delete it to download it again") from None


def normalization(choice: str, entry: Any | None, model: str, channels: int, pretrained: dict[str, Any] | None = None,
                  ) -> tuple[Stats | None, str]:
    """The mean and std images are normalized with (None: the data set's statistics), and the banner's
    words for it. choice: --normalization; entry: torchvision's registry entry the weights are, if any;
    pretrained: the data config that came with the weights (timm's), if any."""
    if choice == "data":
        return None, "images normalized with the data set's statistics (--normalization data)"
    if choice == "imagenet":
        stats, words = IMAGENET, "ImageNet's mean and std (--normalization imagenet)"
    elif pretrained and "mean" in pretrained and "std" in pretrained:
        stats, words = (tuple(pretrained["mean"]), tuple(pretrained["std"])), pretrained["source"]
    else:
        stats = entry_statistics(entry, model.removeprefix(TORCHVISION)) if entry is not None else None
        if stats is None:
            return None, ("images normalized with the data set's statistics: the weights carry none of their own "
                          "(for weights trained on ImageNet elsewhere, pass --normalization imagenet)")
        words = f"the statistics {type(entry).__name__}.{entry.name} was trained with, not the data set's"
    mean, std = stats
    if len(mean) != channels:  # the channels' average for another count than the weights' own
        mean, std = (sum(mean) / len(mean),) * channels, (sum(std) / len(std),) * channels
    shown = [",".join(f"{v:.4g}" for v in values) for values in (mean, std)]
    return (tuple(mean), tuple(std)), f"images normalized with {words} (mean {shown[0]}, std {shown[1]})"


def entry_statistics(entry: Any, model: str) -> Stats | None:
    """The mean and std (RGB) a torchvision registry entry's weights were trained with, or None."""
    if model in HALF_NORMALIZED:
        return (0.5,) * 3, (0.5,) * 3
    transform = entry.transforms()
    mean, std = getattr(transform, "mean", None), getattr(transform, "std", None)
    return (tuple(mean), tuple(std)) if mean is not None and std is not None else None


def weights_problem(flag: str, model: str) -> str | None:
    """For common/config.py: the flag's problem found from the flags alone, or None."""
    return Source.parse(flag, model).problem() if flag else None


def weights_names(model: str) -> list[str] | None:
    """The weights names torchvision's registry has for one of its classification models, DEFAULT
    first; None if `model` is not one of them."""
    import torchvision.models as tv

    if model not in tv.list_models(module=tv):
        return None
    members = list(tv.get_model_weights(model).__members__)
    return ["DEFAULT", *(name for name in members if name != "DEFAULT")]


# --- the torch hub cache -------------------------------------------------------------------------------

def hub_path(url: str) -> Path:
    """Where torch.hub (and so torchvision) keeps the file of `url`."""
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(url).path).name


def fetch_into_hub(name: str, url: str, path: Path, allow_download: bool, say: Say) -> None:
    """Download `url` into the hub cache with torch.hub's own downloader: a temp file of a unique
    name, renamed into place once its sha256 matches the hash prefix in the file name, so processes
    that share the cache never see half a file. A stalled download is bounded by --storage-timeout-s,
    the deadline of rank 0's read."""
    missing = f"{path.name} is not in the torch hub cache {path.parent}"
    way_out = f"download {url} into {path.parent} (or set TORCH_HOME to a folder whose hub/checkpoints holds it)"
    if not allow_download:
        raise UserError(f"--weights {name}: {missing} and --no-download is set; {way_out}")
    hash_prefix = torch.hub.HASH_REGEX.search(path.name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        say(f"downloading {url} into {path.parent}")
        torch.hub.download_url_to_file(url, str(path), hash_prefix[1] if hash_prefix else None, progress=False)
    except Exception as e:  # noqa: BLE001 - urllib, the file system, a hash mismatch: the same way out
        raise UserError(f"--weights {name}: {missing} and downloading it failed ({first_line(e)}); "
                        f"{way_out}") from None


# --- reading and fitting, on every rank ------------------------------------------------------------------

def parse_weights(data: bytes, source: str) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict in a file's bytes (a checkpoint's model), with what the file was, for the
    banner. Raises UserError for a file that is not one, or that carries objects other than plain data."""
    if not data:
        raise UserError(f"--weights {source} is empty; give a state dict saved with torch.save(model.state_dict(), "
                        "FILE) or a checkpoint of this suite")
    unusable = f"--weights {source} is truncated or not a file torch.save writes ({len(data)} bytes"
    if data[8:9] == b"{":  # safetensors: an 8-byte header length, then the header's JSON
        return parse_safetensors(data, source), "a safetensors file"
    if not (zipfile.is_zipfile(io.BytesIO(data)) or data[:1] == b"\x80"):  # torch.save's zip, or its legacy pickle
        raise UserError(f"{unusable}); give a state dict saved with torch.save(model.state_dict(), FILE) or a "
                        "checkpoint of this suite")
    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = next((line.split("error:", 1)[1].split(". ")[0].strip() for line in str(e).splitlines()
                       if "Unpickler error:" in line), "")
        raise UserError(f"--weights {source} holds objects that are not plain data and was refused unread"
                        f"{f' ({reason})' if reason else ''}; save the weights alone: torch.save(model.state_dict(), "
                        "FILE)") from None
    except Exception as e:  # noqa: BLE001 - any failure to parse untrusted bytes means "unusable"
        raise UserError(f"{unusable}: {type(e).__name__}: {first_line(e)})") from None
    what = "a state dict"
    if isinstance(loaded, dict) and isinstance(loaded.get("model"), dict):
        what = (f"the model of a checkpoint of this suite at step {loaded['global_step']}, without its optimizer "
                "and schedule" if "identity" in loaded and "global_step" in loaded else "its 'model' entry")
        loaded = loaded["model"]
    if not isinstance(loaded, dict) or not loaded:
        held = "an empty dict" if isinstance(loaded, dict) else f"a {type(loaded).__name__}"
        raise UserError(f"--weights {source} holds {held}, not a state dict; save one with "
                        "torch.save(model.state_dict(), FILE)")
    key, value = next(((k, v) for k, v in loaded.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))),
                      (None, None))
    if key is not None:
        raise UserError(f"--weights {source} is not a state dict: its entry {str(key)[:60]!r} is a "
                        f"{type(value).__name__}, not a tensor; save one with torch.save(model.state_dict(), FILE)")
    return {strip_prefixes(k): v for k, v in loaded.items()}, what


def parse_safetensors(data: bytes, source: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (export.py writes them): plain data by design, no code."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        loaded = load(data)
    except (SafetensorError, ValueError) as e:
        raise UserError(f"--weights {source} is not a safetensors file that reads ({first_line(e)}); give it again, or "
                        "a state dict saved with torch.save(model.state_dict(), FILE)") from None
    if not loaded:
        raise UserError(f"--weights {source} holds no tensor")
    return {strip_prefixes(k): v for k, v in loaded.items()}


def strip_prefixes(key: str) -> str:
    """A key of the plain model, from one saved through DDP, DataParallel or torch.compile."""
    while key.startswith(PREFIXES):
        key = next(key[len(p):] for p in PREFIXES if key.startswith(p))
    return key


def head_keys(model: nn.Module) -> set[str]:
    """The state-dict keys of the classifier's output layer: the module that holds the model's last
    parameter (resnet's fc, lenet's last Linear, squeezenet's last convolution)."""
    last = next(reversed([name for name, _ in model.named_parameters()]), None)
    if last is None:
        return set()
    prefix = last.rpartition(".")[0]
    prefix += "." if prefix else ""
    return {key for key in model.state_dict() if key.startswith(prefix) and "." not in key[len(prefix):]}


@dataclass(frozen=True)
class Fitted:
    """The weights as the model takes them, and what was left out or changed on the way."""

    state: dict[str, torch.Tensor]
    replaced: tuple[str, ...]  # the head's tensors kept as the model built them
    unused: tuple[str, ...]  # the weights' tensors of auxiliary heads that this model does not have
    adapted: tuple[str, ...]  # RGB first-convolution weights spread over this data set's channels
    head_shapes: str  # "(1000, 512) in the weights, (10, 512) here", or "not in the weights"


def fit(weights: dict[str, torch.Tensor], model: nn.Module, source: Source, channels: int) -> Fitted:
    """Match the weights to the model, tensor by tensor. Raises UserError naming the first tensor
    that does not fit: weights of another architecture. A head of another shape (or none) is left
    whole as the model built it."""
    expected, head = model.state_dict(), head_keys(model)
    auxiliary = AUXILIARY_HEADS.get(source.torchvision_model, ())
    differing = [k for k in expected if k in head and k in weights and weights[k].shape != expected[k].shape]
    keep_head = bool(differing) or any(k not in weights for k in head if not k.endswith("num_batches_tracked"))

    def mismatch(detail: str) -> UserError:
        return UserError(f"--weights {source.text} does not fit --model {source.model}: {detail} (weights of another "
                         f"architecture?); give weights of {source.model}")
    state, unused, adapted = {}, [], []
    for key, tensor in weights.items():
        if key in head and keep_head:
            continue
        if key not in expected:
            if key.startswith(auxiliary):
                unused.append(key)
                continue
            raise mismatch(f"the weights hold {key} {tuple(tensor.shape)}, which the model does not have")
        want = expected[key].shape
        if problem := value_problem(tensor, expected[key]):
            raise UserError(f"--weights {source.text}: {key} {problem}; give weights that trained without diverging, "
                            "saved as the model holds them")
        if tensor.shape == want:
            state[key] = tensor
        elif source.adapts_rgb and channels != 3 and tensor.dim() == 4 and tensor.shape[1] == 3 and \
                (tensor.shape[0], *tensor.shape[2:]) == (want[0], *want[2:]):
            state[key] = spread_rgb(tensor, channels)
            adapted.append(key)
        else:
            raise mismatch(f"{key} is {tuple(tensor.shape)} in the weights and {tuple(want)} in the model")
    # BatchNorm's step counter is missing from old files; the model keeps its own (it only counts).
    lacking = [k for k in expected if k not in weights and k not in head and not k.endswith("num_batches_tracked")]
    if lacking:
        raise mismatch(f"the weights lack {lacking[0]}{f' and {len(lacking) - 1} more' if len(lacking) > 1 else ''}")
    shapes = f"{tuple(weights[differing[0]].shape)} in the weights, {tuple(expected[differing[0]].shape)} here" \
        if differing else "not in the weights"
    replaced = tuple(k for k in expected if k in head) if keep_head else ()
    return Fitted(state, replaced, tuple(unused), tuple(adapted), shapes)


def value_problem(tensor: torch.Tensor, expected: torch.Tensor) -> str | None:
    """What would make a tensor of the right shape wrong: integers for a float parameter (they
    would be cast silently), NaN or infinite values."""
    if tensor.is_floating_point() != expected.is_floating_point():
        have, want = (str(t.dtype).removeprefix("torch.") for t in (tensor, expected))
        return f"is {have} where the model holds {want}"
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        return "holds NaN or infinite values"
    return None


@dataclass(frozen=True)
class Loaded:
    """What --weights put into the model: its pinned flag for the run's identity, and the banner."""

    flag: str  # SOURCE@sha256:HEX
    what: str  # where it came from and what it was
    fitted: Fitted
    normalization: Stats | None  # the mean and std images are normalized with; None: the data set's
    normalized: str  # the banner's words for it
    seed: int
    pretrained: dict[str, Any]  # the data config that came with the weights (timm's); {} for none

    def banner(self) -> str:
        f = self.fitted
        notes = [f"{len(f.state)} tensors loaded"]
        if f.replaced:
            notes.append(f"not loaded: {', '.join(f.replaced)} (the head, {f.head_shapes}: initialized afresh from "
                         f"--seed {self.seed})")
        if f.unused:
            notes.append(f"{len(f.unused)} tensors of auxiliary heads unused (the model is built without them)")
        if f.adapted:
            notes.append(f"{', '.join(f.adapted)}: RGB weights spread over this data set's channels")
        notes.append(self.normalized)
        if shown := ", ".join(f"{k} {v}" for k, v in self.pretrained.items() if k not in ("mean", "std", "source")):
            notes.append(f"pretrained at {shown} (--image-size chooses this run's input size)")
        return f"weights {self.flag} ({self.what}): {'; '.join(notes)}"


def pinned_config(source: Source, pretrained: dict[str, Any] | None) -> bytes:
    """What of a local-dir folder besides its weights joins their digest: the data config its
    config.json gives (mean, std, crop, interpolation), so an edited config.json starts a new run
    instead of resuming one normalized otherwise. Other sources' configs come with the code (timm's
    registry, torchvision's entries): b""."""
    if not (source.is_local_dir and pretrained):
        return b""
    return json.dumps({k: v for k, v in pretrained.items() if k != "source"}, sort_keys=True).encode()


def load_into(model: nn.Module, data: bytes, source: Source, channels: int, seed: int,
              choice: str = "auto", pretrained: dict[str, Any] | None = None) -> Loaded:
    """The file's bytes into the plain model (on every rank, the same bytes): checked against a pinned
    digest, parsed, fitted and loaded; with the normalization --normalization (`choice`) gives them.
    pretrained: the data config that came with them (Source.data_config, rank 0's, broadcast)."""
    digest = hashlib.sha256(data + pinned_config(source, pretrained)).hexdigest()
    if source.pin and not digest.startswith(source.pin):
        raise UserError(f"--weights {source.text}@sha256:{source.pin}: the file's sha256 is {digest[:len(source.pin)]}"
                        "...: its content changed since that run started from it; give the file it was, or "
                        f"--weights {source.text} for a new run from this one")
    weights, what = parse_weights(data, source.text)
    if source.timm_model:
        weights = filtered(weights, model)
    fitted = fit(weights, model, source, channels)
    model.load_state_dict(fitted.state, strict=False)  # fit() checked every key: only the head may stay as built
    entry = source.torchvision_entry(digest)
    if source.is_name and source.timm_model:
        what = f"timm's pretrained {source.timm_model}, {what} from the Hugging Face cache"
    elif source.is_name:
        what = f"torchvision {type(entry).__name__}.{entry.name}, {hub_path(entry.url)}"
    elif entry is not None:
        what += f", torchvision's {type(entry).__name__}.{entry.name} file"
    stats, normalized = normalization(choice, entry, source.model, channels, pretrained)
    return Loaded(f"{source.where}@sha256:{digest[:DIGEST_CHARS]}", what, fitted, stats, normalized, seed,
                  pretrained or {})


def add_weights_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flags of this module: the weights to start from and their normalization."""
    add = group.add_argument
    add("--weights", default="", metavar="SOURCE",
        help="start from trained weights: for torchvision:NAME a weights name of its registry (DEFAULT, "
             "IMAGENET1K_V1, ...), read from the torch hub cache; for timm:NAME[.TAG] DEFAULT, timm's pretrained "
             "weights of that tag, read from the Hugging Face cache (HF_HUB_OFFLINE honoured); for any model "
             "local-dir:FOLDER (what `hf download REPO --local-dir FOLDER` writes), or a file or URL of a state "
             "dict or of a checkpoint of this suite (its weights only). A head of another shape is replaced "
             "(docs/recipes.md)")
    add("--normalization", default="auto", choices=NORMALIZATIONS,
        help="with --weights, the mean and std images are normalized with: auto (the weights' own where they are "
             "torchvision's, by name or as a file of its registry, found by its name or its content; timm's "
             "pretrained config for DEFAULT or a local-dir folder; else the data set's statistics), data (the data "
             "set's), imagenet (ImageNet's, for weights trained on it elsewhere) (default: %(default)s)")


def check_weights_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.normalization != "auto" and not a.weights:
        p.error(f"--normalization {a.normalization} chooses how images are normalized for --weights; without "
                "--weights the data set's statistics are used: drop it or give --weights")
    if problem := weights_problem(a.weights, a.model):
        p.error(f"--weights {a.weights} {problem}")
