"""The small state the load tests save and read back: one tensor of each kind a load must handle
(a float32 matrix, a bfloat16 vector, a bool mask, a 0-dim int64, optionally a zero-element
tensor), drawn from a seed."""

from __future__ import annotations

import torch


def mixed_state(seed: int, rows: int, empty: bool = False) -> dict[str, torch.Tensor]:
    """"w" (rows x 70 float32), "b", "m", "step", and "empty" (0 x 3) when asked for."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "w": torch.randn(rows, 70, generator=g),
        "b": torch.randn(70, generator=g).to(torch.bfloat16),
        "m": torch.rand(50, generator=g) > 0.5,
        "step": torch.tensor(12, dtype=torch.int64),
    }
    if empty:
        out["empty"] = torch.zeros(0, 3)
    return out
