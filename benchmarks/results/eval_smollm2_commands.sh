#!/usr/bin/env bash
# The invocations behind benchmarks/results/eval_smollm2.{json,md,png} (CPU, one thread, nice 19,
# one after another). Every run directory under benchmarks/results/eval_runs/ is resumable: rerunning
# this script runs only unfinished items. Needs runs/demo/export (make demo) and
# runs/demo_hybrid/export (fastrehearse train --config configs/demo.yaml --set run_dir=runs/demo_hybrid
# --set rollout.mode=hybrid).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="nice -n 19 .venv/bin/python benchmarks/bench_eval.py --threads 1"
B=smollm2; R=runs/demo/export; H=runs/demo_hybrid/export
SCRATCH=${SCRATCH:-/tmp/eval_smollm2_partial.json}   # per-invocation reports; the final one is step 7
# 1. builtin EASY (the demo task distribution): N=0 with fidelity, all three models; drift rows (trained)
$PY --models $B,$R,$H --jobs builtin-easy-r0,builtin-easy-r0-drift --limit-easy 32 --json $SCRATCH
# 2. builtin-test (mixed levels) and BFCL single-turn at N=0: base vs rehearse-trained
$PY --models $B,$R --jobs builtin-r0,bfcl-single-r0 --limit-builtin 24 --limit-bfcl 4 --json $SCRATCH
# 3. EASY with the answer checked, clean and drifted: the two trained models
$PY --models $R,$H --jobs builtin-easy-answer-r0,builtin-easy-answer-r0-drift --limit-easy 24 --json $SCRATCH
# 4. test-time rehearsal sweep N=1,2,4 on builtin EASY (the base never calls there: fewer tasks)
$PY --models $R --jobs builtin-easy-r1,builtin-easy-r2,builtin-easy-r4 --limit-easy 24 --json $SCRATCH
$PY --models $B --jobs builtin-easy-r1,builtin-easy-r2,builtin-easy-r4 --limit-easy 8 --json $SCRATCH
# 5. N=2 on builtin-test and BFCL single-turn; BFCL multi-turn and tau2 at N=0 (long prompts: few items)
$PY --models $B,$R --jobs builtin-r2,bfcl-single-r2,bfcl-multi-r0,tau2-r0 --limit-builtin 8 --limit-bfcl 2 \
    --limit-bfcl-multi 1 --limit-tau2 1 --json $SCRATCH
# 6. Not run (CPU budget of ~75 min for the whole report spent): N=2 on BFCL multi-turn and tau2
# $PY --models $R --jobs bfcl-multi-r2,tau2-r2 --limit-bfcl-multi 1 --limit-tau2 1 --json $SCRATCH
# 7. the report over every run directory (runs nothing new)
$PY --models $B,$R,$H --report-only --notes benchmarks/results/eval_smollm2_notes.md
