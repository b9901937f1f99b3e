#!/usr/bin/env bash
# Is the single-machine Slurm cluster of slurm/cluster-up.sh up? Prints each daemon's pid and the
# partition's nodes; exits 0 only when every daemon runs, slurmctld answers, every node is usable and
# sacct answers. Starts and changes nothing, and needs no root.
#
# Usage: cluster-status.sh [-q|--quiet]   (-q: print nothing, just the exit status)
# Environment: MEGASWEEP_SLURM_DIR, MEGASWEEP_SLURM_NODES as for cluster-up.sh.
set -euo pipefail
# shellcheck source=slurm/cluster-up.sh
. "$(dirname "${BASH_SOURCE[0]}")/cluster-up.sh"

main_status() {
    local quiet=0 ok=1 name comm arg pending
    case ${1:-} in
    "") ;;
    -q | --quiet) quiet=1 ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
        return 0
        ;;
    *) fail "unknown argument '$1' (try --help)" ;;
    esac
    ms_init
    # Without MEGASWEEP_SLURM_NODES, check the nodes the last bring-up configured, not the default.
    if [[ -z ${MEGASWEEP_SLURM_NODES:-} && -f $STATE/cluster.json ]]; then
        NUM_NODES=$(grep -o '"node[0-9]*"' "$STATE/cluster.json" | wc -l)
    fi
    say() { ((quiet)) || printf '%s\n' "$*"; }
    # munged may be the host's own (cluster-up then reuses it), so ask munge itself.
    if munge_works; then say "munge      ok"; else say "munge      NOT WORKING"; ok=0; fi
    for name in mariadbd slurmdbd slurmctld $(node_names | sed 's/^/slurmd-/'); do
        comm=${name%%-*}
        arg=""
        [[ $name == slurmd-* ]] && arg=${name#slurmd-}
        if ours "$name" "$comm" ${arg:+"$arg"}; then
            say "$(printf '%-10s pid %s' "$name" "$(recorded_pid "$name")")"
        else
            say "$(printf '%-10s NOT RUNNING' "$name")"
            ok=0
        fi
    done
    if ((ok)) && ctld_up; then
        pending=$(nodes_not_ready)
        if [[ -n $pending ]]; then
            say "nodes not usable: ${pending//$'\n'/ }"
            ok=0
        fi
        if ! sacct_answers >/dev/null 2>&1; then
            say "sacct      NOT ANSWERING"
            ok=0
        fi
        ((quiet)) || sinfo -p "$PARTITION"
    elif ((ok)); then
        say "slurmctld  NOT ANSWERING"
        ok=0
    fi
    if ((ok)); then say "up (state in $STATE)"; else say "not (fully) up; start it with slurm/cluster-up.sh"; fi
    ((ok))
}

main_status "$@"
