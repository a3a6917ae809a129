"""Finding and loading the compiled fsdp_ema library (registers ``torch.ops.fsdp_ema.*``)."""

from __future__ import annotations

import importlib.resources
import json
import os
from pathlib import Path

import torch

_LIB_NAME = "libfsdp_ema.so"
# Written by the build beside the library: the torch (version, CUDA) it was compiled against.
_RECORD_NAME = "fsdp_ema_build.json"
_loaded: str | None = None


class TorchMismatchError(ImportError):
    """The running torch is not the one ``libfsdp_ema.so`` was built against."""


def library_path() -> str:
    """Path of ``libfsdp_ema.so``.

    Looked up in order: the ``FSDP_EMA_LIBRARY`` environment variable, a copy inside this package
    (``fsdp_ema/lib/``, where ``pip install`` puts it, editable installs included), and the source
    tree's ``build/lib/`` (``scripts/build.sh``, with ``PYTHONPATH`` on the checkout's ``python/``).
    """
    env = os.environ.get("FSDP_EMA_LIBRARY")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"FSDP_EMA_LIBRARY={env!r} does not name a file")
        return env
    # importlib.resources, not __file__: an editable install keeps the Python files in the
    # checkout and the compiled library in site-packages, and resources see both.
    packaged = importlib.resources.files(__package__) / "lib" / _LIB_NAME
    if packaged.is_file():
        return os.fspath(packaged)
    built = Path(__file__).resolve().parents[2] / "build" / "lib" / _LIB_NAME
    if built.is_file():
        return str(built)
    raise FileNotFoundError(
        f"{_LIB_NAME} not found; install the package (pip install --no-build-isolation .), "
        "build it with scripts/build.sh, or set FSDP_EMA_LIBRARY"
    )


def check_torch(library: str) -> None:
    """Raises :class:`TorchMismatchError` unless torch is the one ``library`` was built against.

    A C++ extension loaded into another torch fails with an undefined-symbol error from the
    loader, or worse, loads and misbehaves; the build's record beside the library lets us say
    why first. A library without a record (copied by hand) is not checked.
    """
    record = Path(library).with_name(_RECORD_NAME)
    if not record.is_file():
        return
    try:
        built = json.loads(record.read_text(encoding="utf-8"))
        built_version, built_cuda = built["torch_version"], built["torch_cuda"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ImportError(f"fsdp_ema: cannot read the build record {record}: {e!r}") from e
    running_version, running_cuda = str(torch.__version__), torch.version.cuda
    if (built_version, built_cuda) == (running_version, running_cuda):
        return
    raise TorchMismatchError(
        f"fsdp_ema: {library} was built against torch {built_version} "
        f"(CUDA {built_cuda or 'none'}), but this Python runs torch {running_version} "
        f"(CUDA {running_cuda or 'none'}) from {Path(torch.__file__).parent}; a compiled torch "
        "extension only loads into the torch it was built against. Rebuild fsdp_ema against this "
        "torch: `pip install --no-build-isolation --force-reinstall --no-deps <fsdp_ema checkout>` "
        "with this Python (or, in a checkout used through PYTHONPATH, `bash scripts/build.sh`)."
    )


def load_library(path: str | None = None) -> str:
    """Loads the operator library once (``torch.ops.load_library``) and returns its path.

    The torch it was built against is checked first (:func:`check_torch`).
    """
    global _loaded
    if _loaded is None:
        candidate = path or library_path()
        check_torch(candidate)
        torch.ops.load_library(candidate)
        _loaded = candidate
    return _loaded
