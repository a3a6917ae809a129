"""``ShardedEMA``: an exponential moving average of a model's weights, kept shard by shard.

Works on FSDP2 (``fully_shard``: DTensor parameters), FSDP1 (``FullyShardedDataParallel``, with
``use_orig_params`` True or False), DDP and plain modules. Every rank averages only what it holds
(the local shard of each parameter; for FSDP1 the local slice of each FlatParameter), with one
fused ``update_`` op call per step. See docs/SHARDED_EMA.md.

This module holds the class (schedule, update, swap, state dicts, checkpoint directories); what a
model holds is in ``_slots`` (discovery and one slot per tensor), full tensors and the export in
``_full_state``, tensor layouts in ``_layouts`` and the collective save in ``_collective``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _ops
from ._collective import save_collective
from ._dist import rank_world
from ._dtypes import ema_dtypes
from ._full_state import DEFAULT_BUCKET_BYTES, DEFAULT_MAX_FILE_BYTES, Part, full_buckets
from ._full_state import export as _export

# Re-exported: the slot classes and helpers keep their old home (fsdp_ema.sharded_ema).
from ._slots import (  # noqa: F401
    TrainableWatch,
    _clean,
    _discover,
    _Flat,
    _global_shape,
    _join,
    _make_slot,
    _modules,
    _Replicated,
    _rows,
    _Sharded,
    _Slot,
    load_slots,
)

__all__ = ["ShardedEMA", "Warmup"]


@dataclasses.dataclass(frozen=True)
class Warmup:
    """The timm/diffusers warmup: ``decay(s) = 1 - (1 + s / gamma) ** -power``, clamped to
    ``[min_decay, decay]``, where ``s`` counts the updates since ``start_step`` (0 at the first
    one, so the first average copies the weights unless ``min_decay > 0``).

    ``power=2/3`` reaches 0.999 around 31k steps, ``power=3/4`` reaches 0.9999 around 215k.
    """

    gamma: float = 1.0
    power: float = 2 / 3
    min_decay: float = 0.0

    def __call__(self, s: int, decay: float) -> float:
        """The decay at ``s`` as a Python float (for logging and tests)."""
        return min(max(1.0 - (1.0 + s / self.gamma) ** -self.power, self.min_decay), decay)




class _DeviceGroup:
    """The slots on one device: one update_ call (and one copy for copied buffers) each step."""

    def __init__(self, device: torch.device, average: list[int], copy: list[int]):
        self.device, self.average, self.copy = device, average, copy
        self.ema_average: list[torch.Tensor] = []
        self.ema_copy: list[torch.Tensor] = []
        self.model_average: list[torch.Tensor] = []
        self.model_copy: list[torch.Tensor] = []


def _list_names(names: Sequence[str], limit: int = 8) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")



# --- the EMA --------------------------------------------------------------------------------------

class ShardedEMA:
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
        decay: the decay in [0, 1] (the weight of the old average); the upper bound of the
            warmup when there is one.
        warmup: None (fixed decay), True (``Warmup()``), or a ``Warmup``.
        update_every: average on updates ``k`` with ``k % update_every == 0`` only (``k`` counts
            ``update()`` calls from 0).
        start_step: for the first ``start_step`` updates the EMA copies the weights.
        dtype: EMA dtype for averaged tensors (float32, float64, bfloat16, float16), or None
            for each tensor's own dtype. Copied tensors keep their dtype.
        include_buffers: keep persistent buffers too (floating ones averaged or copied, see
            ``buffers``; others, such as BatchNorm's ``num_batches_tracked``, copied).
        buffers: ``"average"`` or ``"copy"`` for floating buffers.
        process_group: the group that checkpoints are written by; default: the default group
            when torch.distributed is initialized, else a single process.
        schedule: instead of ``decay`` and ``warmup``, a schedule object computing the decay of
            the ``t``-th averaging update (``t`` from 1) on the device: ``device_decay(t)`` (0-dim
            int64 tensor -> 0-dim float64 tensor) and ``decay_at(t)`` (float), such as
            ``fsdp_ema.PowerEMA`` (EDM2's power-function EMA). Needs ``start_step=0``.
        params: which parameters the EMA keeps: ``"all"``, ``"trainable"`` (those with
            ``requires_grad`` now, e.g. the adapters of a LoRA model; ``update()`` and the saves
            refuse to run once that set has changed), or a callable ``(clean fqn, parameter) ->
            bool``. Buffers follow ``include_buffers`` whatever ``params`` is. An FSDP1 unit is
            one FlatParameter: it is kept or left out whole.
        device: None (the EMA beside the weights) or ``"cpu"``: for weights on an accelerator,
            the EMA lives in pinned host memory; ``update()`` copies the local shards to pinned
            staging on a side stream and a worker thread runs the fused CPU update, overlapped
            with the next step (``synchronize()`` and every read of the EMA wait for it).
    """

    #: Key of the update counter in ``state_dict()``.
    STEP_KEY = "fsdp_ema.step"

    def __init__(self, model: nn.Module, decay: float = 0.9999, *,
                 warmup: None | bool | Warmup = None, update_every: int = 1,
                 start_step: int = 0, dtype: torch.dtype | None = torch.float32,
                 include_buffers: bool = True, buffers: str = "average",
                 process_group: dist.ProcessGroup | None = None, schedule: Any = None,
                 params: str | Callable[[str, torch.Tensor], bool] = "all",
                 device: str | torch.device | None = None, _offload: bool | None = None):
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"ShardedEMA: decay must be in [0, 1], got {decay}")
        if warmup is True:
            warmup = Warmup()
        if warmup is not None and not isinstance(warmup, Warmup):
            raise TypeError(f"ShardedEMA: warmup must be None, True or a Warmup, got {warmup!r}")
        if warmup is not None and not (warmup.gamma > 0 and warmup.power > 0
                                       and 0.0 <= warmup.min_decay <= decay):
            raise ValueError(f"ShardedEMA: {warmup} needs gamma > 0, power > 0 and "
                             f"0 <= min_decay <= decay ({decay})")
        if int(update_every) != update_every or update_every < 1:
            raise ValueError(f"ShardedEMA: update_every must be an integer >= 1, got "
                             f"{update_every}")
        if int(start_step) != start_step or start_step < 0:
            raise ValueError(f"ShardedEMA: start_step must be an integer >= 0, got {start_step}")
        if dtype is not None and dtype not in ema_dtypes():
            raise ValueError(f"ShardedEMA: dtype must be one of {list(ema_dtypes())} or None, got "
                             f"{dtype}")
        if schedule is not None and (warmup is not None or start_step != 0 or not all(
                callable(getattr(schedule, a, None)) for a in ("device_decay", "decay_at"))):
            raise ValueError(f"ShardedEMA: schedule={schedule!r} needs device_decay(t) and "
                             f"decay_at(t), and no warmup or start_step next to it")
        if buffers not in ("average", "copy"):
            raise ValueError(f"ShardedEMA: buffers must be 'average' or 'copy', got {buffers!r}")
        if not (params in ("all", "trainable") or callable(params)):
            raise ValueError(f"ShardedEMA: params must be 'all', 'trainable' or a callable "
                             f"(name, tensor) -> bool, got {params!r}")
        if device is not None and torch.device(device) != torch.device("cpu"):
            raise ValueError(f"ShardedEMA: device must be None (beside the weights) or 'cpu' "
                             f"(host memory), got {device!r}")
        self.model = model
        self.decay, self.warmup, self.schedule = float(decay), warmup, schedule
        self.update_every, self.start_step = int(update_every), int(start_step)
        self.dtype = dtype
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self._group = process_group

        self.params = params
        select = (None if params == "all" else
                  (lambda fqn, p: bool(p.requires_grad)) if params == "trainable" else params)
        self._slots = _discover(model, include_buffers, buffers, select)
        self._watch = TrainableWatch(model) if params == "trainable" else None
        if select is not None and all(slot.buffer for slot in self._slots):
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
        self._shapes = {fqn: shape for slot in self._slots for fqn, shape in slot.names()}

        with torch.no_grad():
            model_tensors = [slot.get() for slot in self._slots]
            for slot, t in zip(self._slots, model_tensors):
                if t.is_meta:
                    raise ValueError(f"ShardedEMA: {slot.describe()} is on the meta device; create "
                                     f"the EMA after the weights are materialized")
            # device="cpu": host memory, updated on a worker thread (_offload), for weights on
            # an accelerator (or on the CPU when _offload forces that path, for tests).
            offload = device is not None and (
                _offload if _offload is not None
                else any(t.device.type != "cpu" for t in model_tensors))
            if offload:
                from ._offload import HostOffload

                self._ema = [HostOffload.host_ema(t, (self.dtype or t.dtype) if slot.average
                                                  else t.dtype)
                             for slot, t in zip(self._slots, model_tensors)]
            else:
                self._ema = [
                    t.detach().to(dtype=(self.dtype or t.dtype) if slot.average else t.dtype,
                                  copy=True).contiguous()
                    for slot, t in zip(self._slots, model_tensors)]
            self._host = HostOffload(model_tensors, [s.average for s in self._slots]) if (
                offload) else None
        by_device: dict[torch.device, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        for i, (slot, t) in enumerate(zip(self._slots, self._ema)):
            by_device[t.device][0 if slot.average else 1].append(i)
        self._groups = [_DeviceGroup(d, a, c) for d, (a, c) in by_device.items()]
        for g in self._groups:
            g.ema_average = [self._ema[i] for i in g.average]
            g.ema_copy = [self._ema[i] for i in g.copy]
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

    # --- binding to the live model ----------------------------------------------------------------

    def _resolve(self) -> list[torch.Tensor]:
        return [slot.get() for slot in self._slots]

    def _bind(self, tensors: list[torch.Tensor]) -> None:
        for slot, t, ema in zip(self._slots, tensors, self._ema):
            if t.shape != slot.local_shape:
                raise RuntimeError(
                    f"ShardedEMA: the model's sharding changed since the EMA was made: "
                    f"{slot.describe()} has a local shard of shape {list(t.shape)} here, it had "
                    f"{list(slot.local_shape)}; make a new ShardedEMA for the new sharding (and "
                    f"load_state_dict() or load() the old one into it)")
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

    # --- the schedule -----------------------------------------------------------------------------

    def _scheduled_decay(self, k: torch.Tensor) -> torch.Tensor:
        """The decay of update ``k`` (0-dim int64 tensor), with tensor ops only (no host sync)."""
        if self.schedule is not None:
            # The t-th averaging update, counted from 1 (update_every skips the others).
            d = self.schedule.device_decay(k // self.update_every + 1)
        elif self.warmup is None:
            d = self._decay
        else:
            s = (k - self.start_step).clamp_min(0).to(torch.float64)
            d = (1.0 - (1.0 + s / self.warmup.gamma) ** -self.warmup.power).clamp(
                self.warmup.min_decay, self.decay)
        if self.update_every > 1:
            d = torch.where(k % self.update_every == 0, d, 1.0)   # 1 keeps the EMA as it is
        if self.start_step > 0:
            d = torch.where(k < self.start_step, 0.0, d)          # 0 copies the weights
        return d

    def decay_at(self, step: int) -> float:
        """The decay update number ``step`` (counted from 0) uses, as a Python float."""
        if step < self.start_step:
            return 0.0
        if step % self.update_every:
            return 1.0
        if self.schedule is not None:
            return self.schedule.decay_at(step // self.update_every + 1)
        return self.warmup(step - self.start_step, self.decay) if self.warmup else self.decay

    @property
    def step(self) -> torch.Tensor:
        """Number of ``update()`` calls so far (0-dim int64 tensor on the EMA's device)."""
        return self._step

    @property
    def last_decay(self) -> torch.Tensor | None:
        """The decay the last ``update()`` used (0-dim tensor; reading it syncs only if you do)."""
        return self._last_decay

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

    def _count_step(self) -> None:
        if torch.compiler.is_compiling():
            self._step_host = None
        elif self._step_host is not None:
            self._step_host += 1

    def _step_count(self) -> int:
        """The number of update() calls so far, from the host count when it is known (no wait
        for the device), else from the step tensor."""
        return self._step_host if self._step_host is not None else int(self._step)

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

    @contextlib.contextmanager
    def swap(self) -> Iterator[nn.Module]:
        """Context manager: the model holds the EMA weights inside, its own weights after.

        Writes into the tensors the model computes from (FSDP2: the local shards of the DTensor
        parameters; FSDP1: the local slices of the FlatParameters; otherwise the parameters and
        buffers), after keeping a copy of them, which is written back bit for bit on exit.
        """
        if self._swapped:
            raise RuntimeError("ShardedEMA.swap() is already active")
        self.synchronize()
        self._reshard()
        with torch.no_grad():
            model = self._refresh()
            backup = [torch.empty_like(t) for t in model]
            torch._foreach_copy_(backup, model)
            torch._foreach_copy_(model, self._ema)
        self._swapped = True
        try:
            yield self.model
        finally:
            # Drop unsharded copies of the EMA values before the weights come back.
            self._reshard()
            with torch.no_grad():
                torch._foreach_copy_(model, backup)
            self._swapped = False

    @torch.no_grad()
    def copy_to(self, model: nn.Module | None = None) -> None:
        """Writes the EMA into the model for good (timm's ``set``, diffusers' ``copy_to``): into
        the tensors it computes from (as ``swap()`` does, with no copy kept), bit for bit where
        the dtypes agree (else cast). ``model``: the EMA's own model (default), or another model
        wrapped and sharded the same way (same names and local shapes) on the same ranks. Only
        what the EMA keeps is written (see ``params`` and ``include_buffers``)."""
        if self._swapped:
            raise RuntimeError("ShardedEMA.copy_to() inside swap(): the model's own weights "
                               "come back when the block exits; copy after it")
        self.synchronize()  # an EMA in host memory: its update in flight lands first
        self._check_selection("ShardedEMA.copy_to")
        if model is None or model is self.model:
            self._reshard()
            targets = self._refresh()
        else:
            from ._apply import matching_tensors

            targets = matching_tensors(model, self._slots, "ShardedEMA.copy_to")
        torch._foreach_copy_(targets, self._ema)

    def _reshard(self) -> None:
        """Frees unsharded parameters, so that the next forward gathers from the shards.

        FSDP2 keeps the root's parameters unsharded after a forward without backward, FSDP1
        keeps the root's unsharded flat parameter allocated and reuses it without gathering;
        either would make a forward ignore what swap() writes into the shards.
        """
        for module in self._fsdp2_modules:
            module.reshard()
        for slot in self._slots:
            slot.reshard()

    # --- the EMA as a module (a teacher) ----------------------------------------------------------

    def module(self, *, mp_policy=None, reshard_after_forward: bool | int = True, mesh=None,
               compile: bool | dict = True) -> nn.Module:
        """The EMA as a model that runs: the student's structure with the EMA's own tensors as its
        parameters (no second copy), sharded like the student, ``requires_grad=False``, in
        ``eval()`` mode; ``update()`` is the whole teacher update. A self-distillation teacher
        (DINO, iBOT, I-JEPA, BYOL, MoCo, data2vec): see docs/SELF_DISTILLATION.md.

        FSDP2: the student's ``fully_shard`` units over the student's meshes, built on the meta
        device, their sharded parameters pointed at the EMA (uneven rows, HSDP and TP x FSDP
        meshes included). DDP and plain models: parameters over the EMA's tensors. FSDP1 models
        and an EMA in host memory (``device="cpu"``) are refused. Parameters the EMA does not
        keep (``params="trainable"``) are the student's own; buffers the EMA keeps are the
        EMA's, the others the teacher's own (copied from the student's once).

        Args:
            mp_policy: FSDP2: the units' MixedPrecisionPolicy (default: each student unit's).
            reshard_after_forward: FSDP2: as ``fully_shard``'s (True: every unit, the root too,
                frees its gathered parameters after each forward).
            mesh: optional check: the mesh the teacher should run on, which must be the one the
                student's units (and so the EMA's shards) are on.
            compile: True: modules the student compiled (``nn.Module.compile``, or
                ``torch.compile(model)`` at the root) are compiled alike, with torch.compile's
                defaults; a dict: with those arguments; False: none.

        Built once per set of arguments; later calls return the same module.
        """
        from ._teacher import module

        return module(self, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                      mesh=mesh, compile=compile)

    # --- state dicts ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{clean FQN: EMA value}`` plus ``STEP_KEY``: DTensors for FSDP2 parameters
        (sharing the EMA's memory), ShardedTensors (dim-0 chunks) for FSDP1 parameters, plain
        tensors otherwise. ``torch.distributed.checkpoint`` saves it and reloads it at any world
        size. Collective for FSDP1 models (one all_to_all per FSDP unit)."""
        self.synchronize()
        out: dict[str, Any] = {}
        for slot, ema in zip(self._slots, self._ema):
            out.update(slot.state_items(ema))
        out[self.STEP_KEY] = self._step
        return out

    def _check_names(self, available: Mapping[str, torch.Size], strict: bool, what: str) -> None:
        missing = [n for n in self._shapes if n not in available]
        unexpected = [n for n in available if n not in self._shapes]
        problems = []
        if strict and missing:
            problems.append(f"missing {len(missing)} name(s): {_list_names(missing)}")
        if strict and unexpected:
            problems.append(f"unexpected {len(unexpected)} name(s): {_list_names(unexpected)}")
        wrong = [f"{n!r} is {list(available[n])} there but {list(s)} here"
                 for n, s in self._shapes.items() if n in available and available[n] != s]
        if wrong:
            problems.append(f"{len(wrong)} shape mismatch(es): " + "; ".join(wrong[:8]))
        if problems:
            raise ValueError(f"ShardedEMA.{what}: " + "; ".join(problems))

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Loads EMA values from a state dict keyed by clean FQNs, whatever each value is: a
        full tensor, a DTensor or a ShardedTensor (FSDP1 layout), e.g. after ``dcp.load`` into
        ``state_dict()`` at any world size. ``STEP_KEY``, if present, sets the step. Collective
        for FSDP1 models. With ``strict``, the names must match exactly; shapes always must."""
        self.synchronize()
        available = {k: _global_shape(v) for k, v in state_dict.items() if k != self.STEP_KEY}
        self._check_names(available, strict, "load_state_dict")
        for slot, ema in zip(self._slots, self._ema):
            values = {fqn: slot.local_value(fqn, state_dict[fqn])
                      for fqn, _ in slot.names() if fqn in state_dict}
            slot.assign(ema, values)
        if self.STEP_KEY in state_dict:
            self._step.copy_(torch.as_tensor(state_dict[self.STEP_KEY]))
            self._step_host = int(self._step)

    # --- full tensors -----------------------------------------------------------------------------

    def _full_plan(self, bucket_bytes: int, what: str) -> list[Part]:
        if int(bucket_bytes) != bucket_bytes or bucket_bytes <= 0:
            raise ValueError(f"ShardedEMA.{what}: bucket_bytes must be a positive integer, got "
                             f"{bucket_bytes}")
        self.synchronize()
        # Planned without communication, so a refusal raises on every rank before any gather.
        return [part for slot, ema in zip(self._slots, self._ema)
                for part in slot.full_parts(ema)]

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = True, cpu_offload: bool = True,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, torch.Tensor]:
        """The full (unsharded) EMA tensors, keyed by clean FQN in ``state_dict()`` order.
        Collective: call it on every rank.

        Sharded tensors are gathered in buckets with the ``gather_shards`` op (one
        all-gather per bucket over the tensors' process group; FSDP1 members first go through
        one all_to_all per unit and bucket), so the transient memory on the EMA's device stays
        within ``bucket_bytes`` whatever the model size (a single tensor that needs more is a
        bucket of its own; see docs/SHARDED_EMA.md for what a bucket counts).

        Args:
            rank0_only: only rank 0 of the EMA's process group keeps the tensors; the other
                ranks take part in the gathers and return ``{}``.
            cpu_offload: each bucket is moved to the CPU as soon as it is gathered; the values
                never share memory with the EMA. Without it, values stay on the EMA's device,
                and tensors that are already full there (buffers, DDP/plain models, 0-dim and
                replicated DTensors) are the EMA's own tensors, as in ``state_dict()``.
            bucket_bytes: the transient device memory one bucket may take.
        """
        parts = self._full_plan(bucket_bytes, "full_state_dict")
        keep = not rank0_only or self._rank_world()[0] == 0
        out: dict[str, torch.Tensor] = {}
        for bucket in full_buckets(parts, bucket_bytes):
            if keep:
                for fqn, t, fresh in bucket:
                    out[fqn] = t.to("cpu", copy=not fresh) if cpu_offload else t
            del bucket  # before the next gather
        return {fqn: out[fqn] for fqn in self._shapes} if keep else {}

    @torch.no_grad()
    def export(self, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
               max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES, overwrite: bool = False,
               prefix: str | None = None) -> int:
        """Writes the full EMA weights as a consolidated Hugging Face safetensors directory:
        ``path/model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files plus
        ``model.safetensors.index.json`` when the tensor data exceeds ``max_file_bytes``.
        Collective: every rank gathers the buckets (as ``full_state_dict``); rank 0 of the EMA's
        process group writes each bucket's tensors into place as it arrives, so no rank holds
        more than a bucket. Returns the bytes of tensor data written.

        ``dtype`` (float32/float64/bfloat16/float16) casts the F64/F32/F16/BF16 tensors;
        others are written as they are. The writer is the library's ``ExportWriter`` class
        (format/'s, the one ``fsdp-ema export`` uses: the same tensors give the same bytes):
        files staged in a hidden directory in ``path``, fsync'd and renamed into place, the
        index last; weight files of an earlier export in ``path`` are replaced only with
        ``overwrite=True``. A failure raises on every rank.

        ``prefix`` (e.g. ``"net."``): only the tensors whose names start with it, written without
        it (a submodule's weights under the names the submodule itself gives them).
        """
        path = os.fspath(path)
        what = f"ShardedEMA.export({path!r})"
        if dtype is not None and dtype not in ema_dtypes():
            raise ValueError(f"{what}: dtype must be one of {list(ema_dtypes())} or None, got "
                             f"{dtype}")
        if int(max_file_bytes) != max_file_bytes or max_file_bytes <= 0:
            raise ValueError(f"{what}: max_file_bytes must be a positive integer, got "
                             f"{max_file_bytes}")
        parts = self._full_plan(bucket_bytes, "export")
        names = None
        if prefix:
            parts = [p for p in parts if p.fqn.startswith(prefix) and len(p.fqn) > len(prefix)]
            if not parts:
                raise ValueError(f"{what}: no tensor name starts with {prefix!r} (the names are "
                                 f"{_list_names(list(self._shapes), 4)})")
            names = {p.fqn: p.fqn[len(prefix):] for p in parts}
        return _export(parts, path, dtype=dtype, max_file_bytes=int(max_file_bytes),
                       bucket_bytes=bucket_bytes, overwrite=overwrite, group=self._group,
                       device=self._device, what=what, names=names)

    @torch.no_grad()
    def model_fingerprint(self) -> str:
        """A fingerprint (16 hex digits) of the model weights this EMA averages, as they are now:
        equal for bit-equal weights at any world size and sharding, different (up to a ~2^-62
        chance) for any other. Each rank hashes the pieces of them it would save (as
        ``save_shard_weights`` writes them) with their positions in the full tensors, and one
        ``all_reduce`` of two integers combines the ranks: no rank gathers a tensor. Collective
        (FSDP1 units: one all_to_all each, as a save). What the trainer integrations record with
        every EMA they save, to prove on resume that the restored model is the one it was saved
        with (``fsdp_ema._binding``)."""
        from ._binding import fingerprint

        self.synchronize()
        rank, world = self._rank_world()
        pieces: dict[str, Any] = {}
        for slot, t in zip(self._slots, self._refresh()):
            pieces.update(slot.pieces(t.detach(), rank, world))
        return fingerprint(pieces, group=self._group, device=self._device)

    # --- checkpoint directories -------------------------------------------------------------------

    def _rank_world(self) -> tuple[int, int]:
        return rank_world(self._group)

    def _check_selection(self, what: str) -> None:
        if self._watch is not None:
            self._watch.check(what)

    def _save(self, directory, tensors: Sequence[torch.Tensor], overwrite: bool,
              what: str, extra: Mapping[str, torch.Tensor] | None = None, *,
              async_: bool = False, if_busy: str = "wait"):
        """``extra``: whole tensors written by rank 0 next to the EMA's (snapshot metadata)."""
        self.synchronize()
        self._check_selection(what)
        rank, world = self._rank_world()

        def pieces() -> dict[str, Any]:  # collective for FSDP1 (one all_to_all per unit)
            out: dict[str, Any] = {}
            for slot, t in zip(self._slots, tensors):
                out.update(slot.pieces(t.detach(), rank, world))
            if extra and rank == 0:
                out.update({name: t.detach().cpu() for name, t in extra.items()})
            return out

        saver = None
        if async_:
            from ._async import AsyncSaver

            saver = self.__dict__.setdefault("_async_saver", AsyncSaver())
        return save_collective(directory, pieces, group=self._group, device=self._device,
                               what=f"{what}({os.fspath(directory)!r})", overwrite=overwrite,
                               async_saver=saver, if_busy=if_busy)

    @torch.no_grad()
    def save(self, directory: str | os.PathLike, *, overwrite: bool = False,
             async_: bool = False, if_busy: str = "wait"):
        """Writes the EMA weights as a sharded checkpoint directory (``fsdp_ema.checkpoint``
        format: one safetensors file per rank, the index written last by rank 0 once every rank
        has written its file). Collective. A failure on any rank raises on every rank and leaves
        no index. Names are clean FQNs; the step is not saved (use ``state_dict()`` for that).
        Returns the bytes of this rank's file.

        ``async_=True`` returns a ``SaveHandle`` once the EMA is staged into host buffers this
        EMA reuses between saves (``update()`` may run right away); the file is written and
        committed on a background thread, and ``handle.result()`` returns the bytes or raises on
        every rank. One save in flight per EMA: a new one waits for it, or with
        ``if_busy="raise"`` raises on every rank (see docs/SHARDED_EMA.md)."""
        return self._save(directory, self._ema, overwrite, "ShardedEMA.save", async_=async_,
                          if_busy=if_busy)

    @torch.no_grad()
    def save_shard_weights(self, directory: str | os.PathLike, *, overwrite: bool = False,
                           async_: bool = False, if_busy: str = "wait"):
        """Writes the model's own weights (same tensors as the EMA, same format)."""
        return self._save(directory, self._refresh(), overwrite, "ShardedEMA.save_shard_weights",
                          async_=async_, if_busy=if_busy)

    def save_ema_shard_weights(self, directory: str | os.PathLike, *,
                               overwrite: bool = False, async_: bool = False,
                               if_busy: str = "wait"):
        """Alias of ``save`` (the name of the common ShardEMAModel recipe)."""
        return self.save(directory, overwrite=overwrite, async_=async_, if_busy=if_busy)

    @torch.no_grad()
    def load(self, directory: str | os.PathLike, *, strict: bool = True,
             verify: bool = True) -> None:
        """Loads EMA weights from a checkpoint directory written at any world size (``save``,
        ``save_shard_weights``, ``fsdp_ema.checkpoint`` or DCP's HuggingFace writer). Each rank
        reads only the rows it keeps where the layout allows, straight into the EMA's tensors
        where the stored dtype is the EMA's. Collective: every rank checks everything (checksums
        included) before any rank writes, so a failure anywhere leaves every EMA as it was."""
        # An EMA in host memory: the update in flight lands before the load writes the tensors.
        self.synchronize()
        directory = os.fspath(directory)
        # Every rank checks everything (the index, names, shapes, dtypes, every destination and
        # every checksum it will read) before the agreement, and reads into the EMA in place only
        # after it (_collective.load_collective): one rank's failure raises everywhere and leaves
        # every rank's EMA as it was.
        load_slots(directory, self._slots, self._ema,
                   check_names=lambda available: self._check_names(available, strict, "load"),
                   group=self._group, device=self._device,
                   what=f"ShardedEMA.load({directory!r})", verify=verify)

    def __repr__(self) -> str:
        kinds = defaultdict(int)
        for slot in self._slots:
            kinds[type(slot).__name__.lstrip("_").lower()] += 1
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
