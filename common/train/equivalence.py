"""--check-equivalence K: the strategy and a one-process reference, side by side, must agree.

The reference trains the plain model on the whole global batch (the loader of world 1 yields
exactly the union of the ranks' batches, with the same augmentation) from the same initial weights
with the same optimizer and schedule. This is how PyTorch's own DDP tests prove DDP equals a
single process on the concatenated batch (`_test_DDP_niter`), made a user-facing flag.
"""
from __future__ import annotations

import argparse
import io
from itertools import count

import torch
from torch import nn

from common.config import Config
from common.data.loader import TrainLoader
from common.models import build_model
from common.output.logger import NullLogger
from common.train.ema import EMA
from common.train.optim import make_scheduler
from common.train.precision import Precision
from common.train.run import Run
from common.train.step import StepRecipe, train_step
from common.train.strategy import Strategy


def add_equivalence_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flag of check_equivalence."""
    group.add_argument("--check-equivalence", type=int, default=0, metavar="K",
                       help="train K steps beside a one-process reference on the same global batches, print max "
                            "|dw|, exit non-zero above 1e-5")


def check_equivalence_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """What cannot pass the check by design: a flag whose run is not one process's over the whole batch."""
    if a.check_equivalence and a.grad_compression == "powersgd":
        p.error("--check-equivalence compares against exact gradient averaging, which PowerSGD approximates on "
                "purpose; drop one of the two flags")
    if a.drop_path and a.check_equivalence:
        p.error("--check-equivalence cannot pass with --drop-path: stochastic depth draws its own masks on each rank, "
                "unlike one process over the whole batch; check without --drop-path")


TOLERANCE = 1e-5  # float32 on CPU; the two sides sum the same numbers in a different order
# (flag, value, bound) where the two sides round differently. Measured max |dw| after 4 steps (lenet,
# global batch 48, world 2): bf16 autocast 1.21e-06, bf16 gradients on the wire 1.56e-06; fp16
# (7.6e-07, 1.2e-07) and --compile (1.5e-08) stay within TOLERANCE.
LOOSER = [("precision", "bf16", 5e-5), ("grad_compression", "bf16", 5e-5)]


def check_equivalence(run: Run, log: NullLogger) -> None:
    cfg, ctx, data = run.cfg, run.ctx, run.data
    if ctx.device.type == "cuda":  # float32 on both sides: cuDNN's default TF32 convolutions keep 10 mantissa bits
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    reference = build_model(cfg.model, data.spec.channels, data.spec.size, data.spec.classes, cfg.seed,
                            cfg.drop_path)
    reference = reference.to(ctx.device, memory_format=run.memory_format)
    reference.load_state_dict(starting_point(run))
    one_process = Strategy()
    ref_optimizer = one_process.make_optimizer(cfg, reference)
    ref_scheduler = make_scheduler(cfg, ref_optimizer, run.steps_per_epoch)
    ref_precision = Precision(cfg.precision, ctx.device)
    ref_ema = EMA(cfg.ema, one_process, reference) if cfg.ema else None
    whole_batch = TrainLoader(data.train, data.spec, cfg.batch_size, 0, 1, cfg.seed, ctx.device, cfg.max_steps,
                              run.memory_format, cfg.augment, cfg.random_erase, lanes=cfg.shard_lanes)
    recipe = StepRecipe.of(cfg, run.class_weights)
    run.model.train()
    reference.train()
    steps = 0
    for epoch in count():
        for step, ((images, labels), (all_images, all_labels)) in enumerate(zip(
                run.mixing.batches(run.loader.epoch(epoch), epoch, 0),
                run.mixing.batches(whole_batch.epoch(epoch), epoch, 0))):
            train_step(run.step_model, run.strategy, run.optimizer, run.scheduler, run.precision, images, labels,
                       recipe, label_scale=run.loader.label_scale(run.class_weights, epoch, step))
            run.strategy.end_of_step(run.model, steps + 1, False)
            # the reference's own scale, from the whole batch it trains: one process's torch weighted mean
            train_step(reference, one_process, ref_optimizer, ref_scheduler, ref_precision, all_images, all_labels,
                       recipe, label_scale=whole_batch.label_scale(run.class_weights, epoch, step))
            steps += 1
            if run.ema:
                run.ema.update(steps)
                ref_ema.update(steps)
            if steps == cfg.check_equivalence:
                return _verdict(run, reference, ref_ema, steps, log)


def starting_point(run: Run) -> dict[str, torch.Tensor]:
    """The strategy's weights after any broadcast, as rank 0 holds them (gathered where sharded),
    on every rank."""
    buffer = io.BytesIO()
    torch.save(run.strategy.model_state(run.model), buffer)
    data = run.ctx.broadcast_bytes(buffer.getvalue() if run.ctx.is_primary else None)
    return torch.load(io.BytesIO(data), map_location=run.ctx.device, weights_only=True)


def tolerance(cfg: Config) -> float:
    """1e-5 where the maths is the same (float32: the two sides only sum in another order); looser,
    measured bounds where a recipe rounds differently on the two sides (docs/recipes.md, the
    equivalence table of the recipes)."""
    return max([TOLERANCE, *(bound for key, value, bound in LOOSER if getattr(cfg, key) == value)])


def _verdict(run: Run, reference: nn.Module, ref_ema: EMA | None, steps: int, log: NullLogger) -> None:
    """The strategy's model as saved (gathered from its shards where sharded: on rank 0) against
    the reference, parameter by parameter, and so the EMAs with --ema; the worst over ranks."""
    ctx, bound = run.ctx, tolerance(run.cfg)
    gap = _gap(run.strategy.model_state(run.model), reference)
    if ref_ema:
        with ref_ema.swapped():
            gap_ema = _gap(run.ema.state(), reference)
        gap = torch.maximum(gap, gap_ema)
    worst = gap.reshape(1).to(ctx.comm_device)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    max_dw = worst.item()
    ema = ", over the weights and their EMA" if ref_ema else ""
    log.info(f"equivalence: max |dw| = {max_dw:.3g} after {steps} steps ({run.strategy.describe()}, world "
             f"{ctx.world_size}, tolerance {bound:g}){ema}")
    if not max_dw <= bound:  # also catches NaN
        ctx.fail_together(f"equivalence check failed: max |dw| = {max_dw:.3g} > {bound:g}; by design only BatchNorm "
                          "and dropout models differ from one process, and rounding grows with fp16/bf16 or with "
                          "AdamW/LAMB at a high --lr (docs/strategies.md, docs/recipes.md): otherwise the strategy "
                          "does not train what one process trains")


def _gap(state: dict[str, torch.Tensor], reference: nn.Module) -> torch.Tensor:
    """The largest |difference| between a saved state (empty on ranks that do not hold it) and the
    reference's parameters."""
    gaps = [(state[name].detach().to(p.device) - p.detach()).abs().max().double().cpu()
            for name, p in reference.named_parameters() if name in state]
    return torch.stack(gaps).max() if gaps else torch.zeros((), dtype=torch.float64)
