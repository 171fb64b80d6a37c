#!/usr/bin/env bash
# Multi-GPU check of the scale-out placement (Ray actors: FSDP2 trainer workers and
# sampler replicas) on one node with two or more NVIDIA GPUs: one command, no
# network, under 9 minutes.
#
#   bash bench/gpu_check_multi.sh [OUT_JSON [gpu_check_multi.py options]]
#
# OUT_JSON defaults to $OUT/gpu_check_multi.json, else ./gpu_check_multi.json;
# `--quick` (the tiny model, 2 workers and 2 replicas on the CPU) checks the script
# itself. Installs rlengine as bench/gpu_check.sh does (Ray too, from the wheel
# folder, where missing) and runs bench/gpu_check_multi.py from outside the tree.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out_json="${1:-${OUT:-$PWD}/gpu_check_multi.json}"
shift || true
RLENGINE_GPU_CHECK_SCRIPT=gpu_check_multi.py RLENGINE_GPU_CHECK_NEEDS="ray:ray" RLENGINE_GPU_CHECK_TIMEOUT=540 \
    exec bash "$here/gpu_check.sh" "$out_json" "$@"
