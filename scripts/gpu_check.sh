#!/usr/bin/env bash
# One run on the bare GPU machine (H200: sm_90, 16 cores, python3 with torch, nvcc, CMake, ninja,
# pytest; no network, no pip): configure and build what the GPU checks need against that machine's
# torch, run only the CUDA tests (ctest and pytest) and the CUDA benchmarks, and write at most 8
# files to OUT_DIR. The third-party headers, CMake configs and GoogleTest libraries come from
# gpu-deps/ (scripts/stage_gpu_deps.sh, carried by the device tool). Budget: the step timeouts
# below sum to 520 s (560 with every kill grace), under the 10 minutes one run may take.
#
#   bash scripts/gpu_check.sh OUT_DIR             # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run OUT_DIR   # here, no GPU: the same configure and build
#       against the torch 2.11.0+cu130 wheel (downloaded into build-gpu-torch/, never installed),
#       with the system copies of the staged packages hidden (a private mount namespace), then
#       checks the architectures and header sources and runs on the CPU what can run there.
#
# A failed configure or build stops the run at once (exit 2); failed tests or missed benchmark
# targets are reported and give exit 1 after every step has run.
set -uo pipefail

DRY=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY=1
  shift
fi
OUT="${1:?usage: gpu_check.sh [--dry-run] OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAGE="${FSDP_EMA_GPU_DEPS:-$ROOT/gpu-deps}"
ARCHS="90-real"            # the H200: one sm_90 cubin, no PTX (compile time is the budget)
EXPECT_ELF="sm_90"
TORCH_WHEEL_VERSION="2.11.0"  # the GPU machine's torch (2.11.0+cu130)
SUMMARY="$OUT/summary.txt"
# This run's files only (the logs below are appended to step by step).
rm -f "$OUT"/{machine.txt,summary.txt,build.log,ctest.log,pytest.log} \
  "$OUT"/{bench_kernels.log,bench_update.json,bench_io.log}
: >"$SUMMARY"
status=0

say() { echo "$*" | tee -a "$SUMMARY"; }
die() {
  say "gpu_check: FAILED: $*"
  say "gpu_check: stopped; nothing after this step ran"
  exit 2
}
# run NAME TIMEOUT LOG CMD...: appends CMD's output to LOG, records its exit status.
run() {
  local name="$1" limit="$2" log="$3"
  shift 3
  say "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  echo "== $name: $*" >>"$log"
  timeout --kill-after=5 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  say "   $name: exit $rc after $((SECONDS - t0)) s"
  return $rc
}

if [ $DRY -eq 1 ]; then
  BUILD="$ROOT/build-gpu-dry"
  JOBS=2
  NICE=(nice -n 15)
  T_CONFIGURE=900 T_BUILD=10800 T_CTEST=900 T_PYTEST=900
  # The development machine's Python (torch of requirements.txt) only collects the CUDA tests:
  # the library built here links torch 2.11, which that Python cannot load.
  source "$ROOT/scripts/env.sh"
  PY="$FSDP_EMA_PYTHON"
  TORCH_ROOT="$ROOT/build-gpu-torch"
  if [ ! -f "$TORCH_ROOT/torch/share/cmake/Torch/TorchConfig.cmake" ]; then
    say "== fetching the torch $TORCH_WHEEL_VERSION wheel (CPython 3.12) into $TORCH_ROOT"
    mkdir -p "$TORCH_ROOT/wheel"
    "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
      --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$TORCH_ROOT/wheel" \
      "torch==$TORCH_WHEEL_VERSION" || die "pip download torch==$TORCH_WHEEL_VERSION"
    unzip -q -o "$TORCH_ROOT"/wheel/torch-"$TORCH_WHEEL_VERSION"-*.whl 'torch/include/*' \
      'torch/lib/*' 'torch/share/*' 'torch/version.py' -d "$TORCH_ROOT" || die "unzip the wheel"
  fi
  torch_version="$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$TORCH_ROOT/torch/version.py")"
  # libtorch_cuda needs the CUDA libraries of the wheels torch depends on (cuSPARSELt, cuFile,
  # NVSHMEM, NCCL, ...), found beside torch/ in site-packages: the same layout here, with the
  # development venv's copies (the same CUDA 13 sonames), for linking the gtest binary (the
  # CMakeLists adds -rpath-link for them) and for running it (the build runs it once to list
  # its tests).
  site="$("$PY" -c 'import site; print(site.getsitepackages()[0])')"
  [ -d "$site/nvidia" ] || die "no $site/nvidia (the CUDA wheels of the development torch)"
  ln -sfn "$site/nvidia" "$TORCH_ROOT/nvidia"
  export LD_LIBRARY_PATH="$TORCH_ROOT/torch/lib:$(ls -d "$site"/nvidia/*/lib 2>/dev/null |
    tr '\n' ':')/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  TORCH_ARGS=(-DTorch_DIR="$TORCH_ROOT/torch/share/cmake/Torch" -DPython3_EXECUTABLE="$PY")
else
  BUILD="$ROOT/build-gpu"
  JOBS="$(nproc)"
  NICE=()
  T_CONFIGURE=35 T_BUILD=160 T_CTEST=40 T_PYTEST=140 T_BENCH_UPDATE=35 T_BENCH_GATHER=20
  T_BENCH_ASYNC=45 T_BENCH_HOST_EMA=45
  PY="${FSDP_EMA_PYTHON:-$(command -v python3)}"
  torch_version="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  TORCH_ARGS=(-DPython3_EXECUTABLE="$PY")
fi

{
  date -u
  echo "mode: $([ $DRY -eq 1 ] && echo dry-run || echo device)"
  nvidia-smi 2>&1 || echo "nvidia-smi: no GPU visible"
  nvcc --version 2>&1 | tail -n 2
  "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" 2>&1
  echo "torch built against: $torch_version"
  echo "cores: $(nproc)"
  cmake --version | head -n 1
  [ -f "$STAGE/MANIFEST.txt" ] && cat "$STAGE/MANIFEST.txt" || echo "no staged gpu-deps/"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# --- configure and build: only the library, its gtests and what the CUDA tests load -------------
CMAKE_ARGS=(-S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${TORCH_ARGS[@]}"
  -DFSDP_EMA_CUDA=ON -DFSDP_EMA_CUDA_ARCHITECTURES="$ARCHS"
  -DFSDP_EMA_BUILD_TESTS=ON -DFSDP_EMA_FORMAT_BUILD_TESTS=OFF -DFSDP_EMA_BUILD_BENCH=OFF
  -DFSDP_EMA_BUILD_TOOLS=OFF -DFSDP_EMA_BUILD_PACKAGING_TESTS=OFF)
if [ -d "$STAGE" ]; then
  # The staged configs by name as well: a CMake that searches another multiarch folder finds them.
  CMAKE_ARGS+=(-DCMAKE_PREFIX_PATH="$STAGE"
    -Dnlohmann_json_DIR="$STAGE/share/cmake/nlohmann_json"
    -DGTest_DIR="$STAGE/lib/x86_64-linux-gnu/cmake/GTest"
    -DCLI11_DIR="$STAGE/share/cmake/CLI11")
elif [ $DRY -eq 1 ]; then
  die "no $STAGE: run scripts/stage_gpu_deps.sh first"
fi
command -v ninja >/dev/null || die "ninja not found"
if ! command -v cuobjdump >/dev/null; then
  # Some toolkits (this development machine's) ship nvcc without cuobjdump: the dry run takes it
  # from NVIDIA's PyPI wheel, into the same ignored folder as the torch wheel.
  tools="$ROOT/build-gpu-torch/tools"
  if [ $DRY -eq 1 ] && [ ! -x "$tools/x/nvidia/cu13/bin/cuobjdump" ]; then
    "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
      -d "$tools" nvidia-cuda-cuobjdump==13.2.51 || die "pip download nvidia-cuda-cuobjdump"
    unzip -q -o "$tools"/nvidia_cuda_cuobjdump-*.whl -d "$tools/x" || die "unzip cuobjdump"
    chmod +x "$tools/x/nvidia/cu13/bin/cuobjdump"
  fi
  export PATH="$PATH:$tools/x/nvidia/cu13/bin"
fi
HAVE_CUOBJDUMP=1
if ! command -v cuobjdump >/dev/null; then
  [ $DRY -eq 1 ] && die "cuobjdump not found (needed to check the cubins)"
  HAVE_CUOBJDUMP=0  # the GPU run goes on: the nvcc command lines below still show the targets
fi

HIDE=()
if [ $DRY -eq 1 ]; then
  # Ignore /usr as a search prefix and hide the system copies of every staged package in a
  # private mount namespace (an empty tmpfs over each folder, an empty file over each file), so
  # both CMake and the compilers can only use the staged folder.
  CMAKE_ARGS+=(-DCMAKE_IGNORE_PREFIX_PATH=/usr)
  hide_script="$BUILD/hide.sh"
  mkdir -p "$BUILD"
  : >"$BUILD/empty"
  {
    echo 'set -e'
    for p in "$STAGE"/include/* "$STAGE"/share/cmake/* "$STAGE"/lib/*/cmake/* "$STAGE"/lib/*/*.a; do
      sys="/usr/${p#"$STAGE"/}"
      [ -e "$sys" ] || continue
      if [ -d "$p" ]; then
        echo "mount -t tmpfs none '$sys'"
      else
        echo "mount --bind '$BUILD/empty' '$sys'"
      fi
    done
    echo 'exec "$@"'
  } >"$hide_script"
  HIDE=(unshare -m --propagation private bash "$hide_script")
  unshare -m --propagation private true || die "unshare -m (needed to hide system packages)"
fi

LOG="$OUT/build.log"
: >"$LOG"
run configure "$T_CONFIGURE" "$LOG" "${HIDE[@]}" cmake "${CMAKE_ARGS[@]}" ||
  die "CMake configure (see $LOG)"
grep -E "fsdp_ema:|Added CUDA NVCC flags|TORCH_CUDA_ARCH_LIST" "$LOG" | tee -a "$SUMMARY"
run build "$T_BUILD" "$LOG" "${HIDE[@]}" "${NICE[@]}" cmake --build "$BUILD" --parallel "$JOBS" ||
  die "build (see $LOG)"
LIB="$BUILD/lib/libfsdp_ema.so"
[ -f "$LIB" ] || die "build produced no $LIB"

# --- the architectures really built, and where the third-party headers came from ----------------
ninja -C "$BUILD" -t commands fsdp_ema | grep -E '\bnvcc\b.*\.cu\b' |
  grep -oE -- '(-gencode|--generate-code|-arch)[= ][^ ]+' | sort | uniq -c >"$BUILD/arch.txt"
{
  echo "== nvcc architecture flags of the CUDA objects"
  cat "$BUILD/arch.txt"
} | tee -a "$LOG"
other="$(grep -oE '(compute|sm)_[0-9]+[a-z]?' "$BUILD/arch.txt" | grep -v '_90$' | sort -u |
  tr '\n' ' ')"
[ -s "$BUILD/arch.txt" ] && [ -z "$other" ] ||
  die "nvcc compiles for '${other}' too (or no arch flags found); expected sm_90 only"
if [ $HAVE_CUOBJDUMP -eq 1 ]; then
  {
    echo "== cuobjdump --list-elf / --list-ptx $LIB"
    cuobjdump --list-elf "$LIB"
    cuobjdump --list-ptx "$LIB" 2>&1 || true
  } | tee -a "$LOG"
  elf_archs="$(cuobjdump --list-elf "$LIB" | grep -oE 'sm_[0-9]+[a-z]?' | sort -u | tr '\n' ' ')"
  ptx_count="$(cuobjdump --list-ptx "$LIB" 2>/dev/null | grep -c 'PTX file' || true)"
  say "   cubins: ${elf_archs:-none}; PTX files: $ptx_count"
  [ "$elf_archs" = "$EXPECT_ELF " ] && [ "$ptx_count" = 0 ] ||
    die "libfsdp_ema.so holds cubins '$elf_archs' and $ptx_count PTX files; want $EXPECT_ELF only"

  # Registers and the global memory instructions of each kernel (16-byte: LDG/STG.E.128).
  {
    echo "== cuobjdump -res-usage (registers; spills would show as LOCAL)"
    cuobjdump -res-usage "$LIB" | grep -A1 -E 'update_kernel|batched_copy_kernel' |
      sed -E 's/Function [^ ]*(update_kernel|batched_copy_kernel)[^ ]*/\1/'
    echo "== global loads/stores in the SASS, per kernel"
    cuobjdump -sass "$LIB" | awk '
      /Function :/ {
        fn = ""
        if ($3 ~ /update_kernel/) fn = "update_kernel"
        if ($3 ~ /batched_copy_kernel/) fn = "batched_copy_kernel"
      }
      fn != "" {
        line = $0
        while (match(line, /(LDG|STG)\.E[.A-Z0-9]*/)) {
          n[fn " " substr(line, RSTART, RLENGTH)]++
          line = substr(line, RSTART + RLENGTH)
        }
      }
      END { for (k in n) print "  " k ": " n[k] }' | sort
  } >"$BUILD/kernels.txt" 2>&1
  tee -a "$LOG" <"$BUILD/kernels.txt"
  grep -q 'update_kernel LDG.E.128' "$BUILD/kernels.txt" &&
    grep -q 'batched_copy_kernel LDG.E.128' "$BUILD/kernels.txt" ||
    die "the kernels have no 16-byte global loads (LDG.E.128); see $BUILD/kernels.txt"
else
  say "   cuobjdump not found: cubin and SASS checks skipped (nvcc flags checked above)"
fi

if [ $DRY -eq 1 ]; then
  # Every nlohmann/gtest/gmock/CLI/xxhash header a compile read came from the staged folder.
  ninja -C "$BUILD" -t deps >"$BUILD/deps.txt"
  system_re='^ +/usr/include/(nlohmann|gtest|gmock|CLI|xxh)'
  system_hits="$(grep -cE "$system_re" "$BUILD/deps.txt" || true)"
  # ninja prints paths under the build's parent relative to the build folder.
  staged_re="^ +($STAGE|$(realpath --relative-to="$BUILD" "$STAGE"))/include/"
  staged_hits="$(grep -E "$staged_re" "$BUILD/deps.txt" | sed -E "s#${staged_re}([^/.]+).*#\2#" |
    sort | uniq -c | awk '{printf "%s %s files, ", $2, $1}')"
  say "   third-party headers read from the staged folder: ${staged_hits:-none}"
  say "   third-party headers read from /usr/include: $system_hits"
  [ -n "$staged_hits" ] || die "no compile read a staged header (the dependency files say)"
  [ "$system_hits" = 0 ] || die "a compile read third-party headers from /usr/include"
  grep -E '^(nlohmann_json_DIR|GTest_DIR|FSDP_EMA_XXHASH_INCLUDE_DIR|Torch_DIR)' \
    "$BUILD/CMakeCache.txt" | tee -a "$SUMMARY"
fi

# --- tests: only the CUDA ones -----------------------------------------------------------------
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
if [ $DRY -eq 1 ]; then
  # No GPU here: the gtest binary (torch 2.11) runs its CPU tests too, and its CUDA tests skip
  # (TorchScript.* and ModuleLoad.* need a module scripted by a Python with this torch: the
  # make_scripted_module ctest fixture, which this machine's Python cannot run).
  run gtest "$T_CTEST" "$OUT/ctest.log" "$BUILD/tests/fsdp_ema_tests" \
    --gtest_filter='-TorchScript.*:ModuleLoad.*' || status=1
  tail -n 3 "$OUT/ctest.log"
  # The CUDA tests as the device run selects them, collected and run by this machine's Python
  # with this checkout's development build: they must all skip (no GPU) and none may error.
  DEV_LIB="${FSDP_EMA_DEV_LIBRARY:-$ROOT/build/lib/libfsdp_ema.so}"
  if [ -f "$DEV_LIB" ]; then
    run pytest "$T_PYTEST" "$OUT/pytest.log" env -u LD_LIBRARY_PATH FSDP_EMA_LIBRARY="$DEV_LIB" \
      "$PY" -m pytest -q -p no:cacheprovider -k cuda "$ROOT/python_tests" || status=1
    tail -n 3 "$OUT/pytest.log"
  else
    say "   pytest: no development build ($DEV_LIB); run scripts/build.sh for this step"
  fi
else
  export FSDP_EMA_LIBRARY="$LIB"
  run ctest "$T_CTEST" "$OUT/ctest.log" ctest --test-dir "$BUILD" --output-on-failure \
    --parallel 8 --timeout 30 -R 'CUDA|Cuda|cuda' || status=1
  tail -n 5 "$OUT/ctest.log"
  timeout_arg=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_arg=(--timeout 120)
  # -k cuda also selects the integrations' FSDP1 tests (python_tests/test_integration_*.py: one
  # GPU, one rank); they need lightning / transformers + accelerate in this Python and skip
  # without them.
  run pytest "$T_PYTEST" "$OUT/pytest.log" "$PY" -m pytest -q -rfE -p no:cacheprovider \
    "${timeout_arg[@]}" -k cuda "$ROOT/python_tests" || status=1
  tail -n 5 "$OUT/pytest.log"
  KLOG="$OUT/bench_kernels.log" IOLOG="$OUT/bench_io.log"
  run bench_update "$T_BENCH_UPDATE" "$KLOG" "$PY" "$ROOT/bench/bench_update.py" \
    --device cuda --repeat 10 --json "$OUT/bench_update.json" || status=1
  run bench_gather "$T_BENCH_GATHER" "$KLOG" "$PY" "$ROOT/bench/bench_gather.py" \
    --device cuda || status=1
  grep -E "PASS|MISS|launches" "$KLOG" | tee -a "$SUMMARY"
  # Issue 17's GPU rows: async saves with pinned staging, and the host-memory EMA's step time.
  run bench_async "$T_BENCH_ASYNC" "$IOLOG" "$PY" "$ROOT/bench/bench_async.py" --device cuda \
    --megabytes 512 --repeat 3 --steps 8 --matmuls 10 --dir "$BUILD/bench-disk" || status=1
  run bench_host_ema "$T_BENCH_HOST_EMA" "$IOLOG" "$PY" "$ROOT/bench/bench_host_ema.py" \
    --repeat 3 --steps 8 || status=1
  grep -E "PASS|MISS" "$IOLOG" | tee -a "$SUMMARY"
fi

say "gpu_check: overall exit $status ($(ls "$OUT" | wc -l) files in $OUT)"
exit $status
