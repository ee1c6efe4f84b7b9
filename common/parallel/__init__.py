"""Processes and communication: the process's place in the job and its process group (context),
how the gradient collectives travel (transport: the process group, or shared memory between the
CPU ranks of one node), hand-written collectives and gradient buckets (comm), BatchNorm over the
global batch (sync_batchnorm), and the check that every rank holds the same replica (replicas).

May import: the base at the top of common/ (errors, config, storage, models, collector). Nothing
from data/, output/ or train/: every one of them stands on this layer.
"""
