"""Errors a user can act on: they end the job with one clear line instead of a traceback."""
from __future__ import annotations

import os
import time


class UserError(Exception):
    """Bad input or environment (missing data, unusable device): printed as one line."""

    exit_code = 1
    prefix = "error: "
    # A rank that does not print waits up to this long before exiting, so that torchrun, which
    # stops every rank once one exits, does not stop the printing rank before its line is out.
    # The printing rank exits at once, and the job with it.
    quiet_exit_delay_s = 0.0

    def should_print(self) -> bool:
        """Whether this process prints the line. Errors raised after the ranks agreed on them
        (ctx.fail_together) are printed by rank 0 alone; see the subclasses."""
        return True


def exit_quietly_after_the_printer(seconds: float) -> None:
    """Before a rank that prints nothing exits: torchrun stops every rank within 0.1 s of the first
    exit, so the rank that prints the line gets `seconds` to do so (a rank still importing torch on a
    loaded host would otherwise be stopped before its line is out). The printing rank's exit ends
    this wait, torchrun stopping the job; a process that is not a torchrun worker does not wait."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(seconds)


def node_prints() -> bool:
    """Whether this process is the one of its node that prints an error every rank of the node
    reaches alike (each node has its own console): local rank 0."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


class ConfigError(UserError):
    """A flag that cannot work here (e.g. --backend nccl without GPUs); exit 2 like argparse.
    Found before any process group exists, from the flags and the node's hardware, so every rank
    of a node reaches the same verdict: local rank 0 prints it, once per node (each node has its
    own console)."""

    exit_code = 2
    quiet_exit_delay_s = 10.0  # local rank 0 reaches the same verdict at the same point

    def should_print(self) -> bool:
        return node_prints()


class PeerFailed(UserError):
    """Another rank hit a UserError and printed it; this rank exits non-zero without repeating it."""

    quiet_exit_delay_s = 3.0  # rank 0 prints right after the agreement (it may be on another node)

    def should_print(self) -> bool:
        return False


class WaitExpired(UserError):
    """A rank gave up waiting on the job's store for another process's work (a node's data, rank 0's
    storage I/O): that process stopped responding or overran its deadline. The ranks cannot agree
    on it in a collective (the process they waited for may be gone), so each rank decides alone and
    the first waiting rank of each node prints the line (each node has its own console)."""

    quiet_exit_delay_s = 3.0

    def __init__(self, message: str, prints: bool) -> None:
        super().__init__(message)
        self.prints = prints

    def should_print(self) -> bool:
        return self.prints


class PeerVanished(UserError):
    """A peer process ended without a word (killed by a signal, a crash in native code) while this
    rank waited for it. common/parallel/failures.py words it (who, on which host, during what, at which
    step); the lowest surviving rank of each host prints it, unless the launcher names the failure
    itself (launch/quiet_torchrun.py: it knows how the peer ended and joins that to this line)."""

    # No quiet delay: torchrun stops every rank because the peer vanished, not because this one exits.

    def __init__(self, message: str, ranks: tuple[int, ...] = (), prints: bool = True, where: str = "") -> None:
        super().__init__(message)
        self.ranks, self.prints, self.where = ranks, prints, where  # where: "during ... at step N"

    def should_print(self) -> bool:
        return self.prints


class Crashed(UserError):
    """This rank raised an error no one handled (a bug): its traceback is printed, then one line
    saying which rank, where and when."""


def first_line(error: BaseException, with_type: bool = False) -> str:
    """An error's message cut to one line for a one-line error (its type's name if it has none);
    with_type: as `Type: first line`, for an error whose type says what its message does not."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    return f"{type(error).__name__}: {lines[0][:200]}" if with_type else lines[0][:200]
