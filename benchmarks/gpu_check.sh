#!/usr/bin/env bash
# On an NVIDIA GPU, in about 10 minutes (benchmarks/RESULTS.md holds what it printed on an H200):
#   1. kernels: every forward and backward kernel against its XLA reference at the full
#      DeepSeek-V3.2 / GLM-5 shapes (bf16; fp8 indexer and fp8 cache rows), each checked and
#      then timed (median of 20 warm calls) in one pass: benchmarks/kernels.py --check;
#   2. generation: `mla-jax generate` with --backend pallas against --backend xla on the small
#      preset (tokens/s) and on the trained recall preset (whether the greedy tokens agree);
#   3. speculative decoding at batch 1 (the recall preset's trained MTP layer) against plain;
#   4. the engine against static `generate` (benchmarks/serving.py's short workload);
#   5. the Mosaic GPU kernels against the Pallas-Triton ones and XLA (sparse MQA prefill and
#      decode, the indexer, bf16 and fp8, DeepSeek-V3.2 / GLM-5 shapes): each checked, then
#      all three timed side by side (benchmarks/mosaic_gpu.py; exits with the reason on a jax
#      without Mosaic GPU);
#   6. what each part of the warp-specialised sparse MQA kernel costs: timed whole, without
#      its PV wgmmas, without its row gather, and without both (mosaic_gpu.py --parts).
# Every stage runs under its own time limit, with its log in $LOGS/<stage>.log; a failing stage
# does not stop the later ones, and the script exits nonzero if any failed (a kernel mismatch
# fails stage 1).
#   PYTHON=python3 LOGS=/tmp/gpu_logs benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
LOGS="${LOGS:-gpu_check_logs}"
mkdir -p "$LOGS"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # runs from the checkout, no install needed
failed=()

stage() {  # stage NAME SECONDS COMMAND...: COMMAND under a time limit, its output in NAME.log
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  echo "-- $name: exit $rc after $((SECONDS - start))s"
  [ "$rc" = 0 ] || failed+=("$name")
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  "$PYTHON" -c 'import jax, flax, sys; print("python", sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__, "devices", jax.devices())'
} 2>&1 | tee "$LOGS/env.log"
"$PYTHON" -c 'import jax, sys; sys.exit(jax.devices()[0].platform != "gpu")' \
  || { echo "no GPU visible to jax; run the CPU tests instead (pytest tests/kernels)"; exit 2; }

stage kernels 280 "$PYTHON" benchmarks/kernels.py --check --iters 20

GENERATE=("$PYTHON" -m mla_jax generate --dtype bf16 --cache-dtype bf16)
SMALL=(--preset small --prompt-len 1024 --max-new-tokens 64 --batch 8)
stage generate_xla 60 "${GENERATE[@]}" --backend xla "${SMALL[@]}"
stage generate_pallas 60 "${GENERATE[@]}" --backend pallas "${SMALL[@]}"
RECALL=(--preset recall --max-new-tokens 64 --batch 1)
stage speculative_off 40 "${GENERATE[@]}" --backend xla "${RECALL[@]}"
stage speculative_on 40 "${GENERATE[@]}" --backend xla "${RECALL[@]}" --speculative-tokens 2
stage engine 150 env JAX_PLATFORMS=cuda "$PYTHON" benchmarks/serving.py --quick --requests 32 --sections throughput,static
stage speculative_pallas 40 "${GENERATE[@]}" --backend pallas "${RECALL[@]}" \
  --speculative-tokens 2
stage mosaic_vs_triton 180 "$PYTHON" benchmarks/mosaic_gpu.py --iters 20
stage mosaic_parts 90 "$PYTHON" benchmarks/mosaic_gpu.py --parts --iters 20

# Greedy tokens of the two backends: the recall preset is trained (clear margins between its
# logits); the small preset's random weights give near-ties that bf16 rounding may flip.
"$PYTHON" - "$LOGS" <<'EOF' | tee "$LOGS/agree.log"
import re, sys
def ids(stage):
  found = re.findall(r"generated ids: \[(.*)\]", open(f"{sys.argv[1]}/{stage}.log").read())
  return [int(t) for t in found[0].split(",")] if found else None
for preset, xla, pallas in (("recall", "speculative_on", "speculative_pallas"),
                            ("small", "generate_xla", "generate_pallas")):
  a, b = ids(xla), ids(pallas)
  if a is None or b is None:
    print(f"{preset}: a stage printed no ids"); continue
  same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
  print(f"{preset}: pallas vs xla, the first {same} of {len(a)} greedy tokens agree")
EOF


if [ ${#failed[@]} -gt 0 ]; then
  echo "failed stages: ${failed[*]}"
  exit 1
fi
echo "every stage passed"
