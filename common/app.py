"""The program every train_*.py runs, given its strategy: parse, join, load, build, resume, train."""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Sequence

import torch

from common.checkpoint import Checkpoints, Resumed
from common.config import Config, default_log_dir, parse_args, world_size_from_env
from common.data import TrainLoader
from common.distributed import DistContext, check_same_flags, distributed
from common.equivalence import check_equivalence
from common.fetch import load_dataset
from common.errors import UserError
from common.logger import NullLogger, make_logger, node_console
from common.models import build_model
from common.optim import make_optimizer, make_scheduler
from common.preemption import StopRequest
from common.run import Position, Run
from common.strategy import Strategy
from common.sync_batchnorm import convert_batchnorm
from common.trainer import Trainer
from common.warnings_relay import WarningRelay


def main(strategy: Strategy, argv: Sequence[str] | None = None) -> None:
    try:
        strategy.check_world(world_size_from_env())
        cfg = parse_args(argv, strategy=strategy.name, default_dataset=strategy.default_dataset,
                         add_flags=strategy.add_flags, identity_options=strategy.identity_options)
        strategy.configure(cfg.options)
        with distributed(cfg) as ctx:
            train(cfg, ctx, strategy)
    except UserError as e:
        if e.should_print():
            print(f"{e.prefix}{e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


def train(cfg: Config, ctx: DistContext, strategy: Strategy) -> None:
    check_same_flags(cfg, ctx)
    run = build_run(cfg, ctx, strategy)
    checkpoints = Checkpoints(cfg.checkpoint_dir, cfg.keep, ctx, cfg.storage_options)
    resumed, warnings = checkpoints.resume(run)
    start = resume_position(resumed, run)
    run.cfg = replace(cfg, log_dir=log_dir(cfg, resumed, ctx.world_size))
    # On resume TensorBoard drops the cut run's points after the resume point.
    log = make_logger(run.cfg, ctx.rank, run_hparams(run), purge_step=run.global_step(start) + 1 if resumed else None)
    stop, relay = StopRequest(ctx), WarningRelay()
    final = None
    try:
        for warning in warnings:
            log.warn(warning)
        describe(run, checkpoints, log)
        if start.epoch >= cfg.epochs and not cfg.check_equivalence:
            log.info(f"training already complete: {resumed.path} ends epoch {cfg.epochs} of {cfg.epochs}; to train "
                     "again, pass --resume none (a new run beside this one, whose files are kept)")
            return
        if resumed:
            log.info(f"resumed from {resumed.path}: epoch {start.epoch + 1}, step {start.step} "
                     f"(saved at world {resumed.state['world_size']})")
        if cfg.check_equivalence:
            check_equivalence(run, log)
            return
        final = Trainer(run, log, checkpoints, stop, relay).fit(start)
    finally:
        stop.close()
        relay.close()
        log.close(final)


def build_run(cfg: Config, ctx: DistContext, strategy: Strategy) -> Run:
    data = load_dataset(cfg.dataset, cfg.data_dir, ctx=ctx, say=node_console(ctx), allow_download=cfg.download,
                        download_from=cfg.download_from, cache_dir=cfg.cache_dir,
                        storage_options=cfg.storage_options, synthetic_shape=cfg.synthetic_shape)
    loader = ctx.together(lambda: TrainLoader(data.train, data.spec, cfg.batch_size, ctx.rank, ctx.world_size,
                                              cfg.seed, ctx.device, cfg.max_steps))
    model = build_model(cfg.model, data.spec.channels, data.spec.size, data.spec.classes, cfg.seed).to(ctx.device)
    if cfg.sync_bn:
        convert_batchnorm(model)
    wrapped = strategy.wrap(model, ctx)
    optimizer = make_optimizer(cfg, wrapped)
    scheduler = make_scheduler(cfg, optimizer, cfg.epochs * loader.steps_per_epoch)
    return Run(cfg, ctx, strategy, data, loader, wrapped, optimizer, scheduler)


def resume_position(resumed: Resumed | None, run: Run) -> Position:
    """Where to continue: a checkpoint taken after an epoch's last step continues with the next epoch."""
    if resumed is None:
        return Position(0, 0)
    epoch, step = int(resumed.state["epoch"]), int(resumed.state["step_in_epoch"])
    return Position(epoch + 1, 0) if step >= run.steps_per_epoch else Position(epoch, step)


def run_hparams(run: Run) -> dict[str, object]:
    """What tells runs apart in TensorBoard's hparams table and in the report."""
    cfg, ctx = run.cfg, run.ctx
    return {"strategy": run.strategy.describe(), "world_size": ctx.world_size,
            "nodes": ctx.nodes, "backend": ctx.backend, "device": ctx.device.type,
            "model": cfg.model, "dataset": cfg.dataset, "batch_size": cfg.batch_size, "lr": cfg.lr,
            "epochs": cfg.epochs, "run_id": cfg.run_id}


def log_dir(cfg: Config, resumed: Resumed | None, world_size: int) -> str:
    """The flag's, else the resumed run's (its curves continue), else a new timestamped one."""
    return cfg.log_dir or (resumed and resumed.state["config"].get("log_dir")) or default_log_dir(cfg, world_size)


def describe(run: Run, checkpoints: Checkpoints, log: NullLogger) -> None:
    cfg, ctx = run.cfg, run.ctx
    master = f"{os.environ.get('MASTER_ADDR', 'local')}:{os.environ.get('MASTER_PORT', '-')}"
    log.info(f"{run.strategy.describe()}: world {ctx.world_size} = {ctx.nodes} node(s) x {ctx.local_world_size}, "
             f"backend {ctx.backend}, master {master}, device {ctx.device} (rank 0), "
             f"{torch.get_num_threads()} thread(s) per rank")
    log.info(f"{run.data.name}: {len(run.data.train)} train / {len(run.data.test)} test images; model {cfg.model}; "
             f"global batch {cfg.batch_size} = {cfg.batch_size // ctx.world_size} per rank x {ctx.world_size}; "
             f"peak lr {cfg.lr:g}; {cfg.epochs} epoch(s)")
    log.info(f"run {cfg.run_id}: checkpoints {checkpoints.url()}; TensorBoard {cfg.log_dir}")
