#!/usr/bin/env bash
# Start N rollout servers on this host, each its own process with its own GPU(s), ports and log file.
#
#   deploy/launch_rollout_fleet.sh -n 8 -c configs/recipes/qwen2.5-0.5b-gsm8k-vllm.yaml -r RUN_ID \
#       [-- --buffer.redis_url redis://:PW@redis-host:6379/0 --weight_sync.transport.master_addr LEARNER_HOST]
#
# Server i gets GPUs [i*G, (i+1)*G) with G = GPUS_PER_SERVER (the engine's tensor_parallel_size), gRPC
# port PORT_BASE+i, metrics port METRICS_PORT_BASE+i and server id <host>-<i>; it logs to
# LOG_DIR/rollout-<i>.log. Every server registers host:port in Redis, so the learner finds them there.
# Ctrl-C or SIGTERM stops them all (each drains first); the script exits when every server has.
# It also writes LOG_DIR/prometheus-targets.json, a Prometheus file_sd list of the metrics endpoints.
# Secrets come from the environment: TETHER_AUTH_TOKEN (required by the servers on every call; the learner
# sends the same variable).
set -euo pipefail

NUM_SERVERS=${NUM_SERVERS:-1}
CONFIG=${CONFIG:-configs/recipes/qwen2.5-0.5b-gsm8k-vllm.yaml}
RUN_ID=${RUN_ID:-qwen2.5-0.5b-gsm8k-async}
GPUS_PER_SERVER=${GPUS_PER_SERVER:-1}
PORT_BASE=${PORT_BASE:-50051}
METRICS_PORT_BASE=${METRICS_PORT_BASE:-9100}
# The address others reach this host at: servers bind it and publish it in the registry.
HOST_ADDR=${HOST_ADDR:-$(hostname -I 2>/dev/null | awk '{print $1}')}
LOG_DIR=${LOG_DIR:-logs/rollout-$(hostname -s)}
TETHER=${TETHER:-tether}

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while getopts "n:c:r:h" opt; do
  case $opt in
    n) NUM_SERVERS=$OPTARG ;;
    c) CONFIG=$OPTARG ;;
    r) RUN_ID=$OPTARG ;;
    h) usage 0 ;;
    *) usage 2 ;;
  esac
done
shift $((OPTIND - 1))
[[ "${1:-}" == "--" ]] && shift
OVERRIDES=("$@")
[[ -n "$HOST_ADDR" ]] || { echo "launch_rollout_fleet: cannot tell this host's address; set HOST_ADDR" >&2; exit 2; }

# Fail in a second on a bad config, before any GPU is touched.
"$TETHER" config --config "$CONFIG" --run.run_id "$RUN_ID" "${OVERRIDES[@]}" >/dev/null

mkdir -p "$LOG_DIR"
pids=()
targets=()
stop_all() {
  trap - INT TERM
  echo "launch_rollout_fleet: stopping ${#pids[@]} servers" >&2
  kill -TERM "${pids[@]}" 2>/dev/null || true
}
trap stop_all INT TERM

for ((i = 0; i < NUM_SERVERS; i++)); do
  gpus=$(seq -s, $((i * GPUS_PER_SERVER)) $(((i + 1) * GPUS_PER_SERVER - 1)))
  port=$((PORT_BASE + i))
  metrics_port=$((METRICS_PORT_BASE + i))
  log="$LOG_DIR/rollout-$i.log"
  CUDA_VISIBLE_DEVICES=$gpus "$TETHER" rollout --config "$CONFIG" --run.run_id "$RUN_ID" \
    --rollout.host "$HOST_ADDR" --rollout.port "$port" --rollout.metrics_port "$metrics_port" \
    --rollout.server_id "$(hostname -s)-$i" "${OVERRIDES[@]}" >"$log" 2>&1 &
  pids+=($!)
  targets+=("\"$HOST_ADDR:$metrics_port\"")
  echo "rollout-$i: pid $! gpus $gpus grpc $HOST_ADDR:$port metrics :$metrics_port log $log"
done

(IFS=,; echo "[{\"targets\": [${targets[*]}], \"labels\": {\"run_id\": \"$RUN_ID\"}}]") \
  >"$LOG_DIR/prometheus-targets.json"

# Wait for all; report each server that exits with an error, without stopping the others: the fleet
# degrades gracefully and the learner simply stops sending that server updates.
status=0
for idx in "${!pids[@]}"; do
  if ! wait "${pids[$idx]}"; then
    echo "launch_rollout_fleet: rollout-$idx exited with an error; see $LOG_DIR/rollout-$idx.log" >&2
    status=1
  fi
done
wait 2>/dev/null || true  # a signal can interrupt a wait above: reap every server before leaving
exit $status
