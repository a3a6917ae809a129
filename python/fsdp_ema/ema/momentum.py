"""Momentum schedules of self-distillation teachers, as ``ShardedEMA`` schedules computed on the
device: ``CosineMomentum``, DINO's cosine from ``base`` to ``final`` over the run (DINO, DINOv2,
DINOv3, iBOT and BYOL use it). See docs/SELF_DISTILLATION.md.

A schedule gives the decay of the ``t``-th averaging update (``t`` from 1) both as tensor
arithmetic on the device (``device_decay``: no host sync, so a compiled step that calls
``ShardedEMA.update()`` compiles once) and as a Python float (``decay_at``). The EMA's step counter
is part of its ``state_dict()`` (and of ``fsdp_ema.save_training_state``), so a resumed run picks
the schedule up at the step it stopped.
"""

from __future__ import annotations

import math

import torch

from .config import check_schedule_t

__all__ = ["CosineMomentum"]


class CosineMomentum:
    """DINO's teacher momentum: ``final + (base - final) * (1 + cos(pi * i / total_steps)) / 2`` at
    iteration ``i`` (from 0), then ``final`` from ``i = total_steps`` on, as DINO's
    ``cosine_scheduler`` and DINOv3's ``CosineScheduler`` tabulate it; the ``t``-th averaging update
    is iteration ``i = t - 1``.

    Args:
        base: the momentum of the first update (DINO: 0.996; in [0, 1]).
        final: the momentum the schedule reaches (DINO: 1.0; in [0, 1]).
        total_steps: the iterations the cosine spans: the run's optimizer steps (divided by
            ``update_every`` when the EMA averages every few steps). An integer >= 1.

    The momentum is computed in float64 on the device and handed to the update as it is: the EMA
    weight ``1 - m`` is formed in double and rounded once (DINOv3's ``_foreach_mul_(m)`` +
    ``_foreach_add_(alpha=1 - m)`` rounds ``m`` and ``1 - m`` to float32 separately).
    """

    def __init__(self, base: float = 0.996, final: float = 1.0, *, total_steps: int):
        if not (0.0 <= float(base) <= 1.0 and 0.0 <= float(final) <= 1.0):
            raise ValueError(f"CosineMomentum: base and final must be in [0, 1], got base={base}, "
                             f"final={final}")
        if isinstance(total_steps, bool) or int(total_steps) != total_steps or total_steps < 1:
            raise ValueError(f"CosineMomentum: total_steps must be an integer >= 1, got "
                             f"{total_steps!r}")
        self.base, self.final, self.total_steps = float(base), float(final), int(total_steps)
        self._half = 0.5 * (self.base - self.final)
        self._omega = math.pi / self.total_steps

    def decay_at(self, t: int) -> float:
        """The momentum of the ``t``-th averaging update (``t >= 1``: iteration ``t - 1``), as a
        Python float. ``ShardedEMA.decay_at(k)`` counts ``update()`` calls from 0: update ``k``
        uses ``decay_at(k // update_every + 1)``."""
        check_schedule_t("CosineMomentum", t)
        i = t - 1
        if i >= self.total_steps:
            return self.final
        return self.final + self._half * (1.0 + math.cos(self._omega * i))

    def device_decay(self, t: torch.Tensor) -> torch.Tensor:
        """The momentum for a 0-dim int64 tensor ``t >= 1``: a float64 tensor on its device."""
        # Clamped to total_steps, where the cosine is exactly final: no branch, no host sync.
        i = (t - 1).clamp(0, self.total_steps).to(torch.float64)
        return self.final + self._half * (1.0 + torch.cos(i * self._omega))

    def __repr__(self) -> str:
        return (f"CosineMomentum(base={self.base}, final={self.final}, "
                f"total_steps={self.total_steps})")


# Classes carry their public path (repr, pickles, the settings a checkpoint records).
for _cls in (CosineMomentum,):
    _cls.__module__ = "fsdp_ema.momentum"
