#!/usr/bin/env bash
# A one-node Slurm cluster with accounting on this machine: what nano_eval's Slurm tests run against
# (tests/test_sweep_slurm.py), and a place to try `nano_eval sweep --launcher slurm` before a real cluster.
#
#   sudo bash scripts/slurm_cluster.sh start    # installs Debian's packages if missing, writes the configs, starts
#   sudo bash scripts/slurm_cluster.sh status   # which daemons run; exit 0 when sinfo and sacct answer
#   sudo bash scripts/slurm_cluster.sh stop     # cancels the cluster's jobs, stops what `start` started
#
# Debian / Ubuntu, as root. Every step is idempotent: `start` on a running cluster checks it and returns.
# Parts: munge (authentication), MariaDB with the database slurm_acct_db, slurmdbd (so that sacct answers: submitit
# polls job states with it), slurmctld and one slurmd, node `localhost` (127.0.0.1) with 2 CPUs in the default
# partition `debug`; cluster name `nanoeval`. No GPUs, one node (see README "Fan out as jobs").
# Configs go where Debian's Slurm commands read them (/etc/slurm/slurm.conf, /etc/slurm/slurmdbd.conf; sbatch,
# squeue, sacct find them without SLURM_CONF); a slurm.conf this script did not write is never touched (`start`
# stops with a message). Logs: /var/log/slurm/. What `start` started is recorded in /run/nano_eval_slurm/ so that
# `stop` stops that and nothing else (a MariaDB or munged that was already running is left running).
set -euo pipefail

CLUSTER=nanoeval
NODE=localhost
PARTITION=debug
CPUS=2
CONF_DIR=/etc/slurm
MARK="# written by nano_eval's scripts/slurm_cluster.sh"
STARTED=/run/nano_eval_slurm  # one empty file per daemon this script started
LOGS=/var/log/slurm
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)

say() { echo "slurm_cluster: $*"; }
die() { echo "slurm_cluster: error: $*" >&2; exit 2; }

wait_for() {  # wait_for SECONDS WHAT COMMAND...: run COMMAND every 0.5 s until it succeeds
    local seconds=$1 what=$2 i
    shift 2
    for ((i = 0; i < seconds * 2; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.5
    done
    die "$what did not come up within ${seconds}s (logs: $LOGS/, /var/log/mysql/)"
}

alive() {  # alive PIDFILE: the process the pid file names runs
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

munge_answers() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
mariadb_answers() { mysqladmin --silent ping >/dev/null 2>&1; }
slurmdbd_answers() { sacctmgr -n -P list cluster >/dev/null 2>&1; }
slurmctld_answers() { scontrol ping 2>/dev/null | grep -q "is UP"; }
node_idle() { [[ $(sinfo -h -n "$NODE" -o %T 2>/dev/null) =~ ^(idle|mixed|allocated)$ ]]; }

ours() {  # ours FILE: missing, or written by this script
    [[ ! -e $1 ]] || head -1 "$1" | grep -qF "$MARK"
}

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null || die "the packages ${missing[*]} are missing and there is no apt-get. Fix: install Slurm (slurmctld, slurmd, slurmdbd), munge and MariaDB with your system's package manager."
    say "installing ${missing[*]} (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    # the packages' own scripts would start their services (slurmctld without a configuration fails there): this
    # script starts them itself, so they are kept from starting during the install
    local policy=/usr/sbin/policy-rc.d created=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && created=1
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    if ((created)); then rm -f "$policy"; trap - EXIT; fi
}

write_configs() {
    ours "$CONF_DIR/slurm.conf" || die "$CONF_DIR/slurm.conf exists and was not written by this script (a real cluster's configuration?); it is left alone. Fix: run the Slurm tests on a machine without a Slurm configuration, or move it away first."
    ours "$CONF_DIR/slurmdbd.conf" || die "$CONF_DIR/slurmdbd.conf exists and was not written by this script; it is left alone. Fix: move it away first."
    mkdir -p "$CONF_DIR" "$LOGS" /var/spool/slurmctld /var/spool/slurmd
    chown slurm:slurm "$LOGS" /var/spool/slurmctld
    local password
    password=$(sed -n 's/^StoragePass=//p' "$CONF_DIR/slurmdbd.conf" 2>/dev/null || true)
    [[ -n $password ]] || password=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
    cat > "$CONF_DIR/slurm.conf.new" <<EOF
$MARK: a one-node test cluster
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
# no cgroups needed (containers, gVisor): processes are tracked by parent id
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# accounting, so that sacct answers (submitit polls job states with it)
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# a node set down by hand returns once resumed; a job on a failed node goes back to the queue
ReturnToService=2
JobRequeue=1
# quick clean-up after a cancel or requeue (the sweep tests cancel and requeue on purpose)
KillWait=5
MinJobAge=300
SlurmdParameters=config_overrides
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=4096 State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
    cat > "$CONF_DIR/slurmdbd.conf.new" <<EOF
$MARK: accounting for the one-node test cluster
AuthType=auth/munge
DbdHost=localhost
SlurmUser=slurm
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$password
StorageLoc=slurm_acct_db
LogFile=$LOGS/slurmdbd.log
PidFile=/run/slurmdbd.pid
EOF
    chmod 644 "$CONF_DIR/slurm.conf.new"
    chown slurm:slurm "$CONF_DIR/slurmdbd.conf.new"
    chmod 600 "$CONF_DIR/slurmdbd.conf.new"
    CONFIG_CHANGED=0
    cmp -s "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf" || CONFIG_CHANGED=1
    cmp -s "$CONF_DIR/slurmdbd.conf.new" "$CONF_DIR/slurmdbd.conf" || CONFIG_CHANGED=1
    mv "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf"
    mv "$CONF_DIR/slurmdbd.conf.new" "$CONF_DIR/slurmdbd.conf"
    DB_PASSWORD=$password
}

start_munge() {
    munge_answers && return 0
    [[ -s /etc/munge/munge.key ]] || runuser -u munge -- mungekey --create
    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- /usr/sbin/munged
    touch "$STARTED/munged"
    wait_for 30 munged munge_answers
}

start_mariadb() {
    if ! mariadb_answers; then
        mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
        setsid mysqld_safe --user=mysql </dev/null >/dev/null 2>&1 &
        touch "$STARTED/mariadb"
        wait_for 60 MariaDB mariadb_answers
    fi
    mysql -u root <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASSWORD';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASSWORD';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF
}

start_slurm() {
    if ((CONFIG_CHANGED)) && { alive /run/slurmctld.pid || alive /run/slurmd.pid || alive /run/slurmdbd.pid; }; then
        say "the configuration changed: restarting the Slurm daemons"
        stop_slurm_daemons
    fi
    if ! alive /run/slurmdbd.pid; then
        slurmdbd
        touch "$STARTED/slurmdbd"
    fi
    wait_for 60 slurmdbd slurmdbd_answers
    sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
    if ! alive /run/slurmctld.pid; then
        slurmctld
        touch "$STARTED/slurmctld"
    fi
    wait_for 60 slurmctld slurmctld_answers
    if ! alive /run/slurmd.pid; then
        slurmd -N "$NODE"
        touch "$STARTED/slurmd"
    fi
    wait_for 60 "node $NODE" sinfo -h -n "$NODE"
    # a node left down or drained (a test that took it down, a crash) is put back into service
    if [[ $(sinfo -h -n "$NODE" -o %T) =~ (down|drain|fail) ]]; then
        scontrol update NodeName="$NODE" State=RESUME
    fi
    wait_for 60 "node $NODE (idle)" node_idle
}

start() {
    ((EUID == 0)) || die "run as root: sudo bash $0 start"
    install_packages
    mkdir -p "$STARTED"
    write_configs
    start_munge
    start_mariadb
    start_slurm
    say "up: cluster $CLUSTER, partition $PARTITION ($CPUS CPUs on node $NODE), accounting in MariaDB (sacct)"
    say "stop it with: sudo bash $0 stop"
}

stop_pidfile() {  # stop_pidfile NAME PIDFILE
    local pid i
    alive "$2" || return 0
    pid=$(cat "$2")
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 60; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
    say "$1 (pid $pid) did not stop on SIGTERM: killing it"
    kill -9 "$pid" 2>/dev/null || true
}

stop_slurm_daemons() {  # jobs keep their state (StateSaveLocation) across a restart
    stop_pidfile slurmd /run/slurmd.pid
    stop_pidfile slurmctld /run/slurmctld.pid
    stop_pidfile slurmdbd /run/slurmdbd.pid
    rm -f "$STARTED/slurmd" "$STARTED/slurmctld" "$STARTED/slurmdbd"
}

stop() {
    ((EUID == 0)) || die "run as root: sudo bash $0 stop"
    if ! ours "$CONF_DIR/slurm.conf"; then
        die "$CONF_DIR/slurm.conf was not written by this script: not stopping anything"
    fi
    if slurmctld_answers; then  # a job's processes outlive slurmd: cancel them first, leave nothing running
        local jobs i
        jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
        if [[ -n ${jobs// /} ]]; then
            say "cancelling jobs $jobs"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for ((i = 0; i < 60; i++)); do
                [[ -z $(squeue -h -t running,completing -o %A 2>/dev/null) ]] && break
                sleep 0.5
            done
        fi
    fi
    stop_slurm_daemons
    if [[ -e $STARTED/mariadb ]]; then
        mysqladmin shutdown 2>/dev/null || true
        rm -f "$STARTED/mariadb"
    fi
    if [[ -e $STARTED/munged ]]; then
        stop_pidfile munged /run/munge/munged.pid
        rm -f "$STARTED/munged"
    fi
    say "stopped"
}

status() {
    local name pidfile state=0
    for name in munged:/run/munge/munged.pid slurmdbd:/run/slurmdbd.pid slurmctld:/run/slurmctld.pid \
        slurmd:/run/slurmd.pid; do
        pidfile=${name#*:}
        if alive "$pidfile"; then say "${name%%:*}: running (pid $(cat "$pidfile"))"; else say "${name%%:*}: not running"; fi
    done
    if mariadb_answers; then say "mariadb: answers"; else say "mariadb: does not answer"; fi
    if sinfo -h >/dev/null 2>&1; then sinfo; else say "sinfo does not answer"; state=1; fi
    if sacct -n -X -S now-1minutes >/dev/null 2>&1; then say "sacct answers"; else say "sacct does not answer"; state=1; fi
    return $state
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: sudo bash $0 start|stop|status" >&2; exit 2 ;;
esac
