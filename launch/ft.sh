#!/usr/bin/env bash
# Fault-tolerant training on one machine: a torchft Lighthouse and GROUPS replica groups, each its own
# torchrun of NPROC_PER_GROUP processes. A group that dies is started again (it heals from a live one);
# the others keep training meanwhile.
#
#   launch/ft.sh GROUPS NPROC_PER_GROUP train_ft.py [FLAGS...]
#   launch/ft.sh 2 1 train_ft.py --dataset mnist
#
# One line per event: "ft: group G lost (...); restarted (...)", "ft: group G left (stopped by SIGTERM)" (a
# group stopped on its own is not restarted; the others go on without it), "ft: group G gave up (...); not
# restarted" (status 3: its step failed across groups 21 times in a row, or no quorum of --min-groups groups
# formed within --quorum-timeout-s); the groups' own lines
# (prefixed [gG]) say "quorum of N group(s) at step S: this group (group G) is number I [HH:MM:SS]" and
# "group G healed from group K at step S". The events and the quorums end with the wall time.
# Ctrl-C or SIGTERM stops every group: the quorum's first group saves the stop checkpoint, as a plain
# run does; the same command resumes from it. Once every group started here has left or been lost for
# good, the Lighthouse stays up while it still hears from groups started elsewhere (by hand, on another
# machine), and ends when none is left. Settings (environment):
#   FT_PORT               the Lighthouse's port on 127.0.0.1 (default 29510)
#   FT_RESTARTS           restarts per group, at most (default 3)
#   FT_LIGHTHOUSE_RESTARTS  restarts of the Lighthouse, at most (default 10): the groups wait for it within
#                         --quorum-timeout-s and go on, no group ends
#   FT_HEARTBEAT_MS       a group silent this long is out of the quorum (default 3000)
#   FT_JOIN_MS            how long a quorum waits for late groups once enough have joined (default 2000)
#   FT_LOGS               where the Lighthouse's log goes (default: a new folder in TMPDIR, /tmp without it; kept: the line that starts the run names it)
# The Lighthouse forms quorums of the run's --min-groups (among the FLAGS; 1 without it) or more groups: a group
# up before its peers waits for them (docs/fault-tolerance.md, "--min-groups").
# On several machines, Slurm or Kubernetes: docs/clusters.md ("Fault-tolerant replica groups").
set -uo pipefail

if [[ $# -lt 3 || ! $1 =~ ^[1-9][0-9]*$ || ! $2 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: [FT_PORT=29510] [FT_RESTARTS=3] $0 GROUPS NPROC_PER_GROUP train_ft.py [FLAGS...]" >&2
    exit 2
fi
groups=$1 nproc=$2
shift 2
port=${FT_PORT:-29510} restarts=${FT_RESTARTS:-3} lighthouse_restarts=${FT_LIGHTHOUSE_RESTARTS:-10}
heartbeat_ms=${FT_HEARTBEAT_MS:-3000}  # the Lighthouse's, and how long this script waits for its groups to go quiet
logs=${FT_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/ft-XXXXXX")}
mkdir -p "$logs" && rm -f "$logs"/group*.pid "$logs/stopping" "$logs/lighthouse.pid"
lighthouse_bin=$(command -v torchft_lighthouse) ||
    { echo "error: torchft_lighthouse is not on PATH; activate the environment of requirements.txt (torchft)" >&2; exit 2; }
torchrun=$(command -v torchrun) || { echo "error: torchrun is not on PATH; activate the environment that has torch" >&2; exit 2; }
python=$(head -n 1 "$torchrun" | sed 's/^#!//')  # the interpreter torchrun belongs to
here=$(cd "$(dirname "$0")" && pwd)

# The run's --min-groups (the last one given, as train_ft.py's parser takes it; --min-groups=N and argparse's
# abbreviations too). The Lighthouse forms no quorum of fewer groups: a group that comes up before its peers
# waits for them (within --quorum-timeout-s) instead of failing its steps alone and giving up in a second.
min_groups=1
for ((i = 2; i <= $#; i++)); do  # $1: the script
    flag=${!i%%=*} value=
    [[ $flag == --min-g* && --min-groups == "$flag"* ]] || continue
    if [[ ${!i} == *=* ]]; then value=${!i#*=}; else next=$((i + 1)); value=${!next-}; fi
    [[ $value =~ ^[1-9][0-9]*$ ]] && min_groups=$value  # anything else: train_ft.py refuses it in one line
done

say() { printf 'ft: %s [%(%H:%M:%S)T]\n' "$*" -1; }  # the wall time: how long a group was away or alone
ended() { if (( $1 > 128 )); then echo "killed by SIG$(kill -l $(($1 - 128)))"; else echo "exit $1"; fi; }

# shellcheck disable=SC2317  # runs from the traps
stop_all() {  # $1: TERM or INT, passed to every group's torchrun and workers (their own process groups)
    [[ -e "$logs/stopping" ]] && return
    touch "$logs/stopping"
    say "stopping every group ($1): the quorum's first group saves"
    local file
    for file in "$logs"/group*.pid; do [[ -e $file ]] && kill -s "$1" -- "-$(cat "$file")" 2>/dev/null; done
}
trap 'stop_all TERM' TERM
trap 'stop_all INT' INT

[[ -f $1 ]] || { echo "error: $1: no such script (launch/ft.sh GROUPS NPROC_PER_GROUP train_ft.py [FLAGS...])" >&2; exit 2; }
# A port some process listens on (another run's Lighthouse) would send these groups into that run's quorum.
"$python" -c 'import socket, sys
probe = socket.socket()
probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection waiting out TIME_WAIT is no owner
probe.bind(("127.0.0.1", int(sys.argv[1])))' "$port" 2>/dev/null ||
    { echo "error: port $port on 127.0.0.1 is in use (another run's Lighthouse?); set FT_PORT to a free port" >&2; exit 2; }

# The Lighthouse, told to end when its supervisor does, even by SIGKILL (PR_SET_PDEATHSIG, kept across exec).
start_lighthouse() {
    RUST_LOG=${RUST_LOG:-info} "$python" -c 'import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGTERM)
os.execv(sys.argv[1], sys.argv[1:])' "$lighthouse_bin" --min_replicas "$min_groups" --bind "127.0.0.1:$port" \
        --heartbeat_timeout_ms "$heartbeat_ms" --join_timeout_ms "${FT_JOIN_MS:-2000}" \
        >> "$logs/lighthouse.log" 2>&1 &
    echo $! > "$logs/lighthouse.pid"
}

# shellcheck disable=SC2317  # runs in the background
supervise_lighthouse() {  # starts it, and again when it dies, FT_LIGHTHOUSE_RESTARTS times at most
    local attempt=0 code pid
    # Waited for: a run started right after this one ends finds the port free.
    trap 'pid=$(cat "$logs/lighthouse.pid"); kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; exit 0' TERM
    trap '' INT  # a terminal's Ctrl-C is for the groups, which stop and save first
    while :; do
        start_lighthouse
        pid=$(cat "$logs/lighthouse.pid")
        code=0
        wait "$pid" 2>/dev/null || code=$?  # 2>/dev/null: bash's own "Killed" line, said below as ours
        [[ -e "$logs/stopping" ]] && return 0
        if (( attempt >= lighthouse_restarts )); then
            say "the Lighthouse died ($(ended "$code")); no restarts left (FT_LIGHTHOUSE_RESTARTS=$lighthouse_restarts): each" \
                "group ends, saved, within --quorum-timeout-s"
            return 1
        fi
        attempt=$((attempt + 1))
        say "the Lighthouse died ($(ended "$code")); restarted ($attempt of $lighthouse_restarts) on 127.0.0.1:$port: the" \
            "groups wait for its quorum (--quorum-timeout-s) and go on"
    done
}

# How many groups the Lighthouse heard from within its heartbeat timeout (its status page says "[N heartbeating]");
# -1 while it does not answer (being started again), so that a restart is waited out, not taken for "none".
heard_from() {
    "$python" - "$port" <<'EOF' 2>/dev/null || echo -1
import re, sys, urllib.request
page = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/status", timeout=2).read().decode()
print(re.search(r"\[(\d+) heartbeating\]", page).group(1))
EOF
}

# In a process group of its own (a terminal's Ctrl-C is for the groups).
set -m
supervise_lighthouse &
supervisor=$!
set +m
for ((waited = 0; ; waited++)); do  # serving within 60 s, or one line (its entry point imports torch: 16 s seen on a loaded host)
    lighthouse=$(cat "$logs/lighthouse.pid" 2>/dev/null)
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && kill -0 "$lighthouse" 2>/dev/null && break
    if ! kill -0 "$supervisor" 2>/dev/null || (( waited >= 600 )); then
        echo "error: the Lighthouse did not start on 127.0.0.1:$port ($(tail -n 1 "$logs/lighthouse.log")); set" \
             "FT_PORT to a free port" >&2
        touch "$logs/stopping"
        kill "$supervisor" 2>/dev/null
        exit 2
    fi
    sleep 0.1
done
say "Lighthouse on 127.0.0.1:$port (pid $lighthouse, log $logs/lighthouse.log, quorums of $min_groups group(s) or" \
    "more: --min-groups), $groups group(s) of $nproc process(es)"

run_group() {  # $1: group number, then the script and its flags; restarts it when it dies
    local g=$1 attempt=0 code
    shift
    trap '' INT TERM  # this loop outlives a Ctrl-C: it waits for its group's stop and says how it ended
    while :; do
        set -m  # torchrun in a process group of its own: stop_all's signal reaches it and its workers once
        # quiet_torchrun.sh: torchrun, with a worker's one-line error instead of torchrun's dump (single_node.sh).
        # The prefixing sed ignores the stop (as this loop does): it passes on the group's last lines.
        (trap - INT TERM  # the group itself takes the stop
         REPLICA_GROUP_ID=$g FT_GROUPS=$groups TORCHFT_LIGHTHOUSE="http://127.0.0.1:$port" exec "$here/quiet_torchrun.sh" \
             --standalone "--nproc_per_node=$nproc" "$@") > >(exec sed -u "s/^/[g$g] /") 2>&1 &
        echo $! > "$logs/group$g.pid"
        set +m
        code=0
        wait $! || code=$?
        (( code == 0 )) && { say "group $g finished"; return 0; }
        [[ -e "$logs/stopping" ]] && return "$code"
        (( code == 2 )) && return 2  # a flag it refused: every restart would refuse it too
        if (( code == 3 )); then  # common/train/ft.py's GAVE_UP: a restart's steps would fail alike
            say "group $g gave up (its line above says why); not restarted: a restart would fail alike"
            return 3
        fi
        if (( code == 130 || code == 143 )); then say "group $g left (stopped by SIG$(kill -l $((code - 128))))"; return "$code"; fi
        kill -0 "$supervisor" 2>/dev/null || { say "group $g ended (exit $code); the Lighthouse is gone"; return "$code"; }
        (( attempt < restarts )) || { say "group $g lost (exit $code); no restarts left (FT_RESTARTS=$restarts)"; return "$code"; }
        attempt=$((attempt + 1))
        say "group $g lost (exit $code); restarted ($attempt of $restarts): it heals from a live group, if one is left"
    done
}

supervisors=()
for ((g = 0; g < groups; g++)); do
    run_group "$g" "$@" &
    supervisors+=($!)
done
status=0 finished=""
for pid in "${supervisors[@]}"; do
    code=0
    wait "$pid" || code=$?
    while (( code > 128 )) && kill -0 "$pid" 2>/dev/null; do code=0; wait "$pid" || code=$?; done  # a trap ran
    (( code == 0 )) && finished=1
    (( status == 0 )) && status=$code
done
[[ -n $finished && ! -e "$logs/stopping" ]] && status=0  # the run is done: the groups that finished trained it all
# Every group started here left or was lost for good, the run neither done nor stopped: groups started
# elsewhere (by hand, on another machine) may still train through this Lighthouse. It stays up while the
# Lighthouse hears from any (its status page counts the groups heard within FT_HEARTBEAT_MS). None is
# left only once it has heard none for a heartbeat timeout: a Lighthouse just started again has heard
# none yet (a live group's heartbeat reaches it within a few tenths of a second), and ending it then
# left the groups started by hand without a quorum.
if [[ -z $finished && ! -e "$logs/stopping" ]]; then
    up=$(cat "$logs/lighthouse.pid")  # up through the sleep below: it has heard every group still alive
    sleep $(( heartbeat_ms / 1000 + 1 ))  # until the groups that ended here are no longer heard
    silent=0 unheard=0 said=""  # seconds in a row it did not answer (a minute ends the wait), it heard no group
    while [[ ! -e "$logs/stopping" ]] && kill -0 "$supervisor" 2>/dev/null && (( silent < 60 )); do
        heard=$(heard_from)
        if (( heard < 0 )); then silent=$((silent + 1)); else silent=0; fi
        if (( heard == 0 )); then unheard=$((unheard + 1)); else unheard=0; fi
        # None left: heard by the Lighthouse that was up all along, or, by one started again since, over
        # polls a heartbeat timeout apart
        (( heard == 0 )) && [[ $(cat "$logs/lighthouse.pid") == "$up" ]] && break
        (( (unheard - 1) * 1000 >= heartbeat_ms )) && break
        if (( heard > 0 )) && [[ -z $said ]]; then
            say "every group started here has ended; the Lighthouse stays up for the groups it still hears from" \
                "(started elsewhere), until none is left or on Ctrl-C/SIGTERM"
            said=1
        fi
        sleep 1
    done
fi
touch "$logs/stopping"  # the run is over: the Lighthouse is not started again
kill "$supervisor" 2>/dev/null
wait "$supervisor" 2>/dev/null
exit "$status"
