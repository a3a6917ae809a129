#!/usr/bin/env bash
# Installs what fsdp_ema needs, and only what is missing: Debian packages (compilers, CMake,
# GoogleTest, nlohmann-json, xxhash, CLI11, ninja, ccache, and gloo's headers, which the torch
# wheel lacks and examples/train_sharded.cpp needs to make a ProcessGroupGloo) and the Python
# environment from requirements.txt. Idempotent: a second run (or CI on the same machine) downloads nothing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# --- Debian packages (clang + its runtimes: the sanitizer and libFuzzer build of format/;
# clang-format: scripts/lint.sh) -------------------------------------------------------------------
PACKAGES=(build-essential cmake ninja-build ccache pkg-config git
          libgtest-dev libgmock-dev nlohmann-json3-dev libxxhash-dev libcli11-dev
          libgloo-dev
          clang libclang-rt-dev clang-format
          python3 python3-venv python3-dev)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# A python3 that already has venv (pyenv, say) satisfies the python packages.
if command -v python3 >/dev/null && python3 -c "import venv, ensurepip" 2>/dev/null; then
  filtered=()
  for p in "${missing[@]}"; do
    case "$p" in python3|python3-venv|python3-dev) ;; *) filtered+=("$p") ;; esac
  done
  missing=("${filtered[@]}")
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# --- Python environment --------------------------------------------------------------------------
REQ="$FSDP_EMA_ROOT/requirements.txt"
STAMP="$FSDP_EMA_VENV/.fsdp_ema-requirements.sha256"
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ -x "$FSDP_EMA_PYTHON" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "setup: reusing Python environment $FSDP_EMA_VENV"
  exit 0
fi
if [ ! -x "$FSDP_EMA_PYTHON" ]; then
  echo "setup: creating Python environment $FSDP_EMA_VENV"
  mkdir -p "$(dirname "$FSDP_EMA_VENV")"
  python3 -m venv "$FSDP_EMA_VENV"
fi
# pip skips what is already installed at the pinned version, so an existing environment whose
# stamp is missing or stale costs a resolve, not a download.
"$FSDP_EMA_PYTHON" -m pip install --disable-pip-version-check -q -r "$REQ"
"$FSDP_EMA_PYTHON" -c "import torch; print('setup: torch', torch.__version__, 'CUDA', torch.version.cuda)"
echo "$want" > "$STAMP"
