# Sourced by the other scripts: where the machine-wide Python environment lives.
# FSDP_EMA_VENV overrides it; the default is shared by every checkout and CI run on the machine,
# so torch (several GB) is downloaded once per machine.
if [ -z "${FSDP_EMA_VENV:-}" ]; then
  if [ -w /opt ] || [ -d /opt/fsdp_ema/venv ]; then
    FSDP_EMA_VENV=/opt/fsdp_ema/venv
  else
    FSDP_EMA_VENV="${XDG_CACHE_HOME:-$HOME/.cache}/fsdp_ema/venv"
  fi
fi
export FSDP_EMA_VENV
export FSDP_EMA_PYTHON="$FSDP_EMA_VENV/bin/python"
FSDP_EMA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export FSDP_EMA_ROOT
export FSDP_EMA_BUILD="${FSDP_EMA_BUILD:-$FSDP_EMA_ROOT/build}"
export PYTHONPATH="$FSDP_EMA_ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
# ccache hits across checkouts (CI clones into a new folder each time): hash relative paths.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$FSDP_EMA_ROOT}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
