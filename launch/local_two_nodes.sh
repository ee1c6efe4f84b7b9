#!/usr/bin/env bash
# Try multi-node on one machine: two torchrun agents ("nodes") on 127.0.0.1 meet through a c10d
# rendezvous on a free port, exactly as two machines would (each runs launch/multi_node.sh).
#
#   launch/local_two_nodes.sh train_ddp.py --dataset synthetic
#
# NPROC    processes per simulated node (default: 1)
# PORT     rendezvous port (default: a free one)
# DRY_RUN=1 prints the two commands without running them
#
# TERM and INT sent to this script are passed on to both nodes (each multi_node.sh passes them on
# to its torchrun, and torchrun to its workers: they stop after the same step, rank 0 saves a
# checkpoint); the script exits once both have ended, non-zero if either failed.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: [NPROC=N] [PORT=P] [DRY_RUN=1] $0 SCRIPT.py [FLAGS...]" >&2
    exit 2
fi

here=$(dirname "$0")
port=${PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export NNODES=2 RDZV_ENDPOINT="127.0.0.1:${port}" RDZV_ID=local-two-nodes NPROC=${NPROC:-1}

# shellcheck source=launch/children.sh
source "$here/children.sh"
start_child env NODE_RANK=0 "$here/multi_node.sh" "$@"
sleep 1  # node 0 hosts the store
[[ -n "$received" ]] ||
    start_child env NODE_RANK=1 "$here/multi_node.sh" "$@" > >(trap '' INT TERM; exec sed 's/^/[node 1] /') 2>&1

status=0
for node in "${children[@]}"; do
    code=0
    wait_child "$node" || code=$?
    (( code == 0 )) || status=$code
done
exit "$status"
