"""Getting a data set onto every node: local files, a download from the internet, or a copy from
an object store into a local cache, once per node; then every rank reads the same files.

One process per node (its local rank 0) does the work; the others wait on the job's key-value
store, not inside a collective, so a download is not bounded by --timeout-s. The worker bumps a
heartbeat in the store while it works (common/parallel/context.py): every rank ends, with one line naming
the node(s), when a node reports that it failed, when a node's heartbeat stops for STALE_AFTER_S
(its preparing process was killed, e.g. by the OOM killer), or when a node's preparation overruns
--storage-timeout-s (that node reports it; the others give up STALE_AFTER_S later).

Files appear under their final names only when complete and verified (temp name, checksum,
rename), under a file lock, so nodes sharing one volume fetch once and a cut download never passes
for a complete file.
"""
from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import shutil
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from common.config import DATASETS
from common.data import formats, own
from common.data.cache import META, cache_folder, default_cache_dir, file_lock, map_tensors, write_tensors
from common.data.loader import Dataset, Split, make_synthetic
from common.errors import UserError, WaitExpired, first_line
from common.parallel.context import (
    DEADLINE_FLAG,
    PROGRESS_EVERY_S,
    DeadlinePassed,
    DistContext,
    Unanswered,
    run_with_heartbeat,
    wait_for_keys,
)
from common.storage import STORAGE_TIMEOUT_S, StorageError, is_url, storage_for

Say = Callable[[str], None]

DOWNLOAD_TIMEOUT_S = 60.0  # a stalled connection (no byte for this long) fails the download


def add_data_flags(group: argparse._ArgumentGroup, default_dataset: str) -> None:
    """The training scripts' flags of load_dataset: which set, where it is, and how it gets there."""
    add = group.add_argument
    add("--dataset", default=default_dataset, help=f"one of {', '.join(DATASETS)} (default: %(default)s)")
    add("--data-dir", default="./data", help="where data sets live or are downloaded: a folder, or an object-store URL "
                                            "(s3://bucket/prefix, any fsspec URL) copied into --cache-dir "
                                            "(default: %(default)s)")
    add("--no-download", dest="download", action="store_false", help="never download; fail if files are missing")
    add("--download-from", default="", metavar="BASE_URL",
        help="download the data set's archives from BASE_URL/<file name> (a mirror) instead of their home sites")
    add("--cache-dir", default="", help="local copy of a --data-dir URL, one per node "
                                        "(default: $XDG_CACHE_HOME/dp-suite or ~/.cache/dp-suite)")
    add("--synthetic-shape", default="cifar", choices=("cifar", "mnist"), help="image shape of --dataset synthetic")


def check_data_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.dataset not in DATASETS:
        p.error(f"--dataset {a.dataset!r} is unknown; choose one of {', '.join(DATASETS)}")


def load_dataset(name: str, data_dir: str, *, ctx: DistContext, say: Say, allow_download: bool = True,
                 download_from: str = "", cache_dir: str = "", storage_options: dict[str, Any] | None = None,
                 synthetic_shape: str = "cifar", deadline_s: float = STORAGE_TIMEOUT_S,
                 own_data: own.OwnData | None = None) -> Dataset:
    """The data set. Its node's local rank 0 makes the files present and decodes them once into a
    cache of raw tensors (your own images: or indexes them for streaming, common/data/own.py),
    within deadline_s; every rank of the node maps that cache (shared pages, no copy)."""
    if name == "synthetic":
        return make_synthetic(synthetic_shape)
    root = cache_folder(cache_dir, data_dir) if is_url(data_dir) else Path(data_dir)

    def prepare() -> Any:
        if own_data is not None:
            return own.prepare(own_data, say)
        if is_url(data_dir):
            fetch_remote(name, data_dir, root, storage_options or {}, say)
        else:
            ensure_local(name, root, allow_download, download_from, say)
        return str(decode_once(name, root, cache_dir))
    if ctx.is_node_primary:
        try:
            report = {"error": None, "prepared": run_with_heartbeat(ctx.store, node_key(ctx.node_rank), prepare,
                                                                    deadline_s)}
        except DeadlinePassed:
            report = {"error": f"preparing the data did not finish within {deadline_s:g} s ({DEADLINE_FLAG}); "
                               f"pass a larger {DEADLINE_FLAG} for a slow download"}
        except UserError as e:
            report = {"error": str(e)}
        ctx.store.set(node_key(ctx.node_rank), json.dumps(report))
    wait_for_nodes(ctx, say, deadline_s)
    prepared = json.loads(ctx.store.get(node_key(ctx.node_rank)))["prepared"]
    if own_data is not None:
        return ctx.together(lambda: own.open_prepared(prepared, own_data))
    return ctx.together(lambda: map_decoded(name, Path(prepared)))


def node_key(node: int) -> str:
    """Where a node's local rank 0 reports its data (and beats its heartbeat) in the job's store."""
    return f"data/node-{node}"


# ---------------------------------------------------------------- decoded once per node

CACHE_FORMAT = 2  # part of a cache folder's key: a later layout of its files is never read as an earlier one
SPLITS = ("train_images", "train_labels", "test_images", "test_labels")


def decode_once(name: str, root: Path, cache_dir: str) -> Path:
    """Raw uint8 images and int64 labels of the data set, in a folder named after its source files
    (paths, sizes, modification times): decoded the first time, found again by later runs."""
    sources = sorted(p for folder in formats.layout_folders(name) for p in (root / folder).glob("*")
                     if p.is_file() and not p.name.startswith("."))
    files = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sources]
    key = hashlib.sha256(json.dumps([name, CACHE_FORMAT, str(root.resolve()), *files]).encode()).hexdigest()[:16]
    folder = Path(cache_dir or default_cache_dir()) / "decoded" / f"{name}-{key}"
    if (folder / META).is_file():
        return folder
    data = formats.read_dataset(name, root)
    staging = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    try:
        staging.mkdir(parents=True, exist_ok=True)
        write_tensors(staging, dict(zip(SPLITS, (data.train.images, data.train.labels, data.test.images,
                                                 data.test.labels))))
        os.replace(staging, folder)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / META).is_file():  # another process may have won the race
            raise UserError(f"--cache-dir {folder.parent}: {first_line(e)}; pass a writable --cache-dir") from None
    return folder


def map_decoded(name: str, folder: Path) -> Dataset:
    """Every rank maps the same files: the pages are shared, not copied per rank."""
    tensors = [map_tensors(folder)[split] for split in SPLITS]
    spec = formats.CIFAR_SPEC if name == "cifar10" else formats.MNIST_SPEC
    return Dataset(name, spec, Split(*tensors[:2]), Split(*tensors[2:]))


def wait_for_nodes(ctx: DistContext, say: Say, deadline_s: float) -> None:
    """Every rank waits until each node's local rank 0 reported, polling the store; a node's
    failure ends every rank with its message. A node that stopped responding, or that reported
    nothing STALE_AFTER_S after its own deadline, ends every rank that waits for it with one line
    (no collective: that node's ranks may be gone)."""
    keys = [node_key(node) for node in range(ctx.nodes)]

    def progress(pending: list[str], seconds: float) -> None:
        say(f"waiting for the data on node(s) {', '.join(k.rsplit('-', 1)[1] for k in pending)} ({seconds:.0f} s)")
    try:
        wait_for_keys(ctx.store, keys, deadline_s, progress)
    except Unanswered as e:
        nodes = ", ".join(f"node {key.rsplit('-', 1)[1]}{e.who.get(key, '')}" for key in e.pending)
        raise WaitExpired(f"the data preparation on {nodes} {e.why}; see that node's log, then run again",
                          ctx.is_node_primary) from None
    errors = [(key, json.loads(ctx.store.get(key))["error"]) for key in keys]
    failed = [(key, error) for key, error in errors if error]
    if failed:
        ctx.fail_together("; ".join(f"{error}" + (f" (node {key.rsplit('-', 1)[1]})" if ctx.nodes > 1 else "")
                                    for key, error in failed))


# ---------------------------------------------------------------- local folders and downloads

def ensure_local(name: str, root: Path, allow_download: bool, download_from: str, say: Say) -> None:
    """Download what is missing (verified, then renamed into place) or raise one clear UserError."""
    missing = formats.missing_files(name, root)
    if not missing:
        return
    if not allow_download:
        raise UserError(formats.offline_message(name, root, missing, "--no-download is set"))
    lock = root / ".download.lock"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with file_lock(lock, say):
            try:
                if formats.missing_files(name, root):  # another node sharing this folder may have done it
                    download(name, root, download_from, say)
            except BaseException:
                # No debris in the user's data folder: the lock goes too, while held (a process waiting on
                # it then locks its successor: file_lock), so that two never download at once.
                lock.unlink(missing_ok=True)
                raise
    except (OSError, ValueError, tarfile.TarError, http.client.HTTPException) as e:  # URLError, timeouts: OSErrors
        failed = f"the download failed ({first_line(e)})"
        raise UserError(formats.offline_message(name, root, missing, failed)) from None
    still = formats.missing_files(name, root)
    if still:
        raise UserError(formats.offline_message(name, root, still, "the download did not produce them"))


def download(name: str, root: Path, download_from: str, say: Say) -> None:
    remove_partials(root)
    if name == "cifar10":
        url = download_from + formats.CIFAR_ARCHIVE if download_from else formats.CIFAR_URL
        archive = root / f".{formats.CIFAR_ARCHIVE}.part-{os.getpid()}"
        try:
            fetch_url(url, archive, formats.CIFAR_MD5, say)
            extract_cifar(archive, root)
        finally:
            archive.unlink(missing_ok=True)
        return
    folder = root / formats.MNIST_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for stem, md5 in formats.MNIST_FILES.items():
        if formats.mnist_file(root, stem) is None:
            fetch_from_mirrors(f"{stem}.gz", md5, folder, [download_from] if download_from else formats.MNIST_MIRRORS,
                               say)


def fetch_from_mirrors(filename: str, md5: str, folder: Path, mirrors: list[str] | tuple[str, ...], say: Say) -> None:
    errors = []
    for mirror in mirrors:
        part = folder / f".{filename}.part-{os.getpid()}"
        try:
            fetch_url(mirror + filename, part, md5, say)
            os.replace(part, folder / filename)
            return
        except (OSError, ValueError, http.client.HTTPException) as e:
            errors.append(f"{mirror}: {first_line(e)}")
        finally:
            part.unlink(missing_ok=True)
    raise OSError("; ".join(errors))


def fetch_url(url: str, target: Path, md5: str, say: Say) -> None:
    """Stream `url` into `target`, reporting progress; raise ValueError if its md5 is not `md5`."""
    digest = hashlib.md5()
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response, open(target, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0)
        done, started, last = 0, time.monotonic(), time.monotonic()
        while chunk := response.read(1 << 20):
            out.write(chunk)
            digest.update(chunk)
            done += len(chunk)
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                rate = done / (time.monotonic() - started) / 2**20
                say(f"downloading {url}: {done / 2**20:.1f}{f' / {total / 2**20:.1f}' if total else ''} MB "
                    f"({rate:.2f} MB/s)")
                last = time.monotonic()
    if digest.hexdigest() != md5:
        raise ValueError(f"{url} has md5 {digest.hexdigest()}, expected {md5} (a corrupt or different file)")


def extract_cifar(archive: Path, root: Path) -> None:
    """Unpack into a temp folder, then move each batch file into place (a rename: never half a file)."""
    staging = root / f".extract-{os.getpid()}"
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(staging, filter="data")  # no absolute paths, links out or devices
        target = root / formats.CIFAR_DIR
        target.mkdir(exist_ok=True)
        for file in (staging / formats.CIFAR_DIR).iterdir():
            os.replace(file, target / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remove_partials(root: Path) -> None:
    """What a killed download left; safe only while holding the folder's lock."""
    for leftover in [*root.glob(".*.part-*"), *root.glob(f"{formats.MNIST_DIR}/.*.part-*")]:
        leftover.unlink(missing_ok=True)
    for staging in root.glob(".extract-*"):
        shutil.rmtree(staging, ignore_errors=True)


# ---------------------------------------------------------------- object stores, through a cache

def fetch_remote(name: str, url: str, root: Path, options: dict[str, Any], say: Say) -> None:
    """Copy the data set's files from the store into `root` unless the cached copy is of the same
    object (same size and ETag or checksum). Layouts and messages as for a local folder."""
    started = time.monotonic()
    try:
        store = storage_for(url, options)
        files = remote_files(name, store, url)
        root.mkdir(parents=True, exist_ok=True)
        with file_lock(root / ".fetch.lock", say):
            remove_partials(root)
            fetched = [f for f in files if copy_if_changed(store, f, root)]
    except StorageError as e:
        raise UserError(f"--data-dir {e}; check the URL and the credentials") from None
    except OSError as e:
        raise UserError(f"--cache-dir {root}: {first_line(e)}; pass a writable --cache-dir") from None
    size = sum((root / f).stat().st_size for f in fetched)
    say(f"{url}: fetched {len(fetched)} of {len(files)} file(s), {size / 2**20:.1f} MB, into {root} in "
        f"{time.monotonic() - started:.1f} s" + ("" if fetched else " (the cached copy is current)"))


def remote_files(name: str, store: Any, url: str) -> list[str]:
    """The files to fetch, in whichever supported layout the store holds; a UserError lists what
    is missing, as for a local folder."""
    listed = {folder: set(store.list(folder)) for folder in formats.layout_folders(name)}

    def exists(rel: str) -> bool:
        folder, _, file = rel.rpartition("/")
        return file in listed[folder]
    files = formats.choose_files(name, exists)
    if files is None:
        missing = [f"{url.rstrip('/')}/{rel}" for rel in formats.missing_in(name, exists)]
        raise UserError(formats.offline_message(name, url, missing, "the store does not hold them"))
    return files


def copy_if_changed(store: Any, rel: str, root: Path) -> bool:
    """Fetch one object unless the cache holds the same version; True if it was fetched."""
    info = store.info(rel)
    version = {"size": int(info.get("size") or 0),
               "etag": str(info.get("ETag") or info.get("etag") or info.get("checksum") or info.get("mtime") or "")}
    local, meta = root / rel, root / ".versions" / f"{rel}.json"
    if local.is_file() and local.stat().st_size == version["size"] and meta.is_file() and \
            json.loads(meta.read_text()) == version:
        return False
    local.parent.mkdir(parents=True, exist_ok=True)
    part = local.with_name(f".{local.name}.part-{os.getpid()}")
    try:
        store.get(rel, part)
        if part.stat().st_size != version["size"]:
            raise UserError(f"{store.url(rel)} changed while it was fetched; run again")
        if problem := formats.checksum_problem(rel, part):
            raise UserError(f"{store.url(rel)} {problem}; replace it with the file from {formats.CIFAR_URL}")
        os.replace(part, local)
    finally:
        part.unlink(missing_ok=True)
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.with_suffix(".tmp").write_text(json.dumps(version))
    os.replace(meta.with_suffix(".tmp"), meta)
    return True
