#!/usr/bin/env bash
# Stop the single-machine Slurm cluster that slurm/cluster-up.sh started: cancel the jobs still queued or
# running, then stop exactly the daemons cluster-up recorded (by pid, checked against the program name,
# never by pattern), in the reverse order of start-up. Idempotent: with nothing running it just says so.
#
# Usage: cluster-down.sh [--purge]
#   --purge  also delete the state dir (configs, logs, accounting database), the /etc/slurm/slurm.conf
#            link and the node names cluster-up added to /etc/hosts.
# Environment: MEGASWEEP_SLURM_DIR as for cluster-up.sh.
set -euo pipefail
# shellcheck source=slurm/cluster-up.sh
. "$(dirname "${BASH_SOURCE[0]}")/cluster-up.sh"

# Cancel every job, then wait (bounded) until none is left, so that slurmdbd records the final states
# before it goes away and no job step outlives its slurmd.
cancel_jobs() {
    local ids i
    ids=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ') || return 0
    [[ -n ${ids// /} ]] || return 0
    log "cancelling jobs: $ids"
    # shellcheck disable=SC2086  # one argument per job id
    scancel $ids 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        [[ -z $(squeue -h -o %A 2>/dev/null) ]] && return 0
        sleep 0.2
    done
    log "warning: jobs still listed after 20 s: $(squeue -h -o '%A %T' 2>/dev/null | tr '\n' ' ')"
}

# slurmstepd daemons (one per job step) are forked by our slurmd daemons and detach from them. Each
# keeps its node's slurmd log open, which tells this cluster's from anyone else's. (Their environment is
# no help: slurmstepd writes its process title over it.)
our_stepds() {
    local p fd
    for p in /proc/[0-9]*; do
        [[ $(cat "$p/comm" 2>/dev/null) == slurmstepd ]] || continue
        for fd in "$p"/fd/*; do
            if [[ $(readlink "$fd" 2>/dev/null) == "$LOGS"/slurmd-* ]]; then
                echo "${p#/proc/}"
                break
            fi
        done
    done
}

stop_stepds() {
    local pids i
    pids=$(our_stepds)
    [[ -n $pids ]] || return 0
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        [[ -n $(our_stepds) ]] || return 0
        sleep 0.1
    done
    pids=$(our_stepds)
    # shellcheck disable=SC2086
    [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
}

purge() {
    local sys=/etc/slurm/slurm.conf hosts
    if [[ -L $sys && $(readlink "$sys") == "$SLURM_CONF_FILE" ]]; then rm -f "$sys"; fi
    if grep -q "$HOSTS_TAG\$" /etc/hosts 2>/dev/null; then
        # Rewrite in place rather than rename a new file over it: /etc/hosts is often a bind mount.
        hosts=$(grep -v "$HOSTS_TAG\$" /etc/hosts)
        printf '%s\n' "$hosts" >/etc/hosts
    fi
    # Only a directory cluster-up made (it has the marker) is deleted.
    if [[ -f $MARKER ]]; then
        rm -rf "$STATE"
        log "purged $STATE"
    fi
}

main_down() {
    local do_purge=0 t0=$EPOCHREALTIME f name stopped=()
    case ${1:-} in
    "") ;;
    --purge) do_purge=1 ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
        return 0
        ;;
    *) fail "unknown argument '$1' (try --help)" ;;
    esac
    ms_init
    if [[ ! -d $PIDS ]]; then
        ((do_purge)) && purge
        log "down: nothing was started from $STATE"
        return 0
    fi
    ((EUID == 0)) || fail "must run as root, like cluster-up.sh"
    exec 9>"$STATE/lock"
    flock -w 900 9 || fail "another cluster-up/-down holds $STATE/lock"
    if ours slurmctld slurmctld; then cancel_jobs; fi
    for f in "$PIDS"/slurmd-*.pid; do
        [[ -e $f ]] || continue
        name=$(basename "$f" .pid)
        ours "$name" slurmd "${name#slurmd-}" && stopped+=("$name")
        stop_ours "$name" slurmd "${name#slurmd-}"
    done
    stop_stepds
    for name in slurmctld slurmdbd mariadbd munged; do
        ours "$name" "$name" && stopped+=("$name")
        stop_ours "$name" "$name"
    done
    exec 9>&-
    ((do_purge)) && purge
    if ((${#stopped[@]})); then
        log "down: stopped ${stopped[*]} ($(elapsed "$t0"))"
    else
        log "down: nothing was running"
    fi
}

main_down "$@"
