#!/usr/bin/env bash
# Lint, as CI runs it (scripts/test.sh): ruff over the tracked Python files (its rules are in
# pyproject.toml) and clang-format (.clang-format: Google style, 100 columns) over the tracked
# C++/CUDA files, scripts/rules_once.py (no second copy of a rule that lives in one place), and
# the tree's own checks: scripts/private_access.py (no module of the Python front reads another's
# private attributes or imports its private names), scripts/named_paths.py (every repository path the docs and comments name
# exists), scripts/function_length.py and scripts/long_functions.py (no Python or C++ function
# over 80 lines without a stated reason) and scripts/include_cycles.py (no two C++ units include
# each other). Exit 0 only when all are clean.
#   bash scripts/lint.sh          check only, print what is wrong
#   bash scripts/lint.sh --fix    rewrite in place (ruff check --fix, clang-format -i), then check
#                                 again and list what needs a hand (long lines, unused imports)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
fix=0
case "${1:-}" in
  --fix) fix=1 ;;
  "") ;;
  *) echo "usage: scripts/lint.sh [--fix]" >&2; exit 2 ;;
esac
cd "$FSDP_EMA_ROOT"
git rev-parse --is-inside-work-tree >/dev/null 2>&1 ||
  { echo "scripts/lint.sh: $FSDP_EMA_ROOT is not a git checkout (the tracked files are linted)" >&2; exit 2; }

RUFF=("$FSDP_EMA_PYTHON" -m ruff)
CLANG_FORMAT="${CLANG_FORMAT:-clang-format}"
command -v "$CLANG_FORMAT" >/dev/null ||
  { echo "scripts/lint.sh: $CLANG_FORMAT not found (scripts/setup.sh installs clang-format)" >&2; exit 2; }
mapfile -t py_files < <(git ls-files -- '*.py')
mapfile -t cxx_files < <(git ls-files -- '*.cpp' '*.cc' '*.h' '*.hpp' '*.cu' '*.cuh')

if [ $fix -eq 1 ]; then
  "${RUFF[@]}" check --fix --quiet "${py_files[@]}" || true
  "$CLANG_FORMAT" -i "${cxx_files[@]}"
fi

status=0
echo "== ruff ($("${RUFF[@]}" --version)): ${#py_files[@]} Python files"
"${RUFF[@]}" check --no-fix "${py_files[@]}" || status=1
echo "== $("$CLANG_FORMAT" --version | head -n 1): ${#cxx_files[@]} C++/CUDA files"
unformatted=()
for f in "${cxx_files[@]}"; do
  "$CLANG_FORMAT" --dry-run -Werror "$f" >/dev/null 2>&1 || unformatted+=("$f")
done
if [ ${#unformatted[@]} -gt 0 ]; then
  "$CLANG_FORMAT" --dry-run -Werror "${unformatted[0]}" 2>&1 | head -n 12 >&2 || true
  echo "clang-format: ${#unformatted[@]} file(s) differ (bash scripts/lint.sh --fix rewrites" \
       "them): ${unformatted[*]}" >&2
  status=1
fi
echo "== one place per rule (scripts/rules_once.py)"
"$FSDP_EMA_PYTHON" scripts/rules_once.py || status=1
echo "== Python functions a reader can hold (scripts/function_length.py)"
"$FSDP_EMA_PYTHON" scripts/function_length.py || status=1
echo "== modules talk through public names (scripts/private_access.py)"
"$FSDP_EMA_PYTHON" scripts/private_access.py || status=1
echo "== the paths the docs and comments name exist (scripts/named_paths.py)"
"$FSDP_EMA_PYTHON" scripts/named_paths.py || status=1
echo "== C++ functions of at most 80 lines, or a stated reason (scripts/long_functions.py)"
"$FSDP_EMA_PYTHON" scripts/long_functions.py || status=1
echo "== no include cycle between C++ units (scripts/include_cycles.py)"
"$FSDP_EMA_PYTHON" scripts/include_cycles.py || status=1
[ $status -eq 0 ] && echo "lint: clean"
exit $status
