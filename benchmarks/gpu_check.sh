#!/usr/bin/env bash
# The checks that need a CUDA device, in one run: the CUDA-marked tests, then
# the GPU checkpoint benchmark (shardkit beside torch.distributed.checkpoint
# and a plain page-locked copy, measured in the same process).
#
#     bash benchmarks/gpu_check.sh            # report on stdout and in $OUT/gpu_check.log
#     REPS=5 GB=2 bash benchmarks/gpu_check.sh
#
# Meant for a machine that already has a CUDA build of torch (pytest and
# pytest-timeout too).  Python packages that machine lacks (zstandard,
# google-crc32c) may travel as cp3xx wheels in ./.whl; they are installed into
# /tmp/site first.  Each step runs under its own time limit so that one slow
# step still leaves the rest of the report; the exit status is the number of
# steps that failed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/shardkit-gpu-check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
REPS=${REPS:-3}
GB=${GB:-2}
failed=0

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

step machine 60 bash -c "nvidia-smi -L; $PY -c 'import torch, shardkit; print(\"torch\", torch.__version__, \
\"cuda\", torch.version.cuda, torch.cuda.get_device_name(0))'"
step cuda-tests 240 $PY -m pytest -q -p no:cacheprovider -m cuda tests/test_checkpoint_cuda.py tests/test_runtime_cuda.py
step checkpoint-cuda-benchmark 300 $PY benchmarks/checkpoint_cuda.py --gb "$GB" --reps "$REPS"

echo "gpu_check: $failed step(s) failed" | tee -a "$LOG"
exit "$failed"
