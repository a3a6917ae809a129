"""The state dicts a training-state save writes and a load fills: the model's and the optimizer's
from ``torch.distributed.checkpoint.state_dict`` (DTensors for FSDP2, ShardedTensors for FSDP1,
plain tensors otherwise; collective for FSDP1), the EMA's from ``ShardedEMA.state_dict()``. Saves
and loads take them with the same options, so a load's templates match what the save wrote.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class States(NamedTuple):
    """The state dicts of a save or load (None for what is not saved or loaded)."""

    model: dict[str, Any] | None
    optimizer: dict[str, Any] | None
    ema: dict[str, Any] | None


def state_options():
    """Sharded (each rank its own part) and where the tensors are: no gather, no copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def model_state(model):
    """``model``'s sharded state dict."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=state_options())


def optim_state(model, optimizer):
    """``optimizer``'s sharded state dict, keyed by ``model``'s FQNs."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=state_options())
