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

# _ops: the one door to the ops. The public module paths are attributes of the package, as they
# always were (fsdp_ema.posthoc is the function below; its module is fsdp_ema.store.posthoc).
from . import (  # noqa: E402
    _ops,
    checkpoint,
    config,  # noqa: F401
    momentum,  # noqa: F401
    posthoc,  # noqa: F401  (rebound to the function below)
    power_ema,  # noqa: F401
    sharded_ema,  # noqa: F401
    training_state,  # noqa: F401
)
from .distributed.shutdown import destroy_process_group  # noqa: E402
from .ema.config import EMAConfig  # noqa: E402
from .ema.momentum import CosineMomentum  # noqa: E402
from .ema.power import PowerEMA, ShardedPowerEMA  # noqa: E402
from .ema.sharded import ShardedEMA, Warmup  # noqa: E402
from .store.async_save import SaveHandle, init_async_groups  # noqa: E402
from .store.model_weights import load_model_weights  # noqa: E402
from .store.peft import export_merged, export_peft_adapter  # noqa: E402
from .store.posthoc import posthoc, posthoc_plan  # noqa: E402, F811  (the function over the module)
from .store.training_state import (  # noqa: E402
    latest_checkpoint,
    load_training_state,
    save_training_state,
)

# The fake (Meta) kernels of every op live in the library itself (registration/registration.cpp),
# and so does TorchScript's side-effect mark. torch.compile's mark can only be set from Python
# (importing _ops sets it): with it, a save_shard whose byte count is unused stays in a compiled
# graph. (With the library alone: docs/OPERATORS.md, "torch.compile with the library alone".)

__all__ = ["update_", "update_multi_", "load_library", "library_path", "checkpoint", "ShardedEMA",
           "EMAConfig", "Warmup", "CosineMomentum", "PowerEMA", "ShardedPowerEMA", "posthoc",
           "posthoc_plan", "save_training_state", "load_training_state", "latest_checkpoint",
           "load_model_weights", "export_peft_adapter", "export_merged", "SaveHandle",
           "init_async_groups", "destroy_process_group"]

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
    ``decay=0`` copies the model exactly and ``decay=1`` leaves the EMA unchanged. The weight
    ``1 - decay`` is formed in double and rounded once: the result is
    ``torch.lerp(ema, model, 1 - decay)`` bit for bit (pass decay tensors as float64; a float32
    one has already rounded ``decay``). Every argument is validated before any tensor is
    written.
    """
    with torch.no_grad():
        _ops.update_(list(ema), list(model), decay)


def update_multi_(emas: Sequence[Sequence[torch.Tensor]], model: Sequence[torch.Tensor],
                  decays: Sequence[Decay]) -> None:
    """``emas[k][i] <- lerp(emas[k][i], model[i], 1 - decays[k])`` for K EMA lists of the same
    model tensors, in one call that reads the model once (``4 + 8K`` bytes per element for fp32
    instead of ``12K`` for K ``update_`` calls).

    Args:
        emas: K lists, each with one EMA tensor per model tensor (the dtypes ``update_`` takes,
            mixed freely). No EMA tensor may share memory with any other tensor of the call.
        model: the model tensors.
        decays: K decays: floats in [0, 1], or 0-dim floating tensors on the CPU or the
            tensors' device (read by the kernel; no host sync). Floats and tensors may be mixed.

    Each EMA gets exactly what ``update_(emas[k], model, decays[k])`` would give it (the same
    kernels, bit for bit). Validated before any tensor is written. The raw operator takes the
    lists flattened, profile-major: ``torch.ops.fsdp_ema.update_multi_(ema_flat, model, decays)``
    with ``ema_flat[k * len(model) + i] = emas[k][i]``.
    """
    emas = [list(e) for e in emas]
    model = list(model)
    decays = list(decays)
    if len(emas) != len(decays):
        raise ValueError(f"fsdp_ema.update_multi_: {len(emas)} EMA lists but {len(decays)} decays; "
                         f"pass one decay per list")
    for k, e in enumerate(emas):
        if len(e) != len(model):
            raise ValueError(f"fsdp_ema.update_multi_: emas[{k}] has {len(e)} tensors but model "
                             f"has {len(model)}")
    flat = [t for e in emas for t in e]
    if any(isinstance(d, torch.Tensor) for d in decays):
        device = next(d.device for d in decays if isinstance(d, torch.Tensor))
        decays = [d if isinstance(d, torch.Tensor) else torch.tensor(float(d), dtype=torch.float64,
                                                                     device=device)
                  for d in decays]
    else:
        decays = [float(d) for d in decays]
    with torch.no_grad():
        _ops.update_multi_(flat, model, decays)
