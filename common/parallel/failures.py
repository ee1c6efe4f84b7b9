"""How a failure speaks: one line naming the rank that ended, its host, how it ended, and what the
job was doing then, whatever the launcher and the transport.

Who can know what. A rank killed by a signal (the OOM killer's SIGKILL, a segfault) says nothing.
Its launcher, torchrun's agent, learns its exit status, pid and host. The surviving ranks learn
that it vanished (its gloo sockets close; the shared-memory transport sees its pid gone) and know
what they were doing then: the step and the phase. A rank that raises knows all of it itself.

So a rank that raises prints its traceback and one line; the survivors of a vanished rank print
one line naming it (the lowest survivor on each host), or, under launch/quiet_torchrun.py, leave
that line in torchrun's error file, where the agent joins how the rank ended to it and prints the
one line itself (LAUNCHER_NAMES_FAILURES tells the workers so). A rank whose call to the job's
store fails (its host, torchrun's agent, died) is not a crash: each rank that meets it prints one
line, itself (that agent, the launcher that would speak for it, is gone).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from types import TracebackType
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from common.errors import ConfigError, Crashed, PeerVanished, UserError
from common.orphans import said_why_it_ends
from common.parallel.procs import exit_code, running

if TYPE_CHECKING:
    from common.parallel.context import DistContext

T = TypeVar("T")
Peers = tuple[tuple[str, int], ...]  # every rank's (host, pid), in rank order
LAUNCHER_NAMES_FAILURES = "DP_SUITE_LAUNCHER_NAMES_FAILURES"  # set by launch/quiet_torchrun.py for its workers
SPOKEN = "failure-told/"  # store key prefix: this rank printed its own failure
VANISH_GRACE_S = 2.0  # a closed socket comes a little before its process is gone: how long to look for it
LOST_CONNECTION = ("/gloo/transport/", "Connection closed by peer", "Connection reset by peer")

# SIGKILL: a user's kill -9 and a scheduler send it too, so the OOM killer is a possibility, not the cause.
SIGNAL_HINTS = {signal.SIGKILL: " (the out-of-memory killer sends it too: dmesg names what it killed)",
                signal.SIGSEGV: " (a crash in native code)",
                signal.SIGBUS: " (a crash in native code, or /dev/shm ran out)",
                signal.SIGABRT: " (aborted by native code)", signal.SIGILL: " (a crash in native code)",
                signal.SIGFPE: " (a crash in native code)"}

# What the job was doing, by the functions of the loop (common/train/trainer.py) on the failing stack,
# the innermost first. Inside a training step the only talk between ranks is the gradient exchange.
PHASES = {"evaluate": "the evaluation", "check_equivalence": "the equivalence check", "save": "a checkpoint save",
          "check_replicas": "the replica check", "flush": "the exchange of step metrics",
          "agreed_signal": "the stop check", "begin_step": "the stop check",
          "end_of_step": "the synchronization after a step"}
STEP_PHASE = {True: "the gradient exchange", False: "the training step"}  # keyed by: a peer vanished


def host() -> str:
    return socket.gethostname()


def how_it_ended(exitcode: int) -> str:
    """torchrun's exit code of a worker (negative: the signal that killed it), in words."""
    if exitcode >= 0:
        return f"exited with status {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        return f"was killed by signal {-exitcode}"
    return f"was killed by {name}{SIGNAL_HINTS.get(signal.Signals(-exitcode), '')}"


def told(error: Exception, ctx: DistContext | None) -> UserError:
    """The error as the failure it ends this rank with, said once: torchrun's error file, then the
    console (a crash's traceback first)."""
    if getattr(error, "told", False):
        return error  # type: ignore[return-value]
    failure = explained(error, ctx)
    failure.told = True  # type: ignore[attr-defined]
    if isinstance(failure, Crashed):
        traceback.print_exception(error)  # a bug: its traceback is what fixes it
        _mark_spoken(ctx)
    else:  # torchrun's report (and quiet_torchrun's line) then says why
        report_to_torchrun(failure)
    if failure.should_print():
        print(f"{failure.prefix}{failure}", file=sys.stderr, flush=True)
        said_why_it_ends()
    return failure


def is_handled(error: Exception) -> bool:
    """An error that says itself (a UserError) rather than one told here."""
    return isinstance(error, UserError) and not isinstance(error, PeerVanished)


def explained(error: Exception, ctx: DistContext | None) -> UserError:
    if is_handled(error):
        return error  # type: ignore[return-value]
    # Imported once a rank fails, not with this module: launch/quiet_torchrun.py imports it before torch.
    from common.parallel.context import STORE_FAILURES, store_failed
    if isinstance(error, STORE_FAILURES):  # before lost_connection: a store's socket says "Connection reset" too
        return UserError(f"{_me(ctx)} ends: {store_failed(error)} {doing(error.__traceback__, False)}; its host "
                         "(torchrun's agent, or the rendezvous host) ended or did not answer in time")
    peer_vanished = isinstance(error, PeerVanished) or lost_connection(error)
    where = doing(error.__traceback__, peer_vanished)
    if isinstance(error, PeerVanished):
        return vanished(ctx, error.ranks, where, str(error))
    if peer_vanished:
        return vanished(ctx, _wait_for_vanished(ctx.peers if ctx else ()), where, _gloo_words(str(error)))
    return Crashed(f"{_me(ctx)} failed with {type(error).__name__} {where} (traceback above)")


def _me(ctx: DistContext | None) -> str:
    """'rank 1 (pid 4242) on node-a': this process (ctx: None before the process group is joined)."""
    return f"rank {_rank(ctx)} (pid {os.getpid()}) on {host()}"


def _rank(ctx: DistContext | None) -> int:
    return ctx.rank if ctx else int(os.environ.get("RANK", 0))


def lost_connection(error: BaseException) -> bool:
    """A process group's error saying a peer stopped answering: a gloo socket closed or timed out."""
    return any(words in str(error) for words in LOST_CONNECTION)


def vanished(ctx: DistContext | None, ranks: tuple[int, ...], where: str, detail: str) -> PeerVanished:
    """ctx: None before the process group is joined (then the ranks' hosts and pids are unknown)."""
    rank, peers, me = _rank(ctx), ctx.peers if ctx else (), _me(ctx)
    if ranks and peers:
        who = " and ".join(f"rank {r} (pid {peers[r][1]}) on {peers[r][0]} {_how_peer_ended(peers[r][1])}"
                           for r in ranks)
        message = f"{who} {where}; {me} ends with it"
    else:  # on another host (that host's launcher can say which), or before the ranks were known
        message = f"{me} lost its connection to a peer ({detail}) {where}"
    prints = _prints(rank, peers, ranks) and not (ranks and all(_spoke(ctx, r) for r in ranks))
    return PeerVanished(message, ranks, prints=prints, where=where)


def _how_peer_ended(pid: int) -> str:
    code = exit_code(pid)
    return "ended" if code is None else how_it_ended(code)


def _prints(rank: int, peers: Peers, gone: tuple[int, ...]) -> bool:
    """The lowest surviving rank of this host prints, unless the launcher names the failure itself."""
    if os.environ.get(LAUNCHER_NAMES_FAILURES):
        return False
    here = [r for r, (name, _) in enumerate(peers) if name == host() and r not in gone]
    return rank == min(here, default=rank)


def _mark_spoken(ctx: DistContext | None) -> None:
    """Tell the survivors, through the job's store, that this rank printed why it ends: they need not."""
    if ctx is not None and ctx.store is not None:
        try:
            ctx.store.set(f"{SPOKEN}{ctx.rank}", "1")
        except RuntimeError:  # the store is gone too: the survivors then speak as well
            pass


def _spoke(ctx: DistContext | None, rank: int) -> bool:
    try:
        return ctx is not None and ctx.store is not None and ctx.store.check([f"{SPOKEN}{rank}"])
    except RuntimeError:  # the store went with the job: say it rather than stay silent
        return False


def _wait_for_vanished(peers: Peers) -> tuple[int, ...]:
    """The ranks on this host whose process is gone, waiting up to VANISH_GRACE_S for one."""
    deadline = time.monotonic() + VANISH_GRACE_S
    while peers:
        gone = tuple(r for r, (name, pid) in enumerate(peers) if name == host() and not running(pid))
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.05)
    return ()


def _gloo_words(message: str) -> str:
    """gloo's own words without its source path and advice: 'Read error [10.0.0.2]:8581: Connection reset by peer'."""
    first = message.splitlines()[0] if message else ""
    return first.split("] ", 1)[-1].split(". ", 1)[0]


def doing(tb: TracebackType | None, peer_vanished: bool) -> str:
    """'during the gradient exchange at step 180': what the loop was doing when `tb` was raised."""
    names = [frame.f_code.co_name for frame in _frames(tb)]
    phase = next((PHASES[n] for n in reversed(names) if n in PHASES), None)
    if phase is None and "train_step" in names:
        phase = STEP_PHASE[peer_vanished]
    if phase is None:
        phase = "the set-up" if "train" in names else "joining or leaving the process group"
    return f"during {phase}{_when(tb)}"


def _when(tb: TracebackType | None) -> str:
    """' at step N' (counted from 1), ' after step N', or ' in epoch E', from the loop's locals."""
    for frame in reversed(list(_frames(tb))):
        local, name = frame.f_locals, frame.f_code.co_name
        if name == "after_step" and "step" in local:
            return f" after step {local['step']}"
        if name == "train_epoch" and "global_step" in local:
            return f" at step {local['global_step'] + 1}"
        if name == "fit" and "epoch" in local:
            return f" in epoch {local['epoch'] + 1}"
    return ""


def _frames(tb: TracebackType | None) -> Iterator:
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def parsed_telling_torchrun(parse: Callable[[], T]) -> T:
    """parse(): argparse's refusal of a flag (SystemExit 2, its line printed by rank 0 alone) is also
    told to torchrun as a handled error, so that launch/quiet_torchrun.py shows that line alone."""
    try:
        return parse()
    except SystemExit as ended:
        if ended.code:
            report_to_torchrun(ConfigError("a flag was refused (the line above says which)"))
        raise


def report_to_torchrun(error: UserError) -> None:
    """Tell torchrun (through its per-rank error file) that this rank ended on a handled error, so its
    summary says why and launch/quiet_torchrun.py can keep the console to our one line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:  # the format torch.distributed.elastic's @record writes
            json.dump({"message": {"message": f"{type(error).__name__}: {error}",
                                   "extraInfo": {"py_callstack": "(handled; printed as one line above)",
                                                 "timestamp": str(int(time.time())),
                                                 "where": getattr(error, "where", "")}}}, f)
    except FileNotFoundError:  # a killed agent's folder, swept by the next launch: no agent is left to read it
        pass
