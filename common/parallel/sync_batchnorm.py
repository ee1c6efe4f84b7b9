"""BatchNorm over the global batch, for every device and strategy.

With W ranks, plain BatchNorm normalizes each rank's B/W images by their own mean and variance,
so the network computes something else than one process on B images. Synchronized statistics
fix that. torch's nn.SyncBatchNorm does it only for CUDA modules under DDP; this one uses the
differentiable all_reduce of torch.distributed.nn, so it also runs on CPU (gloo) and under the
hand-written strategies. Two passes (mean, then squared deviations) keep float32 accurate.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn


def add_sync_bn_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flag of convert_batchnorm."""
    group.add_argument("--sync-bn", action="store_true",
                       help="BatchNorm statistics over the global batch instead of each rank's share (one all-reduce "
                            "per layer)")


class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2-d input, got {x.dim()}-d")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or dist.get_world_size() == 1:
            return super().forward(x)
        # Statistics in float32 whatever the input (bf16 under autocast or FSDP's bf16 policy), as
        # autocast runs batch_norm; the output keeps the input's dtype, as nn.BatchNorm's does.
        with torch.autocast(x.device.type, enabled=False):
            return self._normalize(x.float()).to(x.dtype)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        # The count is made and used on the device: a host value (new_tensor, .item()) would make
        # the CPU wait for the GPU at every BatchNorm layer of every forward.
        count = dist_fn.all_reduce(torch.full((1,), x.numel() / x.size(1), dtype=x.dtype, device=x.device))
        mean = dist_fn.all_reduce(x.sum(dims)) / count
        centered = x - mean.view(shape)
        var = dist_fn.all_reduce(centered.pow(2).sum(dims)) / count
        self._update_running_stats(mean.detach(), var.detach(), count)
        out = centered / torch.sqrt(var.view(shape) + self.eps)
        return out * self.weight.view(shape) + self.bias.view(shape) if self.affine else out

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        if not self.track_running_stats:
            return
        self.num_batches_tracked += 1
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean, momentum)
        self.running_var.lerp_(var * count / (count - 1).clamp(min=1), momentum)  # unbiased, as nn.BatchNorm


def convert_batchnorm(module: nn.Module) -> nn.Module:
    """Swap every BatchNorm layer for GlobalBatchNorm in place, keeping its weights and buffers."""
    for name, child in module.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            replacement = GlobalBatchNorm(child.num_features, child.eps, child.momentum, child.affine,
                                          child.track_running_stats)
            replacement.load_state_dict(child.state_dict())
            setattr(module, name, replacement)
        else:
            convert_batchnorm(child)
    return module
