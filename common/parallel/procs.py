"""A process's state from /proc (Linux), by pid: whether a peer still runs, how a zombie ended, when
it started, what it started and with which command."""
from __future__ import annotations

import os


def running(pid: int) -> bool:
    """False once the process has exited: gone, or a zombie its parent has not reaped yet."""
    if pid <= 0:
        return True  # not published yet
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def exit_code(pid: int) -> int | None:
    """A zombie's exit code as torchrun gives it (negative: killed by that signal), while its parent
    has not reaped it yet; None once it is gone (Linux 3.5+ keeps it in /proc/PID/stat)."""
    stat = _stat(pid)
    if stat is None or stat[0] != "Z" or len(stat) < 50:
        return None
    status = int(stat[49])  # field 52, exit_code: a waitpid(2) status
    return -(status & 0x7F) if status & 0x7F else status >> 8


def start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (field 22): with the pid, which process
    it is (a pid is reused); None if there is no such process."""
    stat = _stat(pid)
    return int(stat[19]) if stat is not None and len(stat) > 19 else None


def children(pid: int) -> list[int]:
    """The processes `pid`'s main thread started (a torchrun agent's workers); [] once it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            return [int(child) for child in listing.read().split()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: its children, theirs, and so on (in process groups of their own too)."""
    below: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            below.setdefault(int(stat[1]), []).append(int(entry.name))  # field 4: the parent
    found, todo = [], [pid]
    while todo:
        children_of = below.get(todo.pop(), [])
        found += children_of
        todo += children_of
    return found


def command_line(pid: int) -> str:
    """Its arguments joined by spaces; "" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as arguments:
            return arguments.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from its third field (the state) on, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
