"""``fsdp_ema.load_model_weights``: a checkpoint directory written into a live (wrapped) model's
own tensors, found by the slots ``ShardedEMA`` keeps, through the collective load."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.groups import default_group
from ..model.apply import reshard, reshard_fsdp2
from ..model.slots import discover
from .collective import check_names, load_slots


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
    slots = discover(model, True, "copy")
    if not slots:
        raise ValueError(f"{what}: {type(model).__name__} has no parameters or buffers")
    tensors = [slot.get() for slot in slots]
    device = tensors[0].device

    shapes = {fqn: shape for slot in slots for fqn, shape in slot.names()}

    # Checked and agreed on every rank before the first write; then read into the model's own
    # tensors in place (after freeing unsharded copies a forward would use instead).
    load_slots(directory, slots, tensors,
               check_names=lambda available: check_names(shapes, available, strict, what),
               group=process_group, device=device, what=what, verify=verify,
               before_write=lambda: reshard(model, slots))
