"""Run a training script with faults or bans patched into the process, for tests.

    torchrun ... tests/patched.py PATCH[,PATCH...] train_ddp.py [flags]

Patches:
  no-object-collectives  every torch.distributed *_object* collective raises (nothing may pickle
                         between ranks)
  no-hard-links          os.link raises EPERM, as on gcsfuse, blobfuse or S3 Mountpoint
  no-rename              os.rename and os.replace raise EPERM too (S3 Mountpoint)
  eio-after-N            the N-th and later fsyncs of a file raise EIO (a failing disk)
  cifar-md5=HEX          the CIFAR-10 archive's checksum is HEX (a generated archive, not the real one)
  cifar-batch-md5=DIR    the CIFAR-10 batches' checksums are those of the files in DIR (generated ones)
  no-module=NAME         `import NAME` fails, as if the package were not installed
"""
from __future__ import annotations

import errno
import hashlib
import os
import runpy
import sys
from pathlib import Path

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")


def refuse(name: str, code: int = errno.EPERM):
    def raising(*args, **kwargs):
        raise OSError(code, os.strerror(code), *(a for a in args[:1] if isinstance(a, (str, os.PathLike))))
    raising.__name__ = name
    return raising


def ban(name: str):
    def banned(*args, **kwargs):
        raise AssertionError(f"torch.distributed.{name} was called: objects would be pickled between ranks")
    return banned


def failing_fsync(after: int):
    real, files = os.fsync, [0]

    def fsync(fd: int) -> None:
        if os.path.isfile(f"/proc/self/fd/{fd}"):  # folders' fsyncs do not count
            files[0] += 1
            if files[0] >= after:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)
    return fsync


def apply(patch: str) -> None:
    if patch == "no-object-collectives":
        for module in (dist, c10d):
            for name in OBJECT_COLLECTIVES:
                setattr(module, name, ban(name))
    elif patch == "no-hard-links":
        os.link = refuse("link")
    elif patch == "no-rename":
        os.rename, os.replace = refuse("rename"), refuse("replace")
    elif patch.startswith("eio-after-"):
        os.fsync = failing_fsync(int(patch.removeprefix("eio-after-")))
    elif patch.startswith("cifar-md5="):
        from common.data import formats

        formats.CIFAR_MD5 = patch.removeprefix("cifar-md5=")
    elif patch.startswith("cifar-batch-md5="):
        from common.data import formats

        folder = Path(patch.removeprefix("cifar-batch-md5="))
        formats.CIFAR_BATCH_MD5 = {f.name: hashlib.md5(f.read_bytes()).hexdigest() for f in folder.iterdir()}
    elif patch.startswith("no-module="):
        sys.modules[patch.removeprefix("no-module=")] = None  # import raises ImportError
    else:
        raise SystemExit(f"unknown patch {patch}")


if __name__ == "__main__":
    patches, script = sys.argv[1].split(","), sys.argv[2]
    for patch in patches:
        apply(patch)
    sys.argv = sys.argv[2:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
