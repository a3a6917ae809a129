"""fsdp_ema: shard-local exponential moving averages of model weights for FSDP training.

Importing the package loads the operator library, after which the operators are reachable as
``torch.ops.fsdp_ema.*`` (eager, ``torch.compile``, TorchScript) and through the functions below.

Example::

    import torch, fsdp_ema

    ema = [p.detach().clone().float() for p in model.parameters()]
    fsdp_ema.update_(ema, list(model.parameters()), 0.999)  # one fused call for all tensors
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from ._library import library_path, load_library

load_library()

from . import checkpoint  # noqa: E402
from ._async import SaveHandle  # noqa: E402
from .sharded_ema import ShardedEMA, Warmup  # noqa: E402
from .training_state import (latest_checkpoint, load_training_state,  # noqa: E402
                             save_training_state)


# save_shard writes a file and returns a byte count callers usually ignore. Under torch.compile:
# a fake kernel (no file is written while tracing; the count lives on the CPU whatever the
# shards' device), and a side-effect mark so dead-code elimination keeps the call.
# (TorchScript keeps it through CONSERVATIVE alias analysis, set in C++.)
@torch.library.register_fake("fsdp_ema::save_shard")
def _save_shard_fake(directory, rank, world_size, names, shards, offsets, global_shapes,
                     fsync=True, overwrite=False):
    # Registered as the Meta kernel too: real meta tensors (not a tracer's fake ones) would
    # otherwise "save" nothing and return a garbage count.
    from torch._subclasses.fake_tensor import FakeTensor
    for i, s in enumerate(shards):
        if s.device.type == "meta" and not isinstance(s, FakeTensor):
            raise RuntimeError(f"fsdp_ema::save_shard: shards[{i}] ('{names[i]}') is a meta "
                               "tensor, which has no data to save")
    return torch.empty((), dtype=torch.int64, device="cpu")


torch.fx.node.has_side_effect(torch.ops.fsdp_ema.save_shard.default)

__all__ = ["update_", "load_library", "library_path", "checkpoint", "ShardedEMA", "Warmup",
           "save_training_state", "load_training_state", "latest_checkpoint", "SaveHandle"]

Decay = Union[float, torch.Tensor]


def update_(ema: Sequence[torch.Tensor], model: Sequence[torch.Tensor], decay: Decay) -> None:
    """``ema[i] <- ema[i] + (1 - decay) * (model[i] - ema[i])`` for every pair, in one call.

    Args:
        ema: EMA tensors (float32/float64/bfloat16/float16), updated in place. None may share
            memory with another EMA tensor or a model tensor.
        model: model tensors of the same shapes (any of the same four dtypes, mixed freely).
        decay: a float in [0, 1], or a 0-dim floating tensor on the CPU or the tensors' device.
            A device tensor is read by the kernel: no host synchronization, safe in CUDA graphs,
            and a compiled graph does not recompile when its value changes (its range is not
            checked, since that would need a sync).

    Math runs in float32 (float64 for a float64 EMA) in torch.lerp's two-sided form, so
    ``decay=0`` copies the model exactly and ``decay=1`` leaves the EMA unchanged. Every argument
    is validated before any tensor is written.
    """
    with torch.no_grad():
        torch.ops.fsdp_ema.update_(list(ema), list(model), decay)
