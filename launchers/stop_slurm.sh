#!/usr/bin/env bash
# Stop the one-node SLURM cluster started by start_slurm.sh: slurmd, slurmctld, then munged, each by the pid in the
# pid file the daemon wrote (never by process name). Jobs still running are cancelled first. Safe to run twice.
set -uo pipefail

say() { echo "[stop_slurm] $*" >&2; }
SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
as_root() { if [ -n "$SUDO" ]; then $SUDO "$@"; else "$@"; fi; }
# The pid in the file runs the daemon the file is named after: a stale pid file must not make us kill another process.
pid_alive() {
  local pid
  pid="$(cat "$1" 2>/dev/null)" || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$(basename "$1" .pid)" ]
}

if command -v scancel >/dev/null 2>&1 && pid_alive /run/slurmctld.pid; then
  as_root scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
fi
for spec in slurmd:/run/slurmd.pid slurmctld:/run/slurmctld.pid munged:/run/munge/munged.pid; do
  name="${spec%%:*}"; pidfile="${spec#*:}"
  if pid_alive "$pidfile"; then
    pid="$(cat "$pidfile")"
    say "stopping $name (pid $pid)"
    as_root kill "$pid"
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    if kill -0 "$pid" 2>/dev/null; then say "$name (pid $pid) still alive after 10s: sending KILL"; as_root kill -9 "$pid"; fi
  else
    say "$name not running"
  fi
done
