"""Errors a user can act on: they end the job with one clear line instead of a traceback."""
from __future__ import annotations

import os


class UserError(Exception):
    """Bad input or environment (missing data, unusable device): printed as one line."""

    exit_code = 1
    prefix = "error: "

    def should_print(self) -> bool:
        """Whether this process prints the line. Errors raised after the ranks agreed on them
        (ctx.fail_together) are printed by rank 0 alone; see the subclasses."""
        return True


class ConfigError(UserError):
    """A flag that cannot work here (e.g. --backend nccl without GPUs); exit 2 like argparse.
    Found before any process group exists, from the flags and the node's hardware, so every rank
    of a node reaches the same verdict: local rank 0 prints it, once per node (each node has its
    own console)."""

    exit_code = 2

    def should_print(self) -> bool:
        return os.environ.get("LOCAL_RANK", "0") == "0"


class PeerFailed(UserError):
    """Another rank hit a UserError and printed it; this rank exits non-zero without repeating it."""

    def should_print(self) -> bool:
        return False
