"""The program every train_*.py runs, given its strategy: parse, join, load, build, resume, train."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch

from common.collector import ended_cleanly, pause_during_set_up, resume_for_training
from common.config import OWN_DATASETS, Config, default_checkpoint_dir, default_log_dir, world_size_from_env
from common.data.augment import Draws
from common.data.fetch import load_dataset
from common.data.geometry import Resampling, choose_resampling
from common.data.loader import Dataset, TrainLoader, shared_reads_notice
from common.data.own import OwnData
from common.data.reading import cores_per_rank, default_workers
from common.errors import exit_quietly_after_the_printer
from common.models import build_model
from common.output.logger import NullLogger, make_logger, node_console
from common.output.profiling import NoProfiler, StepProfiler, trace_folder
from common.output.warnings_relay import WarningRelay
from common.parallel.context import DistContext, check_same_flags, distributed
from common.parallel.failures import is_handled, parsed_telling_torchrun, told
from common.parallel.procs import start_ticks
from common.parallel.sync_batchnorm import convert_batchnorm
from common.train.checkpoint import Checkpoints, Resumed
from common.train.ema import EMA
from common.train.equivalence import check_equivalence
from common.train.flags import parse_args
from common.train.mixing import Mixing
from common.train.optim import make_scheduler
from common.train.precision import Precision
from common.train.preemption import StopRequest
from common.train.run import Position, Run, torch_memory_format
from common.train.step import class_weights
from common.train.strategy import Strategy
from common.train.trainer import Trainer
from common.weights import Loaded, Source, load_into

STARTED = time.monotonic()  # a fallback for the start-up time where /proc is missing


def main(strategy: Strategy, argv: Sequence[str] | None = None) -> None:
    pause_during_set_up()
    try:
        strategy.check_world(world_size_from_env())
        cfg = parsed_telling_torchrun(lambda: parse_args(
            argv, strategy=strategy.name, default_dataset=strategy.default_dataset, add_flags=strategy.add_flags,
            identity_options=strategy.identity_options))
        strategy.configure(cfg)
        with distributed(cfg) as ctx:
            try:
                train(cfg, ctx, strategy)
            except Exception as error:  # told while the ranks are known, to name the one that vanished
                raise told(error, ctx) from None
        ended_cleanly()
    except Exception as error:  # a UserError's one line, a vanished peer named, a crash's traceback and line
        failure = told(error, None)
        if not failure.should_print():
            exit_quietly_after_the_printer(failure.quiet_exit_delay_s)
        sys.exit(failure.exit_code)


def train(cfg: Config, ctx: DistContext, strategy: Strategy) -> None:
    check_same_flags(cfg, ctx)
    run, weights = build_run(cfg, ctx, strategy)
    cfg = run.cfg  # --weights pinned to the content read: the identity that checkpoints are looked up by
    checkpoints = Checkpoints(cfg.checkpoint_dir, cfg.keep, ctx, cfg.storage_options, cfg.storage_timeout_s,
                              strategy.sole_writer)
    resumed, warnings = checkpoints.resume(run)
    # Start-up ends here on every rank alike, right after a collective: a rank whose Ctrl-C was still
    # start-up's (an exit, common/interrupts.py) while its peer's was already a stop request would
    # leave that peer to fail on it. Rank 0 alone opens TensorBoard next (a second of its import).
    stop = StopRequest(ctx, checkpoints.save_failed, strategy.stop_check_every)
    start = resume_position(resumed)
    run.cfg = replace(cfg, log_dir=log_dir(cfg, resumed, ctx.world_size))
    # On resume TensorBoard drops the cut run's points after the resume point.
    sub = strategy.log_subfolder()
    logged = replace(run.cfg, log_dir=os.path.join(run.cfg.log_dir, sub)) if sub else run.cfg
    log = make_logger(logged, ctx.rank, run_hparams(run), purge_step=run.global_step(start) + 1 if resumed else None)
    relay = WarningRelay()
    profiler = StepProfiler(trace_folder(run.cfg.log_dir, cfg.run_id), ctx.rank, ctx.device, log) \
        if cfg.profile else NoProfiler()
    final = None
    try:
        for warning in warnings:
            log.warn(warning)
        describe(run, checkpoints, log)
        if weights:
            log.info(weights.banner())
        if start.epoch >= cfg.last_epoch and not cfg.check_equivalence:
            log.info(f"training already complete: {resumed.path} ends epoch {cfg.last_epoch} of {cfg.last_epoch}; to "
                     "train on, pass --extend-to N (more epochs, a new schedule segment from this checkpoint); to "
                     "train again, pass --resume none (a new run beside this one, whose files are kept)")
            return
        if resumed:
            saved_world = resumed.state["world_size"]
            moved = f"; restarting at world {ctx.world_size}" if saved_world != ctx.world_size else ""
            log.info(f"resumed from {resumed.path}: epoch {start.epoch + 1}, step {start.step} "
                     f"(saved at world {saved_world}){moved}")
        resume_for_training()
        if cfg.check_equivalence:
            check_equivalence(run, log)
            return
        log.startup(process_age_s(), run.global_step(start))
        final = (strategy.trainer_class or Trainer)(run, log, checkpoints, stop, relay, profiler).fit(start)
    except Exception as error:
        if is_handled(error):
            raise
        # Said here, while the stop handler still holds SIGTERM: torchrun stops the survivors of a
        # vanished peer with it, and the clean-up below would otherwise be cut before the line is out.
        raise told(error, ctx) from None
    finally:
        profiler.stop()
        relay.close()
        checkpoints.close()  # the writer thread logs its save: before the logger closes
        log.close(final)


def build_run(cfg: Config, ctx: DistContext, strategy: Strategy) -> tuple[Run, Loaded | None]:
    """The run, and what --weights put into its model (None without the flag), for the banner."""
    if ctx.device.type == "cuda":
        choose_cuda_kernels(cfg.deterministic)
    memory_format = torch_memory_format(cfg.memory_format)
    say = node_console(ctx)
    pretrained = pretrained_data_config(cfg, ctx)  # before the data: it may say how to crop the images
    resampling = ctx.together(lambda: choose_resampling(cfg.crop_pct, cfg.interpolation, pretrained)) \
        if cfg.image_size else Resampling()
    data = load_dataset(cfg.dataset, cfg.data_dir, ctx=ctx, say=say, allow_download=cfg.download,
                        download_from=cfg.download_from, cache_dir=cfg.cache_dir,
                        storage_options=cfg.storage_options, synthetic_shape=cfg.synthetic_shape,
                        deadline_s=cfg.storage_timeout_s, own_data=own_data(cfg, ctx, resampling))
    model = ctx.together(lambda: build_model(cfg.model, data.spec.channels, data.spec.size, data.spec.classes,
                                             cfg.seed, cfg.drop_path))
    # Into the plain model on every rank, before wrap() replicates and shards it.
    weights = load_weights(cfg, ctx, model, data.spec.channels, say, pretrained) if cfg.weights else None
    cfg = pinned(cfg, weights) if weights else cfg
    data = normalized_for_weights(data, weights)  # the weights' content says which torchvision file they are
    loader = ctx.together(lambda: TrainLoader(data.train, data.spec, cfg.batch_size, ctx.rank, ctx.world_size,
                                              cfg.seed, ctx.device, cfg.max_steps, memory_format, cfg.augment,
                                              cfg.random_erase, ctx.hosts, cfg.shard_lanes))
    model = model.to(ctx.device, memory_format=memory_format)
    if cfg.sync_bn:
        convert_batchnorm(model)
    wrapped = strategy.wrap(model, ctx)
    optimizer = strategy.make_optimizer(cfg, wrapped)
    scheduler = make_scheduler(cfg, optimizer, loader.steps_per_epoch)
    compiled = torch.compile(wrapped) if cfg.compile else None  # for DDP, compile sees DDP and splits at buckets
    ema = EMA(cfg.ema, strategy, wrapped) if cfg.ema else None
    weighting = ctx.together(lambda: class_weights(cfg.class_weights, data.train.labels, data.spec.classes))
    return Run(cfg, ctx, strategy, data, loader, wrapped, optimizer, scheduler, Precision(cfg.precision, ctx.device),
               compiled, ema, Mixing(cfg, data.spec.classes), weights.pretrained if weights else None,
               resampling, weighting.to(ctx.device) if weighting is not None else None), weights


def choose_cuda_kernels(deterministic: bool) -> None:
    """cuDNN's benchmark times the conv kernels once per process and keeps the fastest: with fixed
    shapes the fastest choice, but a restarted process may choose others, which round otherwise, so
    a resume drifts from the uninterrupted run (0.16 after 11 steps of resnet18 on an H200).
    --deterministic: the same kernels in every process; an op without a deterministic kernel warns."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read at cuBLAS's first call: before it
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = not deterministic


def pretrained_data_config(cfg: Config, ctx: DistContext) -> dict:
    """A collective: the data config that comes with --weights (timm's registry's, or a local-dir
    folder's config.json, read by rank 0 alone: the other nodes need not hold the folder); {}."""
    if not cfg.weights:
        return {}
    source = Source.parse(cfg.weights, cfg.model)
    read = ctx.after_primary(f"pretrained config read from {source.text}", source.data_config, cfg.storage_timeout_s)
    return ctx.broadcast_json(read if ctx.is_primary else None)


def load_weights(cfg: Config, ctx: DistContext, model: torch.nn.Module, channels: int, say: Callable[[str], None],
                 pretrained: dict) -> Loaded:
    """A collective: --weights into the plain model on every rank. Rank 0 reads the file while the
    others wait on the store (--storage-timeout-s bounds it, not --timeout-s); every rank loads the
    bytes it broadcasts, as for a resumed checkpoint (common/weights.py). pretrained: its data config
    (pretrained_data_config)."""
    source = Source.parse(cfg.weights, cfg.model)
    read = ctx.after_primary(f"weights read from {source.text}",
                             lambda: source.read(cfg.storage_options, cfg.download, say), cfg.storage_timeout_s)
    data = ctx.broadcast_bytes(read if ctx.is_primary else None)
    return ctx.together(lambda: load_into(model, data, source, channels, cfg.seed, cfg.normalization, pretrained))


def normalized_for_weights(data: Dataset, weights: Loaded | None) -> Dataset:
    """Images normalized as the weights' normalization says (their own, torchvision's, or ImageNet's
    with --normalization imagenet) instead of with the data set's measured statistics."""
    if weights is None or weights.normalization is None:
        return data
    mean, std = weights.normalization
    return replace(data, spec=replace(data.spec, mean=mean, std=std))


def pinned(cfg: Config, weights: Loaded) -> Config:
    """--weights as SOURCE@sha256:HEX, naming the content read: part of the run's identity, so a
    changed file starts a new run instead of resuming one trained from other weights. The default
    checkpoint folder, named after the identity, follows it."""
    with_digest = replace(cfg, weights=weights.flag)
    if cfg.checkpoint_dir == default_checkpoint_dir(cfg):
        return replace(with_digest, checkpoint_dir=default_checkpoint_dir(with_digest))
    return with_digest


def own_data(cfg: Config, ctx: DistContext, resampling: Resampling) -> OwnData | None:
    """How to read --dataset imagefolder | shards | hf; None for the built-in sets."""
    if cfg.dataset not in OWN_DATASETS:
        return None
    workers = default_workers(ctx.local_world_size) if cfg.workers is None else cfg.workers
    return OwnData(cfg.dataset, cfg.data_dir, cfg.cache_dir, cfg.storage_options, cfg.image_size, workers,
                   default_workers(1) + 1, cfg.skip_broken, cfg.cache_gb, cfg.shard_cache_gb, cfg.verify_data,
                   cfg.decode, str(ctx.device), cfg.hf_image_key, cfg.hf_label_key, cfg.shard_lanes, resampling)


def process_age_s() -> float:
    """Seconds since this process started (Linux: from /proc), for the start-up time."""
    ticks = start_ticks(os.getpid())
    try:
        if ticks is not None:
            return float(open("/proc/uptime").read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass  # no /proc/uptime: measured from this module's import instead
    return time.monotonic() - STARTED


def resume_position(resumed: Resumed | None) -> Position:
    """Where to continue. A checkpoint taken after an epoch's last step but before its evaluation
    (a stop there, or during the evaluation) continues with that evaluation."""
    if resumed is None:
        return Position(0, 0)
    return Position(int(resumed.state["epoch"]), int(resumed.state["step_in_epoch"]))


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


def describe_loader(run: Run, log: NullLogger) -> None:
    """What the DataLoader workers can deliver to each rank, from one worker's measured rate: workers
    beyond the rank's share of the cores add processes, not images."""
    cfg, workers = run.cfg, run.data.train.workers
    rate = run.data.train.rate_per_worker(Draws(cfg.seed, 0, 0, cfg.batch_size, cfg.augment))
    made = "reads the JPEGs of" if run.data.train.gpu_decode else "makes"
    if not workers:
        log.info(f"input: the rank {made} {rate:.0f} training images per CPU-second itself (--workers 0, "
                 f"--augment {cfg.augment}), on the thread that trains")
        return
    cores = cores_per_rank(run.ctx.local_world_size)
    log.info(f"input: one worker {made} {rate:.0f} training images per CPU-second here (--augment {cfg.augment}); "
             f"{workers} worker(s) per rank on its {cores} core(s) deliver up to {rate * min(workers, cores):.0f} "
             "images/s per rank")


def describe(run: Run, checkpoints: Checkpoints, log: NullLogger) -> None:
    cfg, ctx = run.cfg, run.ctx
    master = f"{os.environ.get('MASTER_ADDR', 'local')}:{os.environ.get('MASTER_PORT', '-')}"
    wire = ctx.transport.name if run.strategy.uses_transport else ctx.backend
    note = f" ({ctx.transport_note})" if run.strategy.uses_transport and ctx.transport_note else ""
    log.info(f"{run.strategy.describe()}: world {ctx.world_size} = {ctx.nodes} node(s) x {ctx.local_world_size}, "
             f"backend {ctx.backend}, gradients via {wire}{note}, master {master}, device {ctx.device} (rank 0), "
             f"{torch.get_num_threads()} thread(s) per rank")
    log.info(f"{run.data.name}: {len(run.data.train)} train / {len(run.data.test)} test images "
             f"({run.data.spec.channels}x{run.data.spec.size}x{run.data.spec.size}, {run.data.spec.classes} classes), "
             f"{run.data.held}")
    if cfg.image_size:
        log.info(run.resampling.describe(cfg.image_size))
    if run.data.train.augments:
        describe_loader(run, log)
    if run.data.train.reads_shards and (shared := shared_reads_notice(ctx.hosts, run.loader.lanes, cfg.batch_size)):
        log.info(f"note: {shared}")
    shares = run.strategy.batch_shares(ctx.world_size)
    log.info(f"model {cfg.model}; "
             f"global batch {cfg.batch_size} = {cfg.batch_size // shares} per rank x {shares}"
             f"{f' in {cfg.accumulate} micro-batches' if cfg.accumulate > 1 else ''}; peak lr {cfg.lr:g}; "
             f"{cfg.epochs} epoch(s){f' extended to {cfg.extend_to}' if cfg.extend_to else ''}; {cfg.precision}, "
             f"{cfg.memory_format}{', compiled' if cfg.compile else ''}")
    points = f"step-level points every {run.log_every} step(s)" + (
        "" if cfg.log_every else f" (chosen for {run.steps_per_epoch} steps per epoch; --log-every N to choose)")
    log.info(f"run {cfg.run_id}: checkpoints {checkpoints.url()}; TensorBoard {cfg.log_dir}; {points}")
