#!/usr/bin/env bash
# The last staging call of the CuTe DSL (../shared/tools/carry-big-wheels.sh; the calls before run
# `bash .bigwheels/partK/stage.sh` for the first parts) and the carried wheels; source it: it
# exports PYTHONPATH.
for part in .bigwheels/part*/stage.sh; do [ -f "$part" ] && { bash "$part" >/dev/null 2>&1 || echo "CuTe DSL not staged"; }; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/src:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
export PYTHONUNBUFFERED=1
