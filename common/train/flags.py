"""The training scripts' parser, composed from the flags' owners, and parse_args: argv -> Config.

The settings (what is trained and how: common/train/settings.py) come first, then where the job
runs and what it keeps, then the strategy's own flags. Each group's flags are registered by the
module that reads them (add_*_flags), and checked there (check_*_flags); check_flags runs those
checks in turn, with the rules that span several owners' flags, and holds them.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Sequence

from common.config import Config, RankZeroParser, make_config, resolve_defaults, world_size_from_env
from common.data.fetch import check_data_flags
from common.data.own import check_own_data_flags
from common.models import check_model_flags
from common.output.logger import add_logging_flags
from common.parallel.context import add_process_group_flags
from common.parallel.replicas import add_replica_check_flags
from common.storage import add_storage_flags, check_storage_flags
from common.timm_models import check_timm_flags
from common.train.checkpoint import add_checkpoint_flags, check_checkpoint_flags
from common.train.equivalence import add_equivalence_flags, check_equivalence_flags
from common.train.mixing import check_mixing_flags
from common.train.optim import check_optimizer_flags
from common.train.run import check_model_placement_flags, check_run_flags
from common.train.settings import add_settings_flags
from common.train.step import check_loss_flags, check_step_flags
from common.weights import check_weights_flags


def build_parser(strategy: str, default_dataset: str) -> argparse.ArgumentParser:
    p = RankZeroParser(
        prog=f"train_{strategy}.py",
        description=f"Data-parallel training ({strategy}). Launch with torchrun, or plain python for one process.",
    )
    add_settings_flags(p, default_dataset)
    add_storage_flags(p.add_argument_group("storage (docs/object-storage.md)"))
    add_process_group_flags(p.add_argument_group("devices and the process group"))
    add_logging_flags(p.add_argument_group("logging"))
    add_checkpoint_flags(p.add_argument_group("checkpoints"))
    checks = p.add_argument_group("checks")
    add_equivalence_flags(checks)
    add_replica_check_flags(checks)
    return p


def parse_args(argv: Sequence[str] | None = None, *, strategy: str, default_dataset: str,
               world_size: int | None = None,
               add_flags: Callable[[argparse.ArgumentParser], None] | None = None,
               identity_options: Sequence[str] = ()) -> Config:
    """Parse and validate; exits 2 with a message naming the flag on bad input.
    `add_flags` lets a strategy add its own flags; they land in Config.options. `identity_options`
    names those of them that change the trained weights (part of the run's identity)."""
    p = build_parser(strategy, default_dataset)
    if add_flags is not None:
        add_flags(p.add_argument_group(f"{strategy} strategy"))
    a = p.parse_args(argv)
    resolve_defaults(a)
    check_flags(p, a, world_size_from_env() if world_size is None else world_size)
    return make_config(a, strategy, identity_options)


def check_flags(p: argparse.ArgumentParser, a: argparse.Namespace, world_size: int) -> None:
    """Every rule between the flags, on the parsed values (resolve_defaults first): each owner's
    check_*_flags, and here the rules whose one message spans several owners' flags (one line for
    the bounds of a kind, as a user fixes them together). Exits 2 with one line naming the flag.
    Some checks turn a flag into what it names (--class-weights FILE, --storage-options @FILE)."""
    check_data_flags(p, a)
    check_own_data_flags(p, a)  # before the URLs are checked: a file:// --data-dir is a local folder
    check_model_flags(p, a)
    check_run_flags(p, a, world_size)
    if a.max_steps < 0 or (a.eval_batch_size is not None and a.eval_batch_size < 1) or \
            not 0 < a.timeout_s < math.inf or not 0 < a.storage_timeout_s < math.inf or \
            (a.log_every is not None and a.log_every < 1):  # every wait has a deadline: nan and inf are none
        p.error("--max-steps must be >= 0, --eval-batch-size >= 1, --timeout-s and --storage-timeout-s > 0 and "
                "finite, and --log-every >= 1")
    check_checkpoint_flags(p, a)
    if a.check_equivalence < 0 or a.check_replicas < 0:
        p.error("--check-equivalence and --check-replicas take a step count >= 0")
    check_step_flags(p, a, world_size)
    check_equivalence_flags(p, a)
    check_model_placement_flags(p, a)
    check_optimizer_flags(p, a)
    check_timm_flags(p, a)
    if not (0 <= a.label_smoothing < 1 and 0 <= a.random_erase <= 1 and 0 <= a.ema < 1):
        p.error(f"--label-smoothing must be in [0, 1), --random-erase in [0, 1] and --ema in (0, 1), or 0 for off "
                f"(got {a.label_smoothing:g}, {a.random_erase:g}, {a.ema:g})")
    check_mixing_flags(p, a, world_size)
    check_loss_flags(p, a)
    check_storage_flags(p, a)
    check_weights_flags(p, a)
