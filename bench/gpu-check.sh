#!/usr/bin/env bash
# The GPU check: what a machine with a GPU measures first, on a bare machine with its own
# python3 (torch, CuPy, numba-cuda, JAX, pytest, pytest-xdist; nothing is installed or fetched).
# Run from the repository root:
#
#     bash bench/gpu-check.sh [--quick | --simulate] [--kernels TGZ] [--tests FILE]
#                             [--roofline CASES] [--total SECONDS] [OUT]
#
#   (no option)  every stage, 420 s at most: env, preflight, tests (every test the cuda or gpu
#                marker selects, the benchmarks' kernels compiled beside them), null, host,
#                train, second, graph (the main job with --cuda-graph), roofline, quantized
#   --quick      preflight, null, host, train, second, graph, roofline: 180 s at most, for a
#                rerun after a fix
#   --simulate   every stage in Numba's CUDA simulator at tiny sizes, the tests stage on a few
#                files: a rehearsal on a machine without a GPU, in about 3 minutes
#   --kernels TGZ   the kernel-cache.tgz of an earlier run, unpacked into the kernel cache first:
#                the kernels it holds are not compiled again
#   --tests FILE    the tests stage runs the test ids FILE lists, one per line (with --quick too)
#   --roofline CASES  the roofline stage runs these of bench_roofline's cases (its --cases)
#   --total SECONDS   the check's own limit instead of its mode's
#
# Stages write into a work folder outside OUT ($HBK_CHECK_WORK, else a new folder under /tmp).
# After every stage, and on exit, OUT (default $OUT, else gpu-check-<date>) holds at most these
# 7 files, none in a subfolder:
#   summary.txt       a line per stage: NAME rc=N seconds=N limit=N selected=N passed=N failed=N
#                     errors=N skipped=N [-- why]; rc=124 is a stage killed at its limit, rc=skipped
#                     one not run; the counts are tests (tests) or checks (preflight), else -
#   failures.txt      each stage that failed with the end of its log; each failed test with the
#                     first and the last lines of its traceback
#   junit.xml         the tests stage's results, one entry per test
#   roofline.csv      the roofline stage's rows
#   env.log           the machine, the versions, `hbkernels info`
#   results.tgz       the whole work folder: every stage's log, CSV, report and chart
#   kernel-cache.tgz  the compiled kernels (when under 16 MiB), for --kernels on the next machine
# The check ends by printing summary.txt and the head of failures.txt.
# HBK_CHECK_LIMITS="stage=seconds ..." sets a stage's own limit.
set -u
MODE=full
KERNELS=
TESTS=
ROOFLINE=
ARG_TOTAL=
ARG_OUT=
while [ $# -gt 0 ]; do
  case $1 in
    --quick) MODE=quick ;;
    --simulate) MODE=simulate ;;
    --kernels) KERNELS=${2:?--kernels needs a file}; shift ;;
    --tests) TESTS=${2:?--tests needs a file}; shift ;;
    --roofline) ROOFLINE=${2:?--roofline needs cases}; shift ;;
    --total) ARG_TOTAL=${2:?--total needs seconds}; shift ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
    *) ARG_OUT=$1 ;;
  esac
  shift
done
OUT=${ARG_OUT:-${OUT:-gpu-check-$(date +%F)}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
ROOT=$(pwd)
PY=${PYTHON:-python3}
WORK=${HBK_CHECK_WORK:-$(mktemp -d /tmp/hbk-gpu-check.XXXXXX)}
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd) || exit 2
case $MODE in
  full) TOTAL=420 ;;
  quick) TOTAL=180 ;;
  simulate) TOTAL=300 ;;
esac
TOTAL=${ARG_TOTAL:-$TOTAL}
GRACE=5      # seconds between a stage's interrupt at its limit and its kill
RESERVE=8    # seconds kept for the last packing of OUT
DEADLINE=$((SECONDS + TOTAL))
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HBK_CUDA_CACHE_DIR=${HBK_CUDA_CACHE_DIR:-$WORK/kernels}
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-$WORK/numba-cache}
export PYTHONUNBUFFERED=1
if [ "$MODE" = simulate ]; then export NUMBA_ENABLE_CUDASIM=1; else export NUMBA_ENABLE_CUDASIM=0; fi
mkdir -p "$HBK_CUDA_CACHE_DIR"
: > "$WORK/summary.txt"
: > "$WORK/stage-failures.txt"
: > "$WORK/notes.txt"

# numba-cuda <= 0.30 calls np.row_stack, which NumPy 2.5 removed; on a machine with that pair a
# sitecustomize outside OUT puts the alias back for this check only
if ! "$PY" -c "import numpy; numpy.row_stack" 2>/dev/null; then
  mkdir -p "$WORK/shim"
  printf 'import numpy\nnumpy.row_stack = numpy.vstack\n' > "$WORK/shim/sitecustomize.py"
  export PYTHONPATH="$WORK/shim:$PYTHONPATH"
  echo "np.row_stack restored for numba-cuda (NumPy $("$PY" -c 'import numpy; print(numpy.__version__)'))" >> "$WORK/notes.txt"
fi
if [ -n "$KERNELS" ]; then
  if tar -xzf "$KERNELS" -C "$HBK_CUDA_CACHE_DIR"; then
    echo "kernels from $KERNELS: $(find "$HBK_CUDA_CACHE_DIR" -name '*.cubin' | wc -l) cubins" >> "$WORK/notes.txt"
  else
    echo "kernels from $KERNELS: could not be unpacked" >> "$WORK/notes.txt"
  fi
fi

limit_of() {  # limit_of NAME DEFAULT: the stage's limit, cut to the time left
  local name=$1 limit=$2 word
  for word in ${HBK_CHECK_LIMITS:-}; do
    [ "${word%%=*}" = "$name" ] && limit=${word#*=}
  done
  local left=$((DEADLINE - SECONDS - GRACE - RESERVE))
  [ "$left" -lt "$limit" ] && limit=$left
  echo $((limit < 0 ? 0 : limit))
}

record() {  # record NAME RC SECONDS LIMIT COUNTS [WHY]
  local line="$1 rc=$2 seconds=$3 limit=$4 $5${6:+ -- $6}"
  echo "$line" >> "$WORK/summary.txt"
  echo "$line"
}

counts() {  # counts NAME: the selected/passed/failed/errors/skipped fields of a stage
  case $1 in
    tests) "$PY" - "$WORK/tests/tally.json" <<'EOF' 2>/dev/null || echo "selected=- passed=- failed=- errors=- skipped=-"
import json, sys
t = json.load(open(sys.argv[1]))
print(" ".join(f"{k}={t[k]}" for k in ("selected", "passed", "failed", "errors", "skipped")))
EOF
      ;;
    preflight)
      local ok failed
      ok=$(grep -c '^ok ' "$WORK/preflight.log" 2>/dev/null)
      failed=$(grep -c '^FAILED ' "$WORK/preflight.log" 2>/dev/null)
      echo "selected=$((ok + failed)) passed=$ok failed=$failed errors=0 skipped=0" ;;
    *) echo "selected=- passed=- failed=- errors=- skipped=-" ;;
  esac
}

stage() {  # stage NAME LIMIT COMMAND...: run it into WORK/NAME.log within its limit
  local name=$1 limit
  limit=$(limit_of "$1" "$2")
  shift 2
  if [ "$limit" -lt 1 ]; then
    record "$name" skipped 0 0 "$(counts none)" "no time left"
    return
  fi
  local t0=$SECONDS rc
  timeout --signal=INT --kill-after=$GRACE "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  local why=
  [ $rc -eq 124 ] && why="killed at its limit of $limit s"
  if [ $rc -ne 0 ]; then
    { echo "FAILED stage $name: rc=$rc${why:+ ($why)}; the end of $name.log:"
      tail -n 25 "$WORK/$name.log" | sed 's/^/    /'; echo; } >> "$WORK/stage-failures.txt"
  fi
  record "$name" $rc $((SECONDS - t0)) "$limit" "$(counts "$name")" "$why"
}

skip() {  # skip NAME WHY
  record "$1" skipped 0 0 "$(counts none)" "$2"
}

collect() {  # bring OUT up to date: each file written aside, then renamed into place
  local f
  cp "$WORK/summary.txt" "$OUT/.summary.txt" && mv "$OUT/.summary.txt" "$OUT/summary.txt"
  { cat "$WORK/stage-failures.txt"
    if [ -s "$WORK/tests/failures.txt" ]; then
      echo "== failed tests"; cat "$WORK/tests/failures.txt"
    fi
  } > "$OUT/.failures.txt" && mv "$OUT/.failures.txt" "$OUT/failures.txt"
  for f in junit.xml roofline.csv env.log; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/.$f" && mv "$OUT/.$f" "$OUT/$f"
  done
  tar -czf "$OUT/.results.tgz" -C "$WORK" --exclude=./kernels --exclude=./numba-cache \
    --exclude=./shim . 2>/dev/null && mv "$OUT/.results.tgz" "$OUT/results.tgz"
  if [ -d "$HBK_CUDA_CACHE_DIR" ] && [ -n "$(find "$HBK_CUDA_CACHE_DIR" -maxdepth 1 -name '*.cubin' -print -quit)" ]; then
    (cd "$HBK_CUDA_CACHE_DIR" && find . -maxdepth 1 -name '*.cubin' | tar -czf "$OUT/.kernel-cache.tgz" -T -)
    if [ "$(stat -c %s "$OUT/.kernel-cache.tgz")" -lt $((16 << 20)) ]; then
      mv "$OUT/.kernel-cache.tgz" "$OUT/kernel-cache.tgz"
    else
      rm -f "$OUT/.kernel-cache.tgz"
      grep -q "kernel cache over 16 MiB" "$WORK/notes.txt" || echo "kernel cache over 16 MiB: not packed" >> "$WORK/notes.txt"
    fi
  fi
}

finish() {
  trap - EXIT INT TERM
  collect
  echo
  echo "== $OUT/summary.txt ($MODE, $SECONDS s)"
  cat "$OUT/summary.txt"
  [ -s "$WORK/notes.txt" ] && sed 's/^/note: /' "$WORK/notes.txt"
  if [ -s "$OUT/failures.txt" ]; then
    echo "== the head of $OUT/failures.txt"
    head -c 9000 "$OUT/failures.txt"
  fi
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -- env -------------------------------------------------------------------------------
stage env 30 bash -c '
  date -u; cat "$0" 2>/dev/null
  nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$1" -c "import sys, numpy, numba; print(sys.version.split()[0], \"numpy\", numpy.__version__, \"numba\", numba.__version__)"
  for m in numba_cuda cupy torch; do "$1" -c "import $m; print(\"$m\", $m.__version__)" 2>&1 | tail -n 1; done
  "$1" -m hbkernels info' "$WORK/notes.txt" "$PY"
collect

# -- preflight: compile, run and compare one call per op, a planted error ------------------
stage preflight 30 "$PY" -m hbkernels check
PREFLIGHT=$(tail -n 1 "$WORK/summary.txt")
collect

# -- tests, and the benchmarks' kernels compiled beside them --------------------------------
if [ "$MODE" != quick ] || [ -n "$TESTS" ]; then
  if [[ $PREFLIGHT != "preflight rc=0 "* ]]; then
    skip tests "the preflight failed (failures.txt says why)"
  else
    mkdir -p "$WORK/tests"
    if [ "$MODE" = simulate ]; then
      WORKERS=1
      FILES=(tests/test_pending_checks.py tests/test_host_syncs.py tests/test_dispatch.py)
      WARM=(warmup --device cuda --dims 3 --no-train)
    else
      WORKERS=$("$PY" -c "import os; print(max(1, min(12, (os.cpu_count() or 1) - 2)))")
      FILES=(tests)
      WARM=(warmup --device cuda)
    fi
    if [ -n "$TESTS" ]; then
      mapfile -t FILES < <(grep -v '^[[:space:]]*$' "$TESTS")
      [ "$MODE" = quick ] && WARM=()
    fi
    ARGS=(-m "cuda or gpu" -p no:cacheprovider -v -rA --continue-on-collection-errors
          --junitxml="$WORK/junit.xml")
    if [ "$WORKERS" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then ARGS+=(-n "$WORKERS"); fi
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then ARGS+=(--timeout 60); fi
    THREADS=$("$PY" -c "import os; print(max(1, (os.cpu_count() or 1) // $WORKERS))")
    TESTS_LIMIT=$(limit_of tests 150)
    WARM_PID=
    if [ ${#WARM[@]} -gt 0 ]; then
      stage warmup "$TESTS_LIMIT" "$PY" -m hbkernels "${WARM[@]}" &  # bounded by the same limit
      WARM_PID=$!
    fi
    HBK_TEST_REPORT_DIR="$WORK/tests" OMP_NUM_THREADS=$THREADS NUMBA_NUM_THREADS=$THREADS \
      stage tests "$TESTS_LIMIT" "$PY" -m pytest "${ARGS[@]}" "${FILES[@]}"
    [ -n "$WARM_PID" ] && wait "$WARM_PID"
  fi
  collect
fi

# -- benchmarks, the main job ---------------------------------------------------------------
SMOKE=()
[ "$MODE" = simulate ] && SMOKE=(--smoke)
NUMBA_ENABLE_CUDASIM=0 stage null 30 "$PY" -m hbkernels.bench.bench_launch --device null \
  "${SMOKE[@]}" --out "$WORK/null.csv"  # the host's cost of each call with no kernel run
NULL=()
[ -s "$WORK/null.csv" ] && NULL=(--null "$WORK/null.csv")
stage host 40 "$PY" -m hbkernels.bench.bench_launch --device cuda "${SMOKE[@]}" \
  --out "$WORK/host.csv" "${NULL[@]}"
collect
if [ "$MODE" = simulate ]; then
  JOB=(--batch-size 8 --eval-samples 8 --table c0:100:1 --table c1:50:2 --dim 2 --bottom 4 --top 4)
  STEPS=(2 1)
else
  JOB=()
  STEPS=(300 20)
fi
mkdir -p "$WORK/train"
cd "$WORK/train" || exit 1
stage train 30 "$PY" -m hbkernels train --device cuda --steps "${STEPS[0]}" "${JOB[@]}" \
  --metrics "$WORK/train/train-metrics.json"
collect
stage second 20 "$PY" -m hbkernels train --device cuda --steps "${STEPS[1]}" "${JOB[@]}" \
  --metrics "$WORK/train/second-metrics.json"
collect
stage graph 30 "$PY" -m hbkernels train --device cuda --cuda-graph --batch-threads 4 \
  --steps "${STEPS[0]}" "${JOB[@]}" --metrics "$WORK/train/graph-metrics.json"
collect
cd "$ROOT" || exit 1
ROOF=()
[ -n "$ROOFLINE" ] && ROOF=(--cases "$ROOFLINE")
stage roofline 110 "$PY" -m hbkernels.bench.bench_roofline --device cuda "${SMOKE[@]}" "${ROOF[@]}" \
  --out "$WORK/roofline.csv"
collect
if [ "$MODE" != quick ]; then
  stage quantized 15 "$PY" -m hbkernels.bench.bench_quantized_bag --device cuda "${SMOKE[@]}" \
    --out "$WORK/quantized.csv"
fi
