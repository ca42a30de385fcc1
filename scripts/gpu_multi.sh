#!/usr/bin/env bash
# TRL's GRPOTrainer / SFTTrainer against logitless's drop-ins on 2 GPUs, under FSDP2 and DeepSpeed ZeRO-3
# (accelerate launch; scripts/gpu_multi.py has the details). Run from the repository root:
#
#     bash scripts/gpu_multi.sh
#
#   1. installs the wheels carried in .whl/ and .whl-multi/ (TRL, deepspeed and their missing dependencies; the GPU
#      machine has no network) into /tmp/site, without touching the system's packages;
#   2. runs each case (engine x trainer x head) as its own `accelerate launch --num_processes 2`, each under a time
#      limit, GRPO first;
#   3. merges the cases into $OUT/gpu_multi.json and prints ours against TRL per step.
# Everything goes to $OUT (default ./out): the JSON, one JSON per case in $OUT/cases/, this log.
#
# Knobs (environment): ENGINES (default "fsdp2 zero3"), TRAINERS (default "grpo sft"), CASE_S (limit per launch,
# default 170 s), TOTAL_S (default 560 s: cases that would not fit are skipped), NPROC (default 2), ARGS (more
# scripts/gpu_multi.py arguments, e.g. "--layers 12 --steps 3"), PY (default python3), SKIP_WHEELS=1,
# CPU_CHECK=1 (a tiny model on the CPU: 2 gloo processes, DDP instead of FSDP2, DeepSpeed's CPU path; checks the
# script, measures nothing).
set -uo pipefail

START=$(date +%s)
OUT=${OUT:-./out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
TOTAL_S=${TOTAL_S:-560}
CASE_S=${CASE_S:-170}
ENGINES=${ENGINES:-"fsdp2 zero3"}
TRAINERS=${TRAINERS:-"grpo sft"}
NPROC=${NPROC:-2}
ARGS=${ARGS:-}
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
exec > >(tee "$OUT/gpu_multi.log") 2>&1
export PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
elapsed() { echo $(( $(date +%s) - START )); }
step() { echo; echo "=== [$(elapsed)s] $*"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"

step "1. carried wheels"
if [ "${SKIP_WHEELS:-0}" != "1" ]; then
    for d in .whl .whl-multi; do
        if compgen -G "$d/*.whl" > /dev/null; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$d"/*.whl \
                || echo "wheel install from $d FAILED"
            ls "$d"
        else
            echo "no $d/ wheels: using what the image has"
        fi
    done
    export PYTHONPATH=$SITE:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
"$PY" - <<'PYEOF'
import importlib
for mod in ("torch", "transformers", "accelerate", "trl", "datasets", "deepspeed", "logitless"):
    try:
        m = importlib.import_module(mod)
        print(f"ok      {mod} {getattr(m, '__version__', '')} ({m.__file__})")
    except Exception as e:
        print(f"MISSING {mod}: {type(e).__name__}: {e}")
PYEOF

EXTRA=()
if [ "${CPU_CHECK:-0}" = "1" ]; then
    ARGS="--tiny --steps 2 --batch 4 --prompt-len 8 --completion-len 24 $ARGS"
    EXTRA=(--mixed_precision no)
fi

step "2. cases (limit ${CASE_S}s each, ${TOTAL_S}s in all)"
rm -rf "$OUT/cases"
port=29520
for trainer in $TRAINERS; do
    for engine in $ENGINES; do
        for impl in trl logitless; do
            name="$engine-$trainer-$impl"
            left=$(( TOTAL_S - $(elapsed) - 20 ))
            if [ "$left" -lt 60 ]; then
                echo "SKIPPED $name: ${left}s left of TOTAL_S"
                continue
            fi
            limit=$(( left < CASE_S ? left : CASE_S ))
            port=$(( port + 1 ))
            step "$name (limit ${limit}s)"
            # shellcheck disable=SC2086  # ARGS is a list of arguments
            timeout -k 15 "$limit" "$PY" -m accelerate.commands.launch --num_processes "$NPROC" \
                --config_file "scripts/accelerate/$engine.yaml" --main_process_port "$port" "${EXTRA[@]}" \
                scripts/gpu_multi.py --engine "$engine" --trainer "$trainer" --impl "$impl" --out "$OUT/cases" $ARGS
            rc=$?
            [ "$rc" = 0 ] && echo "done $name" || echo "FAILED $name (exit $rc$([ "$rc" = 124 ] && echo ': time limit'))"
        done
    done
done

step "3. report"
"$PY" scripts/gpu_multi.py --report "$OUT"
step "end ($(elapsed)s)"
