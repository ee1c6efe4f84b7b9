"""Node-local cache folders: where data from a store is copied and decoded tensors are kept, the
lock that makes one process per node (or per shared volume) do the work, and the raw tensor files
every rank of a node maps (shared pages, no copy)."""
from __future__ import annotations

import fcntl
import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

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
    The holder's own work is bounded (store timeouts, --storage-timeout-s around the data preparation)."""
    with open(path, "a") as handle:
        started = last = time.monotonic()
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
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_tensors(folder: Path, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> None:
    """Each tensor as a raw file, their shapes and dtypes (and `meta`) in meta.json, written last."""
    for name, tensor in tensors.items():
        tensor.contiguous().numpy().tofile(folder / name)
    shapes = {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for name, t in tensors.items()}
    (folder / META).write_text(json.dumps({"tensors": shapes, **(meta or {})}))


def read_meta(folder: Path) -> dict:
    return json.loads((folder / META).read_text())


def map_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors write_tensors wrote, memory-mapped: every rank maps the same pages."""
    shapes = read_meta(folder)["tensors"]
    return {name: torch.from_file(str(folder / name), shared=False, size=math.prod(s["shape"]),
                                  dtype=getattr(torch, s["dtype"])).view(s["shape"]) for name, s in shapes.items()}
