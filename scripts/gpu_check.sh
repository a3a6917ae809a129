#!/usr/bin/env bash
# One run on the bare GPU machine (H200: sm_90, 16 cores, python3 with torch, nvcc, CMake, ninja,
# pytest; no network, no pip): configure and build what the GPU checks need against that machine's
# torch, run only the CUDA tests (ctest and pytest) and the CUDA benchmarks, and write at most 8
# files to OUT_DIR. The third-party headers, CMake configs and GoogleTest libraries, and
# cuobjdump + nvdisasm where the toolkit lacks them, come from gpu-deps/
# (scripts/stage_gpu_deps.sh, carried by the device tool). Budget: the run keeps within its own
# T_RUN=520 s: each step's limit below (their sum is larger) is cut to what is left of it, kill
# grace included; a test or benchmark step with nothing left is skipped and counts as failed, a
# diagnostic is a WARNING. So the run ends by about 520 s, under the device tool's 540 s (README)
# and the 10 minutes one command may take, whatever each step takes.
#
#   bash scripts/gpu_check.sh OUT_DIR             # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run OUT_DIR   # here, no GPU: the same configure and build
#       against the torch 2.11.0+cu130 wheel (downloaded into build-gpu-torch/, never installed),
#       with the system copies of the staged packages hidden (a private mount namespace), then
#       the same diagnostics, and runs on the CPU what can run there.
#   bash scripts/gpu_check.sh --self-test         # seconds, no GPU, no download (ctest runs it):
#       the diagnostics against fake tools (missing, failing, hanging, a bad verdict)
#
# Only a failed configure or build stops the run (exit 2). The diagnostics (nvcc flags, cubins,
# registers, SASS, 16-byte loads) each say in summary.txt whether they ran and their verdict; one
# that cannot run (tool missing or failing) is a WARNING on the device and the run goes on (an
# ERROR in the dry run, which exists to prove they work: exit 1). Failed tests, FAIL verdicts and
# missed benchmark targets are reported and give exit 1 after every step has run.
set -uo pipefail

DRY=0
SELF_TEST=0
case "${1:-}" in
  --dry-run) DRY=1; shift ;;
  --self-test) SELF_TEST=1; shift ;;
esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAGE="${FSDP_EMA_GPU_DEPS:-$ROOT/gpu-deps}"
ARCHS="90-real"            # the H200: one sm_90 cubin, no PTX (compile time is the budget)
EXPECT_ELF="sm_90"
# The kernels whose pack loads must be 16 bytes wide (LDG.E.128), by their mangled names'
# length-prefixed identifiers (the SASS and register listings name them that way): the update
# kernel's two instantiations (K = 1: update_, K = 4: update_multi_) and the batched copy.
KERNELS="13update_kernelILi1E 13update_kernelILi4E 19batched_copy_kernel"
CUOBJDUMP=cuobjdump        # nvdisasm is found by cuobjdump itself, on the PATH
TORCH_WHEEL_VERSION="2.11.0"  # the GPU machine's torch (2.11.0+cu130)
T_RUN=0                    # the whole run's limit in seconds (0: none); set on the device below
T_DIAG=20                  # each diagnostic command
KILL_GRACE=5
status=0

say() { echo "$*" | tee -a "$SUMMARY"; }
die() {
  say "gpu_check: FAILED: $*"
  say "gpu_check: stopped; nothing after this step ran"
  exit 2
}
# step_limit NOMINAL: a step's own limit, cut to what is left of the run's T_RUN seconds.
step_limit() {
  local limit="$1"
  if [ "$T_RUN" -gt 0 ] && [ $((T_RUN - SECONDS - KILL_GRACE)) -lt "$limit" ]; then
    limit=$((T_RUN - SECONDS - KILL_GRACE))
  fi
  echo "$limit"
}
# run NAME TIMEOUT LOG CMD...: appends CMD's output to LOG, records its exit status.
run() {
  local name="$1" limit log="$3"
  limit="$(step_limit "$2")"
  shift 3
  if [ "$limit" -le 0 ]; then
    say "== $name: skipped: no time left of the run's $T_RUN s"
    return 1
  fi
  say "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  echo "== $name: $*" >>"$log"
  timeout --kill-after=$KILL_GRACE "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  say "   $name: exit $rc after $((SECONDS - t0)) s$( ((rc == 124 || rc == 137)) &&
    echo " (timed out)")"
  return $rc
}

# --- diagnostics ---------------------------------------------------------------------------------
# cannot STEP WHY: a diagnostic that could not run. A WARNING on the device, where the tests and
# benchmarks matter more (the run goes on, the exit status stays theirs); an ERROR in the dry run,
# which exists to prove the diagnostics work (exit 1 at the end; the run goes on too).
cannot() {
  if [ $DRY -eq 1 ]; then
    say "   $1: ERROR: did not run: $2"
    status=1
  else
    say "   $1: WARNING: skipped: $2"
  fi
}
# verdict STEP PASS|FAIL|INFO TEXT...: a diagnostic that ran; FAIL gives exit 1 (the run goes on).
verdict() {
  say "   $1: ran; verdict: $2: ${*:3}"
  if [ "$2" = FAIL ]; then status=1; fi
}
# tool STEP OUT CMD...: runs one diagnostic command, stdout into OUT and stderr into OUT.err (in the
# build folder; the errors are also appended to build.log). Fails, after saying why, when CMD is
# missing, exits non-zero (a cuobjdump -sass without nvdisasm does: exit 1), times out or prints
# nothing, so no check ever reads an empty listing as a verdict.
tool() {
  local step="$1" out="$2" limit rc t0=$SECONDS why
  shift 2
  if ! command -v "$1" >/dev/null; then
    cannot "$step" "$1 not found (neither on PATH nor in $STAGE/bin: scripts/stage_gpu_deps.sh)"
    return 1
  fi
  limit="$(step_limit "$T_DIAG")"
  if [ "$limit" -le 0 ]; then
    cannot "$step" "no time left of the run's $T_RUN s"
    return 1
  fi
  timeout --kill-after=2 "$limit" "$@" >"$out" 2>"$out.err"
  rc=$?
  { echo "== $step: $* (exit $rc after $((SECONDS - t0)) s)"; cat "$out.err"; } >>"$LOG"
  why="$(basename "$1") ${*:2}"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    cannot "$step" "$why: timed out after $limit s"
    return 1
  elif [ $rc -ne 0 ]; then
    cannot "$step" "$why: exit $rc: $(grep -m1 . "$out.err" | tr -s ' \t' ' ' | cut -c1-200)"
    return 1
  elif [ ! -s "$out" ]; then
    cannot "$step" "$why: exit 0 but printed nothing"
    return 1
  fi
}
# diagnostics: what the build really holds (BUILD, LIB), one summary line per step.
# shellcheck disable=SC2016  # the awk programs are single-quoted on purpose
diagnostics() {
  local d="$BUILD/diag" archs other elf_archs ptx_count res sass_ok=0 missing k
  mkdir -p "$d"
  say "== diagnostics: each ran with its verdict, or says why it did not"

  # 1. The architectures nvcc compiled our .cu files for (ninja's command lines).
  if tool "nvcc flags" "$d/commands.txt" ninja -C "$BUILD" -t commands fsdp_ema; then
    grep -E '\bnvcc\b.*\.cu\b' "$d/commands.txt" |
      grep -oE -- '(-gencode|--generate-code|-arch)[= ][^ ]+' | sort | uniq -c >"$d/arch.txt"
    { echo "== nvcc architecture flags of the CUDA objects"; cat "$d/arch.txt"; } >>"$LOG"
    archs="$(awk '{printf "%s%s (%s objects)", sep, $2, $1; sep = ", "}' "$d/arch.txt")"
    other="$(grep -oE '(compute|sm)_[0-9]+[a-z]?' "$d/arch.txt" | grep -v '_90$' | sort -u |
      tr '\n' ' ')"
    if [ ! -s "$d/arch.txt" ]; then
      verdict "nvcc flags" FAIL "no architecture flag on any nvcc command line"
    elif [ -n "$other" ]; then
      verdict "nvcc flags" FAIL "$archs: compiles for ${other}too; want sm_90 only"
    else
      verdict "nvcc flags" PASS "$archs: sm_90 only"
    fi
  fi

  # 2. The cubins and PTX in the library (--list-ptx alone prints nothing when there is none).
  if tool cubins "$d/elf.txt" "$CUOBJDUMP" --list-elf --list-ptx "$LIB"; then
    cat "$d/elf.txt" >>"$LOG"
    elf_archs="$(grep '^ELF file' "$d/elf.txt" | grep -oE 'sm_[0-9]+[a-z]?' | sort -u |
      tr '\n' ' ')"
    ptx_count="$(grep -c '^PTX file' "$d/elf.txt")"
    if [ "$elf_archs" = "$EXPECT_ELF " ] && [ "$ptx_count" = 0 ]; then
      verdict cubins PASS "$(grep -c '^ELF file' "$d/elf.txt") cubins, all $EXPECT_ELF; no PTX"
    else
      verdict cubins FAIL "cubins '${elf_archs% }' and $ptx_count PTX files; want $EXPECT_ELF only"
    fi
  fi

  # 3. Registers and spills (LOCAL bytes) per kernel. Needs no nvdisasm.
  if tool registers "$d/res.txt" "$CUOBJDUMP" -res-usage "$LIB"; then
    res="$(awk -v kernels="$KERNELS" '
      /Function / { fn = ""; n = split(kernels, ks, " ")
        for (i = 1; i <= n; i++) if (index($0, ks[i])) fn = substr(ks[i], 3) }
      fn != "" && /REG:/ { match($0, /REG:[0-9]+/); reg = substr($0, RSTART + 4, RLENGTH - 4)
        match($0, /LOCAL:[0-9]+/); loc = substr($0, RSTART + 6, RLENGTH - 6)
        out = out sep fn " REG " reg (loc > 0 ? " LOCAL " loc " (spills)" : " no spills")
        sep = "; "; fn = "" }
      END { print out }' "$d/res.txt")"
    echo "== registers: $res" >>"$LOG"
    missing=""
    for k in $KERNELS; do
      [[ "$res" == *"${k:2} REG"* ]] || missing+="${k:2} "
    done
    if [ -n "$missing" ]; then
      verdict registers FAIL "no entry for ${missing}in cuobjdump -res-usage${res:+ (found: $res)}"
    else
      verdict registers INFO "$res"
    fi
  fi

  # 4. The SASS (cuobjdump runs nvdisasm for it), and 5. the 16-byte global loads in it.
  if tool sass "$d/sass.txt" "$CUOBJDUMP" -sass "$LIB"; then
    awk -v kernels="$KERNELS" '
      /Function :/ { fn = ""; n = split(kernels, ks, " ")
        for (i = 1; i <= n; i++) if (index($0, ks[i])) fn = substr(ks[i], 3)
        if (fn != "") seen[fn] = 1 }
      fn != "" {
        line = $0
        while (match(line, /(LDG|STG|LD|ST)\.E[.A-Z0-9_]*/)) {
          op = substr(line, RSTART, RLENGTH); kind = substr(op, 1, index(op, ".") - 1)
          all[fn " " kind]++
          if (op ~ /\.128(\.|$)/) wide[fn " " kind]++
          line = substr(line, RSTART + RLENGTH)
        }
      }
      # Generic LD/ST (an address-space check per access) where the compiler could not tell a
      # pointer is global: worth knowing, not a failure.
      END { for (f in seen) printf "%s: %d of %d LDG 16-byte, %d of %d STG 16-byte, " \
              "%d generic LD/ST\n", f, wide[f " LDG"], all[f " LDG"], wide[f " STG"],
              all[f " STG"], all[f " LD"] + all[f " ST"] }' \
      "$d/sass.txt" | sort >"$d/kernels.txt"
    { echo "== global loads/stores in the SASS, per kernel"; cat "$d/kernels.txt"; } >>"$LOG"
    verdict sass INFO "$(grep -c 'Function :' "$d/sass.txt") functions disassembled," \
      "$(wc -l <"$d/kernels.txt") of our $(wc -w <<<"$KERNELS") kernels among them"
    sass_ok=1
  fi
  if [ $sass_ok -eq 0 ]; then
    cannot "16-byte loads" "needs the SASS listing (the sass step above did not run)"
  else
    missing=""
    for k in $KERNELS; do
      grep -qE "^${k:2}: [1-9][0-9]* of [0-9]+ LDG 16-byte" "$d/kernels.txt" || missing+="${k:2} "
    done
    if [ -n "$missing" ]; then
      verdict "16-byte loads" FAIL "no LDG.E.128 in ${missing}($(paste -sd';' "$d/kernels.txt"))"
    else
      verdict "16-byte loads" PASS "$(paste -sd';' "$d/kernels.txt" | sed 's/;/; /g')"
    fi
  fi
  return 0
}

if [ $SELF_TEST -eq 1 ]; then
  # shellcheck source=scripts/gpu_check_self_test.sh
  source "$ROOT/scripts/gpu_check_self_test.sh"
  exit $?
fi

OUT="${1:?usage: gpu_check.sh [--dry-run] OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SUMMARY="$OUT/summary.txt"
# This run's files only (the logs below are appended to step by step).
rm -f "$OUT"/{machine.txt,summary.txt,build.log,ctest.log,pytest.log} \
  "$OUT"/{bench_kernels.log,bench_update.json,bench_io.log}
: >"$SUMMARY"

if [ $DRY -eq 1 ]; then
  BUILD="$ROOT/build-gpu-dry"
  JOBS=2
  NICE=(nice -n 15)
  T_CONFIGURE=900 T_BUILD=10800 T_CTEST=900 T_PYTEST=900 T_DIAG=120
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
    # Python's zipfile, not unzip: scripts/setup.sh does not install unzip.
    "$PY" - "$TORCH_ROOT" "$TORCH_ROOT"/wheel/torch-"$TORCH_WHEEL_VERSION"-*.whl <<'UNZIP' \
      || die "extract the wheel"
import sys, zipfile
root, wheel = sys.argv[1], sys.argv[2]
wanted = ("torch/include/", "torch/lib/", "torch/share/", "torch/version.py")
with zipfile.ZipFile(wheel) as whl:
    whl.extractall(root, [n for n in whl.namelist() if n.startswith(wanted)])
UNZIP
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
  T_RUN=520
  T_CONFIGURE=35 T_BUILD=160 T_CTEST=40 T_PYTEST=140 T_BENCH_UPDATE=35 T_BENCH_GATHER=20
  T_BENCH_ASYNC=45 T_BENCH_HOST_EMA=45 T_BENCH_LOAD=40 T_DIAG=20
  PY="${FSDP_EMA_PYTHON:-$(command -v python3)}"
  torch_version="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  TORCH_ARGS=(-DPython3_EXECUTABLE="$PY")
fi

# cuobjdump and nvdisasm (which cuobjdump -sass runs, from the PATH) for the diagnostics: the
# toolkit's, else the ones scripts/stage_gpu_deps.sh put in gpu-deps/bin (appended to the PATH, so
# a toolkit's own copies come first).
if [ -d "$STAGE/bin" ]; then export PATH="$PATH:$STAGE/bin"; fi
# safetensors for the CUDA tests and the load benchmark, where the machine's Python lacks it.
if [ -d "$STAGE/python" ]; then export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$STAGE/python"; fi

{
  date -u
  echo "mode: $([ $DRY -eq 1 ] && echo dry-run || echo device)"
  nvidia-smi 2>&1 || echo "nvidia-smi: no GPU visible"
  nvcc --version 2>&1 | tail -n 2
  for t in cuobjdump nvdisasm; do
    echo "$t: $(command -v "$t" || echo "not found") $("$t" --version 2>&1 | tail -n 1)"
  done
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
for t in cuobjdump nvdisasm; do
  if ! "$t" --version >/dev/null 2>&1; then
    # The dry run exists to prove the diagnostics work: it stops before the build. On the device
    # the diagnostics that need the tool say so, one WARNING each, and the run goes on.
    [ $DRY -eq 1 ] && die "$t does not run (not on PATH, nor in $STAGE/bin):" \
      "scripts/stage_gpu_deps.sh downloads it"
    say "   WARNING: $t does not run here (not on PATH, nor in $STAGE/bin)"
  fi
done

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

# --- diagnostics: the architectures, cubins, registers and loads really built ------------------
diagnostics

if [ $DRY -eq 1 ]; then
  # Every nlohmann/gtest/gmock/CLI/xxhash header a compile read came from the staged folder.
  ninja -C "$BUILD" -t deps >"$BUILD/deps.txt"
  system_re='^ +/usr/include/(nlohmann|gtest|gmock|CLI|xxh)'
  system_hits="$(grep -cE "$system_re" "$BUILD/deps.txt" || true)"
  # ninja prints paths under the build's parent relative to the build folder.
  staged_re="^ +($STAGE|$(realpath --relative-to="$BUILD" "$STAGE"))/include/"
  staged_hits="$(grep -E "$staged_re" "$BUILD/deps.txt" | sed -E "s#${staged_re}([^/.]+).*#\2#" |
    sort | uniq -c | awk '{printf "%s %s files, ", $2, $1}')"
  if [ -z "$staged_hits" ]; then
    verdict headers FAIL "no compile read a staged header (the dependency files say)"
  elif [ "$system_hits" != 0 ]; then
    verdict headers FAIL "$system_hits third-party headers read from /usr/include" \
      "(from the staged folder: ${staged_hits%, })"
  else
    verdict headers PASS "third-party headers from the staged folder: ${staged_hits%, };" \
      "from /usr/include: 0"
  fi
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
    say "   pytest: skipped: no development build ($DEV_LIB); run scripts/build.sh for this step"
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
  # Issue 29 step 3: loads into CUDA memory through the two pinned staging buffers, from the page
  # cache, against dcp.load, safetensors and torch.load, beside the read and the H2D copy alone.
  run bench_load "$T_BENCH_LOAD" "$IOLOG" "$PY" "$ROOT/bench/bench_checkpoint.py" \
    --places cuda --gigabytes 1 --repeat 3 || status=1
  grep -E "PASS|MISS" "$IOLOG" | tee -a "$SUMMARY"
fi

say "gpu_check: overall exit $status ($(ls "$OUT" | wc -l) files in $OUT)"
exit $status
