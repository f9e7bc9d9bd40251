#!/usr/bin/env bash
# Everything that needs a CUDA device, in one run of at most 9.5 minutes on one GPU, with one report:
#
#   machine            nvidia-smi, torch, CUDA and NCCL versions, GPU count
#   cuda-tests         every test marked `cuda` (pytest -m cuda over the test files that use the mark)
#   runtime-world1     benchmarks/runtime.py: shardkit's fully_shard vs torch's, NCCL, 1 rank on 1 GPU
#   runtime-world2     the same on 2 ranks, one GPU each (skipped on a machine with one GPU)
#   checkpoint-cuda    benchmarks/checkpoint_cuda.py: async_save with pinned staging, blocking time and
#                      stream time vs DCP's async_save with its pinned stager, save and load vs DCP
#   nccl-shared-reads  benchmarks/shared_reads_nccl.py: an HSDP load whose replicated bytes travel over
#                      NCCL, checked bitwise on every rank (needs 2 GPUs: NOT VERIFIED on one)
#   peers-cuda         benchmarks/peers.py --device cuda: shardkit vs DCP vs torch_checkpointing (pinned
#                      staging for all three), save / load / resharding load / async blocking at
#                      $PEERS_SIZES, 3 rounds; on one GPU its sharded job runs at 1 rank and it prints
#                      the 2-rank cells as NOT VERIFIED
#
#     bash benchmarks/gpu_check.sh        # report: $OUT/gpu_check_report.txt, full output: $OUT/gpu_check.log
#     GB=2 REPS=5 bash benchmarks/gpu_check.sh
#
# The report lists every step (PASSED, FAILED, TIMED OUT, SKIPPED or NOT VERIFIED, and why) and every figure the steps
# printed as a `FIGURE ... MET|MISSED` line; a step that failed adds a MISSED figure of its own.
#
# Time: each step runs under its own limit (below) and the limits add up to 560 s, so even a run in
# which every step hits its limit ends within 9.5 minutes (give the device call 600 s; installing
# wheels from ./.whl, when needed, adds at most 60 s).  Expected on one H100: about 5 minutes, scaled
# from the H200 run in docs/performance.md (checkpoint_cuda.py at 2 GB: about 10 s a round for both
# systems, so about 40 s at 1 GB with 3 rounds, warm-up saves and setup), plus process and NCCL start-up
# (10-20 s per torchrun job) for the 7M-parameter runtime model's 12 steps and the 600 MB load, plus
# peers-cuda (limit 150 s; about 2 minutes, not yet measured on a GPU): per size one sharded and one
# 1-process torchrun job (NCCL and torch_checkpointing's writer subprocess start-up each), then 4 rounds
# of 15 timed operations, no sleep after the page cache is dropped.
#
# Without a CUDA device (or without torch) every step is reported SKIPPED with the reason and the run
# exits 0 within seconds.  Python packages the machine lacks (zstandard, google-crc32c) may travel as
# cp3xx wheels in ./.whl: they are installed into /tmp/site when the modules do not import.  The exit
# status is the number of steps that failed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/shardkit-gpu-check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
REPORT="$OUT/gpu_check_report.txt"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
: >"$LOG"
: >"$WORK/steps"
: >"$WORK/figures"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
GB=${GB:-1}
REPS=${REPS:-3}
PEERS_SIZES=${PEERS_SIZES:-50MB,1GB}
failed=0
started=$SECONDS

note() { echo "$*" | tee -a "$LOG"; }

if ! $PY -c 'import zstandard, google_crc32c' >/dev/null 2>&1 && ls .whl/*.whl >/dev/null 2>&1; then
    note "installing $(ls .whl/*.whl | wc -l) wheel(s) from .whl into /tmp/site"
    timeout 60 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >>"$LOG" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

gpus=$($PY -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>>"$LOG")
if [ -z "$gpus" ]; then
    no_gpu="torch does not import with $PY (see the log)"
elif [ "$gpus" -eq 0 ]; then
    no_gpu="no CUDA device (torch.cuda.is_available() is False)"
else
    no_gpu=""
fi

skip() {  # skip NAME REASON
    echo "$1: SKIPPED: $2" >>"$WORK/steps"
    note "=== $1: skipped: $2"
}

not_verified() {  # not_verified NAME REASON: a path this machine cannot run, reported as such, not as a skip
    echo "$1: NOT VERIFIED: $2" >>"$WORK/steps"
    echo "[$1] NOT VERIFIED: $2" >>"$WORK/figures"
    note "=== $1: NOT VERIFIED: $2"
}

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    if [ -n "$no_gpu" ]; then
        skip "$name" "$no_gpu"
        return
    fi
    note "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$WORK/out" 2>&1
    local rc=$?
    local took=$((SECONDS - start))
    cat "$WORK/out" >>"$LOG"
    tail -n 20 "$WORK/out"
    local verdict=PASSED
    if [ "$rc" -eq 0 ] && grep -q '^skipped: ' "$WORK/out"; then  # the script found too little to run on
        verdict="SKIPPED: $(grep -m 1 '^skipped: ' "$WORK/out" | cut -c 10-)"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        verdict="TIMED OUT"
    elif [ "$rc" -ne 0 ]; then
        verdict=FAILED
    fi
    note "=== $name: $verdict (exit $rc) after $took s"
    echo "$name: $verdict (exit $rc) after $took s of $limit s" >>"$WORK/steps"
    grep '^FIGURE ' "$WORK/out" | sed "s/^FIGURE /[$name] /" >>"$WORK/figures"
    if [ "$verdict" != PASSED ] && [ "$rc" -ne 0 ]; then
        failed=$((failed + 1))
        echo "[$name] step finished: $verdict (exit $rc) MISSED" >>"$WORK/figures"
    fi
}

pytest_figure() {  # the pytest summary line of the last step as a figure: MET when tests passed and none failed
    local summary
    summary=$(grep -E ' in [0-9.]+s' "$WORK/out" | tail -n 1 | tr -d '=' | sed 's/^ *//')
    case "$summary" in
        *failed*|*error*|"") echo "[cuda-tests] CUDA tests: ${summary:-no summary} MISSED" >>"$WORK/figures" ;;
        *passed*) echo "[cuda-tests] CUDA tests: $summary MET" >>"$WORK/figures" ;;
        *) echo "[cuda-tests] CUDA tests: $summary (none ran on the GPU) MISSED" >>"$WORK/figures" ;;
    esac
}

step machine 20 bash -c "nvidia-smi -L; $PY -c 'import torch, shardkit; print(\"torch\", torch.__version__, \
\"cuda\", torch.version.cuda, \"nccl\", torch.cuda.nccl.version(), torch.cuda.device_count(), \"GPU(s):\", \
torch.cuda.get_device_name(0))'"
step cuda-tests 100 $PY -m pytest -q -p no:cacheprovider -m cuda $(grep -rlE '^(pytestmark = |@)pytest\.mark\.cuda' --include='test_*.py' tests | LC_ALL=C sort)
[ -z "$no_gpu" ] && pytest_figure
step runtime-world1 60 $PY benchmarks/runtime.py --device cuda --world 1 --rounds 0 --steps 10 --warmup 2
if [ -z "$no_gpu" ] && [ "$gpus" -lt 2 ]; then
    skip runtime-world2 "one GPU (2 NCCL ranks need 2)"
else
    step runtime-world2 60 $PY benchmarks/runtime.py --device cuda --world 2 --rounds 0 --steps 10 --warmup 2
fi
step checkpoint-cuda 110 $PY benchmarks/checkpoint_cuda.py --gb "$GB" --reps "$REPS"
if [ -z "$no_gpu" ] && [ "$gpus" -lt 2 ]; then
    not_verified nccl-shared-reads "one GPU: NCCL between ranks needs 2, so shared reads over NCCL did not run"
else
    step nccl-shared-reads 60 $PY benchmarks/shared_reads_nccl.py --ranks 2 --mb 600
fi
step peers-cuda 150 $PY benchmarks/peers.py --device cuda --sizes "$PEERS_SIZES" --rounds 3 --warmup 1 --cold-sleep 0

{
    echo "shardkit GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "machine: ${gpus:-?} GPU(s)${no_gpu:+; $no_gpu}; $((SECONDS - started)) s in all"
    echo
    echo "steps"
    sed 's/^/  /' "$WORK/steps"
    echo
    echo "figures"
    if [ -s "$WORK/figures" ]; then
        sed 's/^/  /' "$WORK/figures"
    else
        echo "  none (every step was skipped)"
    fi
    echo
    echo "$(grep -c ' MET$' "$WORK/figures") MET, $(grep -c ' MISSED$' "$WORK/figures") MISSED; $failed step(s) failed"
} >"$REPORT"
cat "$REPORT" | tee -a "$LOG"
exit "$failed"
