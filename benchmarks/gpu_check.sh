#!/usr/bin/env bash
# On an NVIDIA GPU: check every kernel against its XLA reference at the full named shapes, then
# print the benchmark table. Exits nonzero on the first failing stage. Budget: < 8 minutes.
#   PYTHON=/path/to/python benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false

"$PYTHON" -c 'import jax, sys; d = jax.devices()[0]; print("device:", d.device_kind, "jax", jax.__version__); sys.exit(d.platform != "gpu")' \
  || { echo "no GPU visible to jax; run the CPU tests instead (pytest tests/kernels)"; exit 2; }

echo "== correctness: kernel vs XLA reference at full shapes =="
timeout 240 "$PYTHON" benchmarks/kernels.py --check

echo "== benchmark (median of 20, warm-up excluded) =="
timeout 200 "$PYTHON" benchmarks/kernels.py --iters 20
