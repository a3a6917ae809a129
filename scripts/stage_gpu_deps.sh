#!/usr/bin/env bash
# Stages into gpu-deps/ (git-ignored, a few MB) every third-party file the GPU build needs that a
# bare GPU image lacks: the nlohmann-json, xxhash, CLI11, GoogleTest and GoogleMock headers, their
# CMake package configs and the GoogleTest/GoogleMock static libraries. The files are copied from
# this machine's Debian packages (the ones the build finds here) with the /usr layout kept, so the
# relocatable package configs resolve to the staged folder. scripts/gpu_check.sh puts the folder
# on CMAKE_PREFIX_PATH when it exists; the device tool carries it (docs/DEVELOPMENT.md, "The GPU check").
#   usage: bash scripts/stage_gpu_deps.sh [DEST]     (DEST defaults to <repo>/gpu-deps)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/gpu-deps}"
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
