"""Imported first by the test programs that run a program's main in their own process (tests/runs.py,
tests/faults.py, tests/patched.py), before torch: where one of them is the program, it is set up as
the program it stands for would be by the package's import: the garbage collector paused while torch
loads and its exit handler registered before any other's for a training script (common/collector.py),
and Ctrl-C as common/interrupts.py decides for that program (one line during a training script's
start-up, for the whole run of evaluate.py, predict.py or export.py). Without it such a program ended
the slow way, with a full collection of all it ever built (measured: 9.5 s a rank at the end of
tests/runs.py's 20 equivalence rows), and its start-up differed from the script's. Imported by a
test into pytest's own process, it does nothing: the collector's exit handler may end a process
with status 0, which must never be pytest's, and a Ctrl-C must stop pytest as it always does."""
import os
import sys

from common.collector import is_training_script, pause_during_set_up, program_name

PROGRAMS = ("runs.py", "faults.py", "patched.py")
A_TRAINING_SCRIPT = "train_*.py"  # runs.py and faults.py run a training script's main: every one is set up alike


def stands_for(program: str, argv: list[str]) -> str:
    """The program a test program stands for (`program`, run as `argv`): patched.py's is the script it
    runs (its second argument), whose own may be runs.py's; runs.py and faults.py run a training script."""
    if program == "patched.py" and len(argv) > 2:
        return stands_for(os.path.basename(argv[2]), argv[2:])
    return A_TRAINING_SCRIPT if program in PROGRAMS else program


if program_name() in PROGRAMS:
    program = stands_for(program_name(), sys.argv)
    if is_training_script(program):
        pause_during_set_up()
    from common.interrupts import end_on_ctrl_c  # after the pause, as in the package

    end_on_ctrl_c(program)
