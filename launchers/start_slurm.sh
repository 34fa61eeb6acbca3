#!/usr/bin/env bash
# Start (or check) a one-node SLURM cluster on this machine, for trying kdexp sweeps locally and for the SLURM
# tests (.ci/run calls it before `make test`).
#
#   bash launchers/start_slurm.sh      # progress on stderr; the last stdout line is the partition name
#   bash launchers/stop_slurm.sh       # stops the daemons this script started
#
# Idempotent: when munged, slurmctld and slurmd already run with the configuration this script would write and the
# node answers, it only prints the partition and returns within a second or two. Otherwise it installs the Debian
# packages slurm-wlm + munge (apt-get) if missing, writes a munge key and /etc/slurm/slurm.conf, (re)starts the
# daemons and waits until `sinfo` shows the node usable. Needs root (or sudo) the first time.
#
# Environment: KDEXP_SLURM_PARTITION (default debug), KDEXP_SLURM_WAIT_S (default 90).
set -euo pipefail

PARTITION="${KDEXP_SLURM_PARTITION:-debug}"
WAIT_S="${KDEXP_SLURM_WAIT_S:-90}"
CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
NODE="$(hostname -s 2>/dev/null || uname -n | cut -d. -f1)"
LOG_DIR=/var/log/slurm

say() { echo "[start_slurm] $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
fi
as_root() { if [ -n "$SUDO" ]; then $SUDO "$@"; else "$@"; fi; }

# --- what slurm.conf should say on this machine ------------------------------------------------------------------
# nproc obeys OMP_NUM_THREADS and OMP_THREAD_LIMIT (a test worker or a job step sets them): count the CPUs without.
ncpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
mem_mb="$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)"  # what `free -m` reports, without procps
# slurmd drains a node whose real memory is below RealMemory; leave a margin for what the kernel reserves.
real_mem=$(( mem_mb * 95 / 100 ))

desired_conf() {
  cat <<EOF
# Written by launchers/start_slurm.sh: a one-node SLURM cluster for local sweeps. Rewritten when it differs.
ClusterName=kdexp
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# No cgroups in containers: track processes through /proc and do not bind tasks (22.05 has no CgroupPlugin=disabled).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# CPUs are consumable, memory is not: jobs without --mem must not each reserve the whole node.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# A node that was down (e.g. the machine restarted) comes back by itself once slurmd registers.
ReturnToService=2
JobRequeue=1
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
Waittime=0
NodeName=${NODE} NodeAddr=127.0.0.1 NodeHostname=${NODE} CPUs=${ncpus} RealMemory=${real_mem} State=UNKNOWN
PartitionName=${PARTITION} Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP
EOF
}

# Node states in which jobs can start ("idle", "mixed", "allocated", possibly with a suffix like "idle*" stripped).
node_state() { sinfo -h -N -n "$NODE" -p "$PARTITION" -o '%T' 2>/dev/null | head -n1 | tr -d '*~#$@+' || true; }
node_ok() { case "$(node_state)" in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac; }
# pid_alive PIDFILE: the pid in the file runs the daemon the file is named after (a pid file left by a killed daemon
# or a restarted container may hold a pid that another process has since been given).
pid_alive() {
  local pid name
  pid="$(cat "$1" 2>/dev/null)" || return 1
  name="$(basename "$1" .pid)"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]
}
munge_ok() { command -v munge >/dev/null 2>&1 && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

# --- fast path: everything already up with this configuration ----------------------------------------------------
if [ -f "$CONF" ] && command -v sinfo >/dev/null 2>&1 && diff -q <(desired_conf) "$CONF" >/dev/null 2>&1 \
   && munge_ok && pid_alive /run/slurmctld.pid && pid_alive /run/slurmd.pid && node_ok; then
  say "already running: node $NODE is $(node_state)"
  echo "$PARTITION"
  exit 0
fi

if [ "$(id -u)" -ne 0 ] && [ -z "$SUDO" ]; then
  die "SLURM is not running and this script needs root (or sudo) to install and start it"
fi

# --- install -------------------------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  say "installing slurm-wlm and munge (apt-get)"
  # Keep the packages' postinst from starting daemons with their own (missing) configuration: we start them below.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
    as_root chmod 755 /usr/sbin/policy-rc.d
    trap 'as_root rm -f /usr/sbin/policy-rc.d' EXIT  # also when apt-get fails: never leave it behind
  fi
  as_root apt-get update -qq >&2 || die "apt-get update failed (no network or no package mirror?)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >&2 \
    || die "apt-get install slurm-wlm munge failed"
  as_root rm -f /usr/sbin/policy-rc.d
  trap - EXIT
  for bin in slurmctld slurmd munged sinfo scontrol; do
    command -v "$bin" >/dev/null 2>&1 || die "$bin is missing after installing slurm-wlm and munge"
  done
fi

# --- munge -----------------------------------------------------------------------------------------------------------
as_root mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  say "writing a munge key"
  as_root dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
as_root chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
as_root chmod 0700 /etc/munge /var/lib/munge /var/log/munge
as_root chmod 0755 /run/munge
as_root chmod 0400 /etc/munge/munge.key
if ! munge_ok; then
  say "starting munged as user munge"
  # A stale socket or pid file from a killed munged makes the new one refuse to start.
  if ! pid_alive /run/munge/munged.pid; then as_root rm -f /run/munge/munged.pid /run/munge/munge.socket.2*; fi
  as_root runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 1 20); do munge_ok && break; sleep 0.5; done
  munge_ok || die "munged does not answer (see /var/log/munge/munged.log)"
fi

# --- slurm.conf + daemons --------------------------------------------------------------------------------------------
as_root mkdir -p "$CONF_DIR" /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR"
restart=0
if ! diff -q <(desired_conf) "$CONF" >/dev/null 2>&1; then
  say "writing $CONF (node $NODE, $ncpus CPUs, ${real_mem} MB)"
  desired_conf | as_root tee "$CONF.tmp" >/dev/null
  as_root mv -f "$CONF.tmp" "$CONF"
  restart=1
fi

stop_daemon() {  # stop_daemon NAME PIDFILE: by the pid the daemon itself wrote, never by name
  if pid_alive "$2"; then
    say "stopping $1 (pid $(cat "$2")) to apply the new configuration"
    as_root kill "$(cat "$2")" || true
    for _ in $(seq 1 40); do pid_alive "$2" || break; sleep 0.25; done
  fi
}
if [ "$restart" = 1 ]; then
  stop_daemon slurmd /run/slurmd.pid
  stop_daemon slurmctld /run/slurmctld.pid
fi

if ! pid_alive /run/slurmctld.pid; then
  say "starting slurmctld"
  as_root /usr/sbin/slurmctld
fi
for _ in $(seq 1 40); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.5; done
scontrol ping 2>/dev/null | grep -q UP || die "slurmctld does not answer (see $LOG_DIR/slurmctld.log)"

if ! pid_alive /run/slurmd.pid; then
  say "starting slurmd -N $NODE"
  as_root /usr/sbin/slurmd -N "$NODE"
fi

# --- wait for the node ------------------------------------------------------------------------------------------------
deadline=$(( $(date +%s) + WAIT_S ))
resumed=0
until node_ok; do
  state="$(node_state)"
  case "$state" in
    drain*|drained|down|fail*|inval*)
      # A node drained by an earlier run (e.g. "Kill task failed", a previous RealMemory) is usable once resumed.
      if [ "$resumed" = 0 ]; then
        say "node $NODE is $state: resuming it"
        as_root scontrol update nodename="$NODE" state=resume >&2 || true
        resumed=1
      fi ;;
  esac
  if [ "$(date +%s)" -ge "$deadline" ]; then
    sinfo -N -l >&2 || true
    die "node $NODE not usable after ${WAIT_S}s (state '$state'; see $LOG_DIR/slurmd.log and slurmctld.log)"
  fi
  sleep 1
done
say "ready: node $NODE is $(node_state), $ncpus CPUs, partition $PARTITION (Default=YES)"
echo "$PARTITION"
