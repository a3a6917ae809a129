#!/usr/bin/env bash
# The main job, end to end: installs what is missing, builds fsdp_ema and the C++ server
# (examples/serve.cpp, an outside project built with find_package(fsdp_ema)), trains a small
# transformer with FSDP on 2 ranks (torchrun; gloo on the CPU, NCCL on GPUs) with a compiled
# optimizer + EMA step and sharded checkpoints, then serves the EMA weights from C++ and checks
# that its validation loss equals Python's.
#
#   bash scripts/demo.sh [train.py arguments: --steps N, --fsdp1, --resume, --serve aoti|both, ...]
#
# --serve picks what the server loads: the TorchScript model (default), the AOTInductor package
# (aoti), or both, each checked against Python's EMA loss.
#
# FSDP_EMA_DEMO_OUT: where the run goes (default: $FSDP_EMA_BUILD/demo; wiped unless --resume).
# FSDP_EMA_DEMO_NPROC: ranks (default 2).
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"
bash "$here/setup.sh"
source "$here/env.sh"
bash "$here/build.sh"

TORCH_DIR="$("$FSDP_EMA_PYTHON" -c 'import os, torch.utils; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')"
echo "== building the C++ server against the installed package (examples/CMakeLists.txt)"
cmake -DBUILD_DIR="$FSDP_EMA_BUILD" -DSOURCE_DIR="$FSDP_EMA_ROOT/examples" \
  -DWORK_DIR="$FSDP_EMA_BUILD/examples" -DTorch_DIR="$TORCH_DIR" \
  -P "$FSDP_EMA_ROOT/cmake/build_outside_project.cmake"
SERVE="$FSDP_EMA_BUILD/examples/build/serve"

OUT="${FSDP_EMA_DEMO_OUT:-$FSDP_EMA_BUILD/demo}"
NPROC="${FSDP_EMA_DEMO_NPROC:-2}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # what torchrun sets anyway, without its warning
case " $* " in *" --resume "*) ;; *) rm -rf "$OUT" ;; esac
mkdir -p "$OUT"

echo "== training: torchrun --standalone --nproc-per-node $NPROC examples/train.py --out $OUT $*"
"$FSDP_EMA_VENV/bin/torchrun" --standalone --nproc-per-node "$NPROC" \
  "$FSDP_EMA_ROOT/examples/train.py" --out "$OUT" "$@"

field() { "$FSDP_EMA_PYTHON" -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$OUT/result.json" "$1"; }
CKPT="$(field checkpoint)"
rm -f "$OUT/serve.txt" "$OUT/serve_aoti.txt"
if [ "$(field model)" != "None" ]; then
  echo "== serving from C++ (TorchScript): serve model.pt $CKPT val"
  "$SERVE" "$OUT/model.pt" "$CKPT" "$OUT/val" | tee "$OUT/serve.txt"
fi
if [ "$(field aoti_model)" != "None" ]; then
  echo "== serving from C++ (AOTInductor): serve model.pt2 $CKPT val"
  "$SERVE" "$OUT/model.pt2" "$CKPT" "$OUT/val" | tee "$OUT/serve_aoti.txt"
fi

echo "== report"
"$FSDP_EMA_PYTHON" - "$OUT" <<'PY'
import json, os, re, sys
out = sys.argv[1]
r = json.load(open(f"{out}/result.json"))
py = r["val_loss_ema"]
tol = 1e-5 * max(1.0, abs(py))
served = {}
for kind, name in (("TorchScript", "serve.txt"), ("AOTInductor", "serve_aoti.txt")):
    if os.path.exists(f"{out}/{name}"):
        text = open(f"{out}/{name}").read()
        served[kind] = float(re.search(r"^loss=(\S+)$", text, re.M).group(1))
print(f"trained: FSDP{r['fsdp']}, {r['world_size']} ranks on {r['device']}, {r['steps_run']} steps, "
      f"{r['steps_per_s']:.1f} steps/s ({r['steps_per_s_compiled'] or 0:.1f} once compiled"
      f"), optimizer + EMA step compiled into {r['compiled_graphs']} graph(s)")
print(f"validation loss, raw weights (Python):   {r['val_loss_raw']:.6f}")
print(f"validation loss, EMA weights (Python):   {py:.6f}")
ok = bool(served)
for kind, cpp in served.items():
    diff = abs(cpp - py)
    print(f"validation loss, EMA weights (C++, {kind}): {cpp:.6f}  (loaded from {r['checkpoint']})")
    good = diff <= tol
    ok = ok and good
    print(f"C++ ({kind}) == Python: |difference| = {diff:.2e} (tolerance {tol:.0e}): "
          f"{'OK' if good else 'MISMATCH'}")
sys.exit(0 if ok else 1)
PY
