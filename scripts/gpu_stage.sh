#!/usr/bin/env bash
# The second staging call of the CuTe DSL (../shared/tools/carry-big-wheels.sh; the first call runs
# `bash .bigwheels/part0/stage.sh`) and the carried wheels; source it: it exports PYTHONPATH.
bash .bigwheels/part1/stage.sh >/dev/null 2>&1 || echo "CuTe DSL not staged"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/src:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
export PYTHONUNBUFFERED=1
