"""The program every train_*.py runs, given its strategy: parse, join, load, build, train."""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from common.checkpoint import (CheckpointWriter, Found, InvalidCheckpoint, check_compatible, find_checkpoint,
                               read_checkpoint)
from common.config import Config, default_log_dir, parse_args, world_size_from_env
from common.data import Dataset, TrainLoader, load_dataset
from common.distributed import DistContext, check_same_flags, distributed
from common.equivalence import check_equivalence
from common.errors import PeerFailed, UserError
from common.logger import NullLogger, make_logger
from common.models import build_model
from common.optim import make_optimizer, make_scheduler
from common.preemption import StopRequest
from common.warnings_relay import WarningRelay
from common.strategy import Strategy
from common.sync_batchnorm import convert_batchnorm
from common.trainer import Position, Trainer


def main(strategy: Strategy, argv: Sequence[str] | None = None) -> None:
    try:
        strategy.check_world(world_size_from_env())
        cfg = parse_args(argv, strategy=strategy.name, default_dataset=strategy.default_dataset,
                         add_flags=strategy.add_flags)
        strategy.configure(cfg.options)
        with distributed(cfg) as ctx:
            train(cfg, ctx, strategy)
    except UserError as e:
        if not isinstance(e, PeerFailed):
            print(f"{e.prefix}{e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


def train(cfg: Config, ctx: DistContext, strategy: Strategy) -> None:
    check_same_flags(cfg, ctx)
    data = load_dataset(cfg.dataset, cfg.data_dir, cfg.synthetic_shape, cfg.download, ctx)
    loader = TrainLoader(data.train, data.spec, cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed,
                         ctx.device, cfg.max_steps)
    model = build_model(cfg.model, data.spec.channels, data.spec.size, data.spec.classes, cfg.seed).to(ctx.device)
    if cfg.sync_bn:
        convert_batchnorm(model)
    optimizer = make_optimizer(cfg, model)
    total_steps = cfg.epochs * loader.steps_per_epoch
    scheduler = make_scheduler(cfg, optimizer, total_steps)
    checkpoints = CheckpointWriter(cfg.checkpoint_dir, cfg.keep, ctx.is_primary)  # also clears a killed save's temp files
    found, warnings = agree_on_checkpoint(cfg, ctx)
    start = restore(found, cfg, ctx, model, optimizer, scheduler, loader) if found else Position(0, 0)
    cfg = replace(cfg, log_dir=log_dir(cfg, found, ctx.world_size))
    # On resume TensorBoard drops the cut run's points after the resume point.
    log = make_logger(cfg, ctx.rank, run_hparams(cfg, ctx, strategy),
                      purge_step=start.global_step(loader.steps_per_epoch) + 1 if found else None)
    stop, relay = StopRequest(ctx), WarningRelay()
    final = None
    try:
        for warning in warnings:
            log.warn(warning)
        describe(cfg, ctx, strategy, data, log)
        if found:
            log.info(f"resumed from {found.path}: epoch {start.epoch + 1}, step {start.step} "
                     f"(saved at world {found.state['world_size']})")
        wrapped = strategy.wrap(model, ctx)
        if cfg.check_equivalence:
            check_equivalence(cfg, ctx, strategy, wrapped, optimizer, scheduler, data, loader, total_steps, log)
            return
        if start.epoch >= cfg.epochs:
            log.info(f"training already complete ({cfg.epochs} epochs); use --resume none or another "
                     "--checkpoint-dir to start over")
            return
        trainer = Trainer(cfg, ctx, strategy, wrapped, optimizer, scheduler, data, loader, log, checkpoints, stop, relay)
        final = trainer.fit(start)
    finally:
        stop.close()
        relay.close()
        log.close(final)


def run_hparams(cfg: Config, ctx: DistContext, strategy: Strategy) -> dict[str, object]:
    """What tells runs apart in TensorBoard's hparams table and in the report."""
    return {"strategy": strategy.describe(), "world_size": ctx.world_size,
            "nodes": ctx.nodes, "backend": ctx.backend, "device": ctx.device.type,
            "model": cfg.model, "dataset": cfg.dataset, "batch_size": cfg.batch_size, "lr": cfg.lr,
            "epochs": cfg.epochs}


def log_dir(cfg: Config, found: Found | None, world_size: int) -> str:
    """The flag's, else the resumed run's (its curves continue), else a new timestamped one."""
    return cfg.log_dir or (found and found.state["config"].get("log_dir")) or default_log_dir(cfg, world_size)


def agree_on_checkpoint(cfg: Config, ctx: DistContext) -> tuple[Found | None, list[str]]:
    """Rank 0 picks the checkpoint (one view of the directory, its warnings printed once); every
    rank then loads that file, so the checkpoint directory must be shared by all nodes."""
    choice: list = [None, [], None]  # path, warnings, error
    found = None
    if ctx.is_primary:
        try:
            found, warnings = find_checkpoint(cfg.resume, cfg.checkpoint_dir)
            choice = [str(found.path) if found else None, warnings, None]
        except UserError as e:
            choice = [None, [], str(e)]
    torch.distributed.broadcast_object_list(choice, src=0)
    path, warnings, error = choice
    if error:
        ctx.fail_together(error)
    if path is None or found is not None:  # rank 0 has loaded it already
        return found, warnings
    try:
        return Found(Path(path), read_checkpoint(Path(path))), warnings
    except InvalidCheckpoint as e:  # rank 0 read it a moment ago: this node sees another file
        raise UserError(f"rank {ctx.rank} cannot use checkpoint {path} ({e}); --checkpoint-dir must be on a "
                        "file system shared by every node") from None


def restore(found: Found, cfg: Config, ctx: DistContext, model: nn.Module, optimizer: torch.optim.Optimizer,
            scheduler: torch.optim.lr_scheduler.LambdaLR, loader: TrainLoader) -> Position:
    """Load into the plain model (before wrapping) on every rank; returns where to continue."""
    try:
        check_compatible(found.state, cfg.as_plain_dict(), model, found.path)
    except UserError as e:
        ctx.fail_together(str(e))  # every rank read the same file and reached the same verdict
    state = found.state
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
    return Position(epoch + 1, 0) if step >= loader.steps_per_epoch else Position(epoch, step)


def describe(cfg: Config, ctx: DistContext, strategy: Strategy, data: Dataset, log: NullLogger) -> None:
    master = f"{os.environ.get('MASTER_ADDR', 'local')}:{os.environ.get('MASTER_PORT', '-')}"
    log.info(f"{strategy.describe()}: world {ctx.world_size} = {ctx.nodes} node(s) x {ctx.local_world_size}, "
             f"backend {ctx.backend}, master {master}, device {ctx.device} (rank 0), "
             f"{torch.get_num_threads()} thread(s) per rank")
    log.info(f"{data.name}: {len(data.train)} train / {len(data.test)} test images; model {cfg.model}; "
             f"global batch {cfg.batch_size} = {cfg.batch_size // ctx.world_size} per rank x {ctx.world_size}; "
             f"peak lr {cfg.lr:g}; {cfg.epochs} epoch(s); TensorBoard: {cfg.log_dir}; checkpoints: {cfg.checkpoint_dir}")
