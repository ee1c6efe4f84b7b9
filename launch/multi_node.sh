#!/usr/bin/env bash
# Several machines: run this same command on every node. torchrun's c10d rendezvous assigns node
# ranks unless NODE_RANK is given, and restarts all workers up to MAX_RESTARTS times when one dies.
#
#   NNODES=2 RDZV_ENDPOINT=node0.example:29400 launch/multi_node.sh train_ddp.py --dataset mnist
#
# NNODES          nodes in the job (required)
# RDZV_ENDPOINT   host:port of the rendezvous store, reachable from every node (required);
#                 the node with that host serves it (open that port, and the gloo/nccl ports)
# RDZV_ID         job id shared by the nodes (default: dp-suite)
# NODE_RANK       this node's rank (optional with c10d); 0 also marks the node that serves the
#                 store, for when the endpoint is an address the hostname does not resolve to
# LOCAL_ADDR      this node's address as the others reach it (default: looked up from the hostname)
# NPROC           processes on this node (default: the GPU count, or 2 on a CPU-only host)
# MAX_RESTARTS    worker-group restarts after a failure (default: 0)
# JOIN_TIMEOUT    seconds to wait for all nodes to join (default: 600)
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds the workers get to stop (finish the step, save) after a
#                 TERM or INT before torchrun kills them (default here: 120; torchrun's own: 30)
# DRY_RUN=1       print the command without running it (credentials in it shown as ***)
#
# Security: the rendezvous port (and gloo's/nccl's) has no authentication, and the c10d rendezvous
# unpickles what its store holds: whoever reaches the port can run code here. Use trusted networks.
#
# TERM and INT sent to this script are passed on to torchrun, which passes them on to the workers:
# they stop after the same step, rank 0 saves a checkpoint, and the script exits with torchrun's
# status once every process has ended.
set -euo pipefail

if [[ $# -lt 1 || -z "${NNODES:-}" || -z "${RDZV_ENDPOINT:-}" ]]; then
    echo "usage: NNODES=N RDZV_ENDPOINT=HOST:PORT [RDZV_ID=..] [NODE_RANK=..] [NPROC=..] [MAX_RESTARTS=..] $0 SCRIPT.py [FLAGS...]" >&2
    exit 2
fi

host=${RDZV_ENDPOINT%:*}
port=${RDZV_ENDPOINT##*:}
join_timeout=${JOIN_TIMEOUT:-600}
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
nproc=${NPROC:-$(( gpus > 0 ? gpus : 2 ))}
rdzv_conf="join_timeout=${join_timeout}"
if [[ -n "${NODE_RANK:-}" ]]; then
    rdzv_conf+=",is_host=$([[ ${NODE_RANK} == 0 ]] && echo true || echo false)"
fi
cmd=(torchrun "--nnodes=${NNODES}" "--nproc_per_node=${nproc}" --rdzv-backend=c10d
     "--rdzv-endpoint=${RDZV_ENDPOINT}" "--rdzv-id=${RDZV_ID:-dp-suite}" "--rdzv-conf=${rdzv_conf}"
     "--max-restarts=${MAX_RESTARTS:-0}")
[[ -n "${NODE_RANK:-}" ]] && cmd+=("--node-rank=${NODE_RANK}")
[[ -n "${LOCAL_ADDR:-}" ]] && cmd+=("--local-addr=${LOCAL_ADDR}")
cmd+=("$@")

# shellcheck source=launch/redact.sh
source "$(dirname "$0")/redact.sh"
shown "${cmd[@]}"
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}

# The node that hosts the endpoint binds its port: say so now if something else holds it.
if [[ "${NODE_RANK:-0}" == 0 ]] && python3 - "$host" "$port" <<'PY'
import errno, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind((sys.argv[1], int(sys.argv[2])))
except OSError as e:
    sys.exit(0 if e.errno == errno.EADDRINUSE else 1)  # another host's address: not ours to check
sys.exit(1)
PY
then
    echo "error: port ${port} on ${host} is already in use (EADDRINUSE); pick another port in RDZV_ENDPOINT," \
         "or on one machine use launch/single_node.sh (torchrun --standalone picks a free port)" >&2
    exit 2
fi

# torchrun runs in the background, so that this script stays alive to read its stderr (in $errors).
# shellcheck source=launch/children.sh
source "$(dirname "$0")/children.sh"
status=0
run_keeping_stderr "$(dirname "$0")/quiet_torchrun.sh" "${cmd[@]:1}" || status=$?
if (( status != 0 )) && grep -q "RendezvousTimeoutError" "$errors"; then
    echo "error: the rendezvous at ${RDZV_ENDPOINT} did not complete within ${join_timeout} s: start this command" \
         "on all ${NNODES} nodes, and check that each reaches ${RDZV_ENDPOINT}" >&2
fi
exit "$status"
