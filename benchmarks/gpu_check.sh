#!/usr/bin/env bash
# One-shot GPU check of the kernels and the trainer, inside an 8-minute budget. From the repo root
# on the GPU machine (docs/gpu.md, section 5):
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh          # the real run (<= 8 min on an H200)
#   bash benchmarks/gpu_check.sh --dry-run              # print the steps, run nothing
#   SMOKE=1 OUT=/tmp/x bash benchmarks/gpu_check.sh     # CPU: every step at tiny sizes (checks
#                                                       # the script, imports and JSON writing)
#   PIP_INSTALL=1 ...                                   # editable install instead of the shim
#
# Order (most valuable first; a step that would start with < 20 s of budget left is skipped):
#   0. gpu_scale_check.py   the trainer's SFT + RL step in a 1-rank NCCL group (dist.timeout_s, the
#                           failure agreement): every collective checked on the device; measured
#                           peak memory vs the --dry-run plan. First: the multi-node path's one check
#   1. gpu_microbench.py    per-piece times vs roofline, num_warps sweep, triton-fused tile sweep
#   2. pytest               tests/test_kernels_cuda.py + tests/test_model.py -k cuda
#   3. bench_logprobs       H=4096 V=128256 N=16384 bf16, unmasked 1.0 / 0.25 (compile: 1.0 only)
#   4. bench_policy_loss    same shape, fused / unfused (triton)
#   4b. bench_logprobs --forward-only  same shape, all rows (old / reference log-probs: the
#                           case the fused tl.dot + LSE backend "triton-fused" is for)
#   5. bench_e2e_gpu.py     Qwen3-1.7B-shaped rollout + one RL step (1-rank FSDP2)
#   6. bench_logprobs       the other shapes (576x49152, 2048x151936), N 4096 / 16384
#   7. bench_policy_loss    Liger's chunked GRPO loss (torch.compile'd: its own step)
#   8. bench_packing        --device cuda
# Torch-backend methods ("ours (torch)", "fused/unfused (torch)") are not run on CUDA.
# Every benchmark rewrites its JSON after each configuration, so a step's timeout keeps what it
# measured. Files in $OUT (at most 8, small enough to copy back from a remote box): gpu_check.log
# and the JSON of the steps (PNGs are moved out; regenerate them from the JSON); past 8 files the
# last steps' JSON go into one gpu_check_extra.tgz at the end.
set -u -o pipefail

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
SMOKE=${SMOKE:-0}
BUDGET_S=${BUDGET_S:-480}
OUT=${OUT:-/tmp/gpu_check_out}
PY=${PY:-python3}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
T0=$(date +%s)
export PYTHONUNBUFFERED=1
# The repo root must not shadow the installed package: ./fastrehearse lacks the kernels subpackage
# (setup.py maps kernels/ to fastrehearse.kernels), so neither the cwd nor a script's folder goes
# on sys.path (the benchmarks add their own folder for _common explicitly).
export PYTHONSAFEPATH=1

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

# ---- sizes: the real run, or tiny ones on the CPU (SMOKE=1) -------------------------------------
if [ "$SMOKE" = 1 ]; then
  DEV=cpu; SHAPE=64x1000; NS="128"; SHAPES2="32x500"; NS2="64"; REPS=1
  MB_ARGS="--smoke"; E2E_ARGS="--tiny"; PACK_ARGS="--episodes 16 --seeds 1 --budgets 8192 --thr-episodes 4 --thr-max-tokens 8192 --repeats 1"
  LP_METHODS=(naive "F.linear_cross_entropy chunked" "ours (torch)")
  FWD_METHODS=(naive "F.linear_cross_entropy chunked" "ours (torch)")
  PL_METHODS=("fused (torch)" "unfused (torch)")
else
  DEV=cuda; SHAPE=4096x128256; NS="16384"; SHAPES2="576x49152 2048x151936"; NS2="4096 16384"; REPS=5
  MB_ARGS=""; E2E_ARGS=""; PACK_ARGS="--repeats 2"
  LP_METHODS=(naive "torch.compile chunked" F.linear_cross_entropy "F.linear_cross_entropy chunked"
              "liger FLCE" cut-cross-entropy "ours (triton)" "ours (triton-fused)")
  FWD_METHODS=(naive "F.linear_cross_entropy chunked" "liger FLCE" cut-cross-entropy
               "ours (triton)" "ours (triton-fused)")
  PL_METHODS=("fused (triton)" "fused (triton, bf16 dW, 1.5 GiB)" "unfused (triton)")
fi

LP_METHODS2=()   # the other shapes: no torch.compile (its compile per shape eats the budget)
for m in "${LP_METHODS[@]}"; do   # and no triton-fused (step 4b covers it at the main shape)
  [ "$m" = "torch.compile chunked" ] || [ "$m" = "ours (triton-fused)" ] || LP_METHODS2+=("$m"); done

# ---- 1. environment: the repo as fastrehearse(.kernels), optional peer wheels -------------------
if [ "$DRY" = 0 ]; then
  [ "$SMOKE" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm \
      --format=csv 2>&1 | tee -a "$LOG"
  if ls .whl/*.whl >/dev/null 2>&1; then   # liger-kernel / cut-cross-entropy (docs/gpu.md)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tail -2 | tee -a "$LOG"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # setup.py maps kernels/ -> fastrehearse.kernels. A symlink package on PYTHONPATH gives exactly
  # that in a second (the default: an editable install without network can hang on build
  # dependencies and eat the budget); PIP_INSTALL=1 tries `pip install -e .` first.
  if [ "${PIP_INSTALL:-0}" != 1 ] \
     || ! timeout 60 $PY -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 \
     || ! $PY -c "import fastrehearse.kernels" >>"$LOG" 2>&1; then
    say "using a PYTHONPATH shim for fastrehearse (+ kernels)"
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

# ---- 2. steps -----------------------------------------------------------------------------------
# 1. the scale path on one GPU, first: a 1-rank NCCL group runs every collective of the trainer's
#    real SFT + RL step (each checked on the compute device) with dist.timeout_s and the per-phase
#    failure agreement, peak memory vs the dry run's plan
SCALE_ARGS=$([ "$SMOKE" = 1 ] && echo "--smoke" || echo "--hidden 2048 --layers 16")
# shellcheck disable=SC2086
step "gpu_scale_check" 90 $PY -m torch.distributed.run --nproc_per_node=1 --master_port=29517 \
  benchmarks/gpu_scale_check.py $SCALE_ARGS --json "$OUT/gpu_scale_check.json"

step "gpu_microbench" 130 $PY benchmarks/gpu_microbench.py $MB_ARGS \
  --json "$OUT/gpu_microbench_gpu.json"

step "pytest cuda" 120 $PY -m pytest -q -x -p no:cacheprovider tests/test_kernels_cuda.py \
  tests/test_model.py -k cuda

# shellcheck disable=SC2086  # NS/SHAPES2 are word lists on purpose
step "bench_logprobs $SHAPE" 150 $PY benchmarks/bench_logprobs.py --device $DEV \
  --shapes $SHAPE --n $NS --fracs 1.0 0.25 --reps $REPS --methods "${LP_METHODS[@]}" \
  --full-only "torch.compile chunked" --json "$OUT/bench_logprobs_gpu.json"

step "bench_policy_loss $SHAPE" 60 $PY benchmarks/bench_policy_loss.py --device $DEV \
  --shapes $SHAPE --n $NS --fracs 1.0 0.25 --reps $REPS --methods "${PL_METHODS[@]}" \
  --json "$OUT/bench_policy_loss_gpu.json"

step "bench_logprobs forward-only $SHAPE" 45 $PY benchmarks/bench_logprobs.py --device $DEV \
  --forward-only --shapes $SHAPE --n $NS --fracs 1.0 --reps $REPS --methods "${FWD_METHODS[@]}" \
  --json "$OUT/bench_logprobs_fwd_gpu.json"

step "bench_e2e_gpu" 120 $PY benchmarks/bench_e2e_gpu.py $E2E_ARGS --json "$OUT/bench_e2e_gpu.json"

step "bench_logprobs other shapes" 80 $PY benchmarks/bench_logprobs.py --device $DEV \
  --shapes $SHAPES2 --n $NS2 --fracs 1.0 0.25 --reps 3 \
  --methods "${LP_METHODS2[@]}" \
  --json "$OUT/bench_logprobs_gpu_shapes.json"

[ "$SMOKE" = 1 ] || step "liger chunked GRPO $SHAPE" 60 $PY benchmarks/bench_policy_loss.py \
  --device $DEV --shapes $SHAPE --n $NS --fracs 1.0 --reps 3 --methods "liger chunked GRPO" \
  --json "$OUT/bench_policy_loss_liger_gpu.json"

step "bench_packing" 60 $PY benchmarks/bench_packing.py --device $DEV $PACK_ARGS \
  --json "$OUT/bench_packing_gpu.json" --png /tmp/bench_packing_gpu.png

if [ "$DRY" = 0 ]; then
  mkdir -p /tmp/gpu_check_png && mv -f "$OUT"/*.png /tmp/gpu_check_png/ 2>/dev/null
  if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then    # keep $OUT to 8 files
    extra=()
    for f in bench_packing_gpu.json bench_policy_loss_liger_gpu.json bench_logprobs_gpu_shapes.json; do
      [ -f "$OUT/$f" ] && extra+=("$f")
    done
    (cd "$OUT" && tar czf gpu_check_extra.tgz "${extra[@]}" && rm -f "${extra[@]}")
  fi
  ls -la "$OUT" | tee -a "$LOG"
fi
say "done in $(( $(date +%s) - T0 ))s (budget ${BUDGET_S}s)"
