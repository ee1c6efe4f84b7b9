"""Shards from an object store through a bounded node-local cache.

Each shard is fetched once per node into --cache-dir (under a per-shard file lock, to a temp name,
then renamed: every rank and worker of the node shares the copy, and a cut download never passes
for a shard) and kept while the cache holds at most its budget: beyond it, the least recently used
shards are deleted (a reader that has one open keeps reading it: Linux frees it on close). A
thread fetches the shards the coming batches need ahead of the workers that read them.

A copy costs the same bookkeeping however many the folder holds (thousands of small parquet row
groups): the cache's total size is kept in a ledger file updated under the eviction lock, temp
files are written in a staging subfolder that holds only fetches in flight (or killed), and the
folder is listed only to evict, down to a low-water mark so that a cache at its budget is not
listed at every miss.
"""
from __future__ import annotations

import errno
import hashlib
import math
import os
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, TypeVar

from common.config import SHUFFLE_WINDOW
from common.data.cache import cache_error, file_lock, remove_lock, staging_path, sweep_staging
from common.errors import UserError
from common.storage import StorageError, storage_for

# Eviction deletes down to this share of the budget: a cache at its budget is then listed once per
# 1/LOW_WATER_PARTS of its bytes fetched, not after every miss.
LOW_WATER_PARTS = 8
LEDGER = ".usage"  # the cached copies' total bytes, as the last fetch or eviction left it
STAGING = ".staging"  # temp files of fetches in flight, and of killed ones
# A copy's fetch lock is one of a fixed set, chosen by its name: one file per copy ever cached would
# pile up, and deleting them with their copies is unsafe where the cache is on NFS (a node's view of
# the folder lags: two nodes could each hold "the" lock). Two copies that share a lock fetch one after
# the other.
FETCH_LOCKS = ".locks"
FETCH_LOCK_COUNT = 256


OPEN_TRIES = 3
GONE = (errno.ENOENT, errno.ESTALE)  # a cached shard deleted by another process (ESTALE: on NFS, by another node)
T = TypeVar("T")


def fetch_lock(folder: Path, copy_name: str) -> Path:
    """The lock the fetch of the copy named `copy_name` into `folder` holds (FETCH_LOCKS)."""
    slot = int(hashlib.sha256(copy_name.encode()).hexdigest(), 16) % FETCH_LOCK_COUNT
    return folder / FETCH_LOCKS / f"{slot:02x}.lock"


class ShardCache:
    """Picklable (DataLoader workers each build their own store client on first use)."""

    SUFFIX = ".tar"  # what the cached copies' names end with: what eviction counts
    WHAT = "shard"  # what is cached, in a budget's error line
    SMALLER = "write smaller shards (python -m common.shards --shard-mb)"  # the other way out of a small budget

    def __init__(self, url: str, options: dict[str, Any], folder: Path, budget_bytes: int,
                 versions: dict[str, str], lanes: int = SHUFFLE_WINDOW) -> None:
        self.url, self.options, self.folder, self.budget = url.rstrip("/"), options, folder, budget_bytes
        self.least, self.lanes = min(least_held(lanes), max(1, len(versions))), lanes
        self.versions = versions  # shard name -> its version (size and ETag) in the store
        self.hits = self.misses = 0
        self._store, self._store_pid = None, 0

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_store": None, "_store_pid": 0}

    def local(self, name: str) -> Path:
        """The version-named local file a shard is cached as."""
        tag = hashlib.sha256(self.versions[name].encode()).hexdigest()[:12]
        return self.folder / f"{name.removesuffix('.tar')}.{tag}{self.SUFFIX}"

    def fetch_lock(self, copy_name: str) -> Path:
        return fetch_lock(self.folder, copy_name)

    def path(self, name: str) -> Path:
        """A local copy of shard `name`, fetched if the cache lacks it; marks it recently used. A
        cache that cannot be written (read-only, full) is one line naming --cache-dir."""
        target = self.local(name)
        try:
            if target.is_file():
                try:
                    os.utime(target)
                    self.hits += 1
                    return target
                except FileNotFoundError:  # evicted since: fetched again below
                    pass
            for folder in (STAGING, FETCH_LOCKS):
                (self.folder / folder).mkdir(parents=True, exist_ok=True)
            with file_lock(self.fetch_lock(target.name)):
                if target.is_file():  # another rank or worker fetched it meanwhile
                    self.hits += 1
                    return target
                # of a fetch killed while it held this lock (the staging folder holds only fetches in flight)
                with os.scandir(self.folder / STAGING) as entries:  # a prefix test: a glob compiles a pattern a call
                    for leftover in [e.path for e in entries if e.name.startswith(f".{target.name}.tmp-")]:
                        os.unlink(leftover)
                self._fetch(name, target)
                self.misses += 1
            return target
        except OSError as e:
            raise cache_error(self.folder, e, "--shard-cache-gb") from None

    def open(self, name: str) -> BinaryIO:
        """Shard `name` open for reading. Another process may evict it between the fetch and the
        open (the cache is short of room): then it is fetched again; once open it stays readable."""
        return self._retrying(name, lambda path: open(path, "rb"))

    def read(self, name: str, offset: int, size: int) -> bytes:
        """Bytes [offset, offset + size) of shard `name`. On NFS, a file another node evicted
        fails with ESTALE even while open here (NFS keeps no unlinked file for other clients):
        the read is retried on a fresh copy."""
        def read(path: Path) -> bytes:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(size)
        return self._retrying(name, read)

    def _retrying(self, name: str, use: Callable[[Path], T]) -> T:
        for _ in range(OPEN_TRIES - 1):
            try:
                return use(self.path(name))
            except OSError as e:
                if e.errno not in GONE:
                    raise
        return use(self.path(name))

    def _fetch(self, name: str, target: Path) -> None:
        part = staging_path(self.folder / STAGING / target.name)
        try:
            self._fill(name, part)
            self.publish(part, target)
        finally:
            part.unlink(missing_ok=True)

    def _fill(self, name: str, part: Path) -> None:
        """Writes the copy of `name` to `part`: a shard fetched from the store."""
        try:
            if self._store_pid != os.getpid():  # a forked worker holds its parent's client: s3fs refuses it
                self._store, self._store_pid = storage_for(self.url, self.options), os.getpid()
            self._store.get(name, part)
        except StorageError as e:
            raise UserError(f"--data-dir {e}; check the URL and the credentials") from None

    def evict(self) -> None:
        """Delete the least recently used shards until the cache is within its budget, and write
        the ledger; at start-up (a lowered --shard-cache-gb trims a cache that would otherwise only
        get hits, and the ledger is made true after anything outside the suite deleted files). The
        temp files of fetches killed mid-copy go too: a fetch of the same copy deletes its own, but
        one that is never fetched again (the set changed) would stay, outside the budget; and the
        fetch locks an older version left, one per copy."""
        if not self.folder.is_dir():
            return
        try:
            with file_lock(self.folder / ".evict.lock"):
                if (self.folder / STAGING).is_dir():
                    sweep_staging(self.folder / STAGING, lock_for=self.fetch_lock)
                self._evict(self.budget, None)
                self._sweep_locks()
        except OSError as e:
            raise cache_error(self.folder, e, "--shard-cache-gb") from None

    def publish(self, part: Path, target: Path) -> None:
        """Renames a fetched copy to `target` and counts it in the ledger, in one step under the
        eviction lock (an eviction between the two would count it twice), then evicts when the
        cache is over its budget: one small file read and written per copy, the folder listed
        only to evict (or when the ledger is missing or unreadable)."""
        with file_lock(self.folder / ".evict.lock"):
            size = part.stat().st_size
            os.replace(part, target)
            total = self._ledger()
            if total is None:
                self._evict(self.budget, target)
            elif total + size > self.budget:
                self._evict(self.low_water(), target)
            else:
                self._write_ledger(total + size)

    def discard(self, path: Path) -> None:
        """Deletes a damaged copy (see RowGroupCache.opened), and its bytes from the ledger."""
        with file_lock(self.folder / ".evict.lock"):
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:  # another process discarded it first
                return
            total = self._ledger()
            if total is not None:
                self._write_ledger(max(total - size, 0))

    def _ledger(self) -> int | None:
        """The ledger's total; None without one (a cache from before it) or with one cut short."""
        try:
            return int((self.folder / LEDGER).read_text())
        except (OSError, ValueError):
            return None

    def low_water(self) -> int:
        return self.budget - self.budget // LOW_WATER_PARTS

    def _evict(self, limit: int, keep: Path | None) -> None:
        """Under the eviction lock: the least recently used copies deleted until at most `limit`
        bytes are left, then the ledger written with what is left."""
        cached = sorted(self._copies(), key=lambda copy: copy[0])
        total = sum(size for _, size, _ in cached)
        for _, size, path in cached:
            if total <= limit:
                break
            if path != keep:
                total -= size
                path.unlink(missing_ok=True)
        self._write_ledger(total)

    def _sweep_locks(self) -> None:
        """Remove the fetch locks of the versions before FETCH_LOCKS (one .COPY.lock per copy ever
        cached), unless one is held: no process of this version waits on them."""
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if entry.name.startswith(".") and entry.name.endswith(f"{self.SUFFIX}.lock"):
                    remove_lock(Path(entry.path))

    def _write_ledger(self, total: int) -> None:
        (self.folder / LEDGER).write_text(str(total))

    def _copies(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of each cached copy, one stat each (the folder holds as many
        copies as the budget does: thousands of small row groups)."""
        copies = []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if entry.name.endswith(self.SUFFIX) and not entry.name.startswith(".") and entry.is_file():
                    info = entry.stat()
                    copies.append((info.st_mtime, info.st_size, Path(entry.path)))
        return copies

    def ahead(self) -> int:
        """How many shards the prefetcher may fetch beyond the one being read without evicting a
        shard that workers still read (eviction may go down to the low-water mark)."""
        return max(1, self.low_water() // max(self.largest(), 1) - self.least)

    def largest(self) -> int:
        """The largest shard's size, from its version (SIZE-TAG)."""
        return max(int(version.split("-")[0]) for version in self.versions.values())

    def check_budget(self) -> None:
        fewer = f", or fewer --shard-lanes (two windows of {self.lanes} are held)" \
            if self.lanes != SHUFFLE_WINDOW else ""
        check_budget(self.budget, self.largest(), self.least, "--shard-cache-gb", self.WHAT, self.SMALLER + fewer)


def least_held(lanes: int) -> int:
    """The shards (row groups) a node may read at once, which a budget must hold of the largest: the
    window of `lanes` being read (--shard-lanes; loader.global_order), and the next one that workers
    already read from while the first one's last batches are still in flight (a set of fewer
    shards: all of them)."""
    return 2 * lanes


def check_budget(budget_bytes: int, largest: int, least: int, flag: str, what: str = "shard",
                 smaller: str = ShardCache.SMALLER) -> None:
    if budget_bytes < least * largest:
        need = least * largest / 2**30
        digits = max(2, 2 - math.floor(math.log10(need)))  # three significant digits, rounded up: enough
        raise UserError(f"{flag} {budget_bytes / 2**30:g} holds fewer than {least} of the largest {what} "
                        f"({largest / 2**20:.2f} MB); pass {flag} {math.ceil(need * 10**digits) / 10**digits:g} or "
                        f"more, or {smaller}")


class Prefetcher:
    """Fetches shards in the order the coming batches first need them, at most `ahead` shards
    beyond the one being read, on a thread (fetching is I/O: it does not compete for a core)."""

    def __init__(self, cache: ShardCache, names: list[str], ahead: int) -> None:
        self.cache, self.names, self.ahead = cache, names, ahead
        self.reading = 0
        self.error: UserError | None = None
        self.done = threading.Event()
        self.moved = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="shard-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for position, name in enumerate(self.names):
            with self.moved:
                while position > self.reading + self.ahead and not self.done.is_set():
                    self.moved.wait(timeout=1.0)
            if self.done.is_set():
                return
            try:
                self.cache.path(name)
            except UserError as e:  # the reader meets the same error, and reports it
                self.error = e
                return

    def reached(self, position: int) -> None:
        with self.moved:
            self.reading = max(self.reading, position)
            self.moved.notify()

    def close(self) -> None:
        """Stops after the fetch in flight (bounded by the store's timeouts), and waits for it: the
        next loader forks its workers, and a fork must not copy a lock this thread holds."""
        self.done.set()
        with self.moved:
            self.moved.notify()
        self.thread.join()
