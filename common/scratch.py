"""Temporary folders that outlive no process for long.

A folder in TMPDIR that a process deletes as it ends stays forever when the process is killed first
(SIGKILL, the OOM killer, a chaos test). So each one is named for its host and process
(PREFIX.HOST-PID-RANDOM), and the next process of the same kind on that host deletes those whose
process is gone before it makes its own.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path


def make(prefix: str) -> Path:
    """A new folder PREFIX.HOST-PID-RANDOM in TMPDIR, once the ones of dead processes are deleted."""
    sweep(prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}.{socket.gethostname()}-{os.getpid()}-"))


def sweep(prefix: str) -> None:
    """Delete this host's PREFIX folders whose process is gone."""
    mine = f"{prefix}.{socket.gethostname()}-"
    for left in Path(tempfile.gettempdir()).glob(f"{glob.escape(mine)}*"):
        # PID-RANDOM and nothing more (mkdtemp's RANDOM has no "-"): HOST-N-PID-RANDOM is host HOST-N's,
        # in a TMPDIR that several hosts share
        named = re.fullmatch(r"(\d+)-[^-]+", left.name[len(mine):])
        if named and not process_alive(int(named[1])):
            shutil.rmtree(left, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        pass
    return True
