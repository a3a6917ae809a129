"""``ShardedEMA``: an exponential moving average of a model's weights, kept shard by shard.

Works on FSDP2 (``fully_shard``: DTensor parameters), FSDP1 (``FullyShardedDataParallel``, with
``use_orig_params`` True or False), DDP and plain modules. Every rank averages only what it holds
(the local shard of each parameter; for FSDP1 the local slice of each FlatParameter), with one
fused ``update_`` op call per step. See docs/SHARDED_EMA.md.

This module holds the class: its tensors, how they follow the live model, and the update. Its
other parts are mixins beside it (``_ema_schedule``, ``_ema_io``, ``_ema_full``, ``_ema_swap``);
its options are ``config.EMAConfig``; what a model holds is in ``_slots`` (discovery and one slot
per tensor), full tensors and the export in ``_full_state``, tensor layouts in ``_layouts`` and
the collective save in ``_collective``.
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
from ..distributed.groups import default_group
from ..model.slots import TrainableWatch, discover
from .config import EMAConfig, Warmup
from .full import FullStateMixin
from .persist import CheckpointMixin
from .schedule import ScheduleMixin
from .swap import SwapMixin

__all__ = ["ShardedEMA", "Warmup", "EMAConfig"]


class _DeviceGroup:
    """The slots on one device: one update_ call (and one copy for copied buffers) each step."""

    def __init__(self, device: torch.device, average: list[int], copy: list[int]):
        self.device, self.average, self.copy = device, average, copy
        self.ema_average: list[torch.Tensor] = []
        self.ema_copy: list[torch.Tensor] = []
        self.model_average: list[torch.Tensor] = []
        self.model_copy: list[torch.Tensor] = []


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
    (``_ema_schedule``), state dicts and checkpoint directories (``_ema_io``), full weights and
    the export (``_ema_full``), the weights in the live model: ``swap``, ``copy_to``,
    ``module`` (``_ema_swap``). This file holds what they share: the tensors (made from the
    model's slots, bound to the live model) and the update.
    """

    #: Key of the update counter in ``state_dict()``.
    STEP_KEY = "fsdp_ema.step"

    def __init__(self, model: nn.Module, config: EMAConfig | float | None = None,
                 **options: Any):
        self._config = config = EMAConfig.of(type(self).__name__, config, options)
        self.model = model
        self._group = default_group(config.process_group)
        select = (None if config.params == "all" else
                  (lambda fqn, p: bool(p.requires_grad)) if config.params == "trainable"
                  else config.params)
        self._slots = discover(model, config.include_buffers, config.buffers, select)
        self._watch = TrainableWatch(model) if config.params == "trainable" else None
        self._check_slots(select is not None)
        self._shapes = {fqn: shape for slot in self._slots for fqn, shape in slot.names()}
        with torch.no_grad():
            model_tensors = [slot.get() for slot in self._slots]
            self._make_tensors(model_tensors)
        # The schedule lives on the device of the largest group: no host sync per step.
        self._device = max(self._groups, key=lambda g: sum(self._ema[i].numel()
                                                             for i in g.average)).device
        self._step = torch.zeros((), dtype=torch.int64, device=self._device)
        # The step on the host as well, counted by eager update() calls, so that reading it
        # (training-state saves, snapshots) never waits for the device; None after an update
        # inside a compiled graph (which cannot count on the host): then the tensor is read.
        self._step_host: int | None = 0
        self._decay = torch.tensor(self.decay, dtype=torch.float64, device=self._device)
        self._last_decay: torch.Tensor | None = None
        self._swapped = False
        self._model_tensors: list[torch.Tensor] = []
        self._bind(model_tensors)
        from torch.distributed.fsdp import FSDPModule

        self._fsdp2_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def _check_slots(self, selected: bool) -> None:
        """What the model must hold for an EMA: a selected parameter, a floating one to average,
        no tensor under the step's key."""
        model, params = self.model, self.config.params
        if selected and all(slot.buffer for slot in self._slots):
            raise ValueError(f"ShardedEMA: params={params!r} selects none of the "
                             f"{sum(1 for _ in model.parameters())} parameters of "
                             f"{type(model).__name__}")
        names = [fqn for slot in self._slots for fqn, _ in slot.names()]
        if self.STEP_KEY in names:
            raise ValueError(f"ShardedEMA: the model has a tensor named {self.STEP_KEY!r}, the key "
                             f"the EMA keeps its step under")
        if not any(slot.average for slot in self._slots):
            raise ValueError(f"ShardedEMA: {type(model).__name__} has no floating-point "
                             f"parameters to average")

    def _make_tensors(self, model_tensors: list[torch.Tensor]) -> None:
        """The EMA's tensors (beside the weights, or in host memory) holding the weights' values,
        and the update's groups of them, one per device."""
        for slot, t in zip(self._slots, model_tensors):
            if t.is_meta:
                raise ValueError(f"ShardedEMA: {slot.describe()} is on the meta device; create "
                                 f"the EMA after the weights are materialized")
        from .offload import HostOffload

        dtypes = [(self.dtype or t.dtype) if slot.average else t.dtype
                  for slot, t in zip(self._slots, model_tensors)]
        # device="cpu": host memory, updated on a worker thread, for weights on an accelerator.
        if HostOffload.wanted(self.config.device, model_tensors):
            self._ema = [HostOffload.host_ema(t, d) for t, d in zip(model_tensors, dtypes)]
            self._host = HostOffload(model_tensors, [s.average for s in self._slots])
        else:
            self._ema = [t.detach().to(dtype=d, copy=True).contiguous()
                         for t, d in zip(model_tensors, dtypes)]
            self._host = None
        by_device: dict[torch.device, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        for i, (slot, t) in enumerate(zip(self._slots, self._ema)):
            by_device[t.device][0 if slot.average else 1].append(i)
        self._groups = [_DeviceGroup(d, a, c) for d, (a, c) in by_device.items()]
        for g in self._groups:
            g.ema_average = [self._ema[i] for i in g.average]
            g.ema_copy = [self._ema[i] for i in g.copy]

    # --- binding to the live model ----------------------------------------------------------------

    def _resolve(self) -> list[torch.Tensor]:
        return [slot.get() for slot in self._slots]

    def _bind(self, tensors: list[torch.Tensor]) -> None:
        for slot, t, ema in zip(self._slots, tensors, self._ema):
            why = (f"{slot.describe()} has a local shard of shape {list(t.shape)} here, it had "
                   f"{list(slot.local_shape)}" if t.shape != slot.local_shape
                   else slot.sharding_changed())
            if why is not None:
                raise RuntimeError(
                    f"ShardedEMA: the model's sharding changed since the EMA was made: {why}; "
                    f"make a new ShardedEMA for the new sharding (and load_state_dict() or "
                    f"load() the old one into it)")
            if t.device != ema.device and self._host is None:
                raise RuntimeError(f"ShardedEMA: {slot.describe()} moved from {ema.device} to "
                                   f"{t.device} since the EMA was made")
        self._model_tensors = tensors
        if self._host is not None:
            self._host.rebind(tensors)
        for g in self._groups:
            g.model_average = [tensors[i] for i in g.average]
            g.model_copy = [tensors[i] for i in g.copy]

    def _refresh(self) -> list[torch.Tensor]:
        # Cheap (attribute reads): catches a model whose tensors were replaced or resharded.
        current = self._resolve()
        if any(a is not b for a, b in zip(current, self._model_tensors)):
            self._bind(current)
        return self._model_tensors

    # --- what it keeps ----------------------------------------------------------------------------

    @property
    def config(self) -> EMAConfig:
        """The options this EMA was made with (read-only; ``repr`` prints them whole)."""
        return self._config

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
        return sum(t.numel() * t.element_size() for t in self._ema)

    @property
    def shapes(self) -> Mapping[str, torch.Size]:
        """``{clean FQN: global shape}`` of every tensor the EMA keeps, in ``state_dict()``
        order (the names ``save``, ``full_state_dict`` and ``export`` use); read-only."""
        return MappingProxyType(self._shapes)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group the EMA's collectives run over (None in a single process); rank 0
        of it is the rank that writes exports."""
        return self._group

    # --- updating ---------------------------------------------------------------------------------

    @torch.no_grad()
    def update(self) -> None:
        """Folds the current weights into the EMA: one ``update_`` call per device."""
        if self._swapped:
            raise RuntimeError("ShardedEMA.update() inside swap(): the model holds the EMA "
                               "weights; update after the swap() block")
        if not torch.compiler.is_compiling():
            self._check_selection("ShardedEMA.update")
            self._refresh()
        decay = self._scheduled_decay(self._step)
        if self._host is not None:  # EMA in host memory: staged copy, worker-thread update
            self._host.update(self._ema, self._model_tensors, decay,
                              self.decay_at(self._step_count()) != 1.0)
            self._count_step()
            self._step.add_(1)
            self._last_decay = decay
            return
        for g in self._groups:
            # The op reads a CPU decay on the host (no sync); only a device decay for a group
            # on another device needs a copy (CPU-offloaded shards next to device buffers).
            d = decay if g.device == decay.device or decay.device.type == "cpu" else decay.to(
                g.device)
            self._update_group(g, d)
        self._count_step()
        self._step.add_(1)
        self._last_decay = decay

    def _update_group(self, g: _DeviceGroup, decay: torch.Tensor) -> None:
        """One device's update (fsdp_ema.ShardedPowerEMA overrides it to update its profiles)."""
        if g.ema_average:
            _ops.update_(g.ema_average, g.model_average, decay)
        if g.ema_copy:
            torch._foreach_copy_(g.ema_copy, g.model_copy)

    def synchronize(self) -> None:
        """Waits for the update in flight of an EMA in host memory (``device="cpu"``) and
        re-raises its error; a no-op otherwise. Every read of the EMA calls it."""
        if self._host is not None:
            self._host.synchronize()

    def __repr__(self) -> str:
        kinds = defaultdict(int)
        for slot in self._slots:
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
