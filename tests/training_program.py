"""Imported first by the test programs that run a train_*.py's main in their own process (tests/runs.py,
tests/faults.py, tests/patched.py), before torch: where one of them is the program, the garbage
collector is paused while torch loads and its exit handler registered before any other's, and a
Ctrl-C during start-up is one line, as the package does when a train_*.py is the program
(common/collector.py, common/interrupts.py). Without it such a program ended
the slow way, with a full collection of all it ever built (measured: 9.5 s a rank at the end of
tests/runs.py's 20 equivalence rows), and its start-up differed from the script's. Imported by a
test into pytest's own process, it does nothing: the collector's exit handler may end a process
with status 0, which must never be pytest's, and a Ctrl-C must stop pytest as it always does."""
from common.collector import pause_during_set_up, program_name

PROGRAMS = ("runs.py", "faults.py", "patched.py")

if program_name() in PROGRAMS:
    pause_during_set_up()
    from common.interrupts import end_start_up_on_ctrl_c  # after the pause, as in the package

    end_start_up_on_ctrl_c()
