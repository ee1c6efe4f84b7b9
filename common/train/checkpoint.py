"""Checkpoints: one owner for what is saved, where, and how a run resumes.

Layout of CHECKPOINT_DIR (a local folder, or an object-store URL through common/storage.py):

    <run>/step-00000123.pt   one file per save; the newest --keep of the run are kept
    <run>/latest.json        pointer to the run's newest checkpoint, with the run's identity

A run folder is created by every fresh start (its name: start time and a random suffix), so a new
run never prunes, overwrites or mixes with another run's files. `--resume auto` continues the run
in the folder whose identity (the settings that change the trained weights) equals this command's,
the most recently saved one if several do. A checkpoint holds only tensors and plain types, so
torch.load(weights_only=True) reads it and a file carrying pickled code is refused unread.

Saving in the background: rank 0 copies the state in memory (the only pause training sees), then
serializes and writes it on one thread while training goes on. At most one save is in flight: the
next save, the run's last one and a stop wait for it. A failed write ends every rank at the next
stop check (common/train/preemption.py), at most CHECK_EVERY + 1 steps later, or at the next save if sooner.

Commit protocol: a step file is written whole and made visible at once (local: temp file, fsync,
rename; object store: one PUT), then the pointer is replaced the same way. No hard links, no
directory renames. A reader trusts only checkpoints that load, newest first: the pointer's target
and every step file it can list, so a cut save or a stale listing costs at most that one save.
A local step file is serialized straight into its temp file: besides the training state, rank 0
holds one copy of it while saving (the detached copy); on an object store two (and the PUT's buffer).

A store that does not answer never starts a run over. Resume tells "the store did not answer"
(unreachable, timed out, throttled, denied: common/storage.py's kinds) apart from "the file is not a
checkpoint". A store that did not answer is asked again, with pauses growing from 1 s to 10 s, until
failed requests and pauses have taken common/storage.py's RESUME_RETRY_S (60 s; the environment variable
DP_STORE_RETRY_S changes it) for one start (the last request's own timeouts and retries may add a
few seconds: a stopped S3 endpoint ends the job about 69 s after its start); then the job ends with
one line naming the URL and the cause, having started and changed nothing. Denied and other
failures end it at once.
Only a file that is there and does not parse is skipped (for the run's previous checkpoint).
What --resume auto concludes from a folder:
- no run folder with this command's settings: a fresh start (a new run folder);
- such a run, and a checkpoint of it loads: the newest one that loads is continued;
- such a run, and none of its checkpoints loads: an error, never a fresh start (which would hide
  the run: after the new run's first save, auto would pick it). Ways out: --resume FILE of a
  checkpoint you trust, or --resume none for a new run beside it;
- a run folder whose pointer is missing, does not parse (rewritten in place where rename is
  refused, and cut) or names an unexpected file: its identity is read from its newest step file
  that loads (step files carry it), with a warning; its save time is then taken as its start time
  (the folder name). A folder with step files of which none loads, and no usable pointer, may be
  this command's run: an error with the same ways out.

Parallel jobs may share a CHECKPOINT_DIR: each writes only its own run folder (names carry 64
random bits), and a start removes the temp files of a killed writer only in its own run folder,
once the start is accepted (a resumed run is written by one job at a time).
"""
from __future__ import annotations

import argparse
import json
import re
import secrets
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, TypeVar

import torch

from common.config import differences
from common.errors import UserError, first_line
from common.parallel.context import DistContext
from common.storage import MISSING, STORAGE_TIMEOUT_S, Patience, Storage, StorageError, split, storage_for
from common.train.run import Position, Run
from common.train.settings import way_to_continue
from common.train.state import (
    InvalidCheckpoint,
    data_entry,
    detached_copy,
    expected_bytes,
    load_training_state,
    model_mismatches,
    order_changed,
    parse_checkpoint,
    training_state,
)

POINTER = "latest.json"
STEP_FILE = re.compile(r"step-(\d{8})\.pt$")
RUN_STARTED = "%Y%m%d-%H%M%S"  # the time-sortable start of a run folder's name
T = TypeVar("T")

def add_checkpoint_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flags of Checkpoints: where, how many, how often, and what to resume."""
    add = group.add_argument
    add("--checkpoint-dir", default="", help="where checkpoints are written: a folder or an object-store URL "
                                             "(default: checkpoints/<script>-<dataset>-<model>-<run id>)")
    add("--resume", nargs="?", const="auto", default="auto",
        help="auto: continue this run (same settings) from its newest valid checkpoint in --checkpoint-dir, if any; "
             "none: start a new run (other runs' files are kept); or a checkpoint file of this run (default: auto)")
    add("--keep", type=int, default=3, help="checkpoints kept, newest first; at least 2 (default: %(default)s)")
    add("--save-every-steps", type=int, default=0, metavar="S",
        help="also save every S optimizer steps inside an epoch (epoch ends always save; 0: only those)")


def check_checkpoint_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.keep < 2:
        p.error(f"--keep must be >= 2 (got {a.keep}): the newest checkpoint may be the one a crash cut short")
    if a.save_every_steps < 0:
        p.error(f"--save-every-steps must be >= 0 (got {a.save_every_steps})")


def _step_files(run: str, names: list[str]) -> list[str]:
    """The run's step files among a listing of its folder, oldest first."""
    return sorted((f"{run}/{n}" for n in names if STEP_FILE.match(n)), key=_step_number)


def step_name(run: str, global_step: int) -> str:
    return f"{run}/step-{global_step:08d}.pt"


WAYS_OUT = ("to load a checkpoint you trust, pass --resume FILE; to start a new run beside it (its files are kept), "
            "pass --resume none")


def kept(previous: str | None) -> str:
    """What a failed save leaves: the run's previous checkpoint."""
    return (f"the previous checkpoint {previous} is intact and the same command resumes from it" if previous
            else "no earlier checkpoint of this run exists")


@dataclass(frozen=True)
class RunInfo:
    name: str
    identity: dict[str, Any]
    checkpoint: str
    global_step: int
    saved_at: float
    warning: str | None = None  # recovered from a step file: why, and from which


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a job continues from, read by rank 0 and sent to every rank."""

    path: str
    state: dict[str, Any]


@dataclass(frozen=True)
class Choice:
    """What a job continues: the run folder it saves into and the checkpoint it loads (None: a
    fresh start), with the warnings met on the way. Rank 0 decides; the rest travels as JSON."""

    run: str
    checkpoint: str | None = None  # as shown to people
    warnings: tuple[str, ...] = ()
    error: str | None = None
    data: bytes | None = field(default=None, repr=False)
    state: dict[str, Any] | None = field(default=None, repr=False)

    def plain(self) -> dict[str, Any]:
        return {"run": self.run, "checkpoint": self.checkpoint, "warnings": list(self.warnings), "error": self.error}


class BadPointer(Exception):
    pass


class CheckpointFolder:
    """Rank 0's side: the folder's runs, choosing what to resume, writing, pruning. No collectives."""

    def __init__(self, storage: Storage, keep: int, options: dict[str, Any] | None = None) -> None:
        self.storage, self.keep, self.options = storage, keep, options or {}
        self.patience = Patience()

    def choose(self, request: str, identity: dict[str, Any]) -> Choice:
        """--resume auto, none or a checkpoint file. Raises UserError for a folder that holds only
        runs with other settings, a file of another run, a run of this command none of whose
        checkpoints loads, or a store that did not answer within RESUME_RETRY_S."""
        self.patience = Patience()
        if request == "none":
            return Choice(new_run_name())
        if request != "auto":
            data, state = self._explicit(request, identity)
            return Choice(new_run_name(), request, tuple(self.patience.warnings()), data=data, state=state)
        runs = self.runs()
        same = [r for r in runs if r.identity == identity]
        if not same and "extend_to" in identity:
            base = {key: value for key, value in identity.items() if key != "extend_to"}
            if other := next((r for r in runs if r.identity.get("extend_to")
                              and {k: v for k, v in r.identity.items() if k != "extend_to"} == base), None):
                raise UserError(f"--extend-to {identity['extend_to']}: run {self.storage.url(other.name)} already "
                                f"extends this run to epoch {other.identity['extend_to']}, and an extension starts "
                                f"from the run's own end (epoch {base['epochs']}); pass --extend-to "
                                f"{other.identity['extend_to']} to continue that one, or --resume none for a new run")
            if extended := [r for r in runs if r.identity == base]:
                return self._extension(extended[0], base)
        if not same:
            if runs:
                raise UserError(self._other_run_message(runs[0], identity))
            return Choice(new_run_name(), warnings=tuple(self.patience.warnings()))
        return self._continue(same[0], identity)

    def _continue(self, run: RunInfo, identity: dict[str, Any]) -> Choice:
        """The run's newest checkpoint that loads. Only a file that is there and is no checkpoint is
        skipped: a store that does not answer ends the start (Patience), and a run none of whose
        checkpoints loads is an error, not a fresh start that would hide it."""
        warnings, problems = [run.warning] if run.warning else [], []
        candidates = self.candidates(run)
        for name in candidates:
            try:
                data = self._read(name)
                state = parse_checkpoint(data)
            except (InvalidCheckpoint, StorageError) as e:
                if isinstance(e, StorageError) and e.kind != MISSING:
                    raise
                why = e.cause if isinstance(e, StorageError) else e
                warnings.append(f"warning: checkpoint {self.storage.url(name)} {why}; falling back to the previous one")
                problems.append(f"{name.rsplit('/', 1)[-1]} {why}")
                continue
            if state["identity"] != identity:  # a file copied in by hand
                warnings.append(f"warning: checkpoint {self.storage.url(name)} belongs to another run "
                                f"({'; '.join(differences(state['identity'], identity))}); skipped")
                problems.append(f"{name.rsplit('/', 1)[-1]} belongs to another run")
                continue
            return Choice(run.name, self.storage.url(name), (*warnings, *self.patience.warnings()), data=data,
                          state=state)
        raise UserError(f"run {self.storage.url(run.name)} has this command's settings, but none of its "
                        f"{len(candidates)} checkpoint(s) loads ({'; '.join(problems[:2])}"
                        f"{' ...' if len(problems) > 2 else ''}); nothing was started; {WAYS_OUT}")

    def _extension(self, run: RunInfo, base: dict[str, Any]) -> Choice:
        """--extend-to: a new run from the newest checkpoint of the finished run it extends (that run's
        files are kept as they are). A run that has not finished is finished first, by its own command."""
        choice = self._continue(run, base)
        epoch, epochs = int(choice.state["epoch"]), int(base["epochs"])
        if epoch < epochs:
            raise UserError(f"--extend-to: run {self.storage.url(run.name)} has not finished (its newest checkpoint "
                            f"is in epoch {epoch + 1} of {epochs}); finish it with the same command without "
                            "--extend-to, then extend it")
        return replace(choice, run=new_run_name())

    def _explicit(self, path: str, identity: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """--resume FILE: that checkpoint, which must belong to a run with this identity. The job
        saves into a new run folder, so the file's own run is never pruned or mixed with."""
        parent, name = split(path)
        try:
            storage = storage_for(parent, self.options)
            data = self.patience.call(lambda: storage.read(name))
        except StorageError as e:
            raise UserError(f"--resume {path}: {e.cause}; give a checkpoint file, 'auto' or 'none'") from None
        try:
            state = parse_checkpoint(data)
        except InvalidCheckpoint as e:
            raise UserError(f"--resume {path}: the checkpoint {e}") from None
        if state["identity"] != identity:
            raise UserError(f"--resume {path} belongs to a run with other settings "
                            f"({'; '.join(differences(state['identity'], identity))}). "
                            f"{way_to_continue(state['identity'], identity)}; to start a new run, pass --resume none")
        return data, state

    def _other_run_message(self, other: RunInfo, identity: dict[str, Any]) -> str:
        return (f"{self.storage.url()} holds run {other.name} (saved at step {other.global_step}) with other "
                f"settings: {'; '.join(differences(other.identity, identity))}. "
                f"{way_to_continue(other.identity, identity)}; to start a new run beside it (its files are kept), "
                "pass --resume none, or another --checkpoint-dir")

    def _read(self, name: str) -> bytes:
        return self.patience.call(lambda: self.storage.read(name))

    def runs(self) -> list[RunInfo]:
        """The folder's runs, most recently saved first: run folders with a pointer, or with a step
        file that loads (recovered, with a warning). A store that does not answer ends the start."""
        found = [run for name in self.patience.call(lambda: self.storage.list("")) if (run := self._run(name))]
        return sorted(found, key=lambda r: r.saved_at, reverse=True)

    def _run(self, name: str) -> RunInfo | None:
        """The run in folder `name`, or None if it is no run's (no pointer and no step file)."""
        try:
            return _from_pointer(name, self._read(f"{name}/{POINTER}"))
        except StorageError as e:
            if e.kind != MISSING:
                raise
            problem = "is missing"
        except BadPointer as e:
            problem = str(e)
        steps = self._steps(name)
        return self._recover(name, steps, problem) if steps else None

    def _recover(self, name: str, steps: list[str], problem: str) -> RunInfo:
        """The run's identity from its newest step file that loads (each carries it)."""
        for step in reversed(steps):
            try:
                state = parse_checkpoint(self._read(step))
            except (InvalidCheckpoint, StorageError) as e:
                if isinstance(e, StorageError) and e.kind != MISSING:
                    raise
                continue
            warning = (f"warning: the pointer {self.storage.url(f'{name}/{POINTER}')} {problem}; run {name} "
                       f"recovered from its newest step file that loads, {step.rsplit('/', 1)[-1]}")
            return RunInfo(name, state["identity"], step, int(state["global_step"]), _started_at(name), warning)
        raise UserError(f"run folder {self.storage.url(name)} holds {len(steps)} step file(s) of which none loads, "
                        f"and its pointer {problem}: it may be this command's run; nothing was started; {WAYS_OUT}")

    def candidates(self, run: RunInfo) -> list[str]:
        """The run's checkpoints, newest first: the pointer's target and every step file listed."""
        return sorted({*self._steps(run.name), run.checkpoint}, key=_step_number, reverse=True)

    def _steps(self, run: str) -> list[str]:
        return _step_files(run, self.patience.call(lambda: self.storage.list(run)))

    def check_writable(self, run: str, expected_bytes: int) -> None:
        """Find out now, not after an epoch, that the folder is read-only, unreachable or full."""
        probe = f"{run}/.write-test"
        try:
            self.storage.write(probe, b"ok")
            self.storage.delete(probe)
        except StorageError as e:
            raise UserError(f"--checkpoint-dir {self.storage.url()} is not writable ({e.cause}); pass a writable "
                            "--checkpoint-dir") from None
        free = self.storage.free_bytes()
        if free is not None and free < expected_bytes:
            raise UserError(f"--checkpoint-dir {self.storage.url()} has {free / 2**20:.1f} MB free, and one "
                            f"checkpoint of this run takes about {expected_bytes / 2**20:.1f} MB; free space there "
                            "or pass another --checkpoint-dir")

    def write(self, run: str, state: dict[str, Any], previous: str | None = None) -> str:
        """Commit one checkpoint: the step file, then the pointer, then prune the run's oldest.
        Raises UserError naming the file, the cause and the checkpoint the same command resumes
        from: `previous` (the run's last good one, if any) when the step file failed, which leaves
        no partial file; the new file itself when only the pointer failed (resume lists step files)."""
        name = step_name(run, state["global_step"])
        pointer = {"checkpoint": name, "global_step": state["global_step"], "saved_at": time.time(),
                   "identity": state["identity"]}
        ways_out = "free space or fix access there, or pass another --checkpoint-dir"
        try:
            self.storage.write_from(name, lambda f: torch.save(state, f))
        except StorageError as e:
            raise UserError(f"saving checkpoint {self.storage.url(name)} failed ({e.cause}); {kept(previous)}; "
                            f"{ways_out}") from None
        try:
            self.storage.write(f"{run}/{POINTER}", json.dumps(pointer, indent=1).encode())
        except StorageError as e:
            raise UserError(f"saving checkpoint {self.storage.url(name)} failed at the run's pointer ({e.cause}); "
                            f"the checkpoint file itself is whole and the same command resumes from it; "
                            f"{ways_out}") from None
        self._prune(run)
        return self.storage.url(name)

    def _prune(self, run: str) -> None:
        """Best effort: the new checkpoint is committed; an old file that stays is pruned next time.
        Asked once, without the start's patience: a store that went away mid-run is met by the next
        save, whose error says what was saved (the start's error would say nothing was started)."""
        try:
            for old in _step_files(run, self.storage.list(run))[:-self.keep]:
                self.storage.delete(old)
        except StorageError:
            pass


class Checkpoints:
    """The checkpoint schema and the resume protocol, for every rank.

    Rank 0 alone reads the folder and writes; the other ranks get its decisions and the
    checkpoint's bytes through the process group (as JSON and raw bytes, never pickles), so every
    outcome, a failed save included, is the same on all ranks and they end together. While rank 0
    reads or waits for a write, the others wait on the store (ctx.after_primary), not in the
    collective: storage time is bounded by timeout_s (--storage-timeout-s), not by --timeout-s."""

    def __init__(self, folder: str, keep: int, ctx: DistContext, options: dict[str, Any] | None = None,
                 timeout_s: float = STORAGE_TIMEOUT_S, sole_writer: bool = True) -> None:
        self.location, self.ctx, self.keep, self.options, self.timeout_s = folder, ctx, keep, options, timeout_s
        self.sole_writer = sole_writer  # False: other jobs may be writing into the run's folder right now
        self.folder: CheckpointFolder | None = None  # rank 0's, opened in resume(): only rank 0 touches the storage
        self.run = ""  # the run folder this job saves into, decided by resume()
        self.writer = BackgroundWriter()  # rank 0's; idle elsewhere
        self.hung = False  # rank 0's storage outlived timeout_s: its writer is left behind, not waited for

    def url(self) -> str:
        return f"{self.location.rstrip('/')}/{self.run}"

    def resume(self, run: Run) -> tuple[Resumed | None, tuple[str, ...]]:
        """A collective. Finds what this job continues (--resume auto, none or a file), checks the
        folder takes writes and has room for a checkpoint, and loads the checkpoint into `run`.
        Returns it (None for a fresh start) and the warnings to print once."""
        choice = self._on_primary(f"checkpoint read from {self.location}", lambda: self._choose_on_primary(run))
        agreed = Choice(**self.ctx.broadcast_json(choice.plain() if choice else None))
        if agreed.error:
            self.ctx.fail_together(agreed.error)
        self.run = agreed.run
        if agreed.checkpoint is None:
            return None, agreed.warnings
        self.writer.last = agreed.checkpoint
        data = self.ctx.broadcast_bytes(choice.data if choice else None)
        resumed = Resumed(agreed.checkpoint, choice.state if choice else parse_checkpoint(data))
        self._restore(run, resumed)
        return resumed, agreed.warnings

    def _choose_on_primary(self, run: Run) -> Choice:
        try:  # opening the storage can fail too (an object store): every rank must hear of it
            self.folder = CheckpointFolder(storage_for(self.location, self.options), self.keep, self.options)
            choice = self.folder.choose(run.cfg.resume, run.cfg.identity())
            self.folder.check_writable(choice.run, expected_bytes(run))
            if self.sole_writer:  # a killed writer's temp files, in this job's folder only
                self.folder.storage.remove_leftovers(choice.run)
            return choice
        except UserError as e:
            return Choice("", error=str(e))
        except StorageError as e:
            return Choice("", error=f"--checkpoint-dir {e}; check the URL and the credentials")

    def _restore(self, run: Run, resumed: Resumed) -> None:
        """Load into the wrapped model (through the strategy), optimizer and schedule, on every rank."""
        problems = model_mismatches(resumed.state["model"], run.plain.state_dict())
        if problems:  # every rank read the same bytes and reaches the same verdict
            self.ctx.fail_together(f"checkpoint {resumed.path} does not fit this model: {'; '.join(problems)}; "
                                   "use another --checkpoint-dir or --resume none")
        if resumed.state.get("data_content", run.data.content) != run.data.content:  # the same verdict on every rank
            self.ctx.fail_together(f"checkpoint {resumed.path} was trained on other data than --data-dir "
                                   f"{run.cfg.data_dir} holds now (its files changed since: other rows, labels or "
                                   "sizes); to resume, restore the files it was trained on; to train on these, "
                                   f"start a new run with --resume none (--weights {resumed.path} starts it from "
                                   "its weights)")
        changed = order_changed(resumed.state, run.loader.split.groups is not None, run.loader.lanes,
                                run.steps_per_epoch)
        if changed:  # the same verdict on every rank
            self.ctx.fail_together(f"checkpoint {resumed.path} {changed}")
        load_training_state(run, resumed.state)

    def save(self, run: Run, at: Position, wait: bool, on_saved: Callable[[str, float], None]) -> str:
        """A collective. Rank 0 copies the state and writes it in the background (wait: and waits for
        it); every rank returns the checkpoint's path, or ends with rank 0's one-line error if this
        save (wait) or the one before it failed. The previous checkpoint stays loadable either way.
        on_saved(path, seconds) is called on rank 0 once the checkpoint is committed."""
        state = training_state(run, at)
        path = self.folder.storage.url(step_name(self.run, state["global_step"])) if self.folder else ""

        def write_on_primary() -> dict[str, Any]:
            outcome = {"path": path, "error": self.writer.outcome()}  # the save before this one
            if not outcome["error"]:
                saved = {**detached_copy(state), "data": data_entry(run)}
                self.writer.start(self.folder, self.run, saved, self.last, on_saved)
                if wait:
                    outcome["error"] = self.writer.outcome()
            return outcome
        outcome = self.ctx.broadcast_json(self._on_primary(f"checkpoint save at step {state['global_step']}",
                                                          write_on_primary))
        if outcome["error"]:
            self.ctx.fail_together(outcome["error"])
        return outcome["path"]

    def finish(self) -> None:
        """A collective: wait for rank 0's save in flight; every rank ends with its error if it failed."""
        error = self.ctx.broadcast_json(self._on_primary("checkpoint save", self.writer.outcome))
        if error:
            self.ctx.fail_together(error)

    def _on_primary(self, what: str, action: Callable[[], T]) -> T | None:
        """Rank 0's storage I/O while the others wait (see DistContext.after_primary)."""
        try:
            return self.ctx.after_primary(what, action, self.timeout_s)
        except UserError:  # on rank 0: its storage outlived the deadline, and the job ends because of it
            self.hung = True
            raise

    def save_failed(self) -> bool:
        """Rank 0, without waiting: whether the save in flight has already failed."""
        return self.writer.failed()

    @property
    def last(self) -> str | None:
        return self.writer.last

    def close(self) -> None:
        """Rank 0: wait for a write still in flight when the job ends early, before the logger closes
        (not for one that outlived --storage-timeout-s: the job is ending because of it)."""
        if not self.hung:
            self.writer.close()


class BackgroundWriter:
    """Rank 0's one writing thread. Holds the outcome of the last save until someone asks for it."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self.pending: Future[str] | None = None
        self.last: str | None = None  # the run's newest committed checkpoint (named if a save fails)

    def start(self, folder: CheckpointFolder, run: str, state: dict[str, Any], previous: str | None,
              on_saved: Callable[[str, float], None]) -> None:
        def write() -> str:
            started = time.perf_counter()
            try:
                path = folder.write(run, state, previous)
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - serializing can fail too (out of memory): one line on every rank
                url = folder.storage.url(step_name(run, state["global_step"]))
                raise UserError(f"saving checkpoint {url} failed ({first_line(e, with_type=True)}); "
                                f"{kept(previous)}") from None
            try:
                on_saved(path, time.perf_counter() - started)
            except OSError:
                pass  # the console went away (a closed pipe): the checkpoint is committed all the same
            return path
        self.pending = self.pool.submit(write)

    def outcome(self) -> str | None:
        """Wait for the save in flight, if any: None when it committed, else its one-line error."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            self.last = pending.result()
        except UserError as e:
            return str(e)
        return None

    def failed(self) -> bool:
        return self.pending is not None and self.pending.done() and self.pending.exception() is not None

    def close(self) -> None:
        """Let a write in flight finish. The job is ending (on an error, or the outcome would have
        been asked for): if the save failed, say so, and which checkpoint the same command resumes from."""
        error = self.outcome()
        if error:
            print(f"warning: the job's last save did not complete: {error}", file=sys.stderr, flush=True)


def _step_number(name: str) -> int:
    return int(STEP_FILE.search(name).group(1))


def _from_pointer(run: str, raw: bytes) -> RunInfo:
    """The pointer's RunInfo; BadPointer if it does not parse (cut) or names a file other than one
    of the run's step files (edited by hand, or a folder copied under another name)."""
    try:
        pointer = json.loads(raw)
        info = RunInfo(run, dict(pointer["identity"]), pointer["checkpoint"], int(pointer["global_step"]),
                       float(pointer["saved_at"]))
    except (ValueError, KeyError, TypeError) as e:
        raise BadPointer(f"does not parse ({type(e).__name__}, {len(raw)} bytes)") from None
    if not isinstance(info.checkpoint, str) or not re.fullmatch(rf"{re.escape(run)}/step-\d{{8}}\.pt", info.checkpoint):
        raise BadPointer(f"names an unexpected file {str(info.checkpoint)[:80]!r}")
    return info


def _started_at(run: str) -> float:
    """The start time in a run folder's name (its save time is unknown without a pointer)."""
    try:
        return time.mktime(time.strptime(run[:15], RUN_STARTED))
    except ValueError:
        return 0.0


def new_run_name() -> str:
    """Start time (sortable) and 64 random bits: parallel starts in one second never share a folder."""
    return f"{time.strftime(RUN_STARTED)}-{secrets.token_hex(8)}"
