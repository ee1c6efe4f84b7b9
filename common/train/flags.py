"""The training scripts' parser, composed from the flags' owners, and parse_args: argv -> Config.

The settings (what is trained and how: common/train/settings.py) come first, then where the job
runs and what it keeps, then the strategy's own flags. Each group's flags are registered by the
module that reads them (add_*_flags); their rules between flags are common/config.py's validate.
"""
from __future__ import annotations

import argparse
from typing import Callable, Sequence

from common.config import Config, RankZeroParser, make_config, resolve_defaults, validate, world_size_from_env
from common.output.logger import add_logging_flags
from common.parallel.context import add_process_group_flags
from common.parallel.replicas import add_replica_check_flags
from common.storage import add_storage_flags
from common.train.checkpoint import add_checkpoint_flags
from common.train.equivalence import add_equivalence_flags
from common.train.settings import add_settings_flags


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
    validate(p, a, world_size_from_env() if world_size is None else world_size)
    return make_config(a, strategy, identity_options)
