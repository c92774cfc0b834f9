#!/usr/bin/env bash
# A real Slurm cluster of N nodes on one machine, for tests: Debian 12's Slurm 22.05, or
# Debian 13 (trixie)'s Slurm 24.11 in a root directory of its own.
#
#   cluster.sh up       install missing packages, start munged, MariaDB, slurmdbd,
#                       slurmctld and N slurmd (node1..nodeN) from an empty state dir
#   cluster.sh down     stop everything `up` started, by PID; idempotent (any version)
#   cluster.sh status   say whether it is up (sinfo)
#   cluster.sh exec CMD run CMD inside the Slurm version's root (24.11: where its clients
#                       and the tests must run; 22.05: here), in the current directory
#   cluster.sh ctld-stop / ctld-start
#                       stop slurmctld alone (a controller gone while jobs run), start it again
#   cluster.sh lose NODE / node-up NODE
#                       a hard loss of NODE (its slurmd and all under it killed at once, as in
#                       a power cut), and its slurmd started again
#
# Version: ${MJLAB_HPC_SLURM_VERSION:-22.05}. 24.11 runs in a trixie root made with mmdebstrap
# and cached under ${MJLAB_HPC_CACHE_DIR:-/var/cache/mjlab-hpc} (keyed by its package list),
# entered through a private mount namespace that binds /tmp, $HOME, this repository and the
# Python of its .venv at the same paths, so the project's own environment runs inside it
# (22.05 clients cannot talk to 24.11 daemons). MJLAB_HPC_ROOT_BINDS: more folders, ':'-separated.
# N: ${MJLAB_HPC_CLUSTER_NODES:-2} (1-64), read by `up` (saved in <state>/node-count); `down`
# stops whatever nodes were started, whatever their count. SlurmdTimeout (how long a silent
# node lives on before Slurm calls it DOWN): ${MJLAB_HPC_CLUSTER_SLURMD_TIMEOUT:-300} s.
# State: ${MJLAB_HPC_CLUSTER_DIR:-${TMPDIR:-/tmp}/mjlab-hpc-cluster}. Clients need
# `source <state>/env.sh` (SLURM_CONF). Needs root: it starts daemons, mknods fake GPUs
# and bind-mounts a hosts file in a private mount namespace.
set -euo pipefail
export LC_ALL=C
# Daemons live in sbin, which a non-login shell may not have on PATH.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

STATE="${MJLAB_HPC_CLUSTER_DIR:-${TMPDIR:-/tmp}/mjlab-hpc-cluster}"
[[ $STATE == /* ]] || STATE="$PWD/$STATE"
STATE="${STATE%/}"
readonly STATE
readonly MARKER="$STATE/.mjlab-hpc-cluster"
readonly MAX_NODES=64
readonly GPUS_PER_NODE=4
readonly CPUS_PER_NODE=8
readonly MEM_PER_NODE_MB=4096
readonly CLUSTER_NAME=mjlab
readonly PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server-core
  mariadb-client-core tini)
readonly BINARIES=(slurmctld slurmd sinfo srun sbatch scontrol sacct sacctmgr munge munged
  slurmdbd mariadbd mariadb-install-db mariadb tini)
readonly IDLE_TIMEOUT_S=60
readonly DB_TIMEOUT_S=60
readonly SLURM_VERSION=${MJLAB_HPC_SLURM_VERSION:-22.05}
# 1: proctrack/cgroup and task/cgroup with ConstrainDevices (cgroup v1), else pgid and none.
readonly CGROUP=${MJLAB_HPC_CLUSTER_CGROUP:-0}
readonly SLURMD_TIMEOUT=${MJLAB_HPC_CLUSTER_SLURMD_TIMEOUT:-300}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
readonly REPO
readonly SCRIPT=$REPO/tests/cluster/cluster.sh
# 24.11: Debian trixie's packages in a root of their own. The project's Python comes from the
# host (bound in at the same path): a second Python there would need torch again (trixie's
# Python 3.13 gets PyPI's CUDA build, 5.7 GB). git: rsl-rl imports GitPython; libEGL and
# libGL: mujoco loads them when it is imported.
readonly ROOT_SUITE=trixie
readonly ROOT_PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server-core
  mariadb-client-core tini git procps libegl1 libgl1)

log() { printf 'cluster.sh: %s\n' "$*" >&2; }

case $SLURM_VERSION in
  22.05 | 24.11) ;;
  *)
    printf 'cluster.sh: MJLAB_HPC_SLURM_VERSION=%s: 22.05 (Debian 12) or 24.11 (trixie root)\n' \
      "$SLURM_VERSION" >&2
    exit 2
    ;;
esac

# N of node1..nodeN for `up`: MJLAB_HPC_CLUSTER_NODES (default 2).
node_count() {
  local n=${MJLAB_HPC_CLUSTER_NODES:-2}
  if [[ ! $n =~ ^[0-9]+$ ]] || ((n < 1 || n > MAX_NODES)); then
    printf 'cluster.sh: MJLAB_HPC_CLUSTER_NODES=%s: a node count from 1 to %d\n' "$n" \
      "$MAX_NODES" >&2
    exit 2
  fi
  echo "$((10#$n))"
}

# Microseconds since the epoch, without forking (bash 5).
now_us() {
  local t=$EPOCHREALTIME
  echo "${t//[.,]/}"
}

# Seconds since a now_us value, with two decimals.
since() {
  local d=$(($(now_us) - $1))
  printf '%d.%02d' $((d / 1000000)) $(((d % 1000000) / 10000))
}

# Process state letter (R, S, Z, ...) of a PID; fails when there is no such process.
proc_state() {
  local stat
  { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 1
  stat=${stat##*) }
  printf '%s' "${stat%% *}"
}

# A zombie only waits for its parent (often PID 1, which reaps slowly): count it as stopped.
alive() {
  local s
  s=$(proc_state "$1") || return 1
  [[ $s != Z && $s != X ]]
}

read_pid() {
  local p
  { read -r p <"$1"; } 2>/dev/null || return 1
  [[ $p =~ ^[0-9]+$ ]] || return 1
  echo "$p"
}

# Only signal PIDs that carry this cluster's id in their environment: a pid file can be
# stale and its PID reused by an unrelated process.
owned() {
  [[ -n ${CLUSTER_ID:-} ]] || return 1
  grep -qzxF -e "MJLAB_HPC_CLUSTER_ID=$CLUSTER_ID" -e "SLURM_CONF=$STATE/etc/slurm.conf" \
    "/proc/$1/environ" 2>/dev/null
}

# Live, owned PIDs from the named pid files in $STATE/run.
pids_of() {
  local name p
  for name in "$@"; do
    p=$(read_pid "$STATE/run/$name.pid") || continue
    if alive "$p" && owned "$p"; then echo "$p"; fi
  done
}

# Wait until none of the PIDs is alive, up to $1 seconds; fails if some are left.
wait_gone() {
  local timeout_s=$1 deadline p left
  shift
  deadline=$(($(now_us) + timeout_s * 1000000))
  while :; do
    left=0
    for p in "$@"; do
      if alive "$p"; then left=1; fi
    done
    ((left)) || return 0
    (($(now_us) < deadline)) || return 1
    sleep 0.05
  done
}

# SIGTERM, wait by the clock, then SIGKILL what is left.
stop_pids() {
  local timeout_s=$1 p
  shift
  (($#)) || return 0
  kill -TERM "$@" 2>/dev/null || true
  wait_gone "$timeout_s" "$@" && return 0
  local left=()
  for p in "$@"; do
    if alive "$p"; then left+=("$p"); fi
  done
  log "SIGKILL after ${timeout_s}s: ${left[*]}"
  kill -KILL "${left[@]}" 2>/dev/null || true
  wait_gone 5 "${left[@]}" || log "still alive after SIGKILL: ${left[*]}"
}

# Live PIDs whose mount namespace is $1 (a string like mnt:[4026532123]).
ns_pids() {
  local pat=$1 f p
  pat=${pat//[/\\[}
  pat=${pat//]/\\]}
  # One find instead of a readlink per process.
  while read -r f; do
    p=${f#/proc/}
    p=${p%%/*}
    [[ $p == "$$" ]] && continue
    if alive "$p"; then echo "$p"; fi
  done < <(find /proc/[0-9]*/ns -maxdepth 1 -name mnt -lname "$pat" 2>/dev/null || true)
}

# A leftover namespace is ours only if one of its processes carries our id or SLURM_CONF;
# its inode number could otherwise belong to a newer namespace (another cluster's).
ns_is_ours() {
  local ns=$1 p
  [[ -n $ns && $ns != "$(readlink /proc/self/ns/mnt)" ]] || return 1
  for p in $(ns_pids "$ns"); do
    if owned "$p"; then return 0; fi
  done
  return 1
}

do_down() {
  if [[ ! -f $MARKER ]]; then
    echo "nothing to stop in $STATE"
    return 0
  fi
  local t0 ns="" stage1 stage2 stage3 left
  t0=$(now_us)
  CLUSTER_ID=$(cat "$STATE/cluster-id" 2>/dev/null || true)
  rm -f "$STATE/env.sh"
  # Decide now, while the namespace holder still runs, whether its namespace is ours.
  ns=$(cat "$STATE/run/mntns" 2>/dev/null || true)
  if ! ns_is_ours "$ns"; then ns=""; fi

  # Stage 1: slurmctld and the slurmds (tini forwards SIGTERM to its slurmd), of every node
  # that has a pid file: down needs no node count.
  local f nodes=()
  for f in "$STATE"/run/tini-*.pid "$STATE"/run/slurmd-*.pid; do
    [[ -e $f ]] || continue
    f=${f##*/}
    nodes+=("${f%.pid}")
  done
  mapfile -t stage1 < <(pids_of slurmctld "${nodes[@]}")
  stop_pids 10 "${stage1[@]}"
  # Job processes (slurmstepd, anything that escaped its process group) live on in the
  # slurmds' namespace: end them by PID until none is left.
  if [[ -n $ns ]]; then
    local deadline=$(($(now_us) + 10 * 1000000))
    while :; do
      mapfile -t left < <(ns_pids "$ns")
      ((${#left[@]})) || break
      if (($(now_us) > deadline)); then
        log "namespace processes left: ${left[*]}"
        break
      fi
      kill -KILL "${left[@]}" 2>/dev/null || true
      wait_gone 1 "${left[@]}" || true
    done
  fi
  mapfile -t left < <(pids_of nodes)
  stop_pids 2 "${left[@]}"

  # Stage 2: slurmdbd and munged; stage 3: MariaDB, last, as slurmdbd writes to it.
  mapfile -t stage2 < <(pids_of slurmdbd munged)
  stop_pids 10 "${stage2[@]}"
  mapfile -t stage3 < <(pids_of mariadbd)
  stop_pids 30 "${stage3[@]}"

  rm -f "$STATE"/run/*
  printf 'cluster down in %s s (%s)\n' "$(since "$t0")" "$STATE"
}

# Up if env.sh exists, our slurmctld runs and answers. The process check comes first: sinfo
# against a dead controller retries for ~9 s before it gives up.
is_up() {
  [[ -f $STATE/env.sh ]] && command -v sinfo >/dev/null || return 1
  CLUSTER_ID=$(cat "$STATE/cluster-id" 2>/dev/null || true)
  [[ -n $(pids_of slurmctld) ]] || return 1
  [[ $(cat "$STATE/slurm-version" 2>/dev/null) == "$SLURM_VERSION".* ]] || return 1
  (
    # shellcheck disable=SC1091
    source "$STATE/env.sh"
    timeout 10 sinfo -h >/dev/null 2>&1
  )
}

do_status() {
  if is_up; then
    echo "up ($STATE)"
    # shellcheck disable=SC1091
    source "$STATE/env.sh"
    sinfo -N -o '%N %P %T %c %m %G'
  else
    echo "down ($STATE)"
    return 3
  fi
}

ensure_packages() {
  local missing=() b
  for b in "${BINARIES[@]}"; do
    command -v "$b" >/dev/null || missing+=("$b")
  done
  ((${#missing[@]})) || return 0
  command -v apt-get >/dev/null || fail "missing ${missing[*]} and no apt-get to install them"
  log "installing ${PACKAGES[*]} (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  # Wait for a dpkg lock held by someone else instead of failing at once.
  apt-get -o DPkg::Lock::Timeout=300 update >>"$STATE/log/apt.log" 2>&1 ||
    fail "apt-get update failed (see $STATE/log/apt.log)"
  apt-get -o DPkg::Lock::Timeout=300 install -y --no-install-recommends "${PACKAGES[@]}" \
    >>"$STATE/log/apt.log" 2>&1 || fail "apt-get install failed (see $STATE/log/apt.log)"
  for b in "${missing[@]}"; do
    command -v "$b" >/dev/null || fail "$b still missing after apt-get install"
  done
}

# spawn NAME CMD...: start a daemon in the foreground of its own session, stdio to a log,
# PID to run/NAME.pid. setsid does not fork here (we are not a group leader), so $! is it.
# fd 9 (the lock) is closed, or the daemons would hold the lock for as long as they run.
spawn() {
  local name=$1
  shift
  setsid "$@" </dev/null >>"$STATE/log/$name.out" 2>&1 9>&- &
  echo $! >"$STATE/run/$name.pid"
}

# wait_for TIMEOUT_S WHAT DAEMONS CMD...: retry CMD until it succeeds, by a clock deadline;
# stop early when one of the DAEMONS (space-separated names, may be empty) has died.
wait_for() {
  local timeout_s=$1 what=$2 daemons deadline
  read -r -a daemons <<<"$3"
  shift 3
  deadline=$(($(now_us) + timeout_s * 1000000))
  until "$@" >/dev/null 2>&1; do
    ((${#daemons[@]} == 0)) || check_running "${daemons[@]}"
    (($(now_us) < deadline)) || fail "$what not ready after ${timeout_s}s"
    sleep 0.1
  done
}

# Fails as soon as a daemon we started has died, so a bad config is not a long timeout.
check_running() {
  local name p
  for name in "$@"; do
    p=$(read_pid "$STATE/run/$name.pid") || fail "no pid file for $name"
    alive "$p" || fail "$name (pid $p) exited"
  done
}

# Free TCP port blocks (slurmctld, slurmdbd, MariaDB, one per slurmd): nothing answers on
# loopback. Blocks of MAX_NODES + 3 ports, below the ephemeral range (32768).
pick_ports() {
  local tries base i
  for tries in $(seq 50); do
    base=$((20000 + (RANDOM % 180) * (MAX_NODES + 6)))
    for ((i = 0; i < ${#NODES[@]} + 3; i++)); do
      if (: <>"/dev/tcp/127.0.0.1/$((base + i))") 2>/dev/null; then continue 2; fi
    done
    echo "$base"
    return 0
  done
  fail "no free port block found after $tries tries"
}

on_up_exit() {
  local rc=$?
  trap - EXIT
  ((rc)) || return 0
  local f
  for f in "$STATE"/log/*; do
    [[ -s $f ]] || continue
    printf '\n==> %s <==\n' "$f" >&2
    tail -n 15 "$f" >&2
  done
  log "up failed; stopping what was started"
  do_down >&2 || true
  exit "$rc"
}

fail() {
  log "ERROR: $*"
  exit 1
}

write_configs() {
  local host=$1 base=$2 dbpass=$3 first_job_id
  local etc=$STATE/etc nodes="node[1-${#NODES[@]}]" ports="$((base + 3))-$((base + 2 + ${#NODES[@]}))"
  ((${#NODES[@]} > 1)) || nodes=node1 ports=$((base + 3))
  # Job ids restart at FirstJobId on every fresh state dir; derive it from the clock (10 ids
  # per second, wrapping every ~76 days) so ids never repeat between bring-ups.
  first_job_id=$((1000 + ($(date +%s) * 10) % 66000000))
  local proctrack=proctrack/pgid task=task/none
  if ((CGROUP)); then
    proctrack=proctrack/cgroup task=task/cgroup
    # ConstrainDevices: each task may open only its own GPUs' device files, and Slurm numbers
    # them from 0 in CUDA_VISIBLE_DEVICES (SLURM_STEP_GPUS keeps the node's numbers).
    cat >"$etc/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
ConstrainDevices=yes
ConstrainCores=no
ConstrainRAMSpace=no
EOF
  fi

  cat >"$etc/slurm.conf" <<EOF
ClusterName=$CLUSTER_NAME
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$base
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Short credential lifetime: a requeued job waits cred_expire before it runs again.
AuthInfo=socket=$STATE/munge/sock/munge.socket,cred_expire=10
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.self.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=$proctrack
TaskPlugin=$task
MpiDefault=none
MailProg=/bin/true
JobRequeue=1
ReturnToService=2
KillOnBadExit=1
KillWait=2
# How long a silent node lives on before Slurm calls it DOWN (Slurm's default: 300 s).
SlurmdTimeout=$SLURMD_TIMEOUT
InactiveLimit=0
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
FirstJobId=$first_job_id
MaxJobId=67043328
GresTypes=gpu
# Lets the nodes declare more CPUs and GPUs than the machine has.
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((base + 1))
# Connections to slurmdbd take the munge socket from here, not from AuthInfo.
AccountingStoragePass=$STATE/munge/sock/munge.socket
AccountingStorageTRES=gres/gpu
NodeName=$nodes NodeHostname=$host NodeAddr=127.0.0.1 Port=$ports CPUs=$CPUS_PER_NODE Sockets=1 CoresPerSocket=$CPUS_PER_NODE ThreadsPerCore=1 RealMemory=$MEM_PER_NODE_MB Gres=gpu:$GPUS_PER_NODE State=UNKNOWN
PartitionName=debug Nodes=$nodes Default=YES MaxTime=INFINITE State=UP
EOF

  cat >"$etc/gres.conf" <<EOF
AutoDetect=off
NodeName=$nodes Name=gpu File=$STATE/gpu/nvidia[0-$((GPUS_PER_NODE - 1))]
EOF

  # slurmdbd reads slurmdbd.conf beside SLURM_CONF and insists on mode 0600.
  (
    umask 077
    cat >"$etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/sock/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((base + 1))
SlurmUser=root
PidFile=$STATE/run/slurmdbd.self.pid
LogFile=$STATE/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((base + 2))
StorageUser=slurm
StoragePass=$dbpass
StorageLoc=slurm_acct_db
EOF
  )

  # A private option file so no MariaDB program reads the system's (/var/lib/mysql).
  cat >"$etc/my.cnf" <<EOF
[client]
socket=$STATE/db/mysqld.sock
[mysqld]
user=root
datadir=$STATE/db/data
socket=$STATE/db/mysqld.sock
pid-file=$STATE/run/mariadbd.self.pid
log-error=$STATE/log/mariadb.log
port=$((base + 2))
bind-address=127.0.0.1
skip-name-resolve
performance_schema=OFF
key_buffer_size=1M
aria_pagecache_buffer_size=8M
innodb_buffer_pool_size=32M
innodb_log_buffer_size=2M
innodb_log_file_size=16M
innodb_flush_log_at_trx_commit=2
innodb_lock_wait_timeout=900
EOF

  {
    cat /etc/hosts
    echo "127.0.0.1 ${NODES[*]}"
  } >"$etc/hosts"
}

start_munge() {
  head -c 1024 /dev/urandom >"$STATE/munge/munge.key"
  chmod 0400 "$STATE/munge/munge.key"
  spawn munged munged -F --key-file="$STATE/munge/munge.key" \
    --socket="$STATE/munge/sock/munge.socket" --pid-file="$STATE/run/munged.self.pid" \
    --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/munge.seed"
}

start_mariadb() {
  local dbpass=$1 cnf=$STATE/etc/my.cnf
  mariadb-install-db --defaults-file="$cnf" --skip-test-db \
    --auth-root-authentication-method=socket >>"$STATE/log/mariadb-install.out" 2>&1 ||
    fail "mariadb-install-db failed"
  spawn mariadbd mariadbd --defaults-file="$cnf"
  wait_for "$DB_TIMEOUT_S" "mariadbd" mariadbd mariadb --defaults-file="$cnf" -e 'SELECT 1'
  mariadb --defaults-file="$cnf" <<EOF
CREATE DATABASE slurm_acct_db;
CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$dbpass';
CREATE USER 'slurm'@'localhost' IDENTIFIED BY '$dbpass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF
}

# slurmd -N node1 and node2, each under tini -s (a subreaper reaps job processes at once;
# PID 1 here reaps only every few seconds), in one private mount namespace whose /etc/hosts
# maps the node names to 127.0.0.1. The holder shell waits for them.
start_nodes() {
  local inner
  # shellcheck disable=SC2016 # expanded by the inner shell
  inner='set -eu
S=$1; shift
mount --bind "$S/etc/hosts" /etc/hosts
readlink /proc/self/ns/mnt >"$S/run/mntns.tmp"
mv "$S/run/mntns.tmp" "$S/run/mntns"
for n in "$@"; do
  tini -s -- slurmd -D -N "$n" </dev/null >>"$S/log/slurmd-$n.out" 2>&1 &
  echo $! >"$S/run/tini-$n.pid"
done
wait'
  spawn nodes unshare --mount --propagation private -- bash -c "$inner" nodes "$STATE" "${NODES[@]}"
}

descendants() {
  local c
  for c in $(pgrep -P "$1"); do
    echo "$c"
    descendants "$c"
  done
}

# The pid of NODE's tini (its slurmd's parent) in this cluster's namespace.
node_tini() {
  local node=$1 ns pid
  ns=$(cat "$STATE/run/mntns" 2>/dev/null) || fail "no cluster in $STATE"
  for pid in $(pgrep -x tini); do
    [[ $(readlink "/proc/$pid/ns/mnt" 2>/dev/null) == "$ns" ]] || continue
    if [[ $(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline") == *" -D -N $node " ]]; then
      echo "$pid"
    fi
  done
}

# A hard node loss, as in a power cut: SIGKILL at once to the node's slurmd (its tini) and
# every process under it (step daemons, ranks); Slurm calls the node dead only after
# SlurmdTimeout. Prints the names of what it killed.
do_lose() {
  local tini all
  tini=$(node_tini "$1")
  [[ -n $tini ]] || fail "no slurmd of $1 runs in $STATE"
  mapfile -t all < <(echo "$tini"; descendants "$tini")
  ps -o comm= -p "$(IFS=,; echo "${all[*]}")" || true
  kill -KILL "${all[@]}" 2>/dev/null || true
}

# A lost node's slurmd started again in the nodes' namespace, with the cluster's settings
# (`down` stops it as the others); back once Slurm calls it responding.
do_node_up() {
  local node=$1 holder deadline
  CLUSTER_ID=$(cat "$STATE/cluster-id" 2>/dev/null || true)
  holder=$(cat "$STATE/run/nodes.pid" 2>/dev/null || true)
  [[ -n $CLUSTER_ID && -n $holder && -f $STATE/env.sh ]] || fail "no cluster at $STATE"
  [[ -z $(node_tini "$node") ]] || fail "the slurmd of $node runs already"
  export MJLAB_HPC_CLUSTER_ID=$CLUSTER_ID SLURM_CONF=$STATE/etc/slurm.conf
  setsid nsenter -t "$holder" -m -r -- tini -s -- slurmd -D -N "$node" </dev/null \
    >>"$STATE/log/slurmd-$node.out" 2>&1 9>&- &
  echo $! >"$STATE/run/tini-$node.pid"
  deadline=$(($(now_us) + 30 * 1000000))
  until [[ -n $(node_tini "$node") ]] && ! sinfo -h -N -n "$node" -o '%T' | grep -q '\*$'; do
    (($(now_us) < deadline)) || fail "$node did not answer Slurm within 30 s"
    sleep 0.2
  done
  echo "$node up"
}

nodes_idle() {
  local out
  out=$(sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
  [[ $(grep -c ' idle$' <<<"$out") -eq ${#NODES[@]} ]]
}

do_up() {
  local t0 t_pkg host base dbpass i n
  t0=$(now_us)
  [[ $(id -u) -eq 0 ]] || fail "must run as root (starts daemons, mknod, mount namespace)"
  if is_up; then
    local had
    had=$(cat "$STATE/node-count" 2>/dev/null || echo 2)
    ((had == ${#NODES[@]})) ||
      fail "already up in $STATE with $had nodes, not ${#NODES[@]}: run down first, or use another MJLAB_HPC_CLUSTER_DIR"
    echo "already up ($STATE)"
    return 0
  fi
  # Leftovers of an earlier bring-up: stop them, then start from an empty directory.
  do_down >/dev/null
  if [[ -e $STATE && ! -f $MARKER ]] && [[ -n $(ls -A "$STATE") ]]; then
    fail "$STATE exists, is not empty and is not a cluster state dir; refusing to wipe it"
  fi
  [[ -n $STATE && $STATE != / ]] || fail "bad state dir '$STATE'"
  rm -rf -- "$STATE"
  mkdir -p "$(dirname "$STATE")"
  mkdir -m 0755 "$STATE"
  touch "$MARKER"
  echo "${#NODES[@]}" >"$STATE/node-count"
  mkdir -m 0755 "$STATE"/{etc,log,run,spool,gpu,db}
  for n in ctld "${NODES[@]}"; do
    mkdir -m 0755 "$STATE/spool/$n"
  done
  # munged wants execute permission for all on every directory above its socket.
  mkdir -m 0755 "$STATE/munge" "$STATE/munge/sock"
  trap on_up_exit EXIT
  # munged refuses a socket below a directory that others cannot search (a 0700 TMPDIR,
  # pytest's tmp_path): say so plainly instead of failing later in its log.
  local d=$STATE
  while [[ $d != / ]]; do
    d=$(dirname "$d")
    [[ -n $(find "$d" -maxdepth 0 -perm -o+x) ]] ||
      fail "munged needs every directory above $STATE to be searchable by others; $d is not (chmod o+x it, or set MJLAB_HPC_CLUSTER_DIR elsewhere)"
  done

  ensure_packages
  t_pkg=$(since "$t0")
  local have
  have=$(slurmctld -V 2>/dev/null | awk '{print $2}')
  [[ $have == "$SLURM_VERSION".* ]] ||
    fail "Slurm ${have:-?} is installed here, not $SLURM_VERSION (MJLAB_HPC_SLURM_VERSION)"
  echo "$have" >"$STATE/slurm-version"

  CLUSTER_ID=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
  echo "$CLUSTER_ID" >"$STATE/cluster-id"
  export MJLAB_HPC_CLUSTER_ID=$CLUSTER_ID
  export SLURM_CONF=$STATE/etc/slurm.conf
  host=$(hostname -s) # slurmctld refuses to start unless SlurmctldHost is this name
  base=$(pick_ports)
  dbpass=$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')
  write_configs "$host" "$base" "$dbpass"
  # Fake GPUs: gres needs character devices; copies of /dev/null will do.
  for ((i = 0; i < GPUS_PER_NODE; i++)); do
    if ((CGROUP)); then
      # Distinct device numbers, so a constraint on one GPU is not one on all (or on
      # /dev/null); no driver behind them: an allowed open fails ENXIO, a denied one EPERM.
      mknod "$STATE/gpu/nvidia$i" c 195 "$i"
    else
      mknod "$STATE/gpu/nvidia$i" c 1 3
    fi
  done

  start_munge
  start_mariadb "$dbpass"
  wait_for 10 "munged" munged munge -n --socket="$STATE/munge/sock/munge.socket"
  spawn slurmdbd slurmdbd -D
  wait_for "$DB_TIMEOUT_S" "slurmdbd (sacctmgr show cluster)" slurmdbd \
    sacctmgr -n -P show cluster
  sacctmgr -i add cluster "$CLUSTER_NAME" >>"$STATE/log/sacctmgr.out" 2>&1 ||
    fail "sacctmgr add cluster failed"

  spawn slurmctld slurmctld -D
  start_nodes
  wait_for 10 "node namespace" nodes test -s "$STATE/run/mntns"
  [[ $(cat "$STATE/run/mntns") != "$(readlink /proc/self/ns/mnt)" ]] ||
    fail "slurmd namespace is the host's"
  local deadline=$(($(now_us) + IDLE_TIMEOUT_S * 1000000))
  until nodes_idle; do
    check_running slurmctld nodes "${NODES[@]/#/tini-}" munged slurmdbd mariadbd
    if (($(now_us) > deadline)); then
      sinfo -N -o '%N %T %E' >&2 || true
      fail "nodes not idle after ${IDLE_TIMEOUT_S}s"
    fi
    sleep 0.05
  done

  {
    printf 'export SLURM_CONF=%q\nexport MJLAB_HPC_CLUSTER_DIR=%q\n' "$SLURM_CONF" "$STATE"
    printf 'export MJLAB_HPC_SLURM_VERSION=%q\nexport MJLAB_HPC_CLUSTER_CGROUP=%q\n' \
      "$SLURM_VERSION" "$CGROUP"
  } >"$STATE/env.sh"
  trap - EXIT
  printf 'cluster up: Slurm %s, nodes idle %s s after start (packages %s s); source %s/env.sh\n' \
    "$have" "$(since "$t0")" "$t_pkg" "$STATE"
}

# The cached root of a Slurm version other than this machine's: made once per package list
# (mmdebstrap, ~1-2 min), reused after. Prints its path.
ensure_root() {
  local cache=${MJLAB_HPC_CACHE_DIR:-/var/cache/mjlab-hpc} key root t0
  key=$(printf '%s\n' "$ROOT_SUITE" "${ROOT_PACKAGES[@]}" | sha256sum | cut -c1-12)
  root=$cache/slurm-$SLURM_VERSION-$ROOT_SUITE-$key
  if [[ ! -f $root/.complete ]]; then
    mkdir -p "$cache"
    exec 8>"$root.lock"
    flock -w 900 8 || fail "could not lock $root.lock"
    if [[ ! -f $root/.complete ]]; then
      t0=$(now_us)
      if ! command -v mmdebstrap >/dev/null; then
        log "installing mmdebstrap"
        export DEBIAN_FRONTEND=noninteractive
        { apt-get -o DPkg::Lock::Timeout=300 update &&
          apt-get -o DPkg::Lock::Timeout=300 install -y --no-install-recommends mmdebstrap; } \
          >"$root.log" 2>&1 || fail "installing mmdebstrap failed (see $root.log)"
      fi
      log "making the Slurm $SLURM_VERSION root ($ROOT_SUITE: ${ROOT_PACKAGES[*]}) in $root"
      rm -rf -- "$root.tmp" # an interrupted build
      mmdebstrap --variant=apt --include="$(IFS=,; echo "${ROOT_PACKAGES[*]}")" "$ROOT_SUITE" \
        "$root.tmp" >>"$root.log" 2>&1 || fail "mmdebstrap failed (see $root.log)"
      rm -rf -- "$root"
      mv "$root.tmp" "$root"
      touch "$root/.complete"
      log "root made in $(since "$t0") s"
    fi
    exec 8>&-
  fi
  echo "$root"
}

# Run a command inside the root, in the current directory: a private mount namespace with the
# root bound on itself (unshare inside needs a mount point), /proc, /sys (slurmd needs its
# cgroup mounts), /dev, the host's /etc/hosts, and the folders where the tests, the state and
# the project's Python live, at the same paths.
in_root() {
  local root py d b skip binds=() extra=()
  root=$(ensure_root) || exit 1
  py=$(sed -n 's/^home = //p' "$REPO/.venv/pyvenv.cfg" 2>/dev/null || true)
  py=${py%/bin}
  if [[ $py == /usr || $py == /usr/local ]]; then
    # The system's Python: its interpreter and standard library only, not the host's /usr.
    local v
    v=$(sed -n 's/^version = \([0-9]*\.[0-9]*\).*/\1/p' "$REPO/.venv/pyvenv.cfg")
    py="$py/bin/python$v:$py/lib/python$v"
  fi
  IFS=: read -r -a extra <<<"$py:${MJLAB_HPC_ROOT_BINDS:-}"
  for d in /tmp "${TMPDIR:-/tmp}" "$HOME" "$REPO" "$(dirname "$STATE")" "${extra[@]}"; do
    [[ $d == /?* && -e $d ]] || continue
    d=$(realpath "$d")
    skip=0
    for b in "${binds[@]}"; do
      if [[ $d == "$b" || $d == "$b"/* ]]; then skip=1; fi
    done
    ((skip)) || binds+=("$d")
  done
  # shellcheck disable=SC2016 # expanded by the inner shell
  exec unshare --mount --propagation private -- bash -c 'set -eu
R=$1 wd=$2 version=$3
shift 3
mount --rbind "$R" "$R"
mount -t proc proc "$R/proc"
mount --rbind /sys "$R/sys"
mount --rbind /dev "$R/dev"
touch "$R/etc/hosts"
mount --bind /etc/hosts "$R/etc/hosts"
while [ "$1" != -- ]; do
  if [ -d "$1" ]; then mkdir -p "$R$1"; else mkdir -p "$R${1%/*}" && touch "$R$1"; fi
  mount --rbind "$1" "$R$1"
  shift
done
shift
exec chroot "$R" /usr/bin/env MJLAB_HPC_IN_ROOT="$version" bash -c '\''cd -- "$1" && shift && exec "$@"'\'' in-root "$wd" "$@"' \
    in-root "$root" "$PWD" "$SLURM_VERSION" "${binds[@]}" -- "$@"
}

# slurmctld alone: gone (the jobs, slurmds and accounting stay), and back from its saved state.
do_ctld_stop() {
  CLUSTER_ID=$(cat "$STATE/cluster-id" 2>/dev/null || true)
  local p
  mapfile -t p < <(pids_of slurmctld)
  ((${#p[@]})) || fail "slurmctld of $STATE does not run"
  stop_pids 10 "${p[@]}"
  echo "slurmctld stopped ($STATE)"
}

do_ctld_start() {
  CLUSTER_ID=$(cat "$STATE/cluster-id" 2>/dev/null || true)
  [[ -n $CLUSTER_ID && -f $STATE/env.sh ]] || fail "no cluster at $STATE"
  [[ -z $(pids_of slurmctld) ]] || fail "slurmctld of $STATE runs already"
  export MJLAB_HPC_CLUSTER_ID=$CLUSTER_ID SLURM_CONF=$STATE/etc/slurm.conf
  spawn slurmctld slurmctld -D
  wait_for 30 "slurmctld (sinfo)" slurmctld sinfo -h
  echo "slurmctld started ($STATE)"
}

with_lock() {
  mkdir -p "$(dirname "$STATE")"
  # One up/down at a time per state dir.
  exec 9>"$STATE.lock"
  flock -w 300 9 || fail "could not lock $STATE.lock"
  "$@"
}

NODE_COUNT=$(node_count)
mapfile -t NODES < <(seq -f 'node%g' "$NODE_COUNT")
readonly NODES

# Inside a root, only its own version.
if [[ -n ${MJLAB_HPC_IN_ROOT:-} && $MJLAB_HPC_IN_ROOT != "$SLURM_VERSION" ]]; then
  fail "inside the Slurm $MJLAB_HPC_IN_ROOT root, MJLAB_HPC_SLURM_VERSION=$SLURM_VERSION"
fi
# What needs Slurm's binaries runs inside the version's root (down stops processes by PID).
outside_root() { [[ $SLURM_VERSION != 22.05 && -z ${MJLAB_HPC_IN_ROOT:-} ]]; }

case "${1:-}" in
  up | status | ctld-start | node-up) if outside_root; then in_root bash "$SCRIPT" "$@"; fi ;;&
  up) with_lock do_up ;;
  down) with_lock do_down ;;
  status) do_status ;;
  ctld-stop) with_lock do_ctld_stop ;;
  ctld-start) with_lock do_ctld_start ;;
  lose | node-up)
    (($# == 2)) || fail "usage: $0 $1 NODE"
    if [[ $1 == lose ]]; then do_lose "$2"; else do_node_up "$2"; fi
    ;;
  exec)
    shift
    (($#)) || fail "usage: $0 exec COMMAND [ARGS...]"
    if outside_root; then in_root "$@"; fi
    exec "$@"
    ;;
  *)
    echo "usage: $0 up|down|status|ctld-stop|ctld-start|lose NODE|node-up NODE|exec COMMAND..." >&2
    exit 2
    ;;
esac
