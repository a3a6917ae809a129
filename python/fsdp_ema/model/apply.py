"""Writing weights into a live (wrapped) model for good: ``ShardedEMA.copy_to`` and
``fsdp_ema.load_model_weights``.

Both write into the tensors the model computes from, found by the same slots ``ShardedEMA``
keeps (``model.slots.discover``): FSDP2 DTensors' local shards, FSDP1 FlatParameters' local slices,
whole tensors otherwise; after freeing the unsharded copies a forward would use instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .slots import Slot, discover


def reshard_fsdp2(model: nn.Module) -> None:
    """Frees FSDP2's unsharded parameters (the root's stay unsharded after a forward without
    backward): first, since discovery would otherwise find the unsharded tensors, whose memory
    this frees, instead of the shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def reshard(model: nn.Module, slots: Sequence[Slot]) -> None:
    """Frees unsharded parameters (FSDP2's; FSDP1 keeps the root's flat parameter), so that the
    next forward gathers from the shards written."""
    reshard_fsdp2(model)
    for slot in slots:
        slot.reshard()


def matching_tensors(model: nn.Module, slots: Sequence[Slot], what: str) -> list[torch.Tensor]:
    """The live tensors of ``model`` that correspond to ``slots`` (of another model wrapped the
    same way), by name and local shape."""
    wanted = {fqn for slot in slots for fqn, _ in slot.names()}
    reshard_fsdp2(model)
    theirs = discover(model, True, "copy", lambda fqn, p: fqn in wanted)
    by_name = {slot.names()[0][0]: slot for slot in theirs}
    out = []
    for slot in slots:
        fqn = slot.names()[0][0]
        other = by_name.get(fqn)
        if other is None or other.names() != slot.names():
            raise ValueError(f"{what}: the model has no tensor laid out as {slot.describe()} of "
                             f"the EMA's model")
        t = other.get()
        if t.shape != slot.local_shape:
            raise ValueError(f"{what}: {slot.describe()} has a local shard of shape "
                             f"{list(t.shape)} in the model but {list(slot.local_shape)} in the "
                             f"EMA; the models must be sharded alike")
        out.append(t)
    reshard(model, theirs)
    return out
