#!/usr/bin/env bash
# The main job: installs what is missing, builds fsdp_ema, and runs the demo training loop.
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"
bash "$here/setup.sh"
source "$here/env.sh"
bash "$here/build.sh"
echo "== demo: compiled training loop with a fused EMA update"
"$FSDP_EMA_PYTHON" "$FSDP_EMA_ROOT/examples/ema_compiled_loop.py" "$@"
