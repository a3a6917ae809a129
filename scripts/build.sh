#!/usr/bin/env bash
# Configures and builds fsdp_ema (library, tests, tools, benchmark helpers) into $FSDP_EMA_BUILD
# (default: build/). Extra arguments go to the CMake configure step, e.g. -DFSDP_EMA_CUDA=OFF.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [ ! -f "$FSDP_EMA_BUILD/build.ninja" ] || [ $# -gt 0 ]; then
  cmake -S "$FSDP_EMA_ROOT" -B "$FSDP_EMA_BUILD" -G Ninja \
    -DPython3_EXECUTABLE="$FSDP_EMA_PYTHON" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
fi
cmake --build "$FSDP_EMA_BUILD" --parallel "$(nproc)"
