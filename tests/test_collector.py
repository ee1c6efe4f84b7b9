"""Python's garbage collector around a training process (common/collector.py): no collection while
torch is imported and the run is built, set-up frozen and collection back on for training; a
program that only imports a train_*.py keeps its collector as it was."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, child_env, read_scalars, run_script

# Runs a script as `python SCRIPT ...` does (runpy makes it __main__). Counts the collections from
# the moment the script first imports the package or torch (whichever comes first) until collection
# is switched back on, notes how many objects are frozen at that moment, and prints both and the
# collector's state at exit.
PROBE = """
import atexit, gc, runpy, sys
set_up, frozen_at_resume = [0], []
def count(phase, info):
    if phase == "start" and ("common" in sys.modules or "torch" in sys.modules) and not frozen_at_resume:
        set_up[0] += 1
gc.callbacks.append(count)
enable = gc.enable
def enable_and_note():  # the first call is the collector's (weakref's exit handler calls it again)
    if not frozen_at_resume:
        frozen_at_resume.append(gc.get_freeze_count())
    enable()
gc.enable = enable_and_note
atexit.register(lambda: print("PROBE", set_up[0], *frozen_at_resume, gc.isenabled(), flush=True))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_training_script_collects_nothing_during_set_up_and_freezes_it_for_training(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", PROBE, "train_allreduce.py", "--dataset", "synthetic", "--synthetic-shape", "mnist",
         "--model", "lenet", "--batch-size", "16", "--epochs", "1", "--max-steps", "3",
         "--log-dir", str(tmp_path / "tb"), "--checkpoint-dir", str(tmp_path / "ckpt")],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    probe = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("PROBE")]
    assert len(probe) == 1 and len(probe[0]) == 3, result.stdout  # collection was switched back on
    set_up_collections, frozen, enabled = int(probe[0][0]), int(probe[0][1]), probe[0][2]
    print(f"\nset-up: {set_up_collections} collections; {frozen} objects frozen as training starts")
    assert set_up_collections == 0  # importing torch alone runs hundreds with the collector on
    assert frozen > 100_000 and enabled == "True"


# Runs a script under torchrun and, after every exit handler of the script's (registered first, so
# run last), lists the threads the process still has.
THREADS_PROBE = """
import atexit, os, runpy, sys
def report():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:  # a thread that ended since the listing
            continue
    names.sort()
    # one write of the whole line: unbuffered (PYTHONUNBUFFERED), print writes word by word, and
    # the two ranks' words would interleave on the shared pipe
    os.write(1, " ".join(["THREADS", os.environ["RANK"], *names, "\\n"]).encode())
atexit.register(report)
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_no_thread_of_the_process_group_runs_into_the_interpreters_exit(tmp_path):
    """Set-up's reference cycles (DDP's module and reducer) hold the process group and gloo's C++
    threads; frozen and never collected, they would run on into the interpreter's teardown, where
    one ended a rank with "terminate called without an active exception" (SIGABRT)."""
    probe = tmp_path / "probe.py"
    probe.write_text(THREADS_PROBE)
    result = run_script([str(probe), "train_ddp.py", "--dataset", "synthetic", "--synthetic-shape", "mnist",
                         "--model", "lenet", "--batch-size", "32", "--epochs", "1", "--max-steps", "3",
                         "--log-dir", str(tmp_path / "tb"), "--checkpoint-dir", str(tmp_path / "ckpt")], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    threads = {line.split()[1]: line.split()[2:] for line in result.stdout.splitlines() if line.startswith("THREADS")}
    print(f"\nthreads left at exit: {threads}")
    assert set(threads) == {"0", "1"}, result.stdout
    assert not [name for names in threads.values() for name in names if name.startswith(("gloo", "pt_"))]


# Runs a script as `python SCRIPT ...` does, registering no exit handler; then prints one line from
# Python and one from C, both left in their buffers (stdout is a pipe); says when the process is
# ended by os._exit.
FAST_EXIT_PROBE = """
import ctypes, os, runpy, sys
end = os._exit
def say_and_end(status):
    os.write(1, f"ENDED BY os._exit({status})\\n".encode())
    end(status)
os._exit = say_and_end
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
print("PYTHON LINE")
ctypes.CDLL(None).printf(b"C LINE\\n")
"""


@pytest.mark.slow
@pytest.mark.quick
@pytest.mark.parametrize("batch, status", [(16, 0), (10**6, 1)], ids=["clean", "error"])
def test_a_clean_run_ends_without_the_interpreters_teardown_and_loses_no_output(tmp_path, batch, status):
    """After a clean run the process ends once the exit handlers have run and the streams (Python's
    and C's) are flushed, with every line printed and the TensorBoard points written; an error exits
    with its own status, through the usual teardown. (A wrapper's own exit handler still runs: the
    PROBE line of the first test above is printed by one.)"""
    buffered = {k: v for k, v in child_env().items() if k != "PYTHONUNBUFFERED"}
    result = subprocess.run(
        [sys.executable, "-c", FAST_EXIT_PROBE, "train_allreduce.py", "--dataset", "synthetic", "--synthetic-shape",
         "mnist", "--model", "lenet", "--batch-size", str(batch), "--epochs", "1", "--max-steps", "3",
         "--log-dir", str(tmp_path / "tb"), "--checkpoint-dir", str(tmp_path / "ckpt")],
        cwd=ROOT, env=buffered, capture_output=True, text=True, timeout=240)
    assert result.returncode == status, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    if status == 0:
        assert lines[-3:] == ["PYTHON LINE", "C LINE", "ENDED BY os._exit(0)"], result.stdout
        assert re.fullmatch(r"saved \S+step-00000003\.pt in [\d.]+ s", lines[-4]), result.stdout
        scalars = read_scalars(tmp_path / "tb")[1]
        assert scalars["test/acc"][-1][0] == 3 and scalars["train/loss"][-1][0] == 3
    else:
        assert "ENDED BY" not in result.stdout and "--batch-size 1000000" in result.stderr


@pytest.mark.slow
@pytest.mark.quick
def test_importing_a_training_script_leaves_the_importers_collector_alone():
    code = "import gc, train_allreduce, train_ddp; print(gc.isenabled(), gc.get_freeze_count())"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "0"]
