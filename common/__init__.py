"""Shared core of the data-parallel training suite: everything the train_*.py scripts share.

Grouped by concern, in layers; a module imports only from its own layer and the layers below it
(tests/test_layout.py declares the order and checks it, with no import circle anywhere):

    use/      using a trained model: evaluate.py, predict.py, export.py     (top)
    train/    the training loop, checkpoints, the seam to the strategies
    data/     reading data              output/  what a run reports           (side by side)
    parallel/ processes and communication
    the base, here at the top: errors, config (the flags), storage (local folders and object
              stores), models (the networks by name), collector (the garbage collector)

The train_*.py scripts, evaluate.py, predict.py, export.py, tests, bench and launch stand above all
of it; nothing here imports them.

Importing the package does three things besides: when one of the suite's train_*.py is the program,
Python's garbage collector pauses until training starts (common/collector.py says why); when one of
its train_*.py (until training starts) or its evaluate.py, predict.py or export.py (for their whole
run) is the program, a Ctrl-C ends the process with one line, not a traceback (common/interrupts.py
decides for which programs; a user's own script of such a name keeps both as they were); in a worker
of torchrun, a thread watches its agent, so that the worker ends if the agent dies, set-up included
(common/orphans.py). Every one of those programs imports the package first, so that its own import
of torch is covered too.
"""
from common.collector import pause_during_set_up, run_by_the_interpreter, started_as_a_training_script, suite_program

__version__ = "0.1.0"

if started_as_a_training_script():
    pause_during_set_up()

# After the pause: their import of threading would otherwise run a collection.
from common.interrupts import end_on_ctrl_c  # noqa: E402
from common.orphans import end_when_the_agent_dies, launched_by_torchrun  # noqa: E402

end_on_ctrl_c(suite_program() if run_by_the_interpreter() else "")  # not a driver's runpy, a notebook's %run

if launched_by_torchrun():
    end_when_the_agent_dies()
