"""torchrun, without its failure dump when the workers ended on an error they reported themselves.

    python3 launch/quiet_torchrun.py --standalone --nproc_per_node=2 train_ddp.py ...

launch/single_node.sh runs it so. It imports the suite's package (common), found where it is
installed (pip install -e .) or, as single_node.sh does, through PYTHONPATH=<the repository>.

The training scripts print a handled error (missing data, a bad flag, a stop by SIGTERM) as one
line and note it in torchrun's per-rank error file. When every failed worker did that (or was
stopped by torchrun after another one did), this exits with the worker's status and prints
nothing more. A worker killed by a signal (the OOM killer's SIGKILL, a segfault) cannot speak:
this prints one line for it instead of torchrun's report, naming its rank, pid, host and signal,
and what the job was doing then (from the survivors' error files), and exits 1. Any other failure
(a crash: the worker printed its traceback and a line) gets torchrun's full report, as plain
torchrun would.

A training script that is not there is one line and status 2, before any worker starts.

torchrun keeps its workers' error files in a folder of TMPDIR that it never deletes, one per launch;
this gives it a folder of its own there and deletes it as it ends (kept after a crash, whose report
names the files in it, until the next launch on the host; see own_log_dir).

A run whose workers refused a flag (exit 2) is not restarted (--max-restarts): every restart would
refuse it again.

It also gives the workers STOP_GRACE_S (not torchrun's 30 s) to stop after a TERM or INT, and then
ends with one line and status 128+N, not torchrun's traceback of the signal. A Ctrl-C before the
workers start (while torch loads, during the rendezvous) ends it with the line its workers would
say (common/interrupts.py: a training script's start-up line, evaluate.py's own) and status 130,
not a KeyboardInterrupt traceback.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

from common import scratch
from common.collector import pause_during_set_up, resume_for_training
from common.interrupts import STARTUP_LINE, ctrl_c_line, end_now, says_on_ctrl_c
from common.parallel.failures import LAUNCHER_NAMES_FAILURES, host, how_it_ended


def workers_line(argv: list[str]) -> str:
    """The line the workers would say for a Ctrl-C at start-up, read before torch loads (torchrun's
    parser needs it): that of the first argument naming a program common/interrupts.py knows (the
    script: no torchrun option takes a .py file; tests/patched.py's script comes after its patches),
    else a training script's."""
    programs = (os.path.basename(arg) for arg in argv[1:] if arg.endswith(".py"))
    return next(filter(None, map(ctrl_c_line, programs)), STARTUP_LINE)


if __name__ == "__main__":
    # Until torchrun's own handler takes the signals, as it starts the workers: nothing to pass on before.
    # No watcher thread (common/interrupts.py): it would go on ending the agent after torchrun took over.
    says_on_ctrl_c(workers_line(sys.argv))
    signal.signal(signal.SIGINT, lambda signum, frame: end_now(signum))
    pause_during_set_up()  # torch's import below without full collections, and no final one at exit (see there)

import logging  # noqa: E402
import logging.handlers  # noqa: E402

from torch.distributed.elastic.multiprocessing import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure  # noqa: E402
from torch.distributed.run import parse_args, run  # noqa: E402

HANDLED = ("UserError", "ConfigError", "PeerFailed", "Preempted", "WaitExpired")
VANISHED = "PeerVanished: "  # a survivor's error file: the worker it waited for vanished
CLOSING = "Sending process %s closing signal %s"  # torchrun's log line as it stops the other workers
# After forwarding a TERM or INT, torchrun waits this long for the workers before it sends SIGKILL;
# its own default (LaunchConfig.shutdown_timeout: 30 s) can cut the stop's checkpoint save short.
STOP_GRACE_S = 120
LOG_DIR_PREFIX = "quiet_torchrun"  # the agent's own folder for torchrun's error files (own_log_dir)


def give_workers_time_to_stop() -> None:
    """torchrun reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT when --shutdown-timeout is not given (torch
    releases of 2026 on; older ones keep 30 s). A value the caller set wins."""
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(STOP_GRACE_S))


def text(message: str | dict) -> str:
    """A failure's message: a string, or the dict an error file holds ({"message": ..., ...})."""
    return message.get("message", "") if isinstance(message, dict) else message


def handled(error: ChildFailedError, stopped: set[int]) -> int | None:
    """The exit status to end with quietly, or None if some worker failed another way."""
    failures = list(error.failures.values())
    reported = [f for f in failures if text(f.message).startswith(HANDLED)]
    # Every worker either reported its handled error or was stopped by torchrun after a peer did.
    if not reported or not all(f in reported or f.pid in stopped for f in failures):
        return None
    return next((f.exitcode for f in reported if f.exitcode > 0), 1)


def stopped_by_torchrun(records: list[logging.LogRecord]) -> set[int]:
    """The pids torchrun sent its closing signal (after another worker failed), from its held log lines."""
    return {int(r.args[0]) for r in records if r.msg == CLOSING and isinstance(r.args, tuple)}


def signal_lines(error: ChildFailedError, stopped: set[int]) -> list[str] | None:
    """One line per worker that a signal killed (torchrun did not stop it: it died first), joined to
    what the survivors were doing; or the lowest survivor's line when the vanished worker ran on
    another node; None if some worker failed another way (a crash: torchrun's report)."""
    failures = sorted(error.failures.items())
    vanished = [(rank, f) for rank, f in failures if text(f.message).startswith(VANISHED)]
    culprits = [(rank, f) for rank, f in failures if f.pid not in stopped and (rank, f) not in vanished]
    if any(f.exitcode >= 0 for _, f in culprits) or not (culprits or vanished):
        return None
    if not culprits:
        return [f"error: {text(vanished[0][1].message).removeprefix(VANISHED)}"]
    where = next((doing for doing in map(survivor_saw, (f for _, f in vanished)) if doing), "")
    return [f"error: rank {rank} (pid {f.pid}) on {host()} {how_it_ended(f.exitcode)} {where}".rstrip()
            for rank, f in culprits]


def survivor_saw(failure: ProcessFailure) -> str:
    """What a survivor was doing as its peer vanished ("during the gradient exchange at step 180"),
    from its error file (common/parallel/failures.py, report_to_torchrun)."""
    return failure.error_file_data["message"]["extraInfo"].get("where", "")


def no_restart_after_a_refused_flag() -> None:
    """torchrun restarts failed workers up to --max-restarts times (elastic.sh: 20): a refused flag
    (a ConfigError, exit 2) is refused again by every restart, so a run whose failed workers all
    reported one ends at once, with its line. Wraps the agent's check of its workers."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers

    def monitored(agent: LocalElasticAgent, group: object) -> object:
        result = monitor(agent, group)
        ended = [f for f in result.failures.values() if f.exitcode > 0]  # not those torchrun signalled
        if ended and all(text(f.message).startswith("ConfigError") for f in ended):
            agent._remaining_restarts = 0
        return result
    LocalElasticAgent._monitor_workers = monitored


def missing_script(args: object) -> str | None:
    """The line for a training script that is not there, before any worker starts: each of them
    would print Python's "can't open file", then torchrun its failure dump."""
    script = args.training_script
    if args.module or args.no_python or os.path.isfile(script):
        return None
    return (f"error: {script}: no such file, the script torchrun is to run; give its path from this folder "
            f"({os.getcwd()}) or an absolute one")


def own_log_dir(args: object) -> Path | None:
    """torchrun keeps its workers' error files in a folder of TMPDIR that it never deletes (one per
    launch: thousands after a test suite); this agent gives it one of its own (common/scratch.py) and
    deletes it as it ends. Not when the caller chose the folder (--log-dir, --logs-specs) or asked for
    the workers' output in it (--redirects, --tee): those files are theirs to keep."""
    if args.log_dir or args.logs_specs or str(args.redirects) != "0" or str(args.tee) != "0":
        return None
    args.log_dir = str(scratch.make(LOG_DIR_PREFIX))
    return Path(args.log_dir)


def log_dir_in_the_way(args: object) -> str | None:
    """The line for a --log-dir that is a file (torchrun: a NotADirectoryError traceback)."""
    if not (args.log_dir and os.path.isfile(args.log_dir)):
        return None
    return (f"error: --log-dir {args.log_dir}: a file, where torchrun keeps its workers' error files (and logs); give "
            "a folder, or leave the flag out")


def main() -> None:
    args = parse_args(sys.argv[1:])
    if (refused := missing_script(args) or log_dir_in_the_way(args)) is not None:
        print(refused, file=sys.stderr, flush=True)
        sys.exit(2)
    # torchrun's own log lines ("failed (exitcode: 1)", "Sending process ... SIGTERM") are held back
    # and shown only if the failure turns out not to be a handled one.
    held = logging.handlers.MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1,
                                          target=logging.StreamHandler(sys.stderr))
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.addHandler(held)
    elastic.propagate = False
    resume_for_training()  # the agent watches its workers for the whole run: its garbage is collected
    os.environ[LAUNCHER_NAMES_FAILURES] = "1"  # the workers leave the naming of a vanished peer to signal_lines
    no_restart_after_a_refused_flag()
    if str(args.nproc_per_node).isdigit() and int(args.nproc_per_node) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets then, without its five-line banner
    logs, crashed = own_log_dir(args), False
    try:
        run(args)
    except ChildFailedError as error:
        stopped = stopped_by_torchrun(held.buffer)
        status, lines = handled(error, stopped), signal_lines(error, stopped)
        if status is None and lines is None:
            held.flush()
            crashed = True  # torchrun's report names the error files: they stay (until the next launch's sweep)
            raise
        held.setTarget(None)  # logging flushes handlers at exit: drop the held lines for good
        if status is None:
            print("\n".join(lines), file=sys.stderr, flush=True)
        sys.exit(status or 1)
    except SignalException as stop:  # torchrun passed it on and waited for the workers: their lines say the rest
        held.setTarget(None)
        print(f"launcher: {stop.sigval.name} passed on to the workers; they have ended", file=sys.stderr, flush=True)
        sys.exit(128 + stop.sigval)
    finally:
        if logs and not crashed:
            shutil.rmtree(logs, ignore_errors=True)
    held.flush()


if __name__ == "__main__":
    give_workers_time_to_stop()
    main()
