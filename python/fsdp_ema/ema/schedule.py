"""The decay schedule of a ``ShardedEMA`` (one part of the class; ``ema.sharded`` says which):
the options that make it, read from the EMA's ``EMAConfig``, the decay of update ``k`` as tensor
ops on the device (no host sync: a compiled step compiles once) and as a Python float, and the
update count, kept on the device and, for eager updates, on the host too.

Reads the EMA's ``config`` and its ``state`` (``EMAState``: the step and the fixed decay).
"""

from __future__ import annotations

from typing import Any

import torch

from .config import EMAConfig, Warmup
from .state import EMAState


class ScheduleMixin:
    """``decay``, ``warmup``, ``schedule``, ``update_every``, ``start_step`` (the config's),
    ``decay_at(k)``, ``step``, ``last_decay``."""

    config: EMAConfig
    state: EMAState

    @property
    def decay(self) -> float:
        """The fixed decay, or the warmup's upper bound (``config.decay``)."""
        return self.config.decay

    @property
    def warmup(self) -> Warmup | None:
        """The warmup (``config.warmup``), or None."""
        return self.config.warmup

    @property
    def schedule(self) -> Any:
        """The schedule object (``config.schedule``), or None."""
        return self.config.schedule

    @property
    def update_every(self) -> int:
        return self.config.update_every

    @property
    def start_step(self) -> int:
        return self.config.start_step

    def _scheduled_decay(self, k: torch.Tensor) -> torch.Tensor:
        """The decay of update ``k`` (0-dim int64 tensor), with tensor ops only (no host sync)."""
        if self.schedule is not None:
            # The t-th averaging update, counted from 1 (update_every skips the others).
            d = self.schedule.device_decay(k // self.update_every + 1)
        elif self.warmup is None:
            d = self.state.fixed_decay
        else:
            s = (k - self.start_step).clamp_min(0).to(torch.float64)
            d = self.warmup.device_decay(s, self.decay)
        if self.update_every > 1:
            d = torch.where(k % self.update_every == 0, d, 1.0)   # 1 keeps the EMA as it is
        if self.start_step > 0:
            d = torch.where(k < self.start_step, 0.0, d)          # 0 copies the weights
        return d

    def decay_at(self, step: int) -> float:
        """The decay update number ``step`` uses, as a Python float: ``step`` counts ``update()``
        calls from 0 (the value of ``self.step`` when that update runs). A schedule's own
        ``decay_at(t)`` counts averaging updates from 1: this is
        ``schedule.decay_at(step // update_every + 1)`` on the averaging updates, 1.0 between."""
        if step < self.start_step:
            return 0.0
        if step % self.update_every:
            return 1.0
        if self.schedule is not None:
            return self.schedule.decay_at(step // self.update_every + 1)
        return self.warmup(step - self.start_step, self.decay) if self.warmup else self.decay

    @property
    def step(self) -> torch.Tensor:
        """Number of ``update()`` calls so far (0-dim int64 tensor on the EMA's device)."""
        return self.state.step

    @property
    def last_decay(self) -> torch.Tensor | None:
        """The decay the last ``update()`` used (0-dim tensor; reading it syncs only if you do)."""
        return self.state.last_decay
