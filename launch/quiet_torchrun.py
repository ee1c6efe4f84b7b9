"""torchrun, without its failure dump when the workers ended on an error they reported themselves.

    python3 launch/quiet_torchrun.py --standalone --nproc_per_node=2 train_ddp.py ...

launch/single_node.sh runs it so. It imports the suite's package (common), found where it is
installed (pip install -e .) or, as single_node.sh does, through PYTHONPATH=<the repository>.

The training scripts print a handled error (missing data, a bad flag, a stop by SIGTERM) as one
line and note it in torchrun's per-rank error file. When every failed worker did that (or was
stopped by torchrun after another one did), this exits with the worker's status and prints
nothing more. Any other failure (a crash) gets torchrun's full report, as plain torchrun would.
"""
from __future__ import annotations

import sys

from common.collector import pause_during_set_up, resume_for_training

if __name__ == "__main__":
    pause_during_set_up()  # torch's import below without full collections, and no final one at exit (see there)

import logging  # noqa: E402
import logging.handlers  # noqa: E402

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.run import parse_args, run  # noqa: E402

HANDLED = ("UserError", "ConfigError", "PeerFailed", "Preempted")


def text(message: str | dict) -> str:
    """A failure's message: a string, or the dict an error file holds ({"message": ..., ...})."""
    return message.get("message", "") if isinstance(message, dict) else message


def handled(error: ChildFailedError) -> int | None:
    """The exit status to end with quietly, or None if some worker failed another way."""
    failures = list(error.failures.values())
    reported = [f for f in failures if text(f.message).startswith(HANDLED)]
    # Every worker either reported its handled error or was stopped by torchrun after a peer did.
    if not reported or not all(f in reported or f.exitcode < 0 for f in failures):
        return None
    return next((f.exitcode for f in reported if f.exitcode > 0), 1)


def main() -> None:
    # torchrun's own log lines ("failed (exitcode: 1)", "Sending process ... SIGTERM") are held back
    # and shown only if the failure turns out not to be a handled one.
    held = logging.handlers.MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1,
                                          target=logging.StreamHandler(sys.stderr))
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.addHandler(held)
    elastic.propagate = False
    resume_for_training()  # the agent watches its workers for the whole run: its garbage is collected
    try:
        run(parse_args(sys.argv[1:]))
    except ChildFailedError as error:
        status = handled(error)
        if status is None:
            held.flush()
            raise
        held.setTarget(None)  # logging flushes handlers at exit: drop the held lines for good
        sys.exit(status)
    held.flush()


if __name__ == "__main__":
    main()
