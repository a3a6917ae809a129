"""Writing weights into a live (wrapped) model for good: ``ShardedEMA.copy_to`` and
``fsdp_ema.load_model_weights``.

Both write into the tensors the model computes from, found by the same slots ``ShardedEMA``
keeps (``_slots.discover``): FSDP2 DTensors' local shards, FSDP1 FlatParameters' local slices,
whole tensors otherwise; after freeing the unsharded copies a forward would use instead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ._dist import default_group
from ._slots import _discover, _Slot, load_slots


def reshard_fsdp2(model: nn.Module) -> None:
    """Frees FSDP2's unsharded parameters (the root's stay unsharded after a forward without
    backward): first, since discovery would otherwise find the unsharded tensors, whose memory
    this frees, instead of the shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def reshard(model: nn.Module, slots: Sequence[_Slot]) -> None:
    """Frees unsharded parameters (FSDP2's; FSDP1 keeps the root's flat parameter), so that the
    next forward gathers from the shards written."""
    reshard_fsdp2(model)
    for slot in slots:
        slot.reshard()


def matching_tensors(model: nn.Module, slots: Sequence[_Slot], what: str) -> list[torch.Tensor]:
    """The live tensors of ``model`` that correspond to ``slots`` (of another model wrapped the
    same way), by name and local shape."""
    wanted = {fqn for slot in slots for fqn, _ in slot.names()}
    reshard_fsdp2(model)
    theirs = _discover(model, True, "copy", lambda fqn, p: fqn in wanted)
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


@torch.no_grad()
def load_model_weights(model: nn.Module, directory: str | os.PathLike, *, strict: bool = True,
                       verify: bool = True,
                       process_group: dist.ProcessGroup | None = None) -> None:
    """Loads a checkpoint directory (``ShardedEMA.save_shard_weights`` or ``save``, written at any
    world size) into ``model``'s parameters and persistent buffers, whatever its wrapping: FSDP2,
    FSDP1 (any strategy), DDP or plain. Each rank reads only the rows it holds where the layout
    allows and writes them into its own shards. Collective over ``process_group`` (default: the
    default group when torch.distributed is initialized): everything is read and checked on every
    rank before any weight is written, so a failure on one rank raises on every rank and leaves
    every model as it was.

    ``strict``: the checkpoint's names must be exactly the model's (else the names both have are
    loaded); shapes must always match, and dtypes be of one kind (floating precision may change).
    """
    directory = os.fspath(directory)
    what = f"fsdp_ema.load_model_weights({directory!r})"
    process_group = default_group(process_group)
    reshard_fsdp2(model)
    slots = _discover(model, True, "copy")
    if not slots:
        raise ValueError(f"{what}: {type(model).__name__} has no parameters or buffers")
    tensors = [slot.get() for slot in slots]
    device = tensors[0].device

    shapes = {fqn: shape for slot in slots for fqn, shape in slot.names()}

    def check_names(available) -> None:
        missing = sorted(n for n in shapes if n not in available)
        unexpected = sorted(n for n in available if n not in shapes)
        wrong = [f"{n!r} is {list(available[n])} there but {list(s)} here"
                 for n, s in shapes.items() if n in available and available[n] != s]
        problems = ([f"missing {len(missing)} name(s), e.g. {missing[:4]}"] if strict and missing
                    else [])
        if strict and unexpected:
            problems.append(f"unexpected {len(unexpected)} name(s), e.g. {unexpected[:4]}")
        if wrong:
            problems.append(f"{len(wrong)} shape mismatch(es): " + "; ".join(wrong[:8]))
        if problems:
            raise ValueError(f"{what}: " + "; ".join(problems))

    # Checked and agreed on every rank before the first write; then read into the model's own
    # tensors in place (after freeing unsharded copies a forward would use instead).
    load_slots(directory, slots, tensors, check_names=check_names, group=process_group,
               device=device, what=what, verify=verify, before_write=lambda: reshard(model, slots))
