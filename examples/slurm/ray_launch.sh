#!/usr/bin/env bash
# Start a Ray cluster over the nodes of a Slurm allocation, run one driver command on it, and
# stop the cluster when the driver ends. Called from the sbatch files in this folder (the launch
# logic lives here only):
#
#   bash examples/slurm/ray_launch.sh python -m megatron_agent train --config C.yaml ray.address={RAY_ADDRESS}
#
# Every argument's `{RAY_ADDRESS}` is replaced by HEAD_IP:RAY_PORT (also exported as RAY_ADDRESS).
#
# What it does, in order:
#   1. the node list from `scontrol show hostnames` (one array element per node);
#   2. the Ray head on the first node (`ray start --head --block`, ports pinned below 9000, so
#      they never collide with the kernel's ephemeral range);
#   3. a worker on every other node; each waits for the head's port and retries its join;
#   4. waits until the cluster shows every node (and GPUS_PER_NODE GPUs on each), with a
#      timeout, never a fixed sleep;
#   5. runs the driver on the head node; any node process that exits meanwhile fails the job
#      at once (status 1, naming the node and its log);
#   6. on exit (normal, error or signal) stops the driver, the workers and the head.
# SIGUSR1 (from `#SBATCH --signal=B:USR1@SECONDS`) is forwarded to the driver, which saves a
# checkpoint and exits; the job is then requeued (REQUEUE_ON_SIGNAL=1) and resumes from it.
#
# Before any of that, every node checks the python tool's sandbox with the driver's --config and
# overrides (`python -m megatron_agent check-sandbox`, one line per node in the log):
# SANDBOX_CHECK=require (default) fails the job when a node cannot hold a call that the run
# needs, warn reports it and goes on, off skips the check.
#
# Settings (environment): CONTAINER_IMAGE, CONTAINER_MOUNTS (pyxis; empty image: no container),
# GPUS_PER_NODE, RAY_PORT and the other RAY_*_PORT values, RAY_JOIN_TIMEOUT_S, LOG_DIR,
# NET_IFNAME (NCCL/Gloo interface), SHARED_CACHE (HF and vLLM caches on shared storage).
# Inside each node's container the same file runs with `_node head|worker`.
set -euo pipefail

SCRIPT=$(readlink -f "${BASH_SOURCE[0]}")
REPO=${REPO:-$(cd "$(dirname "$SCRIPT")/../.." && pwd)}

# Pinned ports (below 9000; the head's GCS port is RAY_PORT). One node per host in production,
# so every node uses the same numbers.
: "${RAY_PORT:=6379}"
: "${RAY_NODE_MANAGER_PORT:=6380}"
: "${RAY_OBJECT_MANAGER_PORT:=6381}"
: "${RAY_CLIENT_SERVER_PORT:=6382}"
: "${RAY_DASHBOARD_AGENT_LISTEN_PORT:=6383}"
: "${RAY_DASHBOARD_AGENT_GRPC_PORT:=6384}"
: "${RAY_METRICS_EXPORT_PORT:=6385}"
: "${RAY_RUNTIME_ENV_AGENT_PORT:=6386}"
: "${RAY_DASHBOARD_PORT:=8265}"
: "${RAY_MIN_WORKER_PORT:=7000}"
: "${RAY_MAX_WORKER_PORT:=7999}"
: "${RAY_DASHBOARD:=1}"
: "${RAY_TMP_DIR:=/tmp/ray-${SLURM_JOB_ID:-0}}"
: "${RAY_JOIN_TIMEOUT_S:=600}"
: "${RAY_JOIN_RETRIES:=5}"
: "${RAY_JOIN_GRACE_S:=30}"
: "${STOP_GRACE_S:=30}"
: "${SANDBOX_CHECK:=require}"
export RAY_PORT RAY_NODE_MANAGER_PORT RAY_OBJECT_MANAGER_PORT RAY_CLIENT_SERVER_PORT \
  RAY_DASHBOARD_AGENT_LISTEN_PORT RAY_DASHBOARD_AGENT_GRPC_PORT RAY_METRICS_EXPORT_PORT \
  RAY_RUNTIME_ENV_AGENT_PORT RAY_DASHBOARD_PORT RAY_MIN_WORKER_PORT RAY_MAX_WORKER_PORT \
  RAY_DASHBOARD RAY_TMP_DIR RAY_JOIN_TIMEOUT_S RAY_JOIN_RETRIES RAY_JOIN_GRACE_S
export RAY_USAGE_STATS_ENABLED=0
# A node told to stop waits this long for leases to drain (Ray's default, 30 s, only delays a job
# whose driver has already ended).
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-5}

log() { echo "[ray_launch $(date +%H:%M:%S)] $*" >&2; }
die() {
  log "error: $*"
  exit 1
}

node_ip() {
  # The address other nodes reach this one at: NET_IFNAME's IPv4 address if set, else the first
  # address of the host name.
  if [ -n "${NET_IFNAME:-}" ]; then
    ip -o -4 addr show dev "$NET_IFNAME" | awk '{split($4, a, "/"); print a[1]; exit}'
  else
    hostname --ip-address | awk '{print $1}'
  fi
}

common_ray_args() {
  ray_args=(
    --block --disable-usage-stats
    --node-ip-address "$(node_ip)"
    --node-manager-port "$RAY_NODE_MANAGER_PORT"
    --object-manager-port "$RAY_OBJECT_MANAGER_PORT"
    --dashboard-agent-listen-port "$RAY_DASHBOARD_AGENT_LISTEN_PORT"
    --dashboard-agent-grpc-port "$RAY_DASHBOARD_AGENT_GRPC_PORT"
    --metrics-export-port "$RAY_METRICS_EXPORT_PORT"
    --runtime-env-agent-port "$RAY_RUNTIME_ENV_AGENT_PORT"
    --min-worker-port "$RAY_MIN_WORKER_PORT"
    --max-worker-port "$RAY_MAX_WORKER_PORT"
    --temp-dir "$RAY_TMP_DIR"
  )
  if [ -n "${RAY_NUM_CPUS:-}" ]; then ray_args+=(--num-cpus "$RAY_NUM_CPUS"); fi
  if [ -n "${RAY_NUM_GPUS:-}" ]; then ray_args+=(--num-gpus "$RAY_NUM_GPUS"); fi
}

wait_for_port() { # host port deadline_s
  local deadline=$((SECONDS + $3))
  until timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; do
    ((SECONDS < deadline)) || return 1
    sleep 2
  done
}

run_node() { # head|worker  (runs on the node, inside the container)
  ulimit -n 65535 2>/dev/null || log "warning: could not raise the open-file limit to 65535 ($(ulimit -n))"
  mkdir -p "$RAY_TMP_DIR"
  common_ray_args
  if [ "$1" = head ]; then
    local dash=(--include-dashboard false)
    if [ "$RAY_DASHBOARD" = 1 ]; then dash=(--include-dashboard true --dashboard-port "$RAY_DASHBOARD_PORT"); fi
    exec ray start --head --port "$RAY_PORT" --ray-client-server-port "$RAY_CLIENT_SERVER_PORT" \
      "${dash[@]}" "${ray_args[@]}"
  fi
  local head=${RAY_HEAD_IP:?RAY_HEAD_IP is set by the launcher}
  wait_for_port "$head" "$RAY_PORT" "$RAY_JOIN_TIMEOUT_S" ||
    die "$(hostname): the Ray head $head:$RAY_PORT did not open within ${RAY_JOIN_TIMEOUT_S}s"
  local attempt started rc attempt_log="$RAY_TMP_DIR/join-attempt.log"
  for ((attempt = 1; attempt <= RAY_JOIN_RETRIES; attempt++)); do
    started=$SECONDS
    rc=0
    ray start --address "$head:$RAY_PORT" "${ray_args[@]}" > >(tee "$attempt_log") 2>&1 || rc=$?
    # A node that joined (Ray said so, or it ran for a while) and then died is a failure of the
    # job, not a failed join: no retry.
    if grep -q "Ray runtime started" "$attempt_log" || ((SECONDS - started >= RAY_JOIN_GRACE_S)); then
      die "$(hostname): the Ray worker exited with status $rc after $((SECONDS - started))s"
    fi
    log "$(hostname): join attempt $attempt/$RAY_JOIN_RETRIES failed (status $rc); retrying"
    sleep $((attempt * 2))
  done
  die "$(hostname): could not join the Ray head $head:$RAY_PORT after $RAY_JOIN_RETRIES attempts"
}

case "${1:-}" in
  _node) run_node "${2:?_node needs head or worker}" ;;
  _ip) node_ip && exit 0 ;;
esac

# ---- the launcher (runs in the batch step on the allocation's first node) ----
((BASH_VERSINFO[0] > 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] >= 1))) ||
  die "bash >= 5.1 is needed (wait -n -p); this is $BASH_VERSION"
(($# > 0)) || die "usage: ray_launch.sh DRIVER_COMMAND [ARGS...] (use {RAY_ADDRESS} in an argument for the address)"
: "${SLURM_JOB_NODELIST:?not inside a Slurm allocation (SLURM_JOB_NODELIST is unset)}"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
((${#NODES[@]} > 0)) || die "scontrol show hostnames '$SLURM_JOB_NODELIST' returned no node"
HEAD_NODE=${NODES[0]}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
LOG_DIR=${LOG_DIR:-$REPO/logs/slurm-${SLURM_JOB_ID:-0}-r${SLURM_RESTART_COUNT:-0}}
mkdir -p "$LOG_DIR"

# Communication and caches, forwarded to every step (srun exports the environment, pyxis passes
# it into the container). NET_IFNAME names the interface NCCL/Gloo bootstrap over.
if [ -n "${NET_IFNAME:-}" ]; then
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$NET_IFNAME}
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NET_IFNAME}
fi
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
if [ -n "${SHARED_CACHE:-}" ]; then
  export HF_HOME=${HF_HOME:-$SHARED_CACHE/hf}
  export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$SHARED_CACHE/vllm}
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$SHARED_CACHE/triton}
  mkdir -p "$HF_HOME" "$VLLM_CACHE_ROOT" "$TRITON_CACHE_DIR"
fi

# Ray's token authentication with one token per job, passed to every step in the environment:
# a token left in ~/.ray (shared home directories) by another cluster must not decide who joins.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
  RAY_AUTH_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
  export RAY_AUTH_TOKEN
fi

container=()
if [ -n "${CONTAINER_IMAGE:-}" ]; then
  mounts=${CONTAINER_MOUNTS:-$REPO:$REPO}
  if [ -n "${SHARED_CACHE:-}" ]; then mounts="$mounts,$SHARED_CACHE:$SHARED_CACHE"; fi
  container=(--container-image "$CONTAINER_IMAGE" --container-mounts "$mounts"
    --container-workdir "$REPO" --container-name "megatron-agent-${SLURM_JOB_ID:-0}")
fi
# NODE ARGS...: one task on NODE (inside the container when one is set). Always called in a
# subshell (`&` or `$(...)`): the exec makes $! the srun itself, so signals reach the step.
step() {
  local node=$1
  shift
  exec srun --nodes=1 --ntasks=1 --overlap -w "$node" "${container[@]}" "$@"
}

HEAD_IP=${RAY_HEAD_IP:-$(step "$HEAD_NODE" bash "$SCRIPT" _ip)}
[ -n "$HEAD_IP" ] || die "could not find the IP address of the head node $HEAD_NODE"
export RAY_HEAD_IP=$HEAD_IP RAY_ADDRESS=$HEAD_IP:$RAY_PORT
log "nodes (${#NODES[@]}): ${NODES[*]}; head $HEAD_NODE at $RAY_ADDRESS; logs in $LOG_DIR"

check_sandbox() { # DRIVER_ARGS...: the python tool's sandbox on every node, with the run's config
  [ "$SANDBOX_CHECK" != off ] || return 0
  local args=() prev="" arg pid node failed=()
  for arg in "$@"; do
    if [ "$prev" = --config ]; then args+=(--config "$arg"); fi
    case "$arg" in
      --config=*) args+=("$arg") ;;
      -*) ;;
      *=*) args+=("${arg//\{RAY_ADDRESS\}/$RAY_ADDRESS}") ;;
    esac
    prev=$arg
  done
  local -A checks=()
  for node in "${NODES[@]}"; do
    step "$node" python -m megatron_agent check-sandbox "${args[@]}" >"$LOG_DIR/sandbox-$node.log" 2>&1 &
    checks[$!]=$node
  done
  for pid in "${!checks[@]}"; do
    node=${checks[$pid]}
    wait "$pid" || failed+=("$node")
    log "$node: $(grep -E '^(sandbox on|error)' "$LOG_DIR/sandbox-$node.log" | tail -n 1)"
  done
  ((${#failed[@]} == 0)) && return 0
  local what="the python tool's sandbox cannot hold a call on ${failed[*]} (see $LOG_DIR/sandbox-NODE.log)"
  [ "$SANDBOX_CHECK" = warn ] || die "$what; SANDBOX_CHECK=warn goes on regardless"
  log "warning: $what"
}
check_sandbox "$@"

declare -A ROLE=() # pid -> "head NODE" / "worker NODE"
driver_pid="" waiter_pid="" got_signal=0

# shellcheck disable=SC2329  # called by the EXIT trap
stop_all() {
  local pids=("$driver_pid" "$waiter_pid")
  local pid
  for pid in "${!ROLE[@]}"; do pids+=("$pid"); done
  for pid in "${pids[@]}"; do
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  local deadline=$((SECONDS + STOP_GRACE_S))
  for pid in "${pids[@]}"; do
    [ -n "$pid" ] || continue
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  wait 2>/dev/null || true
  log "cluster stopped"
}
trap stop_all EXIT
trap 'exit 143' TERM INT
# shellcheck disable=SC2329  # called by the USR1 trap
on_usr1() {
  got_signal=1
  log "SIGUSR1: asking the driver to checkpoint and exit"
  if [ -n "$driver_pid" ]; then kill -USR1 "$driver_pid" 2>/dev/null || true; fi
}
trap on_usr1 USR1

step "$HEAD_NODE" bash "$SCRIPT" _node head >"$LOG_DIR/ray-head-$HEAD_NODE.log" 2>&1 &
ROLE[$!]="head $HEAD_NODE"
for node in "${NODES[@]:1}"; do
  step "$node" bash "$SCRIPT" _node worker >"$LOG_DIR/ray-worker-$node.log" 2>&1 &
  ROLE[$!]="worker $node"
done

watch_until() { # PID: wait for PID to exit and return its status; any node exiting first fails the job
  local target=$1 done_pid rc
  while true; do
    done_pid="" rc=0
    wait -n -p done_pid "$target" "${!ROLE[@]}" || rc=$?
    if [ -z "${done_pid:-}" ]; then continue; fi # a trapped signal interrupted the wait
    if [ "$done_pid" = "$target" ]; then return "$rc"; fi
    read -r role node <<<"${ROLE[$done_pid]}"
    unset "ROLE[$done_pid]"
    die "the Ray $role on $node exited (status $rc) while the job ran; see $LOG_DIR/ray-$role-$node.log"
  done
}

# Wait until every node (and its GPUs) has joined: polled from the head, with a timeout.
step "$HEAD_NODE" python "$REPO/examples/slurm/ray_wait.py" --address "$RAY_ADDRESS" \
  --nodes "${#NODES[@]}" --gpus $((GPUS_PER_NODE * ${#NODES[@]})) --timeout "$RAY_JOIN_TIMEOUT_S" &
waiter_pid=$!
rc=0
watch_until "$waiter_pid" || rc=$?
waiter_pid=""
((rc == 0)) || die "the cluster did not come up (status $rc); see $LOG_DIR"

args=()
for arg in "$@"; do args+=("${arg//\{RAY_ADDRESS\}/$RAY_ADDRESS}"); done
log "driver: ${args[*]}"
step "$HEAD_NODE" "${args[@]}" &
driver_pid=$!
rc=0
watch_until "$driver_pid" || rc=$?
driver_pid=""
log "driver exited with status $rc"
if ((got_signal)) && [ "${REQUEUE_ON_SIGNAL:-1}" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  log "requeueing job $SLURM_JOB_ID (the next run resumes from the newest checkpoint)"
  scontrol requeue "$SLURM_JOB_ID" || log "warning: scontrol requeue failed"
fi
exit "$rc"
