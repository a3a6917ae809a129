#!/usr/bin/env bash
# A longer libFuzzer run over the checkpoint header and index parsers (not part of CI; CI runs a
# 20 s smoke run). Crashing inputs are copied into tests/fuzz/corpus/regressions/ so that they
# become part of the checked-in corpus the smoke run replays.
#   usage: bash scripts/fuzz.sh [SECONDS]   (default 600)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
seconds="${1:-600}"
build="$FSDP_EMA_ROOT/build-format-fuzz"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$FSDP_EMA_ROOT/format" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$build" --target fsdp_ema_format_fuzz --parallel "$(nproc)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" "$work/artifacts"
cp -r "$FSDP_EMA_ROOT/tests/fuzz/corpus/." "$work/corpus/"
status=0
"$build/fsdp_ema_format_fuzz" -max_total_time="$seconds" -max_len=4096 -print_final_stats=1 \
  -artifact_prefix="$work/artifacts/" "$work/corpus" || status=$?
shopt -s nullglob
crashes=("$work"/artifacts/crash-* "$work"/artifacts/leak-* "$work"/artifacts/timeout-*)
if [ ${#crashes[@]} -gt 0 ]; then
  mkdir -p "$FSDP_EMA_ROOT/tests/fuzz/corpus/regressions"
  cp "${crashes[@]}" "$FSDP_EMA_ROOT/tests/fuzz/corpus/regressions/"
  echo "fuzz: ${#crashes[@]} failing input(s) kept in tests/fuzz/corpus/regressions/" >&2
  exit 1
fi
exit "$status"
