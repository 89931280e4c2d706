#!/usr/bin/env bash
# Start a real multi-node SLURM cluster on this machine: munged (own key and socket), slurmctld, and one slurmd
# per emulated node (node1-node4: Feature=trainer, node5: Feature=generation), all on loopback addresses.
#   infra/cluster/start.sh [STATE_DIR]      (default: /tmp/rloo-slurm)   -> prints `export SLURM_CONF=...` lines
# Stop with infra/cluster/stop.sh [STATE_DIR]. Needs root (daemons, /etc/hosts); installs Debian's slurm and
# munge packages when they are missing.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
STATE="${1:-${RLOO_SLURM_DIR:-/tmp/rloo-slurm}}"
NODES="${RLOO_SLURM_TRAINER_NODES:-4}"
PORT_BASE="${RLOO_SLURM_PORT_BASE:-17000}"

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null
fi
if [ -f "$STATE/slurmctld.pid" ] && kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null; then
  echo "export SLURM_CONF=$STATE/slurm.conf"
  echo "export PATH=$HERE/bin:\$PATH"
  exit 0  # already running
fi
mkdir -p "$STATE"/{munge,spool,state,log}
chmod 755 "$STATE/munge"

# --- munge: its own key, socket and pid file (nothing in /etc or /run)
if [ ! -f "$STATE/munge/munge.key" ]; then
  dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$STATE/munge/munge.key"
fi
munged --force --key-file="$STATE/munge/munge.key" --socket="$STATE/munge/munge.socket" \
  --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/munged.seed"

# --- node names resolve to loopback addresses (removed by stop.sh)
total=$((NODES + 1))
for i in $(seq 1 "$total"); do
  if ! grep -q "^127.0.0.$((10 + i)) node$i # rloo-slurm" /etc/hosts; then
    echo "127.0.0.$((10 + i)) node$i # rloo-slurm" >> /etc/hosts
  fi
done

# --- slurm.conf
# cred_expire: how long a requeued job waits before it may start again (SLURM's default, 120 s, is
# for credentials crossing a real network; every daemon here is on loopback)
{
  cat <<CONF
ClusterName=rloo-local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$PORT_BASE
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket,cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
EnforcePartLimits=ALL
MinJobAge=3600
ReturnToService=2
MpiDefault=none
KillWait=5
InactiveLimit=0
PreemptType=preempt/none
SlurmctldParameters=preempt_send_user_signal
CONF
  for i in $(seq 1 "$NODES"); do
    echo "NodeName=node$i NodeAddr=127.0.0.$((10 + i)) NodeHostname=node$i Port=$((PORT_BASE + i)) CPUs=2 RealMemory=4000 Feature=trainer State=UNKNOWN"
  done
  echo "NodeName=node$total NodeAddr=127.0.0.$((10 + total)) NodeHostname=node$total Port=$((PORT_BASE + total)) CPUs=2 RealMemory=4000 Feature=generation State=UNKNOWN"
  echo "PartitionName=debug Nodes=node[1-$total] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
} > "$STATE/slurm.conf"
export SLURM_CONF="$STATE/slurm.conf"

slurmctld -f "$SLURM_CONF"
for i in $(seq 1 "$total"); do
  # each slurmd in its own UTS namespace, so `hostname` inside a job says nodeN
  unshare --uts sh -c "hostname node$i; exec slurmd -f '$SLURM_CONF' -N node$i"
done

for _ in $(seq 1 60); do
  if [ "$(sinfo -h -o '%T' 2>/dev/null | grep -c idle || true)" -ge 1 ] && \
     [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c idle)" -ge "$total" ]; then
    echo "export SLURM_CONF=$SLURM_CONF"
    echo "export PATH=$HERE/bin:\$PATH"
    exit 0
  fi
  sleep 0.5
done
echo "cluster did not come up; see $STATE/log" >&2
sinfo -N >&2 || true
exit 1
