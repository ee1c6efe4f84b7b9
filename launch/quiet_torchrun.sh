#!/usr/bin/env bash
# torchrun "$@", through launch/quiet_torchrun.py and by torchrun's own interpreter: a handled error
# (a bad flag, missing data) is the worker's one line, not torchrun's failure dump after it. It takes
# torchrun's arguments and replaces itself with the agent (exec: same pid, so signals reach it).
# Every launcher runs torchrun so: single_node.sh, multi_node.sh, elastic.sh, ft.sh and slurm.sbatch
# here, k8s.sh in each pod.
#
#   launch/quiet_torchrun.sh --standalone --nproc_per_node=2 train_ddp.py --dataset mnist
set -euo pipefail

torchrun=$(command -v torchrun) || { echo "error: torchrun is not on PATH; activate the environment that has torch" >&2; exit 2; }
python=$(head -n 1 "$torchrun" | sed 's/^#!//')  # the interpreter torchrun belongs to
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# quiet_torchrun.py imports the suite's package: from the repository, whether it is installed or not
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$python" "$root/launch/quiet_torchrun.py" "$@"
