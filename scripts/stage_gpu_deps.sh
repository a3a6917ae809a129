#!/usr/bin/env bash
# Stages into gpu-deps/ (git-ignored, about 10 MB) every third-party file the GPU build needs that a
# bare GPU image lacks: the nlohmann-json, xxhash, CLI11, GoogleTest and GoogleMock headers, their
# CMake package configs and the GoogleTest/GoogleMock static libraries; and bin/cuobjdump and
# bin/nvdisasm for the GPU run's cubin and SASS checks (below). The files are copied from
# this machine's Debian packages (the ones the build finds here) with the /usr layout kept, so the
# relocatable package configs resolve to the staged folder. scripts/gpu_check.sh puts the folder
# on CMAKE_PREFIX_PATH when it exists; the device tool carries it (docs/DEVELOPMENT.md, "The GPU check").
#   usage: bash scripts/stage_gpu_deps.sh [DEST]     (DEST defaults to <repo>/gpu-deps)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/gpu-deps}"
source "$ROOT/scripts/env.sh"
PY="$FSDP_EMA_PYTHON"
[ -x "$PY" ] || PY=python3
PACKAGES=(nlohmann-json3-dev libxxhash-dev libcli11-dev libgtest-dev libgmock-dev)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "stage_gpu_deps: missing Debian packages: ${missing[*]} (run scripts/setup.sh first)" >&2
  exit 1
fi

rm -rf "$DEST"
mkdir -p "$DEST"
count=0
for p in "${PACKAGES[@]}"; do
  # Headers, CMake configs and static libraries; documentation, pkg-config files and the shared
  # xxhash library (the build inlines xxhash) stay behind.
  while IFS= read -r f; do
    [ -f "$f" ] && [ ! -L "$f" ] || continue
    case "$f" in
      /usr/include/* | /usr/share/cmake/* | /usr/lib/*/cmake/*) ;;
      /usr/lib/*/libgtest*.a | /usr/lib/*/libgmock*.a) ;;
      *) continue ;;
    esac
    rel="${f#/usr/}"
    mkdir -p "$DEST/$(dirname "$rel")"
    cp -p "$f" "$DEST/$rel"
    count=$((count + 1))
  done < <(dpkg -L "$p")
done

{
  echo "# Staged by scripts/stage_gpu_deps.sh on $(date -u +%Y-%m-%dT%H:%MZ)" \
       "from $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "# gcc: $(gcc -dumpfullversion 2>/dev/null || echo unknown);" \
       "multiarch: $(gcc -print-multiarch 2>/dev/null || echo unknown)"
  for p in "${PACKAGES[@]}"; do dpkg-query -W -f='${Package} ${Version}\n' "$p"; done
} >"$DEST/MANIFEST.txt"

# NVIDIA's cuobjdump and nvdisasm (which `cuobjdump -sass` runs) from their PyPI wheels, into
# bin/: gpu_check.sh's cubin, register and SASS checks use them when the PATH has none (this
# machine's CUDA 13.0 toolkit ships nvcc without either; the GPU machine's may too). Optional on
# the device (without them its run warns and skips those checks); the dry run requires them.
CUDA_TOOLS_VERSION=13.2.51
tools_note="not staged"
tools_tmp="$(mktemp -d)"
trap 'rm -rf "$tools_tmp"' EXIT
if "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
     --platform manylinux_2_17_x86_64 -d "$tools_tmp" \
     "nvidia-cuda-cuobjdump==$CUDA_TOOLS_VERSION" "nvidia-cuda-nvdisasm==$CUDA_TOOLS_VERSION"; then
  mkdir -p "$DEST/bin"
  tools_note=""
  for t in cuobjdump nvdisasm; do
    "$PY" - "$tools_tmp"/nvidia_cuda_"$t"-*.whl "nvidia/cu13/bin/$t" "$DEST/bin/$t" <<'PYEOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl, whl.open(sys.argv[2]) as src:
    with open(sys.argv[3], "wb") as dst:
        shutil.copyfileobj(src, dst)
PYEOF
    chmod 755 "$DEST/bin/$t"
    # The tool must run here (the GPU machine is the same x86-64 Linux).
    if v="$("$DEST/bin/$t" --version 2>&1 | grep -m1 -oE 'V[0-9][0-9.]+')"; then
      tools_note+="$t $v, "
      count=$((count + 1))
    else
      echo "stage_gpu_deps: WARNING: the staged $t does not run here; left out" >&2
      rm -f "$DEST/bin/$t"
    fi
  done
  tools_note="${tools_note%, } (PyPI wheels nvidia-cuda-*==$CUDA_TOOLS_VERSION)"
else
  echo "stage_gpu_deps: WARNING: could not download cuobjdump/nvdisasm $CUDA_TOOLS_VERSION from" \
       "PyPI: the GPU run skips its cubin and SASS checks unless its toolkit has them, and" \
       "gpu_check.sh --dry-run refuses to run" >&2
fi
echo "# cuda tools in bin/: $tools_note" >>"$DEST/MANIFEST.txt"

# safetensors (the version of requirements.txt; an abi3 wheel, any CPython >= 3.7) into python/:
# the CUDA tests read our files with it and the GPU load benchmark compares against it. The GPU
# machine has no network and may lack it; gpu_check.sh appends python/ to PYTHONPATH, so the
# machine's own copy wins where it has one.
ST_VERSION="$(sed -n 's/^safetensors==//p' "$ROOT/requirements.txt")"
if "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
     --platform manylinux_2_17_x86_64 --python-version 3.12 -d "$tools_tmp" \
     "safetensors==$ST_VERSION" &&
   "$PY" - "$tools_tmp"/safetensors-"$ST_VERSION"-*.whl "$DEST/python" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    whl.extractall(sys.argv[2], [n for n in whl.namelist() if n.startswith("safetensors/")])
PYEOF
then
  echo "# python/: safetensors $ST_VERSION (PyPI wheel)" >>"$DEST/MANIFEST.txt"
  count=$((count + 1))
else
  echo "stage_gpu_deps: WARNING: could not stage safetensors $ST_VERSION; the GPU run uses the" \
       "machine's own or skips what needs it" >&2
fi

# The package configs the GPU build points at (gpu_check.sh passes them as <Package>_DIR too, so a
# machine whose CMake looks in another multiarch folder still finds them).
for cfg in share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake share/cmake/CLI11/CLI11Config.cmake \
           lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake include/xxhash.h; do
  if [ ! -f "$DEST/$cfg" ]; then
    echo "stage_gpu_deps: expected $cfg in the staged folder; the Debian layout changed" >&2
    exit 1
  fi
done
echo "stage_gpu_deps: $count files, $(du -sh "$DEST" | cut -f1) in $DEST"
