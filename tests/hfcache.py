"""Pretrained weights of a timm model, written where the real ones are kept: a Hugging Face cache laid
out as huggingface_hub lays it out (`hf download timm/NAME` writes models--timm--NAME/refs/main, the
revision, and snapshots/REVISION/model.safetensors), for tests that read them with HF_HUB_OFFLINE set.
Nothing is downloaded: the weights are timm's own architecture, initialized here."""
from __future__ import annotations

from pathlib import Path

import torch

REVISION = "0123456789abcdef0123456789abcdef01234567"


def pretrained_state(name: str, seed: int = 11) -> dict[str, torch.Tensor]:
    """Weights of timm's NAME for its 1000 ImageNet classes at its pretrained size, as the Hub's are."""
    import timm

    torch.manual_seed(seed)
    return {k: v.contiguous() for k, v in timm.create_model(name, pretrained=False).state_dict().items()}


def hub_cache(root: Path, name: str, state: dict[str, torch.Tensor]) -> Path:
    """NAME's weights in a Hugging Face cache at `root`, where `hf download timm/NAME` puts them."""
    from safetensors.torch import save_file

    folder = root / f"models--timm--{name}"
    snapshot = folder / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(REVISION)
    save_file(state, snapshot / "model.safetensors")
    return snapshot / "model.safetensors"
