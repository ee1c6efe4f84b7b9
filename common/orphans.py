"""A torchrun worker whose agent died ends, whatever it is doing.

torchrun's agent supervises its workers: it restarts them, stops them, and tells the launcher how
they ended. A worker whose agent is SIGKILLed (an out-of-memory kill, an operator, a chaos test) is
re-parented and would go on unsupervised: a replica group nothing restarts or stops, holding its
port and its GPU, or a rank that waits out a collective's timeout. Its agent may die at any moment,
during set-up too (importing torch, reading data, joining the process group), so a thread started
at the package's import watches the parent and ends the process with one line when it changes
(none more where the process already printed the line it ends with: a store the agent hosted
failed under it, common/parallel/failures.py).
"""
from __future__ import annotations

import os
import threading
import time

POLL_S = 0.5  # how soon an orphan notices; one getppid() per poll costs nothing
# Set once this process printed the line it ends with (common/parallel/failures.py): an agent's death
# it meets then (the store the agent hosted failed under it) ends it without a second line.
SAID = threading.Event()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def end_when_the_agent_dies() -> None:
    """Start the watch on this process's parent (torchrun's agent). And, before torch is imported: no
    C++ warnings from c10d by default (TORCH_CPP_LOG_LEVEL=WARNING brings them back), whose dumps of C++
    frames (a store's connection closed when the agent or a peer died) would say again, as a
    traceback, what the one line says."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    agent = os.getppid()
    threading.Thread(target=_watch, args=(agent,), name="agent-watch", daemon=True).start()


def said_why_it_ends() -> None:
    SAID.set()


def _watch(agent: int) -> None:
    while os.getppid() == agent:
        time.sleep(POLL_S)
    rank = os.environ.get("RANK", "?")
    # os.write and os._exit: the main thread may be anywhere (printing, in a collective, in native code)
    try:
        if not SAID.is_set():
            os.write(2, f"error: rank {rank}'s torchrun agent (pid {agent}) is gone: this worker stops rather than "
                        "train on unsupervised (its checkpoints are kept: the same command resumes)\n".encode())
    except OSError:
        pass  # the agent held the read end of stderr: gone with it (EPIPE); the exit must not be
    finally:
        os._exit(1)
