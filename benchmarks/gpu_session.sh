#!/usr/bin/env bash
# The GPU measurements of benchmarks/README.md in one go, most important first, each
# JSON written to $OUT (default benchmarks/gpu/<date>) as soon as it is measured. Needs
# one NVIDIA GPU and a CUDA build of jax; about 8 minutes on an H200, most of it
# compilation. EXTRA="--dry-run" runs the same commands at a tiny size anywhere.
# PYTHON is the interpreter; by default the repository's .venv/bin/python where it
# exists and runs, else `python` from PATH (a GPU machine's image, with no .venv).
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh
#   PYTHON=/path/to/python EXTRA=--dry-run bash benchmarks/gpu_session.sh
set -uo pipefail
out="${OUT:-benchmarks/gpu/$(date +%Y-%m-%d)}"
mkdir -p "$out"
venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python"
if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x "$venv" ]] && "$venv" -c '' 2>/dev/null; then
    py="$venv"
else
    py="$(command -v python || command -v python3)"
fi
# Files are named by the card (h200_..., h100_...): the model in nvidia-smi's name of
# GPU 0 ("NVIDIA H100 80GB HBM3" -> h100).
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 |
       grep -oiE '\b[A-Z]+[0-9]{2,4}[A-Z]?\b' | head -n 1 | tr '[:upper:]' '[:lower:]')
card="${card:-gpu}"
read -r -a extra <<< "${EXTRA:-}"
failed=()
# A run that fails (a compilation error, memory) is reported and the next one still runs.
run() {
    local json="${*: -1}"
    "$py" -m benchmarks.gpu "${extra[@]}" "$@" || {
        local rc=$?
        failed+=("$(basename "$json"): exit $rc")
    }
}
# The MFU target: batch 32, cuDNN attention; the default gradient, stored_projections
# (the fastest stored gradient on the CPU) and stored.
run --attention cudnn --batch 32 --budget 20 --gradients stored_projections,stored \
    --json "$out/${card}_cudnn_b32.json"
run --attention cudnn --batch 16 --budget 20 --gradients stored_projections,stored_dots \
    --json "$out/${card}_cudnn_b16.json"
run --attention xla --batch 16 --budget 15 --gradients stored --json "$out/${card}_xla_b16.json"
if ((${#failed[@]})); then
    printf 'gpu_session: failed: %s\n' "${failed[@]}" >&2
    exit 1
fi
