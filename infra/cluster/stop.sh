#!/usr/bin/env bash
# Stop the local cluster started by start.sh: daemons by PID, /etc/hosts lines removed, state kept unless --purge.
set -uo pipefail
STATE="${1:-${RLOO_SLURM_DIR:-/tmp/rloo-slurm}}"
for pidfile in "$STATE"/slurmd-*.pid "$STATE/slurmctld.pid" "$STATE/munge/munged.pid"; do
  [ -f "$pidfile" ] || continue
  pid="$(cat "$pidfile")"
  kill "$pid" 2>/dev/null
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null
  rm -f "$pidfile"
done
sed -i '/# rloo-slurm$/d' /etc/hosts
if [ "${2:-}" = "--purge" ]; then rm -rf "$STATE"; fi
