#!/usr/bin/env bash
# Elastic membership: nodes join and leave a running job, between MIN and MAX nodes, and no step is
# lost. At every change torchrun stops the workers (they stop after the same step and rank 0 saves),
# meets the nodes now present and restarts the workers at the new world size from that checkpoint;
# the global batch and the sample stream do not depend on the world size, so the weights are those
# of an uninterrupted run. First the store, once, on a machine that stays up for the whole job; then
# this same command on every node, whenever it is to join:
#
#   python3 launch/elastic_store.py --port 29400
#   NNODES=1:4 RDZV_ENDPOINT=head:29400 launch/elastic.sh train_ddp.py --checkpoint-dir /shared/ckpt
#
# A node leaves when this script gets TERM (or INT): the job's workers stop after the same step, rank
# 0 saves, this node exits with 128+N (after one line), and the others continue from that checkpoint.
# Every node must see the same --checkpoint-dir (a shared folder or an object-store URL): rank 0
# saves and reads it, and rank 0 may be on any node.
#
# NNODES          MIN:MAX nodes (required), e.g. 1:4
# RDZV_ENDPOINT   host:port of launch/elastic_store.py, reachable from every node (required)
# RDZV_ID         job id shared by the nodes (default: dp-suite-elastic); one per job and store
# NPROC           processes on this node (default: the GPU count, or 2 on a CPU-only host)
# LOCAL_ADDR      this node's address as the others reach it (default: looked up from the hostname)
# MAX_RESTARTS    worker-group restarts on this node (default: 20, at least 1); every node that
#                 leaves, and every failure, costs one on each node that stays (a join costs none)
# LAST_CALL       seconds a round waits for more nodes once MIN are there (default: 2)
# DEAD_AFTER      seconds without a heartbeat after which a node that left counts as gone (default: 5;
#                 torchrun's: 15): the others re-form the job that much after it left
# JOIN_TIMEOUT    seconds a round may take to reach MIN nodes (default: 600)
# STORE_WAIT      seconds to wait for the store to answer before giving up (default: 30)
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds the workers get to stop (finish the step, save) after a
#                 TERM or INT before torchrun kills them (default here: 120; torchrun's own: 30). The
#                 stop for a join gets a fixed 30 s whatever this says (torchrun's agent stops its
#                 workers for a new round without it): a save that takes longer is cut, and the job
#                 resumes from the checkpoint before.
# DRY_RUN=1       print the command without running it (credentials in it shown as ***)
#
# What differs from plain torchrun (--nnodes=1:2 --rdzv-backend=c10d), which loses the job at the
# first join (both agents wait 60 s for each other, then DistStoreError on MASTER_ADDR and role_info):
# - TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torchrun's agent keeps the workers' store address of its
#   first round for good, and never publishes it again; a node that joins later waits for it forever.
#   With this set, rank 0's agent publishes a fresh address every round.
# - is_host=false on every node: the store lives in elastic_store.py, not in the first node's agent,
#   whose leaving would end the job.
# - a short LAST_CALL and DEAD_AFTER (torchrun: 30 s and 15 s): a change costs seconds, not a minute.
#
# Security: the store's port (and gloo's/nccl's) has no authentication, and torchrun unpickles what
# the store holds: whoever reaches the port can run code here. Use trusted networks.
set -euo pipefail

if [[ $# -lt 1 || -z "${NNODES:-}" || -z "${RDZV_ENDPOINT:-}" ]]; then
    echo "usage: NNODES=MIN:MAX RDZV_ENDPOINT=HOST:PORT [RDZV_ID=..] [NPROC=..] [MAX_RESTARTS=..]" \
         "$0 SCRIPT.py [FLAGS...] (RDZV_ENDPOINT: where launch/elastic_store.py serves)" >&2
    exit 2
fi

if [[ ! "$NNODES" =~ ^([1-9][0-9]*):([1-9][0-9]*)$ ]] || (( BASH_REMATCH[1] > BASH_REMATCH[2] )); then
    echo "error: NNODES=${NNODES} is not MIN:MAX with 1 <= MIN <= MAX (e.g. 1:4); for a fixed number of nodes use" \
         "launch/multi_node.sh" >&2
    exit 2
fi
for setting in LAST_CALL DEAD_AFTER JOIN_TIMEOUT STORE_WAIT MAX_RESTARTS NPROC; do
    if [[ -n "${!setting:-}" && ! "${!setting}" =~ ^[1-9][0-9]*$ ]]; then
        echo "error: ${setting}=${!setting} is not a positive whole number; see the settings in $0's header" >&2
        exit 2
    fi
done
if [[ ! "$RDZV_ENDPOINT" =~ ^([A-Za-z0-9._-]+):([0-9]{1,5})$ ]] || (( BASH_REMATCH[2] < 1 || BASH_REMATCH[2] > 65535 )); then
    echo "error: RDZV_ENDPOINT=${RDZV_ENDPOINT} is not HOST:PORT (a host name or IPv4 address, a port 1-65535, e.g." \
         "head:29400): where launch/elastic_store.py serves" >&2
    exit 2
fi
host=${BASH_REMATCH[1]} port=${BASH_REMATCH[2]}
rdzv_id=${RDZV_ID:-dp-suite-elastic}
dead_after=${DEAD_AFTER:-5}
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
nproc=${NPROC:-$(( gpus > 0 ? gpus : 2 ))}
# A heartbeat a second; a node is gone after dead_after of them are missed.
rdzv_conf="is_host=false,join_timeout=${JOIN_TIMEOUT:-600},last_call_timeout=${LAST_CALL:-2}"
rdzv_conf+=",keep_alive_interval=1,keep_alive_max_attempt=${dead_after}"
cmd=(torchrun "--nnodes=${NNODES}" "--nproc_per_node=${nproc}" --rdzv-backend=c10d "--rdzv-endpoint=${RDZV_ENDPOINT}"
     "--rdzv-id=${rdzv_id}" "--rdzv-conf=${rdzv_conf}" "--max-restarts=${MAX_RESTARTS:-20}")
[[ -n "${LOCAL_ADDR:-}" ]] && cmd+=("--local-addr=${LOCAL_ADDR}")
cmd+=("$@")

# shellcheck source=launch/redact.sh
source "$(dirname "$0")/redact.sh"
shown TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "${cmd[@]}"  # the variable is what makes a join work: shown with it
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120} TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# torchrun would wait 60 s for an absent store, then print a traceback: one line instead.
if ! python3 - "$host" "$port" "${STORE_WAIT:-30}" <<'PY'
import socket, sys, time
host, port, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:
    try:
        socket.create_connection((host, port), timeout=2).close()
        sys.exit(0)
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.5)
PY
then
    echo "error: no rendezvous store answers at ${RDZV_ENDPOINT} (waited ${STORE_WAIT:-30} s): start" \
         "'python3 launch/elastic_store.py --port ${port}' on ${host}, a machine that stays up for the whole job" >&2
    exit 2
fi

# torchrun runs in the background, so that this script stays alive to read its stderr (in $errors).
# shellcheck source=launch/children.sh
source "$(dirname "$0")/children.sh"
# A file made before a stop of this node is passed on: the workers stopped without it were stopped by
# their agent for a membership change, and say so (common/train/trainer.py, membership_change).
leaving=$(mktemp -u /tmp/dp-suite-leaving-XXXXXX)
export DP_SUITE_LEAVING_MARKER=$leaving
trap 'touch "$leaving"; forward TERM' TERM
trap 'touch "$leaving"; forward INT' INT
status=0
run_keeping_stderr "$(dirname "$0")/quiet_torchrun.sh" "${cmd[@]:1}" || status=$?
rm -f "$leaving"
if [[ -n "$received" ]] && (( status != 0 )); then
    echo "left the job after SIG${received}: the other nodes, if any, continue from the checkpoint saved at the" \
         "stop; run this command again to join again" >&2
    exit $(( 128 + $(kill -l "$received") ))
elif (( status != 0 )) && grep -q "RendezvousClosedError" "$errors"; then
    echo "error: the rendezvous ${rdzv_id} at ${RDZV_ENDPOINT} is closed: a job with this id ended on that store;" \
         "pass another RDZV_ID, or restart launch/elastic_store.py" >&2
elif (( status != 0 )) && grep -q "RendezvousConnectionError" "$errors"; then
    echo "error: lost the rendezvous store at ${RDZV_ENDPOINT} (stopped, or its machine is gone); start it" \
         "again and run this command on every node: the run resumes from its newest checkpoint" >&2
elif (( status != 0 )) && grep -q "RendezvousTimeoutError" "$errors"; then
    echo "error: the rendezvous at ${RDZV_ENDPOINT} did not reach ${NNODES%%:*} node(s) within" \
         "${JOIN_TIMEOUT:-600} s: start this command on more nodes, and check that each reaches ${RDZV_ENDPOINT}" >&2
fi
exit "$status"
