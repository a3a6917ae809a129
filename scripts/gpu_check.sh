#!/usr/bin/env bash
# One run on a machine with a GPU and its own torch (no network there): configure and build
# against that torch, run the GPU tests and the GPU benchmarks, write everything to OUT_DIR.
# Budget: under 8 minutes on a 16-core machine.
#   usage: bash scripts/gpu_check.sh OUT_DIR
set -uo pipefail
OUT="${1:?usage: gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${FSDP_EMA_PYTHON:-$(command -v python3)}"
BUILD="$ROOT/build-gpu"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export FSDP_EMA_LIBRARY="$BUILD/lib/libfsdp_ema.so"
status=0
step() { echo "== $*" | tee -a "$OUT/summary.txt"; }
run() {  # run NAME TIMEOUT CMD...: logs to OUT/NAME.log, records the exit status
  local name="$1" limit="$2"; shift 2
  step "$name: $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc" | tee -a "$OUT/summary.txt"
  tail -n 15 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}

{
  date -u
  nvidia-smi || true
  nvcc --version || echo "nvcc: not found"
  "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  nproc
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

generator="Unix Makefiles"
command -v ninja >/dev/null && generator=Ninja
# sm_90 only here (an H200): the default 80-real;90 list doubles device compile time.
run configure 180 cmake -S "$ROOT" -B "$BUILD" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DPython3_EXECUTABLE="$PY" -DFSDP_EMA_CUDA=ON -DFSDP_EMA_CUDA_ARCHITECTURES=90
run build 300 cmake --build "$BUILD" --parallel "$(nproc)"

if [ -f "$BUILD/tests/CTestTestfile.cmake" ]; then
  run ctest 240 ctest --test-dir "$BUILD" --output-on-failure --parallel 8 --timeout 200
else
  step "ctest: skipped (no GoogleTest on this machine)"
fi
if "$PY" -c "import pytest" 2>/dev/null; then
  run pytest 300 "$PY" -m pytest -q -x "$ROOT/python_tests" -k "cuda" -p no:cacheprovider
else
  step "pytest: skipped (not installed on this machine); the C++ CUDA tests and the benchmark still run"
  status=1
fi
run bench_update 300 "$PY" "$ROOT/bench/bench_update.py" --device cuda --json "$OUT/bench_update_cuda.json"

step "overall exit $status"
exit $status
