#!/usr/bin/env bash
# Bring up a real Slurm cluster on this one machine, for megasweep's tests and for trying megasweep on a
# small box: munged, MariaDB + slurmdbd (so sacct answers as on a real site), slurmctld, and N slurmd
# daemons that each play a node (slurmd -N nodeX). Needs root (Debian/Ubuntu: installs the packages
# with apt-get the first time).
#
# Idempotent: with everything up, a second run only checks and returns; after a partial failure (a
# daemon died, a step timed out) it starts what is missing. Changing the node count or another setting
# re-renders the configs and restarts the Slurm daemons that use them.
#
# Environment (all optional):
#   MEGASWEEP_SLURM_DIR        state: configs, pids, logs, database, spool   [/var/lib/megasweep-slurm]
#   MEGASWEEP_SLURM_NODES      number of emulated nodes node1..nodeN         [4]
#   MEGASWEEP_SLURM_CPUS       CPUs declared per node                        [nproc]
#   MEGASWEEP_SLURM_CORES      real cores: the `cores` license's total       [nproc]
#   MEGASWEEP_SLURM_TIMEOUT    seconds to wait for each daemon to answer     [60]
#   MEGASWEEP_SLURM_PORT_BASE  slurmctld port; slurmdbd +2, nodeI +10+I      [6817]
#   MEGASWEEP_SLURM_DB_PORT    MariaDB port, bound to 127.0.0.1 only         [3307]
#
# cluster-down.sh and cluster-status.sh source this file for its helpers; main_up runs only when this
# file is executed.
set -euo pipefail

ms_init() {
    MS_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    STATE=${MEGASWEEP_SLURM_DIR:-/var/lib/megasweep-slurm}
    STATE=${STATE%/}
    ETC=$STATE/etc
    PIDS=$STATE/pids       # pids recorded by these scripts: the only processes cluster-down stops
    RUNDIR=$STATE/run      # pid files and sockets the daemons write themselves
    LOGS=$STATE/log
    DBDIR=$STATE/mysql
    DB_SOCK=$RUNDIR/mariadb.sock
    MARKER=$STATE/.megasweep-slurm
    SLURM_CONF_FILE=$ETC/slurm.conf
    CLUSTER_NAME=megasweep
    PARTITION=debug
    NUM_NODES=${MEGASWEEP_SLURM_NODES:-4}
    TIMEOUT=${MEGASWEEP_SLURM_TIMEOUT:-60}
    PORT_BASE=${MEGASWEEP_SLURM_PORT_BASE:-6817}
    DB_PORT=${MEGASWEEP_SLURM_DB_PORT:-3307}
    MAX_ARRAY_SIZE=1001
    # The emulated nodes declare 4 x nproc CPUs on nproc real cores: they share the host's cores, so
    # Slurm's node allocation alone never stops jobs from timing each other. The cluster-wide license
    # `cores` (one per real core) does: every measuring job asks for one per CPU it runs
    # (conf/cluster/local.yaml core_license), and Slurm starts it only when that many are free, across
    # arrays, sweeps and users. Jobs that ask for none (plumbing tests, sbatch by hand) still queue and
    # run on the declared CPUs, one job per declared CPU unless the jobs ask to share it
    # (--oversubscribe, up to OVERSUBSCRIBE jobs per CPU: tests of several jobs on one node).
    CORE_LICENSE=cores
    OVERSUBSCRIBE=4
    CORES=${MEGASWEEP_SLURM_CORES:-$(nproc)}
    HOSTS_TAG="# megasweep-slurm"
    # Client commands run here (sacctmgr, scontrol, sinfo) and every daemon read this config.
    export SLURM_CONF=$SLURM_CONF_FILE
}

log() { printf 'megasweep-slurm: %s\n' "$*" >&2; }

# fail MESSAGE [LOGFILE...]: report, show the end of each log that exists, and stop.
fail() {
    local msg=$1 f
    shift
    log "error: $msg"
    for f in "$@"; do
        [[ -s $f ]] || continue
        printf '%s\n' "----- last lines of $f -----" >&2
        tail -n 25 "$f" >&2
    done
    exit 1
}

node_names() {
    local i
    for ((i = 1; i <= NUM_NODES; i++)); do printf 'node%d\n' "$i"; done
}

node_list_expr() {
    if ((NUM_NODES == 1)); then echo node1; else echo "node[1-$NUM_NODES]"; fi
}

# ours NAME COMM [ARG]: is the process recorded as NAME alive, still the program COMM (not a reused
# pid), and, when ARG is given, started with that argument? A zombie child of this shell counts as dead.
ours() {
    local f=$PIDS/$1.pid pid comm stat args
    [[ -s $f ]] || return 1
    pid=$(<"$f")
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm ]] || return 1
    read -r comm 2>/dev/null <"/proc/$pid/comm" || return 1
    [[ $comm == "$2" ]] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat:0:1} != Z ]] || return 1
    if (($# > 2)); then
        args=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
        [[ " $args" == *" $3 "* ]] || return 1
    fi
}

recorded_pid() { cat "$PIDS/$1.pid" 2>/dev/null || true; }

# launch NAME COMM CMD...: start CMD in its own session, detached from our stdio (a caller capturing our
# output must not wait for the daemons) and from the lock on fd 9, and record its pid. Daemons run in
# the foreground (-D/-F) so that this pid is the daemon itself, not a parent that forked it. Returns
# once the exec chain (setsid, setpriv) has reached COMM, so that `ours` can be trusted right away.
launch() {
    local name=$1 comm=$2 pid i
    shift 2
    # From the state directory, not the caller's: a daemon keeps its working directory for life, and
    # slurmd's job steps report a deleted one in every job's output (a checkout or test dir removed later).
    (cd "$STATE" && exec setsid "$@") </dev/null >>"$LOGS/$name.out" 2>&1 9>&- &
    pid=$!
    echo "$pid" >"$PIDS/$name.pid"
    for ((i = 0; i < 100; i++)); do
        [[ $(cat "/proc/$pid/comm" 2>/dev/null) != "$comm" ]] || return 0
        sleep 0.02
    done
}

# stop_ours NAME COMM [ARG]: SIGTERM the recorded process, SIGKILL it if it lingers, forget it.
stop_ours() {
    local name=$1 pid i
    if ours "$@"; then
        pid=$(recorded_pid "$name")
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 150; i++)); do
            ours "$@" || break
            sleep 0.1
        done
        if ours "$@"; then
            log "$name (pid $pid) ignored SIGTERM for 15 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$PIDS/$name.pid"
}

# wait_for WHAT NAME COMM LOG CMD...: poll CMD until it succeeds; give up early, with the log, when the
# daemon NAME/COMM has died ("-" skips that check), or after TIMEOUT seconds.
wait_for() {
    local what=$1 name=$2 comm=$3 logf=$4 deadline
    shift 4
    deadline=$((SECONDS + TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        if [[ $name != - ]] && ! ours "$name" "$comm"; then
            fail "$name exited while waiting for $what" "$logf" "$LOGS/$name.out"
        fi
        ((SECONDS < deadline)) || fail "timed out after ${TIMEOUT}s waiting for $what" "$logf" "$LOGS/$name.out"
        sleep 0.2
    done
}

port_free() {
    command -v ss >/dev/null || return 0
    [[ -z $(ss -Hltn "sport = :$1" 2>/dev/null) ]]
}

require_port() {
    port_free "$1" || fail "port $1 (for $2) is taken by another process; set MEGASWEEP_SLURM_PORT_BASE / MEGASWEEP_SLURM_DB_PORT"
}

validate_settings() {
    if [[ ! $NUM_NODES =~ ^[0-9]+$ ]] || ((NUM_NODES < 1 || NUM_NODES > 64)); then
        fail "MEGASWEEP_SLURM_NODES must be a number from 1 to 64, got '$NUM_NODES'"
    fi
    [[ $CORES =~ ^[1-9][0-9]*$ ]] || fail "MEGASWEEP_SLURM_CORES must be a positive number, got '$CORES'"
    [[ $TIMEOUT =~ ^[0-9]+$ && $PORT_BASE =~ ^[0-9]+$ && $DB_PORT =~ ^[0-9]+$ ]] ||
        fail "MEGASWEEP_SLURM_TIMEOUT, _PORT_BASE and _DB_PORT must be numbers"
    [[ $STATE == /* && $STATE != / ]] || fail "MEGASWEEP_SLURM_DIR must be an absolute path below /, got '$STATE'"
    # A unix socket path is limited to 107 bytes.
    ((${#DB_SOCK} < 100)) || fail "MEGASWEEP_SLURM_DIR is too long for a socket path: $STATE"
}

PACKAGES=(munge mariadb-server slurm-wlm slurmdbd)
POLICY_GUARD=""

remove_policy_guard() { [[ -z $POLICY_GUARD ]] || rm -f /usr/sbin/policy-rc.d; }

install_packages() {
    local missing=() p t0=$EPOCHREALTIME ok=1 i
    for p in "${PACKAGES[@]}"; do
        [[ $(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null) == installed ]] || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    command -v apt-get >/dev/null ||
        fail "missing ${missing[*]} and no apt-get here: install Slurm (22.05+), slurmdbd, MariaDB and munge, then rerun"
    log "installing ${missing[*]} with apt-get (output in $LOGS/apt.log)"
    # Debian packages start their services from postinst. This cluster runs its own daemons with its own
    # configs, so forbid that (the standard policy-rc.d mechanism) unless the host already has a policy.
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        POLICY_GUARD=1
        trap remove_policy_guard EXIT
    fi
    {
        for ((i = 1; i <= 3; i++)); do
            apt-get -o DPkg::Lock::Timeout=600 update -qq && break
            ((i < 3)) || exit 1
            sleep 5
        done
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
            --no-install-recommends "${missing[@]}"
    } >"$LOGS/apt.log" 2>&1 || ok=0
    remove_policy_guard
    POLICY_GUARD=""
    ((ok)) || fail "apt-get could not install ${missing[*]}" "$LOGS/apt.log"
    log "installed ${missing[*]} in $(elapsed "$t0")"
}

elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f s", b - a }'; }

make_dirs() {
    mkdir -p "$ETC" "$PIDS" "$RUNDIR" "$LOGS" "$STATE/ctld" "$STATE/spool"
    chmod 755 "$STATE"
    touch "$MARKER"
}

# Node names must resolve (srun, and MASTER_ADDR in torch.distributed, use the first node's name).
ensure_hosts() {
    local name missing=() addr
    for name in $(node_names); do
        addr=$(getent ahostsv4 "$name" 2>/dev/null | awk 'NR == 1 { print $1 }' || true)
        if [[ -z $addr ]]; then
            missing+=("$name")
        elif [[ $addr != 127.0.0.1 ]]; then
            fail "$name resolves to $addr, not 127.0.0.1; remove it from /etc/hosts or DNS"
        fi
    done
    ((${#missing[@]})) || return 0
    printf '127.0.0.1 %s %s\n' "${missing[*]}" "$HOSTS_TAG" >>/etc/hosts ||
        fail "cannot add ${missing[*]} to /etc/hosts"
}

# render TEMPLATE OUT KEY=VALUE...: replace @KEY@ tokens; returns 0 when OUT changed.
render() {
    local template=$1 out=$2 text kv tmp
    shift 2
    text=$(<"$template")
    for kv in "$@"; do text=${text//@${kv%%=*}@/${kv#*=}}; done
    if [[ $text =~ @[A-Z_]+@ ]]; then fail "unrendered token ${BASH_REMATCH[0]} in $template"; fi
    tmp=$out.tmp
    (umask 077 && printf '%s\n' "$text" >"$tmp")
    if [[ -f $out ]] && cmp -s "$tmp" "$out"; then
        rm -f "$tmp"
        return 1
    fi
    mv -f "$tmp" "$out"
}

host_mem_mb() { awk '/^MemTotal:/ { printf "%d", $2 / 1024 }' /proc/meminfo; }

SLURM_CONF_CHANGED=0
DBD_CONF_CHANGED=0

write_configs() {
    local host cpus mem node_lines="" name i=0 common
    host=$(hostname -s)
    cpus=${MEGASWEEP_SLURM_CPUS:-$(nproc)}
    [[ $cpus =~ ^[1-9][0-9]*$ ]] || fail "MEGASWEEP_SLURM_CPUS must be a positive number, got '$cpus'"
    # Memory is not a consumable resource here (CR_Core), so each node may declare the whole host:
    # a job's --mem request is then checked against something real.
    mem=$(host_mem_mb)
    for name in $(node_names); do
        i=$((i + 1))
        node_lines+="NodeName=$name NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT_BASE + 10 + i))"
        node_lines+=" CPUs=$cpus RealMemory=$mem State=UNKNOWN"$'\n'
    done
    if [[ ! -s $ETC/db.pass ]]; then
        (umask 077 && od -An -N16 -tx1 /dev/urandom | tr -d ' \n' >"$ETC/db.pass")
    fi
    common=("STATE_DIR=$STATE" "HOSTNAME=$host" "DBD_PORT=$((PORT_BASE + 2))")
    render "$MS_HERE/templates/slurm.conf.in" "$SLURM_CONF_FILE" "${common[@]}" \
        "CLUSTER_NAME=$CLUSTER_NAME" "CTLD_PORT=$PORT_BASE" "NUM_NODES=$NUM_NODES" \
        "NODE_LINES=${node_lines%$'\n'}" "NODE_LIST=$(node_list_expr)" "PARTITION=$PARTITION" \
        "CORE_LICENSE=$CORE_LICENSE" "CORES=$CORES" "OVERSUBSCRIBE=$OVERSUBSCRIBE" "MIN_JOB_AGE=10" "KILL_WAIT=5" "MAX_ARRAY_SIZE=$MAX_ARRAY_SIZE" \
        "MAX_JOB_COUNT=10000" "CRED_EXPIRE=15" && SLURM_CONF_CHANGED=1
    chmod 644 "$SLURM_CONF_FILE"
    render "$MS_HERE/templates/slurmdbd.conf.in" "$ETC/slurmdbd.conf" "${common[@]}" \
        "DB_PORT=$DB_PORT" "DB_PASS=$(<"$ETC/db.pass")" && DBD_CONF_CHANGED=1
    # slurmdbd refuses a config that others can read.
    chmod 600 "$ETC/slurmdbd.conf"
    link_system_conf
}

# Client commands look for /etc/slurm/slurm.conf unless SLURM_CONF is set: point it at this cluster's
# config so plain `sinfo` works, but never replace a config this script did not write.
link_system_conf() {
    local sys=/etc/slurm/slurm.conf
    if [[ -L $sys && $(readlink "$sys") == "$SLURM_CONF_FILE" ]]; then return 0; fi
    if [[ -e $sys || -L $sys ]]; then
        log "note: $sys is not this cluster's; run clients with SLURM_CONF=$SLURM_CONF_FILE"
        return 0
    fi
    mkdir -p /etc/slurm
    ln -s "$SLURM_CONF_FILE" "$sys"
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if ours munged munged || munge_works; then return 0; fi
    rm -f "$PIDS/munged.pid"
    # munged will not start without its socket dir, which lives on a tmpfs that no service created.
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --keyfile=/etc/munge/munge.key
        chown munge:munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
    fi
    # munged insists on running as the owner of its key; setpriv execs, so the recorded pid is munged's.
    launch munged munged setpriv --reuid=munge --regid=munge --init-groups munged -F
    wait_for "munge" munged munged /var/log/munge/munged.log munge_works
}

db_query() { mariadb --no-defaults -S "$DB_SOCK" -u root "$@"; }

start_mariadb() {
    # Moved to another port (MEGASWEEP_SLURM_DB_PORT changed): restart it there.
    if ours mariadbd mariadbd && ! ours mariadbd mariadbd "--port=$DB_PORT"; then stop_ours mariadbd mariadbd; fi
    if ! ours mariadbd mariadbd; then
        rm -f "$PIDS/mariadbd.pid"
        require_port "$DB_PORT" MariaDB
        # A datadir whose initialisation was interrupted is not worth repairing: start it afresh.
        if [[ ! -f $DBDIR/.megasweep-initialized ]]; then
            rm -rf "$DBDIR"
            mkdir -p "$DBDIR"
            mariadb-install-db --no-defaults --user=root --datadir="$DBDIR" --skip-test-db \
                --auth-root-authentication-method=socket >"$LOGS/mariadb-install.log" 2>&1 ||
                fail "mariadb-install-db failed" "$LOGS/mariadb-install.log"
            touch "$DBDIR/.megasweep-initialized"
        fi
        # --no-defaults: the host's /etc/mysql settings are for its own server, not this one. The InnoDB
        # settings are the least slurmdbd takes without logging an error (half of what it recommends);
        # the buffer pool is only reserved, and stays small in memory with this tiny database.
        launch mariadbd mariadbd mariadbd --no-defaults --user=root --datadir="$DBDIR" --socket="$DB_SOCK" \
            --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve --pid-file="$RUNDIR/mariadbd.pid" \
            --log-error="$LOGS/mariadb.log" --innodb-buffer-pool-size=512M --innodb-log-file-size=64M \
            --innodb-lock-wait-timeout=900
    fi
    wait_for "MariaDB" mariadbd mariadbd "$LOGS/mariadb.log" db_query -e 'SELECT 1'
    local pass
    pass=$(<"$ETC/db.pass")
    # Idempotent: also repairs a user whose password no longer matches db.pass.
    db_query --batch <<SQL || fail "could not create the slurm database user" "$LOGS/mariadb.log"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
SQL
}

dbd_answers() { sacctmgr -n -P list cluster format=cluster; }

cluster_registered() { [[ $(sacctmgr -n -P list cluster format=cluster 2>/dev/null) == *"$CLUSTER_NAME"* ]]; }

start_slurmdbd() {
    if ((DBD_CONF_CHANGED)); then stop_ours slurmdbd slurmdbd; fi
    if ! ours slurmdbd slurmdbd; then
        rm -f "$PIDS/slurmdbd.pid"
        require_port $((PORT_BASE + 2)) slurmdbd
        # slurmdbd has no -f: it reads slurmdbd.conf from the directory of $SLURM_CONF.
        launch slurmdbd slurmdbd slurmdbd -D
    fi
    wait_for "slurmdbd" slurmdbd slurmdbd "$LOGS/slurmdbd.log" dbd_answers
    if ! cluster_registered; then
        sacctmgr -i add cluster "$CLUSTER_NAME" >"$LOGS/sacctmgr.out" 2>&1 ||
            fail "sacctmgr add cluster failed" "$LOGS/sacctmgr.out" "$LOGS/slurmdbd.log"
    fi
}

ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

start_slurmctld() {
    if ((SLURM_CONF_CHANGED)); then stop_ours slurmctld slurmctld; fi
    if ! ours slurmctld slurmctld; then
        rm -f "$PIDS/slurmctld.pid"
        require_port "$PORT_BASE" slurmctld
        launch slurmctld slurmctld slurmctld -D -f "$SLURM_CONF_FILE"
    fi
    wait_for "slurmctld" slurmctld slurmctld "$LOGS/slurmctld.log" ctld_up
}

start_slurmds() {
    local f name i=0
    # Nodes left over from a run with more nodes than now.
    for f in "$PIDS"/slurmd-*.pid; do
        [[ -e $f ]] || continue
        name=$(basename "$f" .pid)
        name=${name#slurmd-}
        if ((SLURM_CONF_CHANGED)) || ! node_names | grep -qx "$name"; then
            stop_ours "slurmd-$name" slurmd "$name"
        fi
    done
    for name in $(node_names); do
        i=$((i + 1))
        ours "slurmd-$name" slurmd "$name" && continue
        rm -f "$PIDS/slurmd-$name.pid"
        require_port $((PORT_BASE + 10 + i)) "slurmd $name"
        mkdir -p "$STATE/spool/slurmd-$name"
        launch "slurmd-$name" slurmd slurmd -D -N "$name" -f "$SLURM_CONF_FILE"
    done
}

# Prints the nodes of our partition that are not yet usable (not responding, down, drained, ...).
nodes_not_ready() {
    local out name state
    out=$(sinfo -h -N -p "$PARTITION" -o '%N %T' 2>/dev/null) || {
        echo "sinfo failed"
        return
    }
    node_names | while read -r name; do
        state=$(awk -v n="$name" '$1 == n { print $2; exit }' <<<"$out")
        case $state in
        idle | mixed | allocated | completing) ;;
        *) echo "$name:${state:-missing}" ;;
        esac
    done
}

wait_nodes() {
    local deadline=$((SECONDS + TIMEOUT)) resumed=0 name state entry pending logs=()
    while true; do
        pending=$(nodes_not_ready)
        [[ -n $pending ]] || return 0
        for name in $(node_names); do
            ours "slurmd-$name" slurmd "$name" ||
                fail "slurmd for $name exited" "$LOGS/slurmd-$name.log" "$LOGS/slurmd-$name.out"
        done
        # A node that answers but stays down/drained (an old reason from before a restart) is put back:
        # on this throwaway cluster a stale reason only blocks tests. The reason goes to the log.
        if ((!resumed && SECONDS > deadline - TIMEOUT + 3)); then
            for entry in $pending; do
                name=${entry%%:*}
                state=${entry#*:}
                case $state in
                down | drained | draining)
                    log "$name was $state ($(sinfo -h -n "$name" -o '%E')); resuming it"
                    scontrol update nodename="$name" state=resume 2>/dev/null || true
                    ;;
                esac
            done
            resumed=1
        fi
        if ((SECONDS >= deadline)); then
            for name in $(node_names); do logs+=("$LOGS/slurmd-$name.log"); done
            fail "timed out after ${TIMEOUT}s waiting for nodes: ${pending//$'\n'/ }" "$LOGS/slurmctld.log" "${logs[@]}"
        fi
        sleep 0.2
    done
}

sacct_answers() { sacct -n -X -S now-1hours -o JobID; }

write_info() {
    local nodes="" name version
    for name in $(node_names); do nodes+="${nodes:+, }\"$name\""; done
    version=$(sinfo --version 2>/dev/null | awk '{ print $2 }')
    cat >"$STATE/cluster.json.tmp" <<EOF
{
  "cluster_name": "$CLUSTER_NAME",
  "partition": "$PARTITION",
  "nodes": [$nodes],
  "state_dir": "$STATE",
  "slurm_conf": "$SLURM_CONF_FILE",
  "cpus_per_node": ${MEGASWEEP_SLURM_CPUS:-$(nproc)},
  "oversubscribe": $OVERSUBSCRIBE,
  "core_license": "$CORE_LICENSE",
  "cores": $CORES,
  "max_array_size": $MAX_ARRAY_SIZE,
  "slurm_version": "$version"
}
EOF
    mv -f "$STATE/cluster.json.tmp" "$STATE/cluster.json"
}

main_up() {
    local t0=$EPOCHREALTIME
    if (($#)); then
        case $1 in
        -h | --help)
            sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            return 0
            ;;
        *) fail "unknown argument '$1' (try --help)" ;;
        esac
    fi
    ms_init
    # set -e stops silently; say where.
    set -E
    trap 'log "error: unexpected failure (status $?) at ${BASH_SOURCE[0]}:$LINENO: $BASH_COMMAND"' ERR
    validate_settings
    ((EUID == 0)) || fail "must run as root: it installs packages, starts daemons as root and edits /etc/hosts"
    make_dirs
    # One bring-up or tear-down at a time (two test sessions starting at once, say).
    exec 9>"$STATE/lock"
    flock -w 900 9 || fail "another cluster-up/-down holds $STATE/lock"
    install_packages
    ensure_hosts
    write_configs
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurmctld
    start_slurmds
    wait_nodes
    wait_for "sacct" - - "$LOGS/slurmdbd.log" sacct_answers
    write_info
    printf 'megasweep-slurm: up: cluster %s, partition %s (default), nodes %s x %s CPUs, license %s:%s, sacct via slurmdbd;' \
        "$CLUSTER_NAME" "$PARTITION" "$(node_list_expr)" "${MEGASWEEP_SLURM_CPUS:-$(nproc)}" "$CORE_LICENSE" "$CORES"
    printf ' state in %s (%s)\n' "$STATE" "$(elapsed "$t0")"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    main_up "$@"
fi
