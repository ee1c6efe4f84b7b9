"""What a run reports: the console and TensorBoard, written by rank 0 alone (logger), profiler
traces (profiling), Python warnings from every rank printed once (warnings_relay), and the
comparison of finished runs (report: `python -m common.output.report RUN_DIR ...`). Checkpoints
are not here: they save and restore a whole run, so they live with the loop in train/.

May import: the base at the top of common/ and parallel/ (the warning relay gathers from every rank).
Never data/ or train/: the loop hands output what to write.
"""
