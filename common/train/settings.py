"""The flags of what a run trains and how (its settings: data, model, optimizer, regularization,
recipes), composed from their owners, and the command that gives a run's identity back.

common/train/flags.py adds the flags of where a job runs and what it keeps (storage, process
group, logging, checkpoints, checks). The settings' parser stands alone because the checkpoints'
messages name the command that continues another run (way_to_continue), and the checkpoint flags'
owner cannot be below the module that composes them.
"""
from __future__ import annotations

import argparse
import shlex
from typing import Any

from common.config import IDENTITY, RankZeroParser, resolve_defaults
from common.data.augment import add_augment_flags
from common.data.fetch import add_data_flags
from common.data.own import add_own_data_flags
from common.models import add_model_flags
from common.output.profiling import add_profiling_flags
from common.parallel.sync_batchnorm import add_sync_bn_flags
from common.timm_models import add_timm_flags
from common.train.ema import add_ema_flags
from common.train.mixing import add_mixing_flags
from common.train.optim import add_optimizer_flags
from common.train.precision import add_precision_flags
from common.train.run import add_model_placement_flags, add_run_flags
from common.train.step import add_loss_flags, add_step_flags
from common.train.strategy import add_compression_flags
from common.weights import add_weights_flags


def add_settings_flags(p: argparse.ArgumentParser, default_dataset: str) -> None:
    """The settings' flags, one group per concern, each registered by its owner."""
    add_data_flags(p.add_argument_group("data"), default_dataset)
    add_own_data_flags(p.add_argument_group("your own images (--dataset imagefolder | shards | hf; docs/data.md)"))
    model = p.add_argument_group("model")
    add_model_flags(model)
    add_weights_flags(model)
    add_run_flags(p.add_argument_group("the run"))
    add_optimizer_flags(p.add_argument_group("optimizer and schedule"))
    regularization = p.add_argument_group("regularization")
    for add in (add_timm_flags, add_loss_flags, add_mixing_flags, add_augment_flags, add_ema_flags):
        add(regularization)
    recipe = p.add_argument_group("recipes")
    for add in (add_precision_flags, add_step_flags, add_compression_flags, add_sync_bn_flags,
                add_model_placement_flags, add_profiling_flags):
        add(recipe)


# The settings whose value changes other settings' defaults: given first, so that those follow.
LEADING = ("dataset", "optimizer", "schedule", "batch_size")


def settings_flags(identity: dict[str, Any]) -> list[str]:
    """The fewest flags that give a run's identity: its --dataset (the scripts' defaults differ) and
    each setting whose value is not the default that the flags before it give (an lr that follows
    from --batch-size is left out; so is --momentum under adamw, which does not read it). A
    strategy's own settings (not known here) follow as --NAME VALUE. Values are plain, as saved."""
    p = RankZeroParser(prog="settings")
    add_settings_flags(p, default_dataset=identity.get("dataset") or "synthetic")
    actions = {a.dest: a for a in p._actions if a.option_strings}
    argv = ["--dataset", str(identity.get("dataset"))]
    order = [*LEADING, *(key for key in identity if key not in LEADING)]
    for key in (k for k in order if k in actions and k in identity):
        a = p.parse_args(argv)
        resolve_defaults(a)
        default = vars(a)[key]
        if _plain(default) != identity[key]:
            argv += _flag(actions[key], identity[key])
    extra = [key for key in identity if key not in actions and identity[key] not in (None, "", False)]
    for key in extra:
        flag = "--" + key.replace("_", "-")
        argv += [flag] if identity[key] is True else [flag, str(identity[key])]
    return argv


def way_to_continue(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """How to continue a run of another identity: its flags; or, for a run of an earlier version
    (whose identity lacks settings every run has now), that this version cannot."""
    if newer := sorted(key for key in IDENTITY if key in now and key not in saved):
        flags = ", ".join("--" + key.replace("_", "-") for key in newer[:3]) + (" ..." if len(newer) > 3 else "")
        return (f"It was written by an earlier version of the suite, before {flags} existed, and this version "
                "cannot continue it: finish it with the version it was trained with")
    return (f"To continue it, rerun with its settings: {shlex.join(settings_flags(saved))} (with the flags that are "
            "not settings, such as --checkpoint-dir, as before)")


def _plain(value: Any) -> Any:
    """A parsed value as Config.as_plain_dict keeps it (a tuple as one comma-separated string)."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else value


def _flag(action: argparse.Action, value: Any) -> list[str]:
    """The arguments that set `action`'s setting to `value`: the flag alone for an on/off flag."""
    if action.nargs == 0:
        return [action.option_strings[0]] if value == action.const else []
    return [action.option_strings[-1], str(value)]
