#!/usr/bin/env bash
# `logitless demo --device cuda` on one GPU, no network (run from the repository root):
#   scripts/gpu_demo.sh path/to/SmolLM2-135M-Instruct.Q4_1.gguf
# The GGUF file is the one the CPU demo extracts into ~/.cache/logitless/smollm2/; carry it.
# Wheels in .whl/ (as for gpu_check.sh) are installed into /tmp/site first: the demo needs
# trl 1.16 and gguf (gguf's own deps: numpy, pyyaml, requests, tqdm) besides what the image has.
# Writes reward.png, summary.json and demo.log to $OUT (default /tmp/gpu_demo_out).
set -uo pipefail
GGUF=${1:?usage: scripts/gpu_demo.sh path/to/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-/tmp/gpu_demo_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/demo.log") 2>&1
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || { echo "wheel install FAILED"; exit 1; }
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
time python3 -m logitless.cli demo --device cuda --model "$GGUF" --output-dir "$OUT" ${DEMO_ARGS:-}
