"""Python's cyclic garbage collector around a training process.

Building a run (torch's lazy imports, torch._dynamo on the first optimizer, the model, the data)
leaves some hundred thousand long-lived objects that a full collection traverses again and again,
while training itself allocates almost nothing the collector tracks. Measured on 2 CPU cores:
full collections of ~90 ms each during set-up, and about 1 s per rank in the interpreter's final
collection at exit. So: no collection while the run is built; when training starts, every object
alive is frozen (never traversed again) and collection resumes for what training allocates.

At exit, after a run that ended cleanly, the process ends as soon as every other exit handler
has run and the output streams are flushed: the interpreter's teardown (~0.5 s a rank: a final
collection, then every module's objects freed one by one) would do nothing a finished run needs,
since the run closed its files, TensorBoard writer and process group itself. This happens only
where nothing can be skipped by it:
- the collector's handler was the first one registered, so it runs last. That holds when a
  train_*.py is the program and the package is its first import; a wrapper that registered an
  exit handler before (a Python profiler, a coverage tool) gets the usual exit;
- no native tool waits for the process's own teardown: no LD_PRELOAD library (sanitizers, heap
  profilers) and no CUDA context (Nsight and CUPTI traces are flushed when it is destroyed);
- no exception went unhandled after the run, and the streams flushed without an error.

evaluate.py, predict.py and export.py end so too, with their exit status, as their work is over
(end_without_teardown: every exit handler run first, where no native tool waits).

Otherwise (an error, a stop on a signal, a wrapper), one collection runs first, while the
interpreter is still whole: set-up's reference cycles (DDP's module and reducer) hold the process
group, and with it gloo's C++ threads. Left alive into the interpreter's own teardown, a running
C++ thread can end the process with "terminate called without an active exception" (SIGABRT).
Then what is still alive is frozen, so the interpreter's final collection skips it.

Importing the package (common/__init__.py) pauses collection when one of the suite's train_*.py is
the program (suite_program: not a user's own script of such a name), and every train_*.py imports
the package before anything else, so that importing torch (~0.35 s of collections a rank) is
covered too; a test or program that imports a train_*.py keeps its collector untouched.
"""
from __future__ import annotations

import atexit
import gc
import os
import sys


class _Exit:
    registered = False  # the exit handler is registered (once a process)
    runs_last = False  # the exit handler was the first registered: ending the process in it skips no one's
    clean = False  # the run ended without an error


def pause_during_set_up() -> None:
    """From here until `resume_for_training`: no automatic collection. A program that runs several
    runs one after another (tests/runs.py) pauses for each; its exit handler is registered once."""
    if gc.isenabled():  # not already paused at import
        gc.disable()
        if not _Exit.registered:
            # exit handlers run last-registered first: paused at import, this runs after torch's own
            _Exit.runs_last = getattr(atexit, "_ncallbacks", lambda: -1)() == 0
            atexit.register(_at_exit)
            _Exit.registered = True


def resume_for_training() -> None:
    """Set-up's objects become permanent; training's garbage is collected as usual."""
    gc.freeze()
    gc.enable()


def ended_cleanly() -> None:
    """The run finished without an error: at exit, the process may end without the interpreter's teardown."""
    _Exit.clean = True


def _at_exit() -> None:
    if _nothing_waits_for_teardown() and _flushed():
        os._exit(0)
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _nothing_waits_for_teardown() -> bool:
    return (_Exit.clean and _Exit.runs_last and getattr(sys, "last_value", None) is None
            and _no_native_tool_waits())


def _no_native_tool_waits() -> bool:
    torch = sys.modules.get("torch")
    cuda_in_use = torch is not None and torch.cuda.is_initialized()
    return not os.environ.get("LD_PRELOAD") and not cuda_in_use


def end_without_teardown(status: int) -> None:
    """For a program whose work is over, its last line said (evaluate.py, predict.py, export.py:
    common/interrupts.py finished): every exit handler runs, the streams are flushed and the process
    ends with `status`, without the interpreter's teardown (0.8-1.2 s of predict.py's 3-4 s, measured
    on 2 CPU cores). Where a native tool waits for the teardown, or a stream does not flush, it
    returns: the usual exit follows."""
    if _no_native_tool_waits():
        atexit._run_exitfuncs()  # as the usual exit would, and cleared: none runs twice if this returns
        if _flushed():
            os._exit(status)


def _flushed() -> bool:
    import ctypes  # here, not at import: the package's import pauses collection only after this one's

    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):  # a closed pipe: the usual exit reports it
        return False
    ctypes.CDLL(None).fflush(None)  # C stdio buffers too (lines printed by C++ libraries)
    return True


def program_name() -> str:
    """The file name of the program this process runs ("" where it is no file: python -c, a REPL)."""
    return os.path.basename(getattr(sys.modules.get("__main__"), "__file__", None) or "")


def suite_program() -> str:
    """program_name() where the program is one of the suite's own, beside the package (a train_*.py,
    evaluate.py, predict.py, export.py of this checkout); "" for any other: a user's own script
    importing the installed package keeps its collector and its Ctrl-C, whatever its name
    (train_mine.py, evaluate.py)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    suite = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return os.path.basename(main_file) if main_file and os.path.dirname(os.path.realpath(main_file)) == suite else ""


def run_by_the_interpreter() -> bool:
    """Whether the program (__main__) is the one the interpreter was started with (python [OPTIONS]
    FILE or -m MODULE: a shell's command, torchrun's workers), not one run inside another program
    (runpy.run_path from a user's driver, IPython's %run), whose process is not the program's."""
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None) or ""
    args = iter(sys.orig_argv[1:])
    for arg in args:
        if arg in ("-W", "-X", "--check-hash-based-pycs"):  # the options that take the next argument
            next(args, None)
        elif arg == "-m":
            return next(args, None) == getattr(getattr(main, "__spec__", None), "name", None)
        elif arg == "-c":
            return False
        elif not arg.startswith("-"):  # the script
            return bool(main_file) and os.path.realpath(arg) == os.path.realpath(main_file)
    return False


def is_training_script(program: str) -> bool:
    """Whether `program` (a file name) is one of the train_*.py scripts."""
    return program.startswith("train_")


def started_as_a_training_script() -> bool:
    return is_training_script(suite_program())
