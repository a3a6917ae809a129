#!/usr/bin/env bash
# The whole test suite: installs what is missing, lints (scripts/lint.sh), builds, runs the C++
# tests (ctest) and the Python tests (pytest). GPU tests run where a GPU is present and skip
# cleanly elsewhere.
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"
# Every stage's time, and the total, printed at the end whatever the outcome.
suite_start=$SECONDS stage_start=$SECONDS stage_name="setup" stage_times=""
stage() {
  stage_times+="  $stage_name: $((SECONDS - stage_start)) s"$'\n'
  stage_name="$1" stage_start=$SECONDS
  echo "== $1"
}
report_times() {
  local status=$?
  stage_times+="  $stage_name: $((SECONDS - stage_start)) s"$'\n'
  local total=$((SECONDS - suite_start))
  printf 'scripts/test.sh: total %d min %d s (exit %d), by stage:\n%s' $((total / 60)) \
    $((total % 60)) "$status" "$stage_times"
}
trap report_times EXIT
bash "$here/setup.sh"
source "$here/env.sh"
# Lint first (seconds), but run the tests whatever it says: the exit status reports both.
stage "lint (scripts/lint.sh: ruff, clang-format)"
lint_status=0
bash "$here/lint.sh" || lint_status=$?
# Seconds: every planted bug of scripts/mutants.sh still has its site (moved code can never
# silently retire a mutant); running them is not part of the suite (about 16 minutes).
bash "$here/mutants.sh" --check || lint_status=$?
stage "build (scripts/build.sh)"
bash "$here/build.sh"

stage "C++ tests (ctest)"
(cd "$FSDP_EMA_BUILD" && PATH="$FSDP_EMA_VENV/bin:$PATH" \
  ctest --output-on-failure --parallel "$(nproc)" --timeout 900)

stage "format/ under AddressSanitizer + UBSan (clang), with a short libFuzzer run"
# The torch-free checkpoint code on its own: its GoogleTests, CLI checks and the fuzz smoke test.
SAN_BUILD="$FSDP_EMA_ROOT/build-format-san"
if [ ! -f "$SAN_BUILD/build.ninja" ]; then
  cmake -S "$FSDP_EMA_ROOT/format" -B "$SAN_BUILD" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFSDP_EMA_FORMAT_SANITIZE=ON \
    -DFSDP_EMA_FORMAT_PYTHON="$FSDP_EMA_PYTHON" >/dev/null
fi
cmake --build "$SAN_BUILD" --parallel "$(nproc)"
# The libFuzzer smoke run is part of every test run: a clang without libFuzzer must fail here,
# not drop the test (the default build's ctest also replays the corpus, format_fuzz_replay).
if ! (cd "$SAN_BUILD" && ctest -N -R '^format_fuzz_smoke$' | grep -q 'Total Tests: 1'); then
  echo "scripts/test.sh: no format_fuzz_smoke test in $SAN_BUILD: clang's libFuzzer is missing" \
       "(scripts/setup.sh installs clang and libclang-rt-dev)" >&2
  exit 1
fi
(cd "$SAN_BUILD" && ctest --output-on-failure --parallel "$(nproc)" --timeout 300)

stage "Python tests (pytest)"
cd "$FSDP_EMA_ROOT"
# Two workers (FSDP_EMA_TEST_WORKERS), each given whole test files (a file's gloo pool and
# module fixtures stay in one worker): most tests wait on processes they start (gloo ranks,
# torchrun, compilers), so two workers keep both cores busy (8 min instead of 14-15 here).
"$FSDP_EMA_PYTHON" -m pytest -q python_tests --numprocesses "${FSDP_EMA_TEST_WORKERS:-2}" \
  --dist loadfile --durations=15
if [ "$lint_status" -ne 0 ]; then
  echo "scripts/test.sh: the tests passed but lint failed (bash scripts/lint.sh --fix)" >&2
  exit "$lint_status"
fi
