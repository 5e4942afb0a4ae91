#!/usr/bin/env bash
# The GPU check: everything a session with a GPU measures first, in at most 8 minutes, on a
# bare machine with its own python3 (torch, CuPy, numba-cuda, JAX, pytest, pytest-xdist; nothing
# is installed or fetched). Run from the repository root:
#
#     bash bench/gpu-check.sh [OUT]        # OUT defaults to $OUT, else gpu-check-<date>
#
# Every stage has its own time limit and writes into OUT, so what finished survives a stage
# that did not:
#   env.log          the machine, versions, `hbkernels info`
#   tests.log        the CUDA-path tests (-k "cuda or gpu or nccl", pytest-xdist), -rA summary;
#   junit.xml        the same, one entry per test, written as the run goes
#   host.csv/.log    host time per call at a tiny size, kernel launches and syncs per call
#   roofline.csv/.md/.log   the forward, fp16, 26 tables, fused step and unique at GPU sizes,
#                    each against torch (CUDA events), % of the copy bandwidth
#   quantized.csv/.log      int8 and int4 tables' forward against the float32 forward
#   train.log        `hbkernels train --steps 300` on the GPU (samples/s)
#   second.log       the same job for 20 steps in a fresh process: the first step's time
#                    with every kernel in the on-disk cache
#   summary.txt      one line per stage: its exit status and seconds
# Commit the results under bench/results/ with the date, and fix what fails.
set -u
OUT=${1:-${OUT:-gpu-check-$(date +%F)}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HBK_CUDA_CACHE_DIR=${HBK_CUDA_CACHE_DIR:-/tmp/hbkernels-cuda-cache}
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/hbkernels-numba-cache}
export PYTHONUNBUFFERED=1
: > "$OUT/summary.txt"

# numba-cuda <= 0.30 calls np.row_stack, which NumPy 2.5 removed (hbkernels itself refuses
# such a pair with a clear error; the cuda extras keep numpy < 2.5). On a machine that has the
# pair anyway, a sitecustomize puts the alias back for this check only.
if ! "$PY" -c "import numpy; numpy.row_stack" 2>/dev/null; then
  mkdir -p "$OUT/shim"
  printf 'import numpy\nnumpy.row_stack = numpy.vstack\n' > "$OUT/shim/sitecustomize.py"
  export PYTHONPATH="$OUT/shim:$PYTHONPATH"
  echo "note: np.row_stack restored for numba-cuda (NumPy $("$PY" -c 'import numpy; print(numpy.__version__)'))" >> "$OUT/summary.txt"
fi

stage() {  # stage NAME SECONDS LOG COMMAND...
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
}

{
  date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import sys, numpy, numba, numba_cuda, cupy, torch; print(sys.version.split()[0], 'numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__)"
  "$PY" -m hbkernels info
} > "$OUT/env.log" 2>&1
echo "env rc=$? " >> "$OUT/summary.txt"

WORKERS=$("$PY" -c "import os; print(min(12, os.cpu_count() or 1))")
# a test module whose optional imports (hypothesis, ml_dtypes...) are missing there is
# reported and the others run; pytest-timeout bounds each test where it is installed
PER_TEST=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then PER_TEST=(--timeout 180); fi
stage tests 200 "$OUT/tests.log" "$PY" -m pytest -n "$WORKERS" -k "cuda or gpu or nccl" \
  -p no:cacheprovider -q -rA --continue-on-collection-errors ${PER_TEST[@]+"${PER_TEST[@]}"} \
  --junitxml="$OUT/junit.xml" tests
stage host 40 "$OUT/host.log" "$PY" -m hbkernels.bench.bench_launch --device cuda \
  --out "$OUT/host.csv"
stage roofline 120 "$OUT/roofline.log" "$PY" -m hbkernels.bench.bench_roofline --device cuda \
  --out "$OUT/roofline.csv"
stage quantized 30 "$OUT/quantized.log" "$PY" -m hbkernels.bench.bench_quantized_bag \
  --device cuda --out "$OUT/quantized.csv"
cd "$OUT" || exit 1
stage train 45 "$OUT/train.log" "$PY" -m hbkernels train --steps 300 \
  --metrics "$OUT/train-metrics.json"
stage second 30 "$OUT/second.log" "$PY" -m hbkernels train --steps 20 \
  --metrics "$OUT/second-metrics.json"
rm -rf "$OUT/shim"
cat "$OUT/summary.txt"
