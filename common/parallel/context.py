"""The process's place in the job, read once from torchrun's environment, and the process group.

Without torchrun (RANK unset) the script runs as one process with a one-rank process group, so
strategies and collectives work the same at every world size.

Waits for work that only some processes do (a node's data preparation, rank 0's storage I/O) go
through the job's key-value store, not a collective, so they are bounded by their own deadline
(--storage-timeout-s), not by --timeout-s: the worker bumps a heartbeat key while it works and
reports its own overrun of the deadline; a waiter gives up when the heartbeat stops for
STALE_AFTER_S (the worker was killed or froze), or STALE_AFTER_S after the deadline.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist

from common.config import Config
from common.errors import ConfigError, PeerFailed, UserError, WaitExpired, first_line
from common.parallel.transport import (
    LocalTransport,
    ProcessGroupTransport,
    SharedMemoryTransport,
    Transport,
    create_region,
    map_region,
    shared_memory_problem,
)

T = TypeVar("T")
# A call to the job's key-value store (c10d) that failed: its host (torchrun's agent, or the
# rendezvous host) ended or cannot be reached (DistNetworkError), or what was waited for in it did
# not come within the store's timeout (DistStoreError). common/parallel/failures.py tells them.
STORE_FAILURES = (dist.DistNetworkError, dist.DistStoreError)


def add_process_group_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flags of distributed(): the device, the backend and the transport."""
    add = group.add_argument
    add("--device", default="auto", help="auto | cpu | cuda (auto: cuda:LOCAL_RANK when there are enough GPUs)")
    add("--backend", default="auto", choices=("auto", "gloo", "nccl"),
        help="auto: nccl when every rank is on CUDA, else gloo")
    add("--transport", default="auto", choices=("auto", "shm", "gloo"),
        help="how gradient collectives travel between CPU ranks: shm (one shared-memory region per node; "
             "one node, x86-64 Linux), gloo (the process group, TCP), or auto: shm where it can serve, else the "
             "process group; GPUs always use the process group (default: %(default)s)")
    add("--timeout-s", type=float, default=300.0,
        help="process-group timeout: a dead peer ends the job after this (default: %(default)s)")

HEARTBEAT_EVERY_S = 1.0  # a worker bumps its heartbeat key this often
# No heartbeat for this long: the worker is dead or frozen. Far above any pause of a live worker
# (its heartbeat thread needs the GIL, which a long native call may hold for a few seconds).
STALE_AFTER_S = 30.0
POLL_S = 0.2
PROGRESS_EVERY_S = 10.0
EXIT_GRACE_S = 10.0  # a rank that gave up on a hung storage thread ends at most this long after it
DEADLINE_FLAG = "--storage-timeout-s"


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    store: Any = field(default=None, repr=False, compare=False)  # the job's key-value store, once joined
    # How the strategies' gradient collectives travel (common/parallel/transport.py), and why not through
    # shared memory where --transport auto chose the process group.
    transport: Transport = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    transport_note: str = ""
    # Numbers the after_primary waits: every rank makes them in the same order, as for collectives.
    waits: Iterator[int] = field(default_factory=itertools.count, repr=False, compare=False)
    # Every rank's (host, pid), in rank order: a survivor names the rank that vanished (common/parallel/failures.py).
    peers: tuple[tuple[str, int], ...] = field(default=(), repr=False, compare=False)
    # Every rank's device type ("cpu", "cuda"), in rank order: a default that must be one for the job
    # (the evaluation batch) follows all of them, whatever --device each node was given.
    devices: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def is_primary(self) -> bool:
        """The one rank that prints, writes TensorBoard and saves checkpoints."""
        return self.rank == 0

    @property
    def is_node_primary(self) -> bool:
        """The one rank per node that downloads data."""
        return self.local_rank == 0

    @property
    def comm_device(self) -> torch.device:
        """Where our own collectives' tensors live: gloo moves CPU tensors, nccl CUDA ones. With
        mixed devices over gloo a CUDA rank stages its tensors through the CPU."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def hosts(self) -> int:
        """How many hosts the ranks run on where each holds an equal, contiguous block of ranks (as
        torchrun numbers them, node by node), else 1 (nodes of different sizes; peers not known yet):
        the same on every rank, so the places a loader deals host by host (loader.rank_places) are
        one partition of the global batch."""
        names = [host for host, _ in self.peers]
        count = len(set(names))
        per = len(names) // count if count else 0
        blocks = count > 1 and per * count == len(names) and all(names[i] == names[i - i % per]
                                                                 for i in range(len(names)))
        return count if blocks else 1

    @property
    def node_rank(self) -> int:
        """This node's index (torchrun numbers ranks node by node)."""
        return self.rank // self.local_world_size

    def barrier(self) -> None:
        dist.barrier()

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (a copy on the communication device; the input is left as it was)."""
        values = values.to(self.comm_device, copy=True)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def fail_together(self, message: str) -> None:
        """For a verdict every rank reached together: rank 0 reports it, the others exit quietly."""
        self.fail_together_with(UserError(message))

    def fail_together_with(self, error: UserError) -> None:
        if not self.is_primary:
            quiet = PeerFailed(str(error))
            quiet.exit_code = error.exit_code
            raise quiet
        raise error

    def after_primary(self, what: str, action: Callable[[], T], deadline_s: float) -> T | None:
        """Rank 0 runs `action` (storage I/O: `what` names it, e.g. "checkpoint save at step 40") while the
        other ranks wait on the store, not in a collective: a slow store or a large checkpoint is
        not charged to --timeout-s. Call it on every rank in the same order, then enter the
        collective that shares the result. Returns the action's result on rank 0, None elsewhere.
        Rank 0 ends after deadline_s with one line; the others end with it (quietly), or on their
        own when rank 0 stops responding (see wait_for_keys), each node's first waiting rank
        printing the line."""
        key = f"after-primary/{next(self.waits)}"
        if self.is_primary:
            try:
                result, outcome = run_with_heartbeat(self.store, key, action, deadline_s), None
            except DeadlinePassed:
                outcome = f"rank 0's {what} did not finish within {deadline_s:g} s ({DEADLINE_FLAG}): the storage " \
                          f"is hung or slower than that; check it, or pass a larger {DEADLINE_FLAG}"
                abandon_hung_thread()
                raise UserError(outcome) from None
            except UserError as e:
                outcome = str(e)
                raise
            except BaseException as e:
                outcome = f"rank 0 ended with {type(e).__name__} during its {what}"
                raise
            finally:
                self._tell_waiters(key, outcome)
            return result
        first_waiter = self.local_rank == (1 if self.node_rank == 0 else 0)
        try:
            wait_for_keys(self.store, [key], deadline_s)
        except Unanswered as e:
            raise WaitExpired(f"rank 0{e.who.get(key, '')} {e.why} during its {what}", first_waiter) from None
        outcome = json.loads(self.store.get(key))
        if outcome:
            raise PeerFailed(outcome)  # rank 0 prints it
        return None

    def _tell_waiters(self, key: str, outcome: str | None) -> None:
        """Rank 0's outcome (None: done) for the ranks waiting in after_primary. A store that failed
        meanwhile (its host, torchrun's agent, died) must not replace the error rank 0 already ends
        with: that one, the first, is told; the waiters learn of the store's failure themselves."""
        try:
            self.store.set(key, json.dumps(outcome))
        except STORE_FAILURES:
            if outcome is None:
                raise  # the action succeeded: the store's failure is the news

    def together(self, action: Callable[[], T]) -> T:
        """Run `action` on every rank. If it raises a UserError anywhere, every rank ends and the
        error is printed once, by rank 0 (naming the ranks when not all of them hit it)."""
        try:
            result, error = action(), None
        except PeerFailed:
            result, error = None, ""  # failed because another rank did, which says why
        except UserError as e:
            result, error = None, str(e)
        errors = self.all_gather_json(error)
        failed = [rank for rank, e in enumerate(errors) if e is not None]
        if failed:
            # distinct, in rank order
            message = "; ".join(dict.fromkeys(errors[rank] for rank in failed if errors[rank]))
            where = "" if len(failed) == self.world_size else f" (on rank{'s' if len(failed) > 1 else ''} " \
                f"{','.join(map(str, failed))})"
            self.fail_together(message + where)
        return result

    # Flags, paths and warnings cross between ranks as JSON bytes in uint8 tensors, never as
    # pickles (all_gather_object and broadcast_object_list unpickle whatever a peer sends: anyone
    # who reaches the ports could make a rank run code).

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank src's bytes on every rank (the others pass None)."""
        size = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64, device=self.comm_device)
        dist.broadcast(size, src=src)
        payload = _bytes_tensor(data, self.comm_device) if self.rank == src else \
            torch.empty(int(size.item()), dtype=torch.uint8, device=self.comm_device)
        dist.broadcast(payload, src=src)
        return payload.cpu().numpy().tobytes()

    def broadcast_json(self, value: Any, src: int = 0) -> Any:
        return json.loads(self.broadcast_bytes(json.dumps(value).encode() if self.rank == src else None, src))

    def all_gather_json(self, value: Any) -> list[Any]:
        """Every rank's value, in rank order."""
        payload = _bytes_tensor(json.dumps(value).encode(), self.comm_device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.comm_device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=self.comm_device))
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.comm_device)
        padded[:payload.numel()] = payload
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        return [json.loads(g[:int(s.item())].cpu().numpy().tobytes()) for g, s in zip(gathered, sizes)]


class Heartbeat:
    """While its block runs, a thread bumps `key`/beat in the store every HEARTBEAT_EVERY_S and
    `key`/who tells waiters which process it is: a waiter tells a slow worker from a dead one."""

    def __init__(self, store: Any, key: str) -> None:
        self.store, self.beat = store, f"{key}/beat"
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"heartbeat {key}", daemon=True)
        store.set(f"{key}/who", f" (host {socket.gethostname()}, pid {os.getpid()})")

    def _run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_EVERY_S):
            try:
                self.store.add(self.beat, 1)
            except STORE_FAILURES:  # the store's host ended: the job is ending, the waiters see why
                return

    def __enter__(self) -> "Heartbeat":
        self.store.add(self.beat, 1)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()


class DeadlinePassed(Exception):
    """run_with_heartbeat's action is still running at its deadline."""


def run_with_heartbeat(store: Any, key: str, action: Callable[[], T], deadline_s: float) -> T:
    """run_within, under a Heartbeat: the other ranks see that this one still works."""
    with Heartbeat(store, key):
        return run_within(action, deadline_s, key)


def run_within(action: Callable[[], T], deadline_s: float, name: str) -> T:
    """`action`'s result, computed on a daemon thread; DeadlinePassed(name) once deadline_s has
    passed (the thread is left behind: storage I/O cannot be cancelled)."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["result"] = action()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e
    worker = threading.Thread(target=work, name=f"work {name}", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        raise DeadlinePassed(name)
    if "error" in box:
        raise box["error"]
    return box["result"]


def abandon_hung_thread() -> None:
    """The interpreter joins every non-daemon thread at exit (a checkpoint writer's among them), so
    a process whose storage call hangs for good would never end: end it EXIT_GRACE_S from now,
    time enough to print its line and close its files."""
    def end() -> None:
        time.sleep(EXIT_GRACE_S)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)
    threading.Thread(target=end, name="exit after a hung storage call", daemon=True).start()


class Unanswered(Exception):
    """wait_for_keys gave up on `pending` keys: `why` says why in words, `who` names their workers."""

    def __init__(self, pending: list[str], why: str, who: dict[str, str]) -> None:
        super().__init__(why)
        self.pending, self.why, self.who = pending, why, who


def wait_for_keys(store: Any, keys: Sequence[str], deadline_s: float,
                  progress: Callable[[list[str], float], None] | None = None) -> None:
    """Poll the store until every key is set, each by a worker that runs under a Heartbeat of that
    key and sets it, at the latest, when its own deadline_s has passed. Raises Unanswered when a
    pending key's heartbeat has not moved for STALE_AFTER_S (counted from this call for a worker
    that never beat), when the keys are still unset STALE_AFTER_S after deadline_s, or when the
    store itself is gone. progress(pending, seconds) is called every PROGRESS_EVERY_S."""
    started = last_said = last_beats = time.monotonic()
    give_up_at = started + deadline_s + STALE_AFTER_S  # the workers report their own overrun: time to
    beats = {key: (-1, started) for key in keys}  # the last value seen, and when it changed
    pending, pause = list(keys), POLL_S / 256  # a short wait (a save handed to the writer) costs ~1 ms
    try:
        while not store.check(pending):  # one request for all keys; the heartbeats once a second
            now = time.monotonic()
            if now - last_beats >= HEARTBEAT_EVERY_S:
                pending = [key for key in pending if not store.check([key])]
                _check_heartbeats(store, pending, beats, now)
                last_beats = now
            if now > give_up_at:
                raise Unanswered(pending, f"did not finish within {deadline_s:g} s ({DEADLINE_FLAG}) and did not "
                                          f"say so in the {STALE_AFTER_S:g} s after", _who(store, pending))
            if progress and now - last_said >= PROGRESS_EVERY_S:
                progress(pending, now - started)
                last_said = now
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)
    except STORE_FAILURES as e:  # the host of the store (node 0's agent) ended
        raise Unanswered(pending, f"could not be reached: {store_failed(e)}", {}) from None


def store_failed(error: BaseException) -> str:
    """'the job's store failed (Broken pipe)': one of STORE_FAILURES, in words."""
    return f"the job's store failed ({first_line(error)})"


def _check_heartbeats(store: Any, pending: list[str], beats: dict[str, tuple[int, float]], now: float) -> None:
    for key in pending:
        value = store.add(f"{key}/beat", 0)  # reads the counter without waiting for it to exist
        if value != beats[key][0]:
            beats[key] = (value, now)
    stale = [key for key in pending if now - beats[key][1] > STALE_AFTER_S]
    if stale:
        raise Unanswered(stale, f"stopped responding (no heartbeat for {STALE_AFTER_S:g} s: killed, e.g. out of "
                                "memory, or frozen)", _who(store, stale))


def _who(store: Any, keys: list[str]) -> dict[str, str]:
    """' (host H, pid P)' of each key's worker, where it said."""
    return {key: store.get(f"{key}/who").decode() for key in keys if store.check([f"{key}/who"])}


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


# Flags that may differ between nodes (paths, devices); every other flag must match everywhere.
PER_NODE_FLAGS = ("data_dir", "download", "device", "log_dir", "checkpoint_dir", "log_all_ranks")


def check_same_flags(cfg: Config, ctx: DistContext) -> None:
    """Nodes started with different flags (another model, another global batch) would train
    nonsense or hang: compare a hash of the flags across ranks, and name the keys that differ."""
    flags = {k: v for k, v in cfg.as_plain_dict().items() if k not in PER_NODE_FLAGS}
    digest = hashlib.sha256(json.dumps(flags, sort_keys=True).encode()).hexdigest()
    gathered = ctx.all_gather_json((digest, flags))
    if len({d for d, _ in gathered}) == 1:
        return
    reference = gathered[0][1]
    differing = sorted({k for _, other in gathered for k in other.keys() | reference.keys()
                        if other.get(k) != reference.get(k)})
    details = "; ".join(f"{k}: " + ", ".join(f"rank {r} {other.get(k)!r}" for r, (_, other) in enumerate(gathered))
                        for k in differing)
    ctx.fail_together(f"the ranks were started with different flags ({details}); start every node with the same "
                      "command")


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def device_list(flag: str, local_world_size: int) -> list[str]:
    """--device for each local rank: one value for all, or a comma list indexed by local rank."""
    choices = [c.strip() for c in flag.split(",")]
    unknown = [c for c in choices if c not in ("auto", "cpu", "cuda")]
    if unknown:
        raise ConfigError(f"--device {flag!r}: {unknown[0]!r} is unknown; use auto, cpu or cuda (or a comma list)")
    if len(choices) == 1:
        return choices * local_world_size
    if len(choices) != local_world_size:
        raise ConfigError(f"--device {flag} lists {len(choices)} devices for {local_world_size} process(es) per "
                          "node; give one per local rank")
    if "auto" in choices:
        raise ConfigError(f"--device {flag}: a comma list names cpu or cuda for each local rank, not auto")
    return choices


def resolve_device(flag: str, local_rank: int, local_world_size: int) -> torch.device:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    choices = device_list(flag, local_world_size)
    if choices[local_rank] == "auto":
        if gpus and gpus < local_world_size:  # silently training on the CPU would be the wrong thing
            raise ConfigError(f"--device auto: this node has {gpus} GPU(s) for {local_world_size} processes; start "
                              f"at most {gpus} per node (--nproc_per_node={gpus}), or pass --device cpu to train "
                              "on the CPU")
        return torch.device("cuda", local_rank) if gpus else torch.device("cpu")
    if choices[local_rank] == "cpu":
        return torch.device("cpu")
    wanted = choices.count("cuda")  # cuda entries take GPUs 0, 1, ... in local-rank order
    if gpus < wanted:
        raise ConfigError(f"--device {flag} needs {wanted} GPU(s) on this node, found {gpus}; "
                          "use --device cpu or fewer processes per node")
    return torch.device("cuda", choices[:local_rank].count("cuda"))


def resolve_backend(flag: str, device_flag: str, device: torch.device) -> str:
    """auto: nccl only when every rank is on CUDA, else gloo (a device list with a cpu entry: gloo)."""
    mixed = "cpu" in device_flag.split(",") and "," in device_flag
    if flag == "auto":
        return "nccl" if device.type == "cuda" and not mixed else "gloo"
    if flag == "nccl" and (device.type != "cuda" or mixed):
        raise ConfigError("--backend nccl needs every rank on a CUDA GPU, but some rank is on the CPU; "
                          "use --backend gloo (or auto)")
    return flag


def _set_cpu_threads(local_world_size: int) -> None:
    """Ranks sharing a host split its cores instead of each spawning one thread per core."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // local_world_size))


def context_from_env(cfg: Config) -> DistContext:
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    device = resolve_device(cfg.device, local_rank, local_world)
    return DistContext(rank, world, local_rank, local_world, device, resolve_backend(cfg.backend, cfg.device, device))


def _bind_to_loopback(ctx: DistContext) -> None:
    """On one node no peer is remote: keep gloo's and nccl's listening sockets on the loopback
    interface instead of every interface (unless the user chose one). torchrun's own rendezvous
    store still listens on all interfaces: torch offers no way to bind it (see docs/security.md)."""
    if ctx.nodes == 1 and sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


@contextmanager
def distributed(cfg: Config) -> Iterator[DistContext]:
    """Join the process group (a private one-rank group without torchrun) and always leave it."""
    ctx = context_from_env(cfg)
    _set_cpu_threads(ctx.local_world_size)
    _bind_to_loopback(ctx)
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    timeout = timedelta(seconds=cfg.timeout_s)
    if "RANK" in os.environ:
        # torchrun keeps its store across restarts: without a per-attempt prefix a restarted rank
        # can read the dead attempt's gloo addresses and fail to connect.
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"attempt-{attempt}", store)
        dist.init_process_group(ctx.backend, store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout)
    else:
        store = dist.HashStore()
        dist.init_process_group(ctx.backend, store=store, rank=0, world_size=1, timeout=timeout)
    ctx = replace(ctx, store=dist.PrefixStore("suite", store))  # our keys apart from the process group's
    try:
        ranks = ctx.all_gather_json([socket.gethostname(), os.getpid(), ctx.device.type])
        ctx = replace(ctx, peers=tuple((host, pid) for host, pid, _ in ranks),
                      devices=tuple(kind for *_, kind in ranks))
        transport, note = open_transport(ctx, cfg.transport, cfg.timeout_s)
        ctx = replace(ctx, transport=transport, transport_note=note)
        yield ctx
        dist.barrier()  # leave together: a rank tearing down gloo while a peer still talks can abort it
    finally:
        dist.destroy_process_group()


def open_transport(ctx: DistContext, choice: str, timeout_s: float) -> tuple[Transport, str]:
    """--transport: shm, gloo (the process group's own), or auto (shm wherever it can serve, else
    the process group, with the reason). Every rank takes the same one: a collective."""
    if ctx.world_size == 1:
        return LocalTransport(), ""
    process_group = ProcessGroupTransport(ctx.backend)
    if choice == "gloo":
        return process_group, ""
    problems = [p for p in ctx.all_gather_json(shared_memory_problem(ctx.nodes, ctx.backend, ctx.device)) if p]
    if not problems:
        region, problem = create_region(ctx.world_size) if ctx.is_primary else (None, "")
        try:
            path, problem = ctx.broadcast_json([region.path if region else "", problem])
            problems = [problem] if problem else []
            if not problems:
                mapped, problems = _map_on_every_rank(ctx, path)
        finally:  # every rank mapped it, or the set-up failed: the name goes, the mappings stay
            if region:
                region.remove()
        if not problems:
            return SharedMemoryTransport(mapped, ctx.rank, ctx.world_size, timeout_s), ""
    why = problems[0]
    if choice == "shm":
        ctx.fail_together(f"--transport shm: {why}; use --transport auto (shared memory where it can serve) or gloo")
    return process_group, f"not shm: {why}"


def _map_on_every_rank(ctx: DistContext, path: str) -> tuple[Any, list[str]]:
    """Every rank maps rank 0's region (which rank 0 then removes: the mappings stay)."""
    try:
        mapped, problem = map_region(path, ctx.world_size), None
    except OSError as e:
        mapped, problem = None, f"rank {ctx.rank} could not map {path} ({e.strerror})"
    return mapped, [p for p in ctx.all_gather_json(problem) if p]
