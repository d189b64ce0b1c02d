#!/usr/bin/env bash
# Give this container one GPU of its own, then exec the command: gpu-lease.sh CMD [ARGS...]
#
# Why: `docker compose up --scale rollout=N` starts N identical replicas, and a device request of
# `count: 1` hands every one of them the same first GPU. So each replica sees all GPUs and takes an
# exclusive flock on /leases/gpu<i> for the first free index in $LEASE_GPUS (default: every visible
# GPU). The lock lives on the open file descriptor, which exec keeps: it is released the moment the
# container's process dies, so a restarted or re-scaled replica can take the GPU again.
set -euo pipefail

lease_dir=${LEASE_DIR:-/leases}
mkdir -p "$lease_dir"
if [[ -n "${LEASE_GPUS:-}" ]]; then
  IFS=',' read -r -a gpus <<<"$LEASE_GPUS"
else
  count=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
  (( count > 0 )) || { echo "gpu-lease: no GPU visible (set LEASE_GPUS or run on a GPU host)" >&2; exit 1; }
  mapfile -t gpus < <(seq 0 $((count - 1)))
fi

waited=0
while true; do
  for gpu in "${gpus[@]}"; do
    exec {lock_fd}>"$lease_dir/gpu$gpu"
    if flock -n "$lock_fd"; then
      export CUDA_VISIBLE_DEVICES=$gpu
      echo "gpu-lease: $(hostname) took GPU $gpu" >&2
      exec "$@"
    fi
    exec {lock_fd}>&-
  done
  # More replicas than GPUs: wait for one to free up instead of crash-looping.
  (( waited % 60 == 0 )) && echo "gpu-lease: all of GPUs ${gpus[*]} are taken; waiting" >&2
  sleep 5
  waited=$((waited + 5))
done
