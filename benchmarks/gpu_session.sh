#!/usr/bin/env bash
# The GPU measurements of benchmarks/README.md in one go, most important first, each
# JSON written to $OUT (default benchmarks/gpu/<date>) as soon as it is measured. Needs
# one NVIDIA GPU and a CUDA build of jax; about 8 minutes on an H200, most of it
# compilation. EXTRA="--dry-run" runs the same commands at a tiny size anywhere.
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh
set -euo pipefail
out="${OUT:-benchmarks/gpu/$(date +%Y-%m-%d)}"
mkdir -p "$out"
py="${PYTHON:-python}"
read -r -a extra <<< "${EXTRA:-}"
run() { "$py" -m benchmarks.gpu "${extra[@]}" "$@"; }
# The MFU target: batch 32, cuDNN attention; the default gradient, stored_projections
# (the fastest stored gradient on the CPU) and stored.
run --attention cudnn --batch 32 --budget 20 --gradients stored_projections,stored \
    --json "$out/h200_cudnn_b32.json"
run --attention cudnn --batch 16 --budget 20 --gradients stored_projections,stored_dots \
    --json "$out/h200_cudnn_b16.json"
run --attention xla --batch 16 --budget 15 --gradients stored --json "$out/h200_xla_b16.json"
