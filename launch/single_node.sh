#!/usr/bin/env bash
# One machine: torchrun --standalone picks a free port for its c10d store (no EADDRINUSE on 29500).
#   launch/single_node.sh train_ddp.py --dataset mnist
# NPROC: processes on this node (default: the GPU count, or 2 on a CPU-only host).
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT: seconds the workers get to stop (finish the step, save) after a TERM
#   or INT before torchrun kills them (default here: 120; torchrun's own: 30).
# DRY_RUN=1 prints the command without running it (credentials in it shown as ***).
# It runs torchrun through launch/quiet_torchrun.sh (same process, so signals reach it as before):
# when the workers end on an error they reported in one line (missing data, a bad flag), that line
# is all you see, not torchrun's failure dump after it.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: [NPROC=N] [DRY_RUN=1] $0 SCRIPT.py [FLAGS...]" >&2
    exit 2
fi

gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
nproc=${NPROC:-$(( gpus > 0 ? gpus : 2 ))}
args=(--standalone "--nproc_per_node=${nproc}" "$@")

# shellcheck source=launch/redact.sh
source "$(dirname "$0")/redact.sh"
echo "torchrun $(shown "${args[@]}")"
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
exec "$(dirname "$0")/quiet_torchrun.sh" "${args[@]}"
