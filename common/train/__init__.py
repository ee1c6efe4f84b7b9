"""The training loop, written once for every strategy: the program every train_*.py runs (app),
what a job is made of (run), the seam to the strategies (strategy), --precision (precision), one
optimizer step (step), the optimizer and schedule (optim), the loop and exact evaluation
(trainer), checkpoints and resume (checkpoint), stops on a signal (preemption), and
--check-equivalence (equivalence).

May import: every layer below it, the base at the top of common/, parallel/, data/ and output/.
Only use/ (evaluate.py, predict.py, export.py) imports it under common/; the train_*.py scripts do.
"""
