#!/usr/bin/env bash
# One script for the GPU machine (run from the repository root, no network there):
#   0. puts CUTLASS's CuTe DSL on the path when its two parts were carried (step 0 says how);
#   1. installs the carried wheels in .whl/ (trl, its missing deps, liger-kernel, cut-cross-entropy)
#      into /tmp/site, and checks that TRL's chunked head imports;
#   2. runs the GPU tests (tests/test_gpu.py, the kernel modules' compiled cases, the zero-row and fused preference
#      passes on the GPU; PYTEST_MORE adds modules),
#      then scripts/gpu_accuracy.py (every backend against float64) at ACCURACY_SHAPES (default 8k:llama3-8b);
#   3. runs `logitless bench`, writing the JSON into benchmarks/results/, regenerating BENCHMARKS.md and
#      benchmarks/bench.png, and copying all three (and this script's log) to $OUT;
#   4. with E2E_S > 0: `logitless bench --e2e` (whole GRPO training steps) for E2E_S seconds, its JSON to $OUT.
# Stays under ~9 minutes on an H100: each step has a time limit, and the bench gets what is left
# (--time-budget), minus a margin for writing its report.
#
# Knobs (environment): BENCH_ARGS (default: the full grid), TOTAL_S (default 530), PYTEST_S (default 150),
# SKIP_PYTEST=1, SKIP_BENCH=1, PYTEST_MORE, ACCURACY_SHAPES (space-separated; set empty: none), E2E_S (default 0: no e2e
# step; its seconds come off the bench's budget), E2E_ARGS.
set -uo pipefail

START=$(date +%s)
TOTAL_S=${TOTAL_S:-530}
PYTEST_S=${PYTEST_S:-150}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee "$LOG") 2>&1
export PYTHONUNBUFFERED=1
elapsed() { echo $(( $(date +%s) - START )); }
step() { echo; echo "=== [$(elapsed)s] $*"; }
status=0

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())'

step "0. CuTe DSL (impl='cute')"
# Its wheels exceed one transfer: ../shared/tools/carry-big-wheels.sh packs them into .bigwheels/part0,
# part1, ...; calls carrying the first parts run `bash .bigwheels/partK/stage.sh`, then this script's
# call carries the last part (with .whl), while the machine is still warm.
# (the parts carried here: the last one unpacks them all).
for part in .bigwheels/part*/stage.sh; do [ -f "$part" ] && { bash "$part" || echo "CuTe DSL not staged"; }; done
if [ -d /tmp/site/nvidia_cutlass_dsl ]; then
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}
    python3 -c 'import cutlass; print("ok      cutlass", cutlass.__file__)'
else
    echo "no CuTe DSL: its tests are skipped"
fi

step "1. carried wheels"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || { echo "wheel install FAILED"; status=1; }
    ls .whl
else
    echo "no .whl/ folder: using what the image has"
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
python3 - <<'EOF' || true
import importlib
for mod in ("trl.kernels.chunked_logprob", "trl.trainer.utils", "liger_kernel.chunked_loss",
            "liger_kernel.transformers.functional", "cut_cross_entropy", "logitless"):
    try:
        importlib.import_module(mod)
        print(f"ok      {mod}")
    except Exception as e:
        print(f"MISSING {mod}: {type(e).__name__}: {e}")
from trl.kernels.chunked_logprob import ChunkedLogProbFunction  # noqa: F401  (the bench's TRL row)
print("ok      from trl.kernels.chunked_logprob import ChunkedLogProbFunction")
EOF

if [ "${SKIP_PYTEST:-0}" != "1" ]; then
    # The GPU tests (marked cuda) and the kernel test modules, whose interpreter cases run in a
    # child process there; modules that need TRL or the reference cache are left to CPU CI.
    step "2. GPU tests + kernel modules (limit ${PYTEST_S}s)"
    timeout "$PYTEST_S" python3 -m pytest -q -p no:cacheprovider --disable-warnings -rs \
        tests/test_gpu.py tests/test_gemm_backend.py tests/test_triton_backend.py tests/test_flash_backend.py \
        tests/test_weight_grad_kernels.py tests/test_zero_rows.py tests/test_preference_fused.py tests/test_backward_scale.py \
        tests/test_distill_gemm.py tests/test_cute_backend.py tests/test_host_syncs.py tests/test_sum_sq.py \
        tests/test_bench.py::test_in_step_timing_hides_host_work_before_a_read_only \
        ${PYTEST_MORE:-} 2>&1 | tail -40
    rc=${PIPESTATUS[0]}
    echo "pytest exit status $rc"; [ "$rc" = 0 ] || status=1
fi

for shape in ${ACCURACY_SHAPES-8k:llama3-8b}; do
    step "accuracy vs float64 at $shape"
    timeout 150 python3 scripts/gpu_accuracy.py "$shape" "$OUT/accuracy-${shape/:/-}.json"
    rc=$?; echo "accuracy exit status $rc"; [ "$rc" = 0 ] || status=1
done

if [ "${SKIP_BENCH:-0}" = "1" ]; then echo; echo "=== [$(elapsed)s] done (SKIP_BENCH=1), status $status"; exit $status; fi
step "3. logitless bench"
left=$(( TOTAL_S - $(elapsed) ))
E2E_S=${E2E_S:-0}
budget=$(( left - 45 - E2E_S ))   # the last row may run past the budget by a few calls, then the report
if [ "$budget" -lt 30 ]; then echo "no time left for the bench"; exit 1; fi
BENCH_ARGS=${BENCH_ARGS:---full --min-time 0}
# `python3 -m logitless.cli bench` when the top-level CLI imports; else the bench's own entry point.
if python3 -c "import logitless.cli, logitless.demo" 2>/dev/null; then BENCH=(python3 -m logitless.cli bench);
else BENCH=(python3 -m logitless.bench); fi
echo "${BENCH[*]} $BENCH_ARGS --time-budget $budget --update-repo"
timeout $(( left - 5 - E2E_S )) "${BENCH[@]}" $BENCH_ARGS --time-budget "$budget" --update-repo
rc=$?; echo "bench exit status $rc"; [ "$rc" = 0 ] || status=1

newest=$(ls -t benchmarks/results/*.json 2>/dev/null | head -1)
[ -n "$newest" ] && cp "$newest" "$OUT/"

if [ "$E2E_S" -gt 0 ]; then
    step "4. logitless bench --e2e (${E2E_S}s)"
    left=$(( TOTAL_S - $(elapsed) ))
    timeout $(( left - 5 )) "${BENCH[@]}" --e2e ${E2E_ARGS:-} --time-budget $(( left - 40 )) --out /tmp/e2e --no-report
    rc=$?; echo "e2e exit status $rc"; [ "$rc" = 0 ] || status=1
    cp /tmp/e2e/benchmarks/results/*.json "$OUT/" 2>/dev/null
fi
[ -f BENCHMARKS.md ] && cp BENCHMARKS.md "$OUT/"
[ -f benchmarks/bench.png ] && cp benchmarks/bench.png "$OUT/"
step "done, status $status; files in \$OUT:"
ls -la "$OUT"
exit $status
