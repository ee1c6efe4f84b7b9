"""Node-local cache folders: where data from a store is copied and decoded tensors are kept, the
lock that makes one process per node (or per shared volume) do the work, and the raw tensor files
every rank of a node maps (shared pages, no copy)."""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import secrets
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from common.errors import UserError
from common.parallel.context import POLL_S, PROGRESS_EVERY_S

META = "meta.json"


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dp-suite")


def cache_folder(cache_dir: str, url: str) -> Path:
    """One local folder per data URL: s3://bucket/prefix -> CACHE/s3/bucket/prefix."""
    protocol, _, rest = url.partition("://")
    return Path(cache_dir or default_cache_dir()) / protocol / rest.strip("/")


@contextmanager
def file_lock(path: Path, say: Callable[[str], None] = lambda line: None) -> Iterator[None]:
    """An exclusive lock across processes and, on shared volumes that support it (NFS), nodes.
    The holder's own work is bounded (store timeouts, --storage-timeout-s around the data preparation).
    A lock file deleted while this process waited on it (its holder removed it: remove_lock, a failed
    download) is locked again as newly made: two holders, one of the deleted file and one of its
    successor, would both do the work."""
    started = last = time.monotonic()
    while True:
        with open(path, "a") as handle:
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() - last >= PROGRESS_EVERY_S:
                        say(f"waiting for another process fetching into {path.parent} "
                            f"({time.monotonic() - started:.0f} s)")
                        last = time.monotonic()
                    time.sleep(POLL_S)
            try:
                if _still_named(handle.fileno(), path):
                    yield
                    return
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _still_named(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (not deleted, nor replaced, since it was opened)."""
    try:
        named, held = os.stat(path), os.fstat(fd)
    except OSError as e:  # deleted; on NFS, deleted by another node (ESTALE): lock its successor
        if e.errno in (errno.ENOENT, errno.ESTALE):
            return False
        raise
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def remove_lock(lock: Path) -> None:
    """Delete a lock file no process of this version uses, unless a process holds it. Deleted while
    held here, so a process waiting on it finds it gone and locks its successor (file_lock)."""
    try:
        # open for writing, as file_lock does: on NFS an exclusive flock is a write lock, refused
        # (EBADF) on a file open only for reading; "r+": a missing lock is not made
        with open(lock, "r+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            lock.unlink()
    except (FileNotFoundError, BlockingIOError, PermissionError):
        pass  # gone already; in use (its holder fetches the copy again); another user's, which this one cannot lock


def cache_error(folder: Path, error: OSError, budget_flag: str = "") -> UserError:
    """A write into the cache that failed, in one line naming --cache-dir and what to do (for a
    full disk under a bounded cache, its budget's flag too: the bound may be above the room)."""
    room = f", pass a smaller {budget_flag}" if budget_flag else ""
    advice = CACHE_ADVICE.get(error.errno, CACHE_ADVICE[None]).format(room=room)
    return UserError(f"--cache-dir {folder}: {error.strerror or error}; {advice}")


CACHE_ADVICE = {errno.ENOSPC: "free space there{room}, or pass another --cache-dir",
                errno.EDQUOT: "free space in your quota there{room}, or pass another --cache-dir",
                errno.EROFS: "pass a --cache-dir on a writable file system",
                errno.EACCES: "make it writable for this user, or pass another --cache-dir",
                errno.ENOTDIR: "a part of that path is a file, not a folder: pass another --cache-dir",
                errno.EEXIST: "a part of that path is a file, not a folder: pass another --cache-dir",
                errno.EISDIR: "a file it needs there is a folder: pass another --cache-dir",
                None: "pass a --cache-dir that is a writable folder with room"}


def staging_path(target: Path) -> Path:
    """A temp name beside `target`, unique across processes and hosts (two pods share a pid; a
    --cache-dir on NFS is shared by nodes): .NAME.tmp-HOST-PID-RANDOM."""
    return target.with_name(f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")


_HELD: dict[Path, object] = {}  # lock -> its handle: the cache folders this process maps, until it exits


def hold_shared(lock: Path) -> None:
    """Marks the cache folder of `lock` in use by this process for as long as it lives (a shared
    flock, released by the kernel when the process ends, however it ends). Eviction, on any node
    sharing the cache, skips a folder in use: on NFS, deleting a file another client maps makes
    that client's next page fault a SIGBUS."""
    if lock not in _HELD:
        try:
            handle = open(lock, "a")  # a read-only cache is refused here, where every run starts
        except OSError as e:
            raise cache_error(lock.parent, e) from None
        fcntl.flock(handle, fcntl.LOCK_SH)
        _HELD[lock] = handle


@contextmanager
def unused(lock: Path) -> Iterator[bool]:
    """Whether no process holds the folder of `lock` (exclusively locked meanwhile, so none starts to)."""
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def sweep_staging(parent: Path, target: Path | None = None,
                  lock_for: Callable[[str], Path] | None = None) -> None:
    """Delete what builds killed mid-way left in `parent`: a staging .NAME.tmp-* whose build lock
    (lock_for(NAME), by default .NAME.lock in `parent`) no process holds (flock is released when its
    holder dies, on any node sharing the volume). The caller holds `target`'s build lock: its
    leftovers go too."""
    for staging in parent.glob(".*.tmp-*"):
        name = staging.name[1:].rsplit(".tmp-", 1)[0]  # the last: a shard or parquet file's name may hold ".tmp-"
        with unused(lock_for(name) if lock_for else parent / f".{name}.lock") as free:
            if free or (target is not None and name == target.name):
                shutil.rmtree(staging, ignore_errors=True) if staging.is_dir() else staging.unlink(missing_ok=True)


def lock_of(folder: Path) -> Path:
    """The lock a cache folder (or file) is built under: beside it, .NAME.lock."""
    return folder.parent / f".{folder.name}.lock"


def use_lock_of(folder: Path) -> Path:
    """The lock a cache folder's users hold shared, and eviction exclusive: beside it, .NAME.use.
    Not the build lock: a builder that goes on to use its folder would otherwise hold the build
    lock shared forever, and a second preparer waiting to build would wait as long."""
    return folder.parent / f".{folder.name}.use"


def write_atomically(path: Path, text: str) -> None:
    """A small file under its final name only when whole: a full disk or a kill leaves the old file
    or none, never a cut one that breaks every later run."""
    tmp = staging_path(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_tensors(folder: Path, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> None:
    """Each tensor as a raw file, their shapes and dtypes (and `meta`) in meta.json, written last."""
    for name, tensor in tensors.items():
        tensor.contiguous().numpy().tofile(folder / name)
    shapes = {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
              for name, t in tensors.items()}
    (folder / META).write_text(json.dumps({"tensors": shapes, **(meta or {})}))


def read_meta(folder: Path) -> dict:
    return json.loads((folder / META).read_text())


def map_tensors(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors write_tensors wrote (those whose name starts with `prefix`), memory-mapped:
    every rank maps the same pages."""
    return {name: _mapped(folder / name, s["shape"], getattr(torch, s["dtype"]))
            for name, s in read_meta(folder)["tensors"].items() if name.startswith(prefix)}


def _mapped(path: Path, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    if not math.prod(shape):
        return torch.empty(shape, dtype=dtype)  # an empty file cannot be mapped
    return torch.from_file(str(path), shared=False, size=math.prod(shape), dtype=dtype).view(shape)
