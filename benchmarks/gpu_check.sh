#!/usr/bin/env bash
# One-shot GPU check of the kernels: CUDA tests, then the kernel benchmarks at the issues' GPU
# shapes, all inside a time budget. Run from the repo root on the GPU machine:
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh            # the real run (~6-8 min on an H200)
#   bash benchmarks/gpu_check.sh --dry-run                # print the steps, run nothing (CPU ok)
#
# Writes into $OUT (at most 8 files, so the device tool returns them all):
#   gpu_check.log, bench_logprobs_gpu.json/.png, bench_logprobs_gpu_shapes.json,
#   bench_policy_loss_gpu.json/.png, bench_packing_gpu.json
# and copies the JSON/PNG into benchmarks/results/ as well (that copy stays on the device;
# fetch the $OUT files and commit them here). See docs/kernels.md "Running the GPU checks".
#
# Budget: every step has its own timeout and the script skips what would overrun
# BUDGET_S (default 480 s), so the whole run stays under the device tool's 10-minute limit.
set -u -o pipefail

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
BUDGET_S=${BUDGET_S:-480}
OUT=${OUT:-/tmp/gpu_check_out}
PY=${PY:-python3}
mkdir -p "$OUT" benchmarks/results
LOG="$OUT/gpu_check.log"
: > "$LOG"
T0=$(date +%s)
export PYTHONUNBUFFERED=1

say() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# step NAME TIMEOUT_S CMD...: run with min(TIMEOUT_S, what is left of the budget); never abort
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - T0) ))
  if [ "$DRY" = 1 ]; then say "DRY $name (timeout ${limit}s): $*"; return 0; fi
  if [ "$left" -lt 20 ]; then say "SKIP $name: budget spent (${left}s left)"; return 0; fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "START $name (timeout ${limit}s)"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  say "END $name rc=$rc$([ "$rc" = 124 ] && echo ' (TIMED OUT)')"
  return 0
}

# ---- 1. environment: the repo as fastrehearse(.kernels), optional peer wheels -------------------
if [ "$DRY" = 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
  if ls .whl/*.whl >/dev/null 2>&1; then   # liger-kernel / cut-cross-entropy (see docs)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tail -2 | tee -a "$LOG"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # setup.py maps kernels/ -> fastrehearse.kernels: an editable install gives exactly that;
  # without pip/setuptools fall back to a shim package on PYTHONPATH.
  if ! timeout 90 $PY -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 \
     || ! $PY -c "import fastrehearse.kernels" >>"$LOG" 2>&1; then
    say "editable install failed: using a PYTHONPATH shim"
    SHIM=/tmp/fr_shim/fastrehearse
    rm -rf /tmp/fr_shim && mkdir -p "$SHIM"
    for f in fastrehearse/*; do ln -s "$PWD/$f" "$SHIM/"; done
    ln -sfn "$PWD/kernels" "$SHIM/kernels"
    export PYTHONPATH=/tmp/fr_shim${PYTHONPATH:+:$PYTHONPATH}
  fi
  $PY - <<'EOF' 2>&1 | tee -a "$LOG"
import torch, triton, fastrehearse.kernels as k
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-", "kernels at", k.__file__)
for m in ("liger_kernel", "cut_cross_entropy", "transformers"):
    try:
        mod = __import__(m); print(m, getattr(mod, "__version__", "present"))
    except Exception as e:
        print(m, "missing:", type(e).__name__)
EOF
fi

# ---- 2. CUDA tests (compiled Triton, bf16, torch backend on CUDA; varlen attention) -------------
step "pytest cuda" 150 $PY -m pytest -q -x -p no:cacheprovider tests/test_kernels_cuda.py \
  tests/test_model.py -k "cuda"

# ---- 3. benchmarks ------------------------------------------------------------------------------
# The issue-2 target shape first (H=4096, V=128256, N=16384, bf16; 1.0 / 0.5 / 0.25 unmasked).
# "ours (torch)" (the fp32 CPU path) is left out on the GPU: ~1.5 s a run in fp32 GEMMs.
step "bench_logprobs 4096x128256" 170 $PY benchmarks/bench_logprobs.py --device cuda \
  --shapes 4096x128256 --n 16384 --fracs 1.0 0.5 0.25 --reps 10 \
  --methods naive "torch.compile chunked" F.linear_cross_entropy "F.linear_cross_entropy chunked" \
            "liger FLCE" cut-cross-entropy "ours (triton)" \
  --json "$OUT/bench_logprobs_gpu.json"
step "bench_policy_loss 4096x128256" 100 $PY benchmarks/bench_policy_loss.py --device cuda \
  --shapes 4096x128256 --n 16384 --fracs 1.0 0.5 0.25 --reps 10 \
  --json "$OUT/bench_policy_loss_gpu.json"
# The other shapes of issue 2 (no torch.compile here: its compile time would eat the budget).
step "bench_logprobs other shapes" 120 $PY benchmarks/bench_logprobs.py --device cuda \
  --shapes 576x49152 2048x151936 --n 4096 16384 --fracs 1.0 0.25 --reps 5 \
  --methods naive F.linear_cross_entropy "liger FLCE" cut-cross-entropy "ours (triton)" \
  --json "$OUT/bench_logprobs_gpu_shapes.json"
step "bench_packing cuda" 60 $PY benchmarks/bench_packing.py --device cuda --repeats 2 \
  --json "$OUT/bench_packing_gpu.json" --png /tmp/bench_packing_gpu.png

if [ "$DRY" = 0 ]; then
  cp -f "$OUT"/bench_*_gpu*.json "$OUT"/bench_*_gpu*.png benchmarks/results/ 2>/dev/null
  rm -f "$OUT"/bench_logprobs_gpu_shapes.png    # keep $OUT at <= 8 files
  ls -la "$OUT" | tee -a "$LOG"
fi
say "done in $(( $(date +%s) - T0 ))s (budget ${BUDGET_S}s)"
