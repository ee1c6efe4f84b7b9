#!/usr/bin/env bash
# One machine: torchrun --standalone picks a free port for its c10d store (no EADDRINUSE on 29500).
#   launch/single_node.sh train_ddp.py --dataset mnist
# NPROC: processes on this node (default: the GPU count, or 2 on a CPU-only host).
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT: seconds the workers get to stop (finish the step, save) after a TERM
#   or INT before torchrun kills them (default here: 120; torchrun's own: 30).
# DRY_RUN=1 prints the command without running it (credentials in it shown as ***).
# It runs torchrun through launch/quiet_torchrun.py (same process, so signals reach it as before):
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
torchrun=$(command -v torchrun) || { echo "error: torchrun is not on PATH; activate the environment that has torch" >&2; exit 2; }
python=$(head -n 1 "$torchrun" | sed 's/^#!//')  # the interpreter torchrun belongs to
root=$(cd "$(dirname "$0")/.." && pwd)
# quiet_torchrun.py imports the suite's package: from the repository, whether it is installed or not
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$python" "$root/launch/quiet_torchrun.py" "${args[@]}"
