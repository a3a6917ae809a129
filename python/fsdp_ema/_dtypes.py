"""The dtypes fsdp_ema knows, read from the C++ table (the ``dtypes`` op).

format/include/fsdp_ema/format/dtype_table.h is the one table: each dtype's safetensors name,
torch name, size and the roles it may take ("ema": an EMA or update dtype, "model": a model
weight, "cast": a checkpoint cast target). Python asks the op instead of keeping its own list, and
every dtype name that crosses from C++ (``info()``'s ``"torch_dtype"``) or from a file (the
training-state codec) becomes a ``torch.dtype`` here and nowhere else.
"""

from __future__ import annotations

import functools
import json

import torch

from . import _ops


@functools.cache
def table() -> tuple[dict, ...]:
    """Every row of the C++ dtype table: ``{"name", "torch", "size", "floating", "roles"}``."""
    return tuple(json.loads(_ops.dtypes()))


@functools.cache
def with_role(role: str) -> tuple[torch.dtype, ...]:
    """The torch dtypes that may take ``role`` ("ema", "model" or "cast"), in table order."""
    return tuple(getattr(torch, row["torch"]) for row in table() if role in row["roles"])


def ema_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes an EMA may be kept in (what ``update_`` accepts for ``ema``)."""
    return with_role("ema")


def check_ema_dtype(what: str, dtype: object) -> None:
    """``ValueError`` naming ``what`` unless ``dtype`` is None or one of :func:`ema_dtypes` (an
    EMA's dtype, an export's cast)."""
    if dtype is not None and dtype not in ema_dtypes():
        raise ValueError(f"{what}: dtype must be one of {list(ema_dtypes())} or None, got {dtype}")


def from_name(name: object, where: str) -> torch.dtype:
    """The ``torch.dtype`` called ``name`` ("float32", "int64", ...); ``ValueError`` naming
    ``where`` for anything else. Accepts every torch dtype (training-state extras may hold any
    tensor), not only the table's."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: unknown tensor dtype {name!r}")
    return dtype


def name_of(dtype: torch.dtype) -> str:
    """The name :func:`from_name` reads back ("float32" for ``torch.float32``)."""
    return str(dtype).removeprefix("torch.")
