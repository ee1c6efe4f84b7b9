"""Models for --model MODULE:FUNCTION in tests (tests.tinymodels:NAME), each a shape the built-ins lack."""
from __future__ import annotations

import torch
from torch import nn


class Odd(nn.Module):
    """A frozen first layer (a fine-tuned backbone's): optimizer state is keyed by position in
    model.parameters(), frozen ones included, on every strategy. And a parameter on the root module
    itself, as a ViT's class token: FSDP2 keeps such parameters gathered after a forward without a
    backward (evaluation)."""

    def __init__(self, channels: int, size: int, classes: int) -> None:
        super().__init__()
        self.frozen = nn.Linear(channels * size * size, 32).requires_grad_(False)
        self.token = nn.Parameter(torch.zeros(1, 16))
        self.body = nn.Linear(32, 16)
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(torch.relu(self.frozen(x.flatten(1)))) + self.token))


def odd(channels: int, size: int, classes: int) -> nn.Module:
    return Odd(channels, size, classes)
