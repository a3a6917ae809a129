"""Adapters that keep a sharded EMA in the trainers people use (docs/INTEGRATIONS.md).

- ``fsdp_ema.integrations.lightning.ShardedEMA``: a Lightning ``Callback``
  (``pip install "fsdp-ema[lightning]"``);
- ``fsdp_ema.integrations.transformers.ShardedEMACallback``: a Hugging Face ``TrainerCallback``,
  which also serves Accelerate loops (``pip install "fsdp-ema[transformers]"``).

Each module imports its framework when it is imported (and raises one ``ImportError`` naming the
extra when the framework is missing); this package imports neither. The adapters only translate
the trainer's events into ``fsdp_ema.ShardedEMA`` calls: the averaging, the layouts and the files
are ShardedEMA's and fsdp_ema's.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any


def check_options(what: str, decay: float, options: dict[str, Any]) -> None:
    """Raises the ``TypeError`` that ``fsdp_ema.ShardedEMA(model, decay, **options)`` would raise
    for an unknown option, when the callback is made (the EMA itself is made later, once the
    trainer has wrapped the model)."""
    from ..sharded_ema import ShardedEMA

    try:
        inspect.signature(ShardedEMA).bind(None, decay, **options)
    except TypeError as e:
        raise TypeError(f"{what}: {e} (the options are fsdp_ema.ShardedEMA's)") from None


def missing_framework(module: str, framework: str, extra: str) -> ImportError:
    """The one error an integration raises when its framework is not installed."""
    return ImportError(f"{module} needs {framework}, which is not installed: pip install "
                       f"\"fsdp-ema[{extra}]\"")


class HeldSwap:
    """The EMA weights swapped into the model between two trainer events (an evaluation's start
    and its end), which one ``with ema.swap():`` block cannot span. ``enter`` is a no-op while a
    swap is held; a swap that fails to enter leaves nothing held."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    @property
    def active(self) -> bool:
        return self._stack is not None

    def enter(self, ema: Any) -> None:
        if self._stack is None:
            stack = contextlib.ExitStack()
            stack.enter_context(ema.swap())
            self._stack = stack

    def exit(self) -> None:
        """Puts the training weights back (no-op when no swap is held)."""
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()
