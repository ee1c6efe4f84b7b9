# shellcheck shell=bash
# Sourced by the launchers that echo the command they run, so that the echo (a terminal, a Slurm
# output file) never shows a credential: shown() prints its arguments shell-quoted (a line that can
# be pasted back), with the value of an inline --storage-options (JSON that may hold keys and
# secrets; its @FILE and env:VAR forms only name where they are, and are shown) and the password of
# any scheme://user:password@host URL as ***. The password is everything between `user:` and the
# LAST `@` before the host, spaces and `@`s included: s3://AKIA:se@cret@host/b is s3://AKIA:***@host/b.
# A prefix of the flag (--storage, --st=...) counts too: the scripts refuse it, but only after this echo.

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
        out+=("$(quoted "$(password_hidden "$arg")")")
    done
    echo "${out[*]}"
}

password_hidden() {  # $1 with every URL's password as ***: from `scheme://user:` to the last `@` before the host's `/`
    local rest=$1 done=""
    local url='^(.*[A-Za-z][A-Za-z0-9+.-]*://[^/@:[:space:]]*:)[^/]*@(.*)$'
    while [[ $rest =~ $url ]]; do  # the last URL of the argument first: its `user:` starts the longest prefix
        done="***@${BASH_REMATCH[2]}$done"
        rest=${BASH_REMATCH[1]}
    done
    printf '%s' "$rest$done"
}

quoted() {  # $1 as Python's shlex.quote writes it: bare when every character is safe, else in single quotes
    if [[ -n $1 && $1 != *[^A-Za-z0-9_@%+=:,./-]* ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\"\'\"\'}"
    fi
}

inline_hidden() {  # $1: a --storage-options value
    if [[ $1 == @* || $1 == env:* ]]; then
        echo "$1"
    else
        echo "***"
    fi
}
