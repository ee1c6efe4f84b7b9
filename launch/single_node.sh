#!/usr/bin/env bash
# One machine: torchrun --standalone picks a free port for its c10d store (no EADDRINUSE on 29500).
#   launch/single_node.sh train_ddp.py --dataset mnist
# NPROC: processes on this node (default: the GPU count, or 2 on a CPU-only host).
# DRY_RUN=1 prints the command without running it.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: [NPROC=N] [DRY_RUN=1] $0 SCRIPT.py [FLAGS...]" >&2
    exit 2
fi

gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
nproc=${NPROC:-$(( gpus > 0 ? gpus : 2 ))}
cmd=(torchrun --standalone "--nproc_per_node=${nproc}" "$@")

echo "${cmd[*]}"
[[ "${DRY_RUN:-0}" == 1 ]] || exec "${cmd[@]}"
