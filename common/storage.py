"""Where checkpoints and data live, behind one small interface: a local folder or an object store
(s3://, gs://, az://, ... through fsspec; LocalStorage and FsspecStorage below).

Names are '/'-separated paths relative to the storage's root. `write` is all-or-nothing for
readers: they see the old object or the new one, never part of one.

Every failure is a StorageError whose `kind` says what a reader may conclude from it: MISSING (no
such file: nothing is there), DENIED (credentials or permissions), TRANSIENT (unreachable, timed
out, throttled, busy: the same request may work in a moment) or FAILED (anything else). Only
MISSING says something about the folder's contents; the others say the store did not answer.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import io
import os
import shutil
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Protocol, TypeVar

from common.credentials import read_storage_options, secrets_in
from common.errors import UserError, first_line

T = TypeVar("T")

MISSING, DENIED, TRANSIENT, FAILED = "missing", "denied", "transient", "failed"
# --storage-timeout-s's default: generous, so that it covers a large checkpoint on a slow store, with
# the storage layer's own bounded retries of transient errors, and a data set's download.
STORAGE_TIMEOUT_S = 1800.0


class StorageError(Exception):
    """An operation on `url` failed; `cause` says why in a few words (for one-line errors), `kind`
    what it means (MISSING, DENIED, TRANSIENT or FAILED)."""

    def __init__(self, url: str, cause: str, kind: str = FAILED) -> None:
        super().__init__(f"{url}: {cause}")
        self.url, self.cause, self.kind = url, cause, kind

    @property
    def transient(self) -> bool:
        return self.kind == TRANSIENT


class Storage(Protocol):
    def url(self, name: str = "") -> str:
        """What a person should see for `name` (the root itself for '')."""

    def write(self, name: str, data: bytes) -> None: ...

    def write_from(self, name: str, produce: Callable[[BinaryIO], None]) -> None:
        """Like write, with the bytes written by `produce` into a file object: a local file gets
        them as they come (no copy of the whole in memory); it may be called twice."""

    def read(self, name: str) -> bytes: ...

    def list(self, prefix: str) -> list[str]:
        """Names directly under `prefix` ('' for the root), files and folders alike; [] if none."""

    def delete(self, name: str) -> None: ...

    def free_bytes(self) -> int | None:
        """Room left for writes, or None where the store has no such limit."""

    def remove_leftovers(self, folder: str) -> None:
        """Remove what a writer killed mid-write left in `folder` (never a complete object). Only
        for a folder no other live writer uses: the job's own run folder, once its start is accepted."""


def os_cause(error: OSError) -> str:
    """'No space left on device (ENOSPC)': the words and the code people search for."""
    code = errno.errorcode.get(error.errno or 0)
    return f"{error.strerror or error}{f' ({code})' if code else ''}"


# Errors after which the same request may well succeed: a network file system or a FUSE mount of
# an object store (which reports a failed request as EIO) that is slow, busy or briefly away.
TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.EIO, errno.ETIMEDOUT, errno.ESTALE,
                    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EHOSTDOWN, errno.EHOSTUNREACH,
                    errno.ENETDOWN, errno.ENETUNREACH, errno.ENETRESET, errno.EPIPE, errno.EREMOTEIO}
# botocore's and aiohttp's names for a request that got no answer (they are not ConnectionErrors).
TRANSIENT_NAMES = {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError",
                   "ConnectionError", "ResponseStreamingError", "IncompleteReadError", "ClientConnectorError",
                   "ServerDisconnectedError", "ClientOSError", "ClientPayloadError", "ServerTimeoutError"}
THROTTLED = ("SlowDown", "Throttl", "RequestLimitExceeded", "TooManyRequests", "ServiceUnavailable", "(503)",
             "(500)", "InternalError", "RequestTimeout")
DENIED_WORDS = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "Forbidden")


def error_kind(error: BaseException) -> str:
    """MISSING, DENIED, TRANSIENT or FAILED, from the exception a file system or store raised."""
    name, text = type(error).__name__, str(error)
    if isinstance(error, (FileNotFoundError, NotADirectoryError)):
        return MISSING
    if isinstance(error, PermissionError) or name in ("NoCredentialsError", "PartialCredentialsError") \
            or any(word in text for word in DENIED_WORDS):
        return DENIED
    if isinstance(error, (ConnectionError, TimeoutError)) or name in TRANSIENT_NAMES \
            or getattr(error, "errno", None) in TRANSIENT_ERRNOS or any(word in text for word in THROTTLED):
        return TRANSIENT
    return FAILED


# rename(2) refused by the file system (S3 Mountpoint, some FUSE mounts), not by permissions on the file.
NO_RENAME = {errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM}


class LocalStorage:
    """A folder on a local or mounted file system. A write goes to a temp file in the same folder,
    is fsynced and renamed over the target, and the folder is fsynced: no hard links, so FUSE
    mounts of object stores (gcsfuse, blobfuse) work. Where rename is refused too, the file is
    written in place: a cut write then leaves a file that does not load, which readers skip."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def url(self, name: str = "") -> str:
        return str(self.root / name) if name else str(self.root)

    def _path(self, name: str) -> Path:
        return self.root / name if name else self.root

    def write(self, name: str, data: bytes) -> None:
        self.write_from(name, lambda f: f.write(data))

    def write_from(self, name: str, produce: Callable[[BinaryIO], None]) -> None:
        path = self._path(name)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_synced(tmp, produce)
            try:
                os.replace(tmp, path)
            except OSError as e:
                if e.errno not in NO_RENAME:
                    raise
                tmp.unlink(missing_ok=True)
                _write_synced(path, produce)
            _fsync_dir(path.parent)
        except BaseException as e:  # serializing can fail too (out of memory)
            with contextlib.suppress(OSError):  # e.g. the folder is a file: the first error is the one to tell
                tmp.unlink(missing_ok=True)  # never leave a partial file behind
            if (os_error := _os_error_behind(e)) is not None:
                raise StorageError(self.url(name), os_cause(os_error), error_kind(os_error)) from None
            raise

    def read(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise StorageError(self.url(name), "no such file", MISSING) from None
        except OSError as e:
            raise StorageError(self.url(name), os_cause(e), error_kind(e)) from None

    def list(self, prefix: str) -> list[str]:
        try:
            return sorted(p.name for p in self._path(prefix).iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise StorageError(self.url(prefix), os_cause(e), error_kind(e)) from None

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink(missing_ok=True)
        except OSError as e:
            raise StorageError(self.url(name), os_cause(e), error_kind(e)) from None

    def free_bytes(self) -> int | None:
        existing = next(p for p in (self.root, *self.root.absolute().parents) if p.exists())
        return shutil.disk_usage(existing).free

    def remove_leftovers(self, folder: str) -> None:
        for tmp in self._path(folder).glob(".*.tmp-*"):
            try:
                tmp.unlink(missing_ok=True)
            except OSError as e:
                raise StorageError(str(tmp), os_cause(e), error_kind(e)) from None


def _os_error_behind(error: BaseException | None) -> OSError | None:
    """The OSError that caused `error`, if any: torch.save reports a failed write (a full disk) as
    a RuntimeError ('unexpected pos') raised while it closes its archive, in the OSError's handling."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def _write_synced(path: Path, produce: Callable[[BinaryIO], None]) -> None:
    with open(path, "wb") as f:
        produce(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    """Makes the rename durable; some file systems (FUSE mounts) cannot fsync a folder: no harm."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def split(url: str) -> tuple[str, str]:
    """(parent, name) of a file's path or URL."""
    parent, _, name = url.rstrip("/").rpartition("/")
    return parent or ".", name


def is_url(path: str) -> bool:
    """s3://bucket/prefix, gs://..., memory://...: anything fsspec opens that is not a local path."""
    return "://" in path and not path.startswith("file://")


# Timeouts and retries for object stores: an unreachable endpoint must end the job in seconds, not
# hang it (botocore's defaults: 60 s per connect and per read, several retries). Bounds in
# docs/object-storage.md (Errors).
S3_DEFAULTS = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 20,
                                 "retries": {"max_attempts": 3, "mode": "standard"}}}
S3FS_RETRIES = 2  # s3fs's own retry loop around botocore's (its default: 5, with growing sleeps)


class FsspecStorage:
    """An object store (or any fsspec file system) at `url`. A write is one PUT of the whole
    object, atomic for readers on S3-compatible stores; listings are refreshed on every call, since
    a cached (or eventually consistent) listing may miss the newest checkpoint."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        import fsspec

        self.root_url = url.rstrip("/")
        protocol = fsspec.core.split_protocol(url)[0]
        defaults = S3_DEFAULTS if protocol in ("s3", "s3a") else {}
        self.secrets = secrets_in(options)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **{**defaults, **options})
        except (ImportError, ValueError, TypeError) as e:
            raise StorageError(url, self.scrub(f"{type(e).__name__}: {e}")) from None
        if defaults:
            self.fs.retries = S3FS_RETRIES
        self.root = self.root.rstrip("/")

    def scrub(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    def url(self, name: str = "") -> str:
        return f"{self.root_url}/{name}" if name else self.root_url

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def _do(self, name: str, action: Callable[[str], T]) -> T:
        quiet_orphaned_connection_errors()  # here, not once: a forked process (a loader's worker) has a new loop
        try:
            return action(self._path(name))
        except Exception as e:  # noqa: BLE001 - every store error becomes one line naming the URL
            raise StorageError(self.url(name), self.scrub(describe_store_error(e)), error_kind(e)) from None

    def write(self, name: str, data: bytes) -> None:
        self._do(name, lambda path: self.fs.pipe_file(path, data))

    def write_from(self, name: str, produce: Callable[[BinaryIO], None]) -> None:
        """One PUT of an in-memory buffer. CPython's getvalue() hands over the buffer itself, not a
        copy (botocore takes bytes, not a memoryview)."""
        buffer = io.BytesIO()
        produce(buffer)
        self.write(name, buffer.getvalue())

    def read(self, name: str) -> bytes:
        return self._do(name, self.fs.cat_file)

    def info(self, name: str) -> dict[str, Any]:
        return self._do(name, self.fs.info)

    def get(self, name: str, local: Path) -> None:
        self._do(name, lambda path: self.fs.get_file(path, str(local)))

    def versions(self) -> dict[str, str]:
        """Name -> version (size and ETag) of each object directly under the URL, in one listing."""
        def listing(path: str) -> dict[str, str]:
            self.fs.invalidate_cache(path)
            return {entry["name"].rstrip("/").rsplit("/", 1)[-1]: _version(entry)
                    for entry in self.fs.ls(path, detail=True) if entry.get("type") != "directory"}
        return self._do("", listing)

    def files(self) -> dict[str, str]:
        """Name ('/'-separated, relative to the URL) -> version of every object under it, at any depth."""
        def listing(path: str) -> dict[str, str]:
            self.fs.invalidate_cache(path)
            return {name[len(path):].strip("/"): _version(entry)
                    for name, entry in self.fs.find(path, detail=True).items() if entry.get("type") != "directory"}
        return self._do("", listing)

    def open(self, name: str) -> BinaryIO:
        """`name` open for reading by ranges (a parquet reader's footer, then its row groups)."""
        return self._do(name, lambda path: self.fs.open(path, "rb"))

    def list(self, prefix: str) -> list[str]:
        def names(path: str) -> list[str]:
            try:
                self.fs.invalidate_cache(path)
                return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(path, detail=False))
            except FileNotFoundError as e:
                if "bucket" in str(e).lower():
                    raise
                return []
        return self._do(prefix, names)

    def delete(self, name: str) -> None:
        self._do(name, self.fs.rm_file)

    def free_bytes(self) -> int | None:
        return None

    def remove_leftovers(self, folder: str) -> None:
        pass  # a cut PUT leaves nothing behind


def _version(entry: dict[str, Any]) -> str:
    """An object's version from its listing entry: its size and ETag (or checksum, or date)."""
    return f"{int(entry.get('size') or 0)}-{entry.get('ETag') or entry.get('etag') or entry.get('mtime') or ''}"


def quiet_orphaned_connection_errors() -> None:
    """When a store goes down during a request, aiohttp (under s3fs) can leave a task of that request
    failed and unawaited; asyncio then prints "Task exception was never retrieved" with its traceback
    when the task is collected. The request's failure is already this module's one line (a
    StorageError), so fsspec's event loop drops such orphaned connection errors; anything else goes
    to the handler that was there (asyncio's own, or one the program set)."""
    from fsspec.asyn import get_loop

    loop = get_loop()
    previous = loop.get_exception_handler()
    if getattr(previous, "drops_orphaned_connection_errors", False):
        return

    def handler(loop: Any, context: dict[str, Any]) -> None:
        if _orphaned_connection_error(context):
            return
        if previous:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)
    handler.drops_orphaned_connection_errors = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)


def _orphaned_connection_error(context: dict[str, Any]) -> bool:
    orphaned = context.get("message", "").startswith("Task exception was never retrieved")
    return orphaned and isinstance(context.get("exception"), ConnectionError | _client_connection_error())


def _client_connection_error() -> type[BaseException]:
    """aiohttp's base of its connection errors (some, like ServerDisconnectedError, are not OSErrors)."""
    try:
        from aiohttp import ClientConnectionError
    except ImportError:
        return ConnectionError
    return ClientConnectionError


def describe_store_error(error: Exception) -> str:
    """What went wrong, in the words a user acts on."""
    name = type(error).__name__
    text = first_line(error) if str(error) else ""
    if name == "NoCredentialsError":
        return ("no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile (AWS_PROFILE), "
                "an instance role, or key/secret in --storage-options @FILE or env:VAR (not inline: ps shows it)")
    if isinstance(error, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text:
        return f"access denied, wrong or missing credentials ({text})"
    if name in TRANSIENT_NAMES or isinstance(error, (ConnectionError, TimeoutError)):
        return f"the store is unreachable ({text}); check AWS_ENDPOINT_URL or endpoint_url in --storage-options"
    if error_kind(error) == TRANSIENT:
        return f"the store is busy or throttling ({text})"
    if isinstance(error, FileNotFoundError):
        return f"not found ({text})" if text else "not found"
    return f"{name}: {text}"


def url_problem(url: str) -> str | None:
    """Why this installation cannot open `url`, or None (local paths always open)."""
    if not is_url(url):
        return None
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return f"no file system is known for {protocol}:// URLs"
    except ImportError as e:
        return f"{protocol}:// URLs need a package that is not installed ({first_line(e)}); pip install it " \
               "(s3fs for s3:// is in requirements.txt)"
    return None


def log_url_problem(url: str) -> str | None:
    """TensorBoard writes URLs through its own file layer: s3:// with boto3, others with fsspec."""
    if not is_url(url):
        return None
    if url.startswith(("s3://", "s3a://")):
        if importlib.util.find_spec("boto3") is None:
            return "TensorBoard writes s3:// through boto3, which is not installed; pip install boto3"
        return None
    return url_problem(url)


def export_s3_endpoint(options: dict[str, Any]) -> None:
    """TensorBoard writes s3:// with boto3, which reads AWS_ENDPOINT_URL itself but not our
    --storage-options: pass their endpoint on (S3_ENDPOINT is what TensorBoard reads)."""
    endpoint = options.get("endpoint_url") or options.get("client_kwargs", {}).get("endpoint_url")
    if endpoint:
        os.environ.setdefault("S3_ENDPOINT", endpoint)


def storage_for(url: str, options: dict[str, Any] | None = None) -> Storage:
    if is_url(url):
        return FsspecStorage(url, options or {})
    return LocalStorage(url.removeprefix("file://"))


# How long one start keeps asking a store that does not answer (unreachable, timed out, throttled)
# before the job ends: seconds spent on failed requests and pauses, over all of the start's reads;
# the pause between two asks grows from FIRST_PAUSE_S, doubling up to LONGEST_PAUSE_S.
RESUME_RETRY_S = float(os.environ.get("DP_STORE_RETRY_S", "60"))
FIRST_PAUSE_S, LONGEST_PAUSE_S = 1.0, 10.0


class Patience:
    """One start's allowance for a store that does not answer: a transient failure is retried after
    a pause (1 s, doubling up to 10 s) while the time spent on failures stays within `bound_s`."""

    def __init__(self, bound_s: float | None = None) -> None:
        self.bound_s = RESUME_RETRY_S if bound_s is None else bound_s
        self.spent_s, self.retries = 0.0, 0
        self.last: StorageError | None = None

    def call(self, action: Callable[[], T]) -> T:
        pause = FIRST_PAUSE_S
        while True:
            started = time.monotonic()
            try:
                return action()
            except StorageError as e:
                if not e.transient:
                    raise
                self.spent_s += time.monotonic() - started
                self.last = e
                if self.spent_s + pause > self.bound_s:
                    raise UserError(f"the store did not answer reading {e.url} for "
                                    f"{self.spent_s:.0f} s ({e.cause}); nothing was started and no file was changed; "
                                    "run the same command again once the store answers") from None
                time.sleep(pause)
                self.spent_s += pause
                self.retries += 1
                pause = min(2 * pause, LONGEST_PAUSE_S)

    def warnings(self) -> list[str]:
        if not self.retries:
            return []
        return [f"warning: the store did not answer at first ({self.last.url}: {self.last.cause}); it did after "
                f"{self.retries} retries over {self.spent_s:.0f} s"]


def add_storage_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flags of this module: how URLs are opened and how long a store may take."""
    add = group.add_argument
    add("--storage-options", default="{}", metavar="JSON|@FILE|env:VAR",
        help='fsspec options for URLs in --data-dir, --checkpoint-dir and --resume: a JSON object such as '
             '\'{"endpoint_url": "http://minio:9000"}\', or @FILE (read from that JSON file) or env:VAR (from that '
             "environment variable). Give credentials in a file or a variable: a command line is readable by every "
             "user of the machine (ps). They are never printed or saved "
             "(default: the standard AWS variables, profile or instance role)")
    add("--storage-timeout-s", type=float, default=STORAGE_TIMEOUT_S,
        help="the longest a node's data preparation or one of rank 0's checkpoint reads and saves may take; the "
             "other ranks wait for it outside the process group, so --timeout-s does not bound it, and a process "
             "that dies meanwhile is noticed within 30 s by its heartbeat (default: %(default)s)")


def check_storage_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """URLs this installation cannot open are found here, before any process group starts; the
    --storage-options read (JSON, @FILE or env:VAR) become the options themselves."""
    try:
        a.storage_options = read_storage_options(a.storage_options)
    except ValueError as e:
        p.error(f"--storage-options {e}")
    for flag, value in (("--data-dir", a.data_dir), ("--checkpoint-dir", a.checkpoint_dir), ("--resume", a.resume)):
        if problem := url_problem(value):
            p.error(f"{flag} {value}: {problem}")
    if problem := log_url_problem(a.log_dir):
        p.error(f"--log-dir {a.log_dir}: {problem}")
