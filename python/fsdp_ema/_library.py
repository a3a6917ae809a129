"""Finding and loading the compiled fsdp_ema library (registers ``torch.ops.fsdp_ema.*``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

_LIB_NAME = "libfsdp_ema.so"
_loaded: str | None = None


def library_path() -> str:
    """Path of ``libfsdp_ema.so``.

    Looked up in order: the ``FSDP_EMA_LIBRARY`` environment variable, a copy inside this package
    (``fsdp_ema/lib/``, where an install puts it), and the source tree's ``build/lib/``.
    """
    env = os.environ.get("FSDP_EMA_LIBRARY")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"FSDP_EMA_LIBRARY={env!r} does not name a file")
        return env
    here = Path(__file__).resolve().parent
    for candidate in (here / "lib" / _LIB_NAME, here.parents[1] / "build" / "lib" / _LIB_NAME):
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"{_LIB_NAME} not found; build it with scripts/build.sh or set FSDP_EMA_LIBRARY"
    )


def load_library(path: str | None = None) -> str:
    """Loads the operator library once (``torch.ops.load_library``) and returns its path."""
    global _loaded
    if _loaded is None:
        _loaded = path or library_path()
        torch.ops.load_library(_loaded)
    return _loaded
