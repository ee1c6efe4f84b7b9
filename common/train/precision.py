"""--precision: autocast and loss scaling, shared by the training step and the strategies' step
(the strategies see it only through this class, so neither module imports the other for it)."""
from __future__ import annotations

import argparse
from contextlib import nullcontext
from typing import Any, ContextManager

import torch

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_precision_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flag of Precision."""
    group.add_argument("--precision", default="fp32", choices=tuple(PRECISIONS),
                       help="autocast dtype of forward and loss; fp16 adds loss scaling (default: %(default)s)")


class Precision:
    """--precision: autocast around forward and loss. fp16 also scales the loss (GradScaler), so
    small gradients survive the cast. The strategies synchronize the scaled gradients before the
    scaler looks at them, so every rank sees the same infs and takes the same skip/step decision
    and the same next scale (a check of each rank's own gradients would let replicas drift)."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name, self.dtype, self.device_type = name, PRECISIONS[name], device.type
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def autocast(self) -> ContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype) if self.dtype else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)  # unscales; skips the step if any gradient is inf or nan
            self.scaler.update()
        else:
            optimizer.step()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients at their true size, before they are measured (fp16); the scaler's step then
        does not unscale them again."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def scale(self) -> float:
        return self.scaler.get_scale() if self.scaler else 1.0

    def follow(self, scale: float) -> None:
        """A rank that did not step (master/worker's workers) takes the scale the stepping rank chose."""
        if self.scaler:
            self.scaler.update(new_scale=scale)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
