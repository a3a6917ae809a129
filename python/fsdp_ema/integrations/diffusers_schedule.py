"""diffusers' EMA schedule (``EMAModel.get_decay`` of diffusers 0.42) as an ``fsdp_ema.EMAConfig``
schedule, ``DiffusersDecay``, computed on the device like every schedule of the EMA (the decay a
float64 tensor, the weight ``1 - decay`` formed in double), and the checks of its settings that
diffusers' ``EMAModel.load_state_dict`` makes. Imports no framework."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["DiffusersDecay", "SCALARS", "check_settings"]

#: The scalars of diffusers' ``EMAModel.state_dict()``, in its order.
SCALARS = ("decay", "min_decay", "optimization_step", "update_after_step", "use_ema_warmup",
           "inv_gamma", "power")


class DiffusersDecay:
    """diffusers' ``EMAModel.get_decay`` as an ``EMAConfig(schedule=...)``: for the
    ``optimization_step``-th update (from 1), ``s = optimization_step - update_after_step - 1``;
    0 (a copy of the weights) while ``s <= 0``, else ``1 - (1 + s / inv_gamma) ** -power`` with
    ``use_ema_warmup``, ``(1 + s) / (10 + s)`` without, then ``min(., decay)`` and
    ``max(., min_decay)``. The ``t`` of a schedule is the optimization step."""

    def __init__(self, decay: float = 0.9999, min_decay: float = 0.0,
                 update_after_step: int = 0, use_ema_warmup: bool = False,
                 inv_gamma: float = 1.0, power: float = 2 / 3):
        check_settings("DiffusersDecay", dict(
            decay=decay, min_decay=min_decay, update_after_step=update_after_step,
            use_ema_warmup=use_ema_warmup, inv_gamma=inv_gamma, power=power))
        self.decay, self.min_decay = decay, min_decay
        self.update_after_step, self.use_ema_warmup = update_after_step, use_ema_warmup
        self.inv_gamma, self.power = inv_gamma, power

    def settings(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in SCALARS if k != "optimization_step"}

    def get_decay(self, optimization_step: int) -> float:
        """The decay of update ``optimization_step`` (diffusers' ``get_decay``), any integer."""
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_ema_warmup:
            value = 1 - (1 + step / self.inv_gamma) ** -self.power
        else:
            value = (1 + step) / (10 + step)
        return max(min(value, self.decay), self.min_decay)

    def decay_at(self, t: int) -> float:
        if t < 1:
            raise ValueError(f"DiffusersDecay.decay_at: t counts updates from 1, got {t}")
        return self.get_decay(t)

    def device_decay(self, t: torch.Tensor) -> torch.Tensor:
        """``get_decay`` of a 0-dim int64 tensor, as float64 tensor ops (no host sync)."""
        s = (t - (self.update_after_step + 1)).clamp_min(0).to(torch.float64)
        if self.use_ema_warmup:
            value = 1.0 - (1.0 + s / float(self.inv_gamma)) ** -float(self.power)
        else:
            value = (1.0 + s) / (10.0 + s)
        value = value.clamp_max(float(self.decay)).clamp_min(float(self.min_decay))
        return torch.where(s <= 0, torch.zeros_like(value), value)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"DiffusersDecay({args})"


def check_settings(what: str, values: Mapping[str, Any]) -> None:
    """diffusers' checks of ``load_state_dict`` (types) and the ranges the formula needs; each
    error names the setting."""
    kinds = {"decay": (float, int), "min_decay": (float, int), "optimization_step": (int,),
             "update_after_step": (int,), "use_ema_warmup": (bool,), "inv_gamma": (float, int),
             "power": (float, int)}
    for name, value in values.items():
        ok = isinstance(value, kinds[name]) and (name == "use_ema_warmup"
                                                 or not isinstance(value, bool))
        if not ok:
            expected = " or ".join(k.__name__ for k in kinds[name])
            raise ValueError(f"{what}: {name} must be {expected}, got {value!r}")
        if name in ("decay", "min_decay") and not 0.0 <= value <= 1.0:
            raise ValueError(f"{what}: {name} must be in [0, 1], got {value}")
        if name in ("optimization_step", "update_after_step") and value < 0:
            raise ValueError(f"{what}: {name} must be >= 0, got {value}")
        if name in ("inv_gamma", "power") and not value > 0:
            raise ValueError(f"{what}: {name} must be > 0, got {value}")


# Classes carry their public path (repr, pickles, the settings a checkpoint records).
DiffusersDecay.__module__ = "fsdp_ema.integrations.diffusers"
