#!/usr/bin/env bash
# Starts a one-node Slurm cluster on this machine (as root), for testing multi-process launches:
#
#   sudo scripts/slurm/local_cluster.sh [--install]     # then: srun -n 2 ..., sbatch ..., sinfo
#   sudo scripts/slurm/local_cluster.sh --stop
#
# --install first installs the Debian packages (slurmctld slurmd slurm-client munge). The node has all of
# this machine's CPUs; processes are tracked without cgroups (proctrack/linuxproc, task/none), so it also
# works inside a container. Running it again restarts the daemons with a fresh configuration.
set -euo pipefail

if [[ $(id -u) != 0 ]]; then
  echo "error: the local Slurm cluster is started as root; run this script with sudo." >&2
  exit 2
fi
if [[ ${1:-} == --stop ]]; then
  pkill -x slurmd || true
  pkill -x slurmctld || true
  exit 0
fi
if [[ ${1:-} == --install ]]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null; }
fi
for tool in slurmctld slurmd sinfo munged; do
  if ! command -v "$tool" >/dev/null; then
    echo "error: $tool is not installed; run this script with --install (Debian packages slurmctld slurmd slurm-client munge)." >&2
    exit 2
  fi
done

node=$(hostname -s)
# processes reach the coordinator by the node's name (the first of SLURM_STEP_NODELIST)
getent hosts "$node" >/dev/null || echo "127.0.0.1 $node" >>/etc/hosts
cpus=$(nproc)
memory_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))

# munge authenticates slurm's messages; the package creates the key
if [[ ! -s /etc/munge/munge.key ]]; then
  mungekey --create --force 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! pgrep -x munged >/dev/null; then
  runuser -u munge -- munged
fi

pkill -x slurmd || true
pkill -x slurmctld || true
sleep 1
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat >/etc/slurm/slurm.conf <<EOF
ClusterName=jaxtron-local
SlurmctldHost=${node}
SlurmUser=root
AuthType=auth/munge
# a requeued job may start again only once its old credentials have expired (default 120 s); a one-node
# test cluster needs far less than that
AuthInfo=cred_expire=20
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=10
NodeName=${node} CPUs=${cpus} RealMemory=${memory_mb} State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF

slurmctld -i
slurmd
for _ in $(seq 60); do
  if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
    sinfo
    exit 0
  fi
  sleep 1
done
echo "error: the local Slurm node did not come up within 60 s; see /var/log/slurm/slurmctld.log and slurmd.log." >&2
exit 1
