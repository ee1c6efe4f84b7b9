"""What the three programs share: their checkpoint flags, how they write their output (whole under
its final name, or not at all: staged), and how they end (one line and an exit status for an error,
as the training scripts do; a Ctrl-C: one line and status 130, common/interrupts.py)."""
from __future__ import annotations

import argparse
import errno
import math
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from common.config import RankZeroParser
from common.credentials import read_storage_options
from common.data.index import staging_for
from common.errors import ConfigError, UserError, exit_quietly_after_the_printer
from common.interrupts import finished, output_in_place, removed_on_ctrl_c
from common.parallel.context import DeadlinePassed, abandon_hung_thread, run_within
from common.parallel.failures import parsed_telling_torchrun, told
from common.storage import NO_RENAME, STORAGE_TIMEOUT_S, os_cause, url_problem
from common.use.source import Saved, find_checkpoint


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser whose errors are one line (printed by rank 0 alone under torchrun), with the flags
    that choose the checkpoint and its weights."""
    p = RankZeroParser(prog=prog, description=description)
    p.add_argument("--checkpoint", required=True, metavar="FILE_OR_DIR",
                   help="a checkpoint file, a run folder (its newest checkpoint that loads) or a training run's "
                        "--checkpoint-dir (its most recently saved run's newest), local or a URL")
    p.add_argument("--ema", action="store_true",
                   help="use the moving average of the weights the checkpoint holds (its run trained with --ema)")
    p.add_argument("--storage-timeout-s", type=float, default=STORAGE_TIMEOUT_S,
                   help="the longest reading the checkpoint (and evaluate.py's data preparation) may take "
                        "(default: %(default)s)")
    p.add_argument("--storage-options", default="{}", metavar="JSON|@FILE|env:VAR",
                   help="fsspec options for URLs (an object store's endpoint, credentials), as the training "
                        "scripts take them (docs/flags.md)")
    return p


def check_storage(p: argparse.ArgumentParser, a: argparse.Namespace, *flags: str) -> None:
    """--storage-options parsed into a dict, and URLs this installation cannot open refused (exit 2)."""
    if not 0 < a.storage_timeout_s < math.inf:
        p.error(f"--storage-timeout-s must be > 0 and finite (got {a.storage_timeout_s})")
    try:
        a.storage_options = read_storage_options(a.storage_options)
    except ValueError as e:
        p.error(f"--storage-options {e}")
    for flag in ("checkpoint", *flags):
        if problem := url_problem(getattr(a, flag) or ""):
            p.error(f"--{flag.replace('_', '-')} {getattr(a, flag)}: {problem}")


def check_writable(p: argparse.ArgumentParser, flag: str, given: Path, files: Sequence[Path] = ()) -> None:
    """The files a program will write, checked before any work: `given` (the flag's file), or `files`
    (the flag's folder's, or its file and those beside it); one line naming the flag (exit 2), not a
    traceback after it."""
    if problem := writable_problem(flag, given, files):
        p.error(problem)


def writable_problem(flag: str, given: Path, files: Sequence[Path] = ()) -> str | None:
    """Why the program could not write `files` (default: `given`, the flag's value), all in one
    folder, in words naming the flag; None if it can. Each is put in place by a rename (staged), so
    one that is there must be a regular file: a rename over a folder fails after the work, and one
    over a device (--output /dev/null, as root) or a FIFO would replace it."""
    files = files or [given]
    folder = files[0].parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"{flag} {given}: cannot create the folder {folder} ({e.strerror}); give a path you can write"
    for file in files:
        which, way_out = ("", "give a file path you can write") if file == given else \
            (f"{file} ", f"move it away or give another {flag}")
        if file.is_dir():
            return f"{flag} {given}: {which}is a folder; {way_out}"
        if file.exists() and not file.is_file():
            return (f"{flag} {given}: {which}is not a regular file (a device, a FIFO or a socket), which the output, "
                    f"renamed into place, would replace; {way_out}")
    # Written to, not asked (os.access): root passes every permission check, yet /proc, a read-only
    # mount or a full disk still refuse the file after the work.
    try:
        probe, name = tempfile.mkstemp(prefix=".write-check-", dir=folder)
        os.close(probe)
        os.unlink(name)
        for file in files:
            if file.exists():
                with open(file, "ab"):
                    pass
    except OSError as e:
        return f"{flag} {given}: not writable ({e.strerror}); give a path you can write"
    return None


@contextmanager
def staged(folder: Path, names: Sequence[str]) -> Iterator[Path]:
    """A staging folder beside the output, in `folder`, where the block writes the files `names` under
    their final names (an ONNX file names its PATH.data by its own). When the block ends without an
    error, those it wrote are moved into `folder` in the order of `names`, a Ctrl-C meanwhile waiting
    for the moves (common/interrupts.py); an error or a Ctrl-C before them removes the staging folder.
    A file of the output is under its final name only whole: a Ctrl-C, an error or a full disk
    mid-way leaves the previous file, or none."""
    staging = staging_for(folder / "output")  # .output.tmp-HOST-PID-RANDOM
    with removed_on_ctrl_c(staging):
        try:
            with told_when_full(folder):
                yield staging
            with output_in_place():
                for name in names:
                    if (staging / name).exists():
                        move(staging / name, folder / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def told_when_full(folder: Path) -> Iterator[None]:
    """A full disk (or quota) as the output is staged: one line naming the folder, not a traceback;
    nothing of the output is in place yet."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise UserError(f"{folder}: no room for the output ({os_cause(e)}); free space there or write it elsewhere: "
                        "no file was written, those there are as they were") from None


def move(staged_file: Path, final: Path) -> None:
    """A rename; copied where the file system renames nothing (S3 Mountpoint, some FUSE mounts),
    the one way such a mount takes a file. A symbolic link under the final name is written through,
    as open() writes (the file it names is replaced; the link stays), not replaced by the file."""
    final = Path(os.path.realpath(final)) if final.is_symlink() else final
    try:
        os.replace(staged_file, final)
    except OSError as e:
        if e.errno not in NO_RENAME:
            raise
        shutil.copyfile(staged_file, final)


def read_checkpoint(flags: argparse.Namespace) -> Saved:
    """--checkpoint, read within --storage-timeout-s: a store that never answers ends the program
    with one line, not a hang."""
    try:
        return run_within(lambda: find_checkpoint(flags.checkpoint, flags.storage_options), flags.storage_timeout_s,
                          "checkpoint read")
    except DeadlinePassed:
        abandon_hung_thread()  # the read's thread cannot be stopped; the process must still end
        raise ConfigError(f"--checkpoint {flags.checkpoint}: no answer within {flags.storage_timeout_s:g} s "
                          "(--storage-timeout-s); check the URL and that the store is up") from None


def run_program(parse: Callable[[], argparse.Namespace],
                use: Callable[[argparse.Namespace, Saved], int | None]) -> None:
    """Parse the flags, find the checkpoint, use it (`use` returns the exit status; None: 0); an error
    ends the process with its one line (a crash: its traceback, then a line) and its exit status.
    Then the process ends at once (common/interrupts.py finished); a test's call returns, or raises
    SystemExit for a status other than 0."""
    try:
        status = status_of(parse, use)
    except SystemExit as ended:  # argparse's refusal of a flag (2) or --help (0), said already
        status = ended.code if isinstance(ended.code, int) else 1
    finished(status)
    if status:
        sys.exit(status)


def status_of(parse: Callable[[], argparse.Namespace], use: Callable[[argparse.Namespace, Saved], int | None]) -> int:
    """The program's exit status: `use`'s, or an error's once its line is said."""
    try:
        flags = parsed_telling_torchrun(parse)
        return use(flags, read_checkpoint(flags)) or 0
    except Exception as error:
        failure = told(error, None)
        if not failure.should_print():
            exit_quietly_after_the_printer(failure.quiet_exit_delay_s)
        return failure.exit_code
