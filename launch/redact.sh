# shellcheck shell=bash
# Sourced by the launchers that echo the command they run, so that the echo (a terminal, a Slurm
# output file) never shows a credential: shown() prints its arguments joined by spaces with the value
# of an inline --storage-options (JSON that may hold keys and secrets; its @FILE and env:VAR forms
# only name where they are, and are shown) and the password of any user:password@ URL as ***.
# argparse takes any unambiguous prefix of a flag (--storage, --st=...): those count too.

shown() {
    local arg name hide_next=0 out=()
    for arg in "$@"; do
        name=${arg%%=*}
        if (( hide_next )); then
            arg=$(inline_hidden "$arg")
            hide_next=0
        elif [[ $name == --st* && --storage-options == "$name"* ]]; then
            if [[ $arg == *=* ]]; then
                arg="$name=$(inline_hidden "${arg#*=}")"
            else
                hide_next=1
            fi
        fi
        out+=("$(sed -E 's#(://[^/@[:space:]:]*:)[^/@[:space:]]+@#\1***@#g' <<< "$arg")")
    done
    echo "${out[*]}"
}

inline_hidden() {  # $1: a --storage-options value
    if [[ $1 == @* || $1 == env:* ]]; then
        echo "$1"
    else
        echo "***"
    fi
}
