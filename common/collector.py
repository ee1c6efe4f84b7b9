"""Python's cyclic garbage collector around a training process.

Building a run (torch's lazy imports, torch._dynamo on the first optimizer, the model, the data)
leaves some hundred thousand long-lived objects that a full collection traverses again and again,
while training itself allocates almost nothing the collector tracks. Measured on 2 CPU cores:
full collections of ~90 ms each during set-up, and about 1 s per rank in the interpreter's final
collection at exit. So: no collection while the run is built; when training starts, every object
alive is frozen (never traversed again) and collection resumes for what training allocates.

At exit, one collection runs first, while the interpreter is still whole: set-up's reference
cycles (DDP's module and reducer) hold the process group, and with it gloo's C++ threads. Left
alive into the interpreter's own teardown, a running C++ thread can end the process with
"terminate called without an active exception" (SIGABRT). Then what is still alive is frozen, so
the interpreter's final collection skips it.

Every train_*.py imports this module first, so that importing torch (~0.35 s of collections a rank)
is covered too; a test or program that imports a train_*.py keeps its collector untouched.
"""
from __future__ import annotations

import atexit
import gc
import os
import sys


def pause_during_set_up() -> None:
    """From here until `resume_for_training`: no automatic collection."""
    if gc.isenabled():  # not already paused at import
        gc.disable()
        # exit handlers run last-registered first: paused at import, this runs after torch's own
        atexit.register(_collect_then_freeze)


def resume_for_training() -> None:
    """Set-up's objects become permanent; training's garbage is collected as usual."""
    gc.freeze()
    gc.enable()


def _collect_then_freeze() -> None:
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _started_as_a_training_script() -> bool:
    return os.path.basename(getattr(sys.modules.get("__main__"), "__file__", None) or "").startswith("train_")


if _started_as_a_training_script():
    pause_during_set_up()
