"""``ShardedEMA``: an exponential moving average of a model's weights, kept shard by shard.

Works on FSDP2 (``fully_shard``: DTensor parameters), FSDP1 (``FullyShardedDataParallel``, with
``use_orig_params`` True or False), DDP and plain modules. Every rank averages only what it holds
(the local shard of each parameter; for FSDP1 the local slice of each FlatParameter), with one
fused ``update_`` op call per step. See docs/SHARDED_EMA.md.

This module holds the class and its update; what it is (slots, tensors, step, options) is its
``state`` (``ema.state.EMAState``). Its other parts are mixins beside it, one role each, reading
the state (``ema.schedule``, ``ema.persist``, ``ema.full``, ``ema.swap``); its options are
``ema.config.EMAConfig``; what a model holds is in ``model.slots`` (discovery and one slot per
tensor), full tensors and the export in ``store.full_state``, tensor layouts in
``model.layouts`` and the collective save in ``store.collective``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .. import _ops
from .config import EMAConfig, Warmup
from .full import FullStateMixin
from .persist import CheckpointMixin
from .schedule import ScheduleMixin
from .state import STEP_KEY, DeviceGroup, EMAState
from .swap import SwapMixin
from .teacher_checks import check_teachers

__all__ = ["ShardedEMA", "Warmup", "EMAConfig"]


# --- the EMA --------------------------------------------------------------------------------------

class ShardedEMA(ScheduleMixin, CheckpointMixin, FullStateMixin, SwapMixin):
    """Exponential moving average of a model's weights, each rank keeping only its shards.

    ``ema <- decay * ema + (1 - decay) * weights`` after every optimizer step, for every
    parameter (and, by default, every persistent buffer), on the shards this rank holds:

    - FSDP2 (``fully_shard``): the local shard of every DTensor parameter;
    - FSDP1 (``FullyShardedDataParallel``, ``use_orig_params`` True or False): the local slice of
      every FlatParameter, padding included;
    - DDP and plain modules (and buffers everywhere): the whole tensor.

    Memory per rank is the local numel times the EMA dtype's size. ``update()`` is one
    ``update_`` op call (per device) with the decay computed on the device, so it
    never synchronizes with the host and a ``torch.compile(fullgraph=True)`` step that calls it
    compiles once.

    Args:
        model: the (wrapped) model; the EMA reads and, in ``swap()``, writes its tensors.
        config: an ``fsdp_ema.EMAConfig`` holding the options (each field documented there),
            or the decay as a number (``ShardedEMA(model, 0.999)``); None: the defaults.
        **options: the same options as keywords (``ShardedEMA(model, decay=0.999,
            warmup=True)``), replacing those fields of ``config``.

    The parts of the class live beside it, one responsibility each: the schedule
    (``ema.schedule``), state dicts and checkpoint directories (``ema.persist``), full weights
    and the export (``ema.full``), the weights in the live model: ``swap``, ``copy_to``,
    ``module`` (``ema.swap``). What they share is ``state`` (``EMAState``: the tensors made
    from the model's slots, bound to the live model); this file holds the update.
    """

    #: Key of the update counter in ``state_dict()``.
    STEP_KEY = STEP_KEY

    def __init__(self, model: nn.Module, config: EMAConfig | float | None = None,
                 **options: Any):
        config = EMAConfig.of(type(self).__name__, config, options)
        self.model = model
        self._state = EMAState.build(model, config, "ShardedEMA")

    @property
    def state(self) -> EMAState:
        """What this EMA is, as one object (``fsdp_ema.ema.state.EMAState``): its slots, tensors,
        step, options, process group and device. Every part of the EMA, every save and every
        load reads and writes it through this object."""
        return self._state

    # --- what it keeps ----------------------------------------------------------------------------

    @property
    def config(self) -> EMAConfig:
        """The options this EMA was made with (read-only; ``repr`` prints them whole)."""
        return self.state.config

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of averaged tensors (``config.dtype``; None: each tensor's own)."""
        return self.config.dtype

    @property
    def params(self) -> str | Callable[[str, torch.Tensor], bool]:
        """Which parameters the EMA keeps (``config.params``)."""
        return self.config.params

    @property
    def nbytes(self) -> int:
        """Bytes of EMA state held on this rank."""
        return sum(t.numel() * t.element_size() for t in self.state.tensors)

    @property
    def shapes(self) -> Mapping[str, torch.Size]:
        """``{clean FQN: global shape}`` of every tensor the EMA keeps, in ``state_dict()``
        order (the names ``save``, ``full_state_dict`` and ``export`` use); read-only."""
        return MappingProxyType(self.state.shapes)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group the EMA's collectives run over (None in a single process); rank 0
        of it is the rank that writes exports."""
        return self.state.group

    # --- updating ---------------------------------------------------------------------------------

    @torch.no_grad()
    def update(self) -> None:
        """Folds the current weights into the EMA: one ``update_`` call per device."""
        state = self.state
        if state.swapped:
            raise RuntimeError("ShardedEMA.update() inside swap(): the model holds the EMA "
                               "weights; update after the swap() block")
        if not torch.compiler.is_compiling():
            state.check_selection("ShardedEMA.update")
            state.refresh()
            if state.teachers:  # module()'s: none requires grad (an optimizer would write here)
                check_teachers(state.teachers, "ShardedEMA.update()")
        decay = self._scheduled_decay(state.step)
        if state.host is not None:  # EMA in host memory: staged copy, worker-thread update
            state.host.update(state.tensors, state.model_tensors, decay,
                              self.decay_at(state.step_count()) != 1.0)
            state.count_step(decay)
            return
        for g in state.device_groups:
            # The op reads a CPU decay on the host (no sync); only a device decay for a group
            # on another device needs a copy (CPU-offloaded shards next to device buffers).
            d = decay if g.device == decay.device or decay.device.type == "cpu" else decay.to(
                g.device)
            self._update_group(g, d)
        state.count_step(decay)

    def _update_group(self, g: DeviceGroup, decay: torch.Tensor) -> None:
        """One device's update (fsdp_ema.ShardedPowerEMA overrides it to update its profiles)."""
        if g.ema_average:
            _ops.update_(g.ema_average, g.model_average, decay)
        if g.ema_copy:
            torch._foreach_copy_(g.ema_copy, g.model_copy)

    def synchronize(self) -> None:
        """Waits for the update in flight of an EMA in host memory (``device="cpu"``) and
        re-raises its error; a no-op otherwise. Every read of the EMA calls it."""
        self.state.synchronize()

    def __repr__(self) -> str:
        kinds = defaultdict(int)
        for slot in self.state.slots:
            kinds[slot.kind] += 1
        schedule = f"decay={self.decay}"
        if self.params != "all":
            schedule += f", params={self.params!r}"
        if self.warmup:
            schedule += f", warmup={self.warmup}"
        if self.schedule is not None:
            schedule = f"schedule={self.schedule!r}"
        if self.update_every > 1:
            schedule += f", update_every={self.update_every}"
        if self.start_step:
            schedule += f", start_step={self.start_step}"
        return (f"ShardedEMA({schedule}, dtype={self.dtype}, tensors={dict(kinds)}, "
                f"nbytes={self.nbytes})")


# Classes carry their public path (repr, pickles, the settings a checkpoint records).
for _cls in (ShardedEMA,):
    _cls.__module__ = "fsdp_ema.sharded_ema"
