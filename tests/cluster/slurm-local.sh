#!/bin/bash
# A one-node Slurm cluster for CI on Debian 12 (bookworm): root, no systemd, no cgroups, no GPU.
#
#   bash slurm-local.sh up      # install (apt), configure, start munged + slurmctld + slurmd
#   bash slurm-local.sh down    # stop the daemons, remove the network namespace
#
# The project's copy of ../shared/cluster/slurm-local.sh (CI clones have no ../shared), used by
# tests/integration/test_slurm_cluster.py. Its one addition: KILL_WAIT (KillWait, the seconds
# between a job's SIGTERM and its SIGKILL; 120 here, Slurm's default is 30), so that a plain
# scancel of a 2-core toy run leaves time for the orderly stop of examples/cluster/slurm.
#
# Slurm commands then run inside the cluster's network namespace (see NETNS):
#   nsenter --net=/run/netns/slurmci sinfo     (or the wrapper this script writes: slurmci sinfo)
#
# What the node claims (Slurm only schedules by these numbers, nothing is enforced):
#   FAKE_CPUS (32) CPUs, whatever the machine has  -> jobs with --cpus-per-task=8 fit on 2 cores
#   FAKE_GPUS (8)  GPUs as /dev/null-like device nodes -> --gres=gpu:N is accepted, CUDA_VISIBLE_DEVICES set
# NETNS (slurmci): slurmctld/slurmd (and every job) run in a private network namespace that has
# only the loopback interface, so their 0.0.0.0 listeners (Slurm's, a job's) reach nothing else.
# NETNS= (empty) runs them in the host's namespace instead (they then listen on every interface).
set -euo pipefail
trap 'echo "[slurm-ci] failed (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR
ACTION=${1:-up}
NODE=$(hostname -s)
FAKE_CPUS=${FAKE_CPUS:-32}
FAKE_GPUS=${FAKE_GPUS:-8}
MEM_MB=${MEM_MB:-$(awk '/MemTotal/ {print int($2 / 1024 * 3 / 4)}' /proc/meminfo)}
PARTITION=${PARTITION:-debug}
KILL_WAIT=${KILL_WAIT:-120}
NETNS=${NETNS-slurmci}
IN=()
# nsenter, not `ip netns exec`: the latter mounts a fresh /sys, hiding /sys/fs/cgroup, and slurmd
# then stops with "No filesystem mounted on /sys/fs/cgroup ... slurmd initialization failed"
[[ -n "$NETNS" ]] && IN=(nsenter --net=/run/netns/"$NETNS")

down() {
  "${IN[@]}" scontrol shutdown 2>/dev/null || true          # stops slurmctld and slurmd
  for _ in $(seq 1 20); do pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || break; sleep 0.5; done
  # stale pid files make Debian's slurmctld prerm run scancel (and fail) on a later apt purge
  rm -f /run/slurmctld.pid /run/slurmd.pid
  [[ -s /run/munge/munged.pid ]] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
  [[ -n "$NETNS" ]] && ip netns del "$NETNS" 2>/dev/null || true
  return 0
}
if [[ "$ACTION" == down ]]; then down; exit 0; fi

t0=$SECONDS
# 1. packages (Slurm 22.05.8 on bookworm). The postinst cannot start services (no systemd): fine.
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v ip >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge iproute2 >/dev/null
fi
echo "[slurm-ci] packages ready ($((SECONDS - t0)) s): $(slurmctld -V)"

# 2. munge (Slurm's authentication): the postinst made /etc/munge/munge.key
[[ -s /etc/munge/munge.key ]] || runuser -u munge -- mungekey --create
install -d -o munge -g munge -m 0755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
fi
munge -n | unmunge >/dev/null
echo "[slurm-ci] munged up"

# 3. the network namespace (loopback only)
if [[ -n "$NETNS" ]]; then
  [[ -e /run/netns/$NETNS ]] || ip netns add "$NETNS"
  ip -n "$NETNS" link set lo up
  # A second loopback address: with only 127.0.0.1, glibc's getaddrinfo(AI_ADDRCONFIG) finds "no
  # IPv4 configured" and slurmctld loops on "get_addr_info: getaddrinfo() failed: Name or service
  # not known" without ever listening.
  ip -n "$NETNS" addr replace 127.0.0.2/32 dev lo
  cat > /usr/local/bin/slurmci <<EOF
#!/bin/sh
# run a command inside the local Slurm cluster's network namespace
exec nsenter --net=/run/netns/$NETNS "\$@"
EOF
  chmod 755 /usr/local/bin/slurmci
fi

# 4. configuration: no accounting DB, no cgroups (proctrack/linuxproc, task/none), fake CPUs/GPUs
mkdir -p /etc/slurm /var/spool/slurmd /var/lib/slurm-fakegpu
install -d -o slurm -g slurm /var/spool/slurmctld /var/log/slurm
for ((i = 0; i < FAKE_GPUS; i++)); do
  [[ -e /var/lib/slurm-fakegpu/nvidia$i ]] || mknod /var/lib/slurm-fakegpu/nvidia$i c 1 3
done
cat > /etc/slurm/slurm.conf <<EOF
# One-node Slurm for CI (written by slurm-local.sh)
ClusterName=ci
SlurmctldHost=$NODE(127.0.0.1)
AuthType=auth/munge
CredType=cred/munge
SlurmUser=slurm
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
KillWait=$KILL_WAIT
GresTypes=gpu
# the node as configured, not as detected: no drain for "less than configured" hardware
SlurmdParameters=config_overrides
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$FAKE_CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$FAKE_CPUS ThreadsPerCore=1 RealMemory=$MEM_MB Gres=gpu:$FAKE_GPUS State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
# Slurm drops a GPU without File= ("Removing file-less GPU") and rejects regular files ("not a
# valid character or block device"): device nodes with /dev/null's numbers (made above).
cat > /etc/slurm/gres.conf <<EOF
NodeName=$NODE Name=gpu File=/var/lib/slurm-fakegpu/nvidia[0-$((FAKE_GPUS - 1))]
EOF

# 5. the daemons (each forks into the background; logs in /var/log/slurm)
"${IN[@]}" slurmctld
"${IN[@]}" slurmd
state=""
for _ in $(seq 1 60); do
  state=$("${IN[@]}" sinfo -h -N -n "$NODE" -o %T 2>/dev/null || true)
  [[ "$state" == idle ]] && break
  sleep 1
done
if [[ "$state" != idle ]]; then
  echo "[slurm-ci] node $NODE is '$state', not idle:" >&2
  "${IN[@]}" sinfo -N -o "%N %T %E" >&2 || true
  tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2
  exit 1
fi
"${IN[@]}" srun -N1 hostname >/dev/null                   # smoke test: a job step runs
for _ in $(seq 1 20); do                                     # back to idle after the step
  [[ "$("${IN[@]}" sinfo -h -N -n "$NODE" -o %T)" == idle ]] && break
  sleep 0.5
done
"${IN[@]}" sinfo -N -o "%N %P %c %G %T"
echo "[slurm-ci] up in $((SECONDS - t0)) s; run Slurm commands as: ${IN[*]:+${IN[*]} }sbatch ..."
