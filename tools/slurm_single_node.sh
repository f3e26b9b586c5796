#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine (Debian's slurm-wlm + munge, as root), so that
# tests/test_launchers.py can submit a real sweep through hydra/launcher=slurm. Not run by CI:
# `apt-get install -y slurm-wlm munge`, then `bash tools/slurm_single_node.sh`.
set -euo pipefail
host=$(hostname -s)
cpus=$(nproc)
mem=$(( $(free -m | awk "/^Mem:/{print \$2}") * 9 / 10 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /etc/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=dpsgd-local
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
MpiDefault=none
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
chown -R munge:munge /etc/munge /run/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || munged --force
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 30); do sinfo -h -o "%P %a" 2>/dev/null | grep -q " up" && break; sleep 1; done
sinfo
