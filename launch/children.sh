# shellcheck shell=bash disable=SC2034  # `received` is read by the launcher that sources this
# Sourced by the launchers that stay alive beside what they start (multi_node.sh and elastic.sh read torchrun's
# stderr, local_two_nodes.sh runs two agents). Each child runs in a process group of its own, so a
# TERM or INT reaches it once, from forward() (a Ctrl-C in a terminal reaches the launcher's group
# only); the launcher then waits for every child and exits with their status.
children=()
received=""  # the signal forwarded so far, if any

# shellcheck disable=SC2317  # forward() runs from the traps
forward() {  # $1: TERM or INT
    received=$1
    (( ${#children[@]} > 0 )) || exit $(( 128 + $(kill -l "$1") ))  # nothing started yet
    kill -s "$1" "${children[@]}" 2>/dev/null || true
}
trap 'forward TERM' TERM
trap 'forward INT' INT

start_child() {  # runs "$@" in the background, in its own process group
    set -m
    "$@" &
    children+=($!)
    set +m
}

wait_child() {  # $1: pid; returns its exit status, waiting on when a forwarded signal interrupts wait
    local code=0
    wait "$1" || code=$?
    while (( code > 128 )) && kill -0 "$1" 2>/dev/null; do
        code=0
        wait "$1" || code=$?
    done
    return "$code"
}

run_keeping_stderr() {  # runs "$@" as the child, its stderr shown and kept in the file $errors; returns its status
    errors=$(mktemp)
    trap 'rm -f "$errors"' EXIT
    exec 3> >(trap '' INT TERM; exec tee "$errors" >&2)  # a copy of stderr that outlives a Ctrl-C
    local tee_pid=$! code=0
    start_child "$@" 2>&3 3>&-
    exec 3>&-
    wait_child "${children[0]}" || code=$?
    wait "$tee_pid" 2>/dev/null || true
    return "$code"
}
