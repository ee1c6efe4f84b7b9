"""--check-equivalence K: the strategy and a one-process reference, side by side, must agree.

The reference trains the plain model on the whole global batch (the loader of world 1 yields
exactly the union of the ranks' batches, with the same augmentation) from the same initial weights
with the same optimizer and schedule. This is how PyTorch's own DDP tests prove DDP equals a
single process on the concatenated batch (`_test_DDP_niter`), made a user-facing flag.
"""
from __future__ import annotations

from itertools import count

import torch
from torch import nn

from common.data import TrainLoader
from common.distributed import DistContext
from common.logger import NullLogger
from common.models import build_model
from common.optim import make_optimizer, make_scheduler
from common.run import Run
from common.strategy import Strategy
from common.trainer import train_step

TOLERANCE = 1e-5  # float32 on CPU; the two sides sum the same numbers in a different order


def check_equivalence(run: Run, log: NullLogger) -> None:
    cfg, ctx, data, plain = run.cfg, run.ctx, run.data, run.plain
    reference = build_model(cfg.model, data.spec.channels, data.spec.size, data.spec.classes, cfg.seed).to(ctx.device)
    reference.load_state_dict(plain.state_dict())  # the strategy's starting point, after any broadcast
    ref_optimizer = make_optimizer(cfg, reference)
    ref_scheduler = make_scheduler(cfg, ref_optimizer, run.total_steps)
    whole_batch = TrainLoader(data.train, data.spec, cfg.batch_size, 0, 1, cfg.seed, ctx.device, cfg.max_steps)
    run.model.train()
    reference.train()
    steps = 0
    for epoch in count():
        for (images, labels), (all_images, all_labels) in zip(run.loader.epoch(epoch), whole_batch.epoch(epoch)):
            train_step(run.model, run.strategy, run.optimizer, run.scheduler, images, labels)
            train_step(reference, Strategy(), ref_optimizer, ref_scheduler, all_images, all_labels)
            steps += 1
            if steps == cfg.check_equivalence:
                return _verdict(run.strategy.describe(), ctx, plain, reference, steps, log)


def _verdict(label: str, ctx: DistContext, plain: nn.Module, reference: nn.Module, steps: int,
             log: NullLogger) -> None:
    local = max((a.detach() - b.detach()).abs().max() for a, b in zip(plain.parameters(), reference.parameters()))
    worst = local.reshape(1).to(ctx.comm_device)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    max_dw = worst.item()
    log.info(f"equivalence: max |dw| = {max_dw:.3g} after {steps} steps ({label}, world {ctx.world_size})")
    if not max_dw <= TOLERANCE:  # also catches NaN
        ctx.fail_together(f"equivalence check failed: max |dw| = {max_dw:.3g} > {TOLERANCE:g}; models with "
                          "BatchNorm or dropout differ from one process by design (see README)")
