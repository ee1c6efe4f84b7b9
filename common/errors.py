"""Errors a user can act on: they end the job with one clear line instead of a traceback."""


class UserError(Exception):
    """Bad input or environment (missing data, unusable device): printed as one line."""

    exit_code = 1
    prefix = "error: "


class ConfigError(UserError):
    """A flag that cannot work on this machine (e.g. --backend nccl without GPUs); exit 2 like argparse."""

    exit_code = 2


class PeerFailed(UserError):
    """Another rank hit a UserError and printed it; this rank exits non-zero without repeating it."""
