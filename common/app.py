"""The program every train_*.py runs, given its strategy: parse, join, load, build, train."""
from __future__ import annotations

import os
import sys
from typing import Sequence

import torch
from torch import nn

from common.checkpoint import CheckpointWriter, load_checkpoint, restore_model, resume_path
from common.config import Config, parse_args
from common.data import Dataset, TrainLoader, load_dataset
from common.distributed import DistContext, distributed
from common.equivalence import check_equivalence
from common.errors import PeerFailed, UserError
from common.logger import NullLogger, make_logger
from common.models import build_model
from common.optim import make_optimizer, make_scheduler
from common.strategy import Strategy
from common.sync_batchnorm import convert_batchnorm
from common.trainer import Trainer


def main(strategy: Strategy, argv: Sequence[str] | None = None) -> None:
    try:
        strategy.check_world(int(os.environ.get("WORLD_SIZE", "1")))
        cfg = parse_args(argv, strategy=strategy.name, default_dataset=strategy.default_dataset,
                         add_flags=strategy.add_flags)
        strategy.configure(cfg.options)
        with distributed(cfg) as ctx:
            train(cfg, ctx, strategy)
    except UserError as e:
        if not isinstance(e, PeerFailed):
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


def train(cfg: Config, ctx: DistContext, strategy: Strategy) -> None:
    log = make_logger(cfg, ctx.is_primary)
    final = None
    try:
        data = load_dataset(cfg.dataset, cfg.data_dir, cfg.synthetic_shape, cfg.download, ctx)
        describe(cfg, ctx, strategy, data, log)
        loader = TrainLoader(data.train, data.spec, cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed,
                             ctx.device, cfg.max_steps)
        model = build_model(cfg.model, data.spec.channels, data.spec.size, data.spec.classes, cfg.seed).to(ctx.device)
        if cfg.sync_bn:
            convert_batchnorm(model)
        optimizer = make_optimizer(cfg, model)
        total_steps = cfg.epochs * loader.steps_per_epoch
        scheduler = make_scheduler(cfg, optimizer, total_steps)
        start_epoch = resume(cfg, model, optimizer, scheduler, log)
        wrapped = strategy.wrap(model, ctx)
        if cfg.check_equivalence:
            check_equivalence(cfg, ctx, strategy, wrapped, optimizer, scheduler, data, loader, total_steps, log)
            return
        trainer = Trainer(cfg, ctx, strategy, wrapped, optimizer, scheduler, data, loader, log,
                          CheckpointWriter(cfg.checkpoint_dir, ctx.is_primary))
        final = trainer.fit(start_epoch)
    finally:
        log.close(final)


def describe(cfg: Config, ctx: DistContext, strategy: Strategy, data: Dataset, log: NullLogger) -> None:
    log.info(f"{strategy.describe()}: world {ctx.world_size} ({ctx.local_world_size} per node), backend {ctx.backend}, "
             f"device {ctx.device}, {torch.get_num_threads()} thread(s) per rank")
    log.info(f"{data.name}: {len(data.train)} train / {len(data.test)} test images; model {cfg.model}; "
             f"global batch {cfg.batch_size} = {cfg.batch_size // ctx.world_size} per rank x {ctx.world_size}; "
             f"peak lr {cfg.lr:g}; {cfg.epochs} epoch(s); TensorBoard: {cfg.log_dir}")


def resume(cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer,
           scheduler: torch.optim.lr_scheduler.LambdaLR, log: NullLogger) -> int:
    """Load a checkpoint into the plain model (before wrapping) on every rank; returns the epoch to start at."""
    path = resume_path(cfg.resume, cfg.checkpoint_dir)
    if path is None:
        return 0
    state = load_checkpoint(path)
    restore_model(model, state, path)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    log.info(f"resumed from {path}: {state['epoch']} epoch(s) done")
    return int(state["epoch"])
