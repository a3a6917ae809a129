"""scikit-build-core metadata provider: a version and a torch pin saying which torch a wheel needs.

A compiled torch extension runs only with the torch it was built against, so the wheel says so:
its version carries a local part naming that torch and its CUDA (``0.1.0+torch2.14.1.cu130``) and
it depends on exactly that torch release (``torch==2.14.1``, which any local build of it, +cu130
or +cpu, satisfies; ``import fsdp_ema`` checks the CUDA part). The base version is the one in the
top-level CMakeLists.txt ``project(... VERSION ...)``, the single place it is written.
Used by pyproject.toml ([[tool.dynamic-metadata]]); runs in the Python that builds the wheel.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]


def project_version() -> str:
    text = (_ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    match = re.search(r"project\(\s*fsdp_ema\s+VERSION\s+([0-9][0-9.]*)", text)
    if not match:
        raise RuntimeError(f"{_ROOT / 'CMakeLists.txt'}: no project(fsdp_ema VERSION x.y.z)")
    return match.group(1)


def torch_tag(release: str, cuda: str | None, hip: str | None) -> str:
    """``torch2.14.1.cu130`` for torch 2.14.1 with CUDA 13.0 (``.cpu``, ``.rocm6.4`` likewise)."""
    if cuda:
        accel = "cu" + cuda.replace(".", "")
    elif hip:
        accel = "rocm" + ".".join(hip.split(".")[:2])
    else:
        accel = "cpu"
    return f"torch{release}.{accel}"


def dynamic_metadata(settings: dict[str, Any], project: dict[str, Any]) -> dict[str, Any]:
    import torch

    release = str(torch.__version__).split("+")[0]
    tag = torch_tag(release, torch.version.cuda, getattr(torch.version, "hip", None))
    return {"version": f"{project_version()}+{tag}", "dependencies": [f"torch=={release}"]}
