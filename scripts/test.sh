#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs the C++ tests (ctest) and the
# Python tests (pytest). GPU tests run where a GPU is present and skip cleanly elsewhere.
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"
bash "$here/setup.sh"
source "$here/env.sh"
bash "$here/build.sh"

echo "== C++ tests (ctest)"
(cd "$FSDP_EMA_BUILD" && PATH="$FSDP_EMA_VENV/bin:$PATH" \
  ctest --output-on-failure --parallel "$(nproc)" --timeout 900)

echo "== Python tests (pytest)"
cd "$FSDP_EMA_ROOT"
"$FSDP_EMA_PYTHON" -m pytest -q python_tests
