"""How the strategies' gradient collectives travel: through the process group (gloo or nccl), or,
when every rank is a CPU process on one node, through one shared-memory region.

gloo has no shared-memory transport: between two processes on one machine it moves every
collective through loopback TCP and its own threads. A 116 KB all-reduce costs 1-1.8 ms that
way on two cores, as much as a sixth of a small model's step, and the woken gloo threads compete
with backward for the rank's only core. Through shared memory the same exchange is a copy in, one
barrier and a sum: about 0.04 ms. NCCL picks such intra-node transports by itself; for CPU ranks
this module does. Everything else (set-up, evaluation, metrics, checkpoints) stays on the process
group: it runs rarely.

Results are identical on every rank: each sums the ranks' contributions in rank order.
"""
from __future__ import annotations

import fcntl
import glob
import mmap
import os
import platform
import tempfile
import threading
import time
from typing import Protocol

import torch
import torch.distributed as dist

from common.errors import PeerVanished, UserError
from common.parallel.procs import running

SHM_FOLDER = "/dev/shm"
SLOT_BYTES = 1 << 20  # one rank's share of a round; larger tensors go through in chunks of this
FLAG_STRIDE = 8  # int64 entries between two ranks' flags: one 64-byte cache line each (round, pid)
SPINS_BEFORE_YIELD = 64
YIELDS_BEFORE_SLEEP = 192  # then the waiting rank sleeps: with more ranks than cores, a yielding one still
# takes its turns (and system time) from the peer it waits for
SLEEP_S = (20e-6, 1e-3)  # the first sleep, doubled up to the last: a late peer is met within twice its lateness
PEER_CHECK_S = 0.02  # how often a waiting rank looks whether the late peers still run
REGION_PREFIX = "dp-suite-"
LEFTOVER_AFTER_S = 10.0  # a region this old whose creator holds no lock on it was left by a killed set-up


class Handle(Protocol):
    def wait(self) -> object: ...


class Done:
    """Handle of a collective that already finished (synchronous transports)."""

    def wait(self) -> None:
        return None


class Transport(Protocol):
    """Collectives on flat, contiguous tensors; each returns a handle to wait on before reading."""

    name: str

    def all_reduce(self, tensor: torch.Tensor) -> Handle: ...

    def reduce(self, tensor: torch.Tensor, dst: int = 0) -> Handle: ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Handle: ...


class ProcessGroupTransport:
    """The process group's own asynchronous collectives (gloo over TCP, nccl on GPUs)."""

    def __init__(self, backend: str) -> None:
        self.name = backend

    def all_reduce(self, tensor: torch.Tensor) -> Handle:
        return dist.all_reduce(tensor, async_op=True)

    def reduce(self, tensor: torch.Tensor, dst: int = 0) -> Handle:
        return dist.reduce(tensor, dst=dst, async_op=True)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Handle:
        return dist.broadcast(tensor, src=src, async_op=True)


class LocalTransport:
    """One rank: every collective is the identity, so none is sent (gloo would still hand each one
    to its worker thread and back)."""

    name = "none (one rank)"

    def all_reduce(self, tensor: torch.Tensor) -> Handle:
        return Done()

    def reduce(self, tensor: torch.Tensor, dst: int = 0) -> Handle:
        return Done()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Handle:
        return Done()


class SharedMemoryTimeout(UserError):
    """A peer did not reach a shared-memory exchange within --timeout-s."""


class SharedMemoryTransport:
    """Collectives through one shared-memory file that every rank of the node maps.

    Layout: one flag per rank (a cache line each), then two sets of W slots of SLOT_BYTES. A round
    is: write my slot, publish the round number in my flag, wait until every flag shows it, read.
    Rounds alternate between the two slot sets, so a rank may write round k+2's slot as soon as all
    flags show k+1: a peer posts k+1 only after it finished reading round k. The file is unlinked
    as soon as every rank has mapped it (or the set-up failed), so a killed job leaves nothing in
    /dev/shm, and the memory goes with the last process; a set-up killed before that leaves a file
    that the next job on the node removes (see Region).

    Memory order: on x86-64 stores become visible in program order and loads are not reordered with
    older loads, so a peer that sees my flag also sees my slot. The empty lock between the two is
    a locked instruction, which also drains non-temporal stores a large copy may use. Other
    architectures keep the process group (see `shared_memory_problem`).

    Synchronous: every call returns after its exchange, with a done handle. A waiting rank spins
    briefly, yields its core a while, then sleeps, from 20 us doubling to 1 ms, so that more ranks
    than cores still make progress without spending the cores on the wait. Unlike a gloo
    socket, shared memory does not tell a rank that its peer died: each rank publishes its pid
    beside its flag, and a waiting rank gives up as soon as a late peer has exited (torchrun's
    SIGTERM would only ask it to finish the step it cannot finish), naming it (PeerVanished), or
    after --timeout-s."""

    name = "shm"

    def __init__(self, buffer: mmap.mmap, rank: int, world: int, timeout_s: float) -> None:
        self.buffer, self.rank, self.world, self.timeout_s = buffer, rank, world, timeout_s
        self.flags = memoryview(buffer)[:flag_bytes(world)].cast("q")
        region = torch.frombuffer(buffer, dtype=torch.uint8, offset=flag_bytes(world))
        self.slots = region.view(2, world, SLOT_BYTES)
        self.round = 0
        self.fence = threading.Lock()
        self.flags[rank * FLAG_STRIDE + 1] = os.getpid()

    @staticmethod
    def size(world: int) -> int:
        return flag_bytes(world) + 2 * world * SLOT_BYTES

    def all_reduce(self, tensor: torch.Tensor) -> Handle:
        for chunk in self._chunks(tensor):
            rows = self._exchange(chunk)
            _sum_rows(rows, chunk)
        return Done()

    def reduce(self, tensor: torch.Tensor, dst: int = 0) -> Handle:
        for chunk in self._chunks(tensor):
            rows = self._exchange(chunk)
            if self.rank == dst:
                _sum_rows(rows, chunk)
        return Done()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Handle:
        for chunk in self._chunks(tensor):
            rows = self._exchange(chunk if self.rank == src else None, like=chunk)
            if self.rank != src:
                chunk.copy_(rows[src])
        return Done()

    def _chunks(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError("the shared-memory transport takes contiguous CPU tensors")
        flat = tensor.view(-1)
        per_slot = SLOT_BYTES // flat.element_size()
        return [flat[i:i + per_slot] for i in range(0, flat.numel(), per_slot)] or [flat]

    def _exchange(self, chunk: torch.Tensor | None, like: torch.Tensor | None = None) -> torch.Tensor:
        """One round: my chunk (if any) into my slot, then every rank's slot as rows of `like`'s dtype."""
        like = chunk if like is None else like
        self.round += 1
        slots = self.slots[self.round % 2, :, :like.numel() * like.element_size()]
        rows = slots.view(like.dtype)
        if chunk is not None:
            rows[self.rank].copy_(chunk)
        with self.fence:
            pass
        self.flags[self.rank * FLAG_STRIDE] = self.round
        self._wait_for(self.round)
        return rows

    def _wait_for(self, round_: int) -> None:
        flags, stride, spins, started, next_check = self.flags, FLAG_STRIDE, 0, 0.0, 0.0
        peers, pause = range(self.world), SLEEP_S[0]
        while not all(flags[r * stride] >= round_ for r in peers):
            spins += 1
            if spins < SPINS_BEFORE_YIELD:
                continue
            if spins < SPINS_BEFORE_YIELD + YIELDS_BEFORE_SLEEP:
                os.sched_yield()
                continue
            time.sleep(pause)
            pause = min(2 * pause, SLEEP_S[1])
            now = time.monotonic()
            started = started or now
            if now >= next_check:
                self._check_late_peers(round_, now - started)
                next_check = now + PEER_CHECK_S

    def _check_late_peers(self, round_: int, waited_s: float) -> None:
        late = [r for r in range(self.world) if self.flags[r * FLAG_STRIDE] < round_]
        gone = tuple(r for r in late if not running(self.flags[r * FLAG_STRIDE + 1]))
        if gone:  # common/parallel/failures.py names it, with the step and the phase, as the line the job ends with
            raise PeerVanished(f"rank(s) {','.join(map(str, gone))} ended during shared-memory exchange {round_}", gone)
        if waited_s > self.timeout_s:
            raise SharedMemoryTimeout(
                f"rank(s) {','.join(map(str, late))} did not reach shared-memory exchange {round_} within "
                f"{self.timeout_s:g} s (--timeout-s); a peer is stuck")


def flag_bytes(world: int) -> int:
    return world * FLAG_STRIDE * 8


def _sum_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """Rank 0's row plus rank 1's plus ...: the same order, so the same bits, on every rank."""
    out.copy_(rows[0])
    for row in rows[1:]:
        out.add_(row)


def shared_memory_problem(nodes: int, backend: str, device: torch.device) -> str | None:
    """Why this job cannot exchange gradients through shared memory, or None if it can."""
    if nodes != 1:
        return f"the job spans {nodes} nodes"
    if backend != "gloo" or device.type != "cpu":
        return "ranks are on GPUs (nccl has its own intra-node transports)"
    if platform.machine().lower() not in ("x86_64", "amd64") or not os.path.isdir(SHM_FOLDER):
        return f"it needs x86-64 Linux with {SHM_FOLDER} (this is {platform.system()} on {platform.machine()})"
    return None


class Region:
    """Rank 0's new file in /dev/shm, named only until every rank has mapped it. Its creator holds a
    shared lock on it meanwhile: a named region that nobody locks belongs to a set-up that was killed
    (SIGKILL gives no chance to remove it), and the next create_region on the node removes it."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path

    def remove(self) -> None:
        os.unlink(self.path)
        os.close(self.fd)  # releases the lock, after the name is gone


def create_region(world: int) -> tuple[Region | None, str]:
    """Rank 0: a new file in /dev/shm with all its pages reserved. Returns (region, "") or (None, why not):
    a region that did not fit would kill the job with SIGBUS at the first write, not fail here."""
    remove_leftover_regions()
    size = SharedMemoryTransport.size(world)
    try:
        fd, path = tempfile.mkstemp(prefix=REGION_PREFIX, dir=SHM_FOLDER)
    except OSError as e:
        return None, f"cannot create a file in {SHM_FOLDER} ({e.strerror})"
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        os.posix_fallocate(fd, 0, size)
        return Region(fd, path), ""
    except OSError as e:
        Region(fd, path).remove()
        return None, f"{SHM_FOLDER} has no room for {size / 2**20:.0f} MB ({e.strerror})"


def remove_leftover_regions() -> None:
    """Remove the regions of set-ups that were killed: named, older than a moment (a new one is
    locked right after it is made), and locked by no process."""
    for path in glob.glob(os.path.join(SHM_FOLDER, REGION_PREFIX + "*")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # removed meanwhile, or another user's
        try:
            if time.time() - os.fstat(fd).st_mtime > LEFTOVER_AFTER_S:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(path)
        except OSError:
            pass  # a live set-up holds it, or it went meanwhile
        finally:
            os.close(fd)


def map_region(path: str, world: int) -> mmap.mmap:
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), SharedMemoryTransport.size(world))
