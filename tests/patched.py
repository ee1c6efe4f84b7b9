"""Run a training script (or evaluate.py, predict.py, export.py) with faults or bans patched into the
process, for tests.

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
  stale-after=S          a heartbeat that has not moved for S seconds is stale (common.parallel.context.STALE_AFTER_S)
  hang-preparing=PATH    on node 1, the node's data preparation writes its pid into PATH and never ends
  slow-steps=S           every optimizer step (common.train.step.update) sleeps S seconds first: runs long
                         enough in steps for recoveries to happen inside them (bench chaos), at a few ms of
                         compute per step
  slow-storage=S@K       the K-th read or write of a local checkpoint folder by this process sleeps S seconds
                         first, saying so on stderr ("storage op K (write NAME) sleeps S s at UNIX_TIME in pid P")
  gate=WHO@POINT         held at a training step (or train_ft.py's heal, start-up's data preparation, or
                         predict.py's writing of its output) until the test releases it: a fault at a known
                         step on a host of any speed (tests/gates.py; GATE_DIR names the folder of its markers)
"""
from __future__ import annotations  # noqa: I001 - ruff wants a blank line above `# isort: split`, test_layout none

# The package first, as every train_*.py imports it: its watch on torchrun's agent and its quiet C++ log
# level (common/orphans.py) must come before torch's import, or the patched run prints what the
# script alone does not (c10d's dumps of C++ frames when a peer dies); and the collector and Ctrl-C
# as in the program it runs (tests/training_program.py).
import tests.training_program  # noqa: F401
# isort: split
import errno
import hashlib
import os
import runpy
import sys
import time
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


def hang_preparing(path: str) -> None:
    from common.data import fetch

    real = fetch.decode_once

    def decode_once(*args, **kwargs):
        if os.environ.get("GROUP_RANK") != "1":
            return real(*args, **kwargs)
        Path(path).write_text(str(os.getpid()))
        while True:
            time.sleep(60)  # the hang under test: the node never ends its preparation (the test kills it)
    fetch.decode_once = decode_once


def slow_storage(spec: str) -> None:
    from common.storage import LocalStorage

    seconds, op = spec.split("@")
    count = [0]

    def slowed(real):
        def operation(self, name, *args):
            count[0] += 1
            if count[0] == int(op):
                print(f"storage op {op} ({real.__name__} {name}) sleeps {seconds} s at {time.time():.3f} in pid "
                      f"{os.getpid()}", file=sys.stderr, flush=True)
                time.sleep(float(seconds))  # the slow store under test, not a point in training
            return real(self, name, *args)
        return operation
    for method in ("read", "write_from"):  # every write goes through write_from (a step file streams to disk)
        setattr(LocalStorage, method, slowed(getattr(LocalStorage, method)))


def slow_steps(seconds: float) -> None:
    from common.train import step

    real = step.update

    def update(*args, **kwargs):
        time.sleep(seconds)  # the patch's whole point: a longer step
        return real(*args, **kwargs)
    step.update = update


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
    elif patch.startswith("stale-after="):
        from common.parallel import context as distributed

        distributed.STALE_AFTER_S = float(patch.removeprefix("stale-after="))
    elif patch.startswith("hang-preparing="):
        hang_preparing(patch.removeprefix("hang-preparing="))
    elif patch.startswith("slow-storage="):
        slow_storage(patch.removeprefix("slow-storage="))
    elif patch.startswith("slow-steps="):
        slow_steps(float(patch.removeprefix("slow-steps=")))
    elif patch.startswith("gate="):
        from tests.gates import install

        install(patch.removeprefix("gate="))
    else:
        raise SystemExit(f"unknown patch {patch}")


if __name__ == "__main__":
    patches, script = sys.argv[1].split(","), sys.argv[2]
    for patch in patches:
        apply(patch)
    sys.argv = sys.argv[2:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
