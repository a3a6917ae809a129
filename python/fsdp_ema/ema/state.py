"""``EMAState``: what a ``ShardedEMA`` is, as one object.

Its slots (one per tensor the EMA keeps, from ``fsdp_ema.model``), its tensors and their global
shapes, the update's groups (one per device), the step and the schedule's position, its options
(``EMAConfig``), its process group and device, and the live model tensors it is bound to. Every
part of the EMA (the schedule, state dicts and checkpoint directories, full weights, swap, the
teacher, the power EMA, an EMA in host memory) and every integration reads and writes the EMA
through this object and its methods, never through another object's private attributes. What a
save must carry to resume the EMA (the step, the schedule's settings) is ``position()``, which
``ShardedEMA.save`` records and ``ShardedEMA.load`` takes back through ``check_position``;
``state_dict()`` and the training state carry the step and settings themselves.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.groups import default_group, rank_world
from ..model.slots import Slot, TrainableWatch, discover
from .config import SCHEDULE_SETTINGS, STEPPED_SETTINGS, EMAConfig

__all__ = ["DeviceGroup", "EMAState", "POSITION_KEY", "STEP_KEY", "allowed_changes"]

#: Key of the update counter in ``state_dict()``.
STEP_KEY = "fsdp_ema.step"
#: Key of ``position()`` (JSON) in the index metadata of a checkpoint ``ShardedEMA.save`` writes.
POSITION_KEY = "fsdp_ema.ema"


@dataclasses.dataclass(eq=False)
class DeviceGroup:
    """The slots on one device: one update_ call (and one copy for copied buffers) each step.
    ``average``/``copy``: slot indices; the lists beside them hold the EMA's and the bound
    model's tensors of those slots."""

    device: torch.device
    average: list[int]
    copy: list[int]
    ema_average: list[torch.Tensor] = dataclasses.field(default_factory=list)
    ema_copy: list[torch.Tensor] = dataclasses.field(default_factory=list)
    model_average: list[torch.Tensor] = dataclasses.field(default_factory=list)
    model_copy: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # Several EMA profiles of the same weights (``ShardedPowerEMA``): the K lists flattened.
    profile_average: list[torch.Tensor] = dataclasses.field(default_factory=list)
    profile_copy: list[torch.Tensor] = dataclasses.field(default_factory=list)
    profile_model_copy: list[torch.Tensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class EMAState:
    """What a ``ShardedEMA`` is (``ShardedEMA.state``); built by ``EMAState.build``."""

    config: EMAConfig
    model: nn.Module
    group: dist.ProcessGroup | None
    slots: list[Slot]
    #: The EMA's values, one per slot (host memory for ``device="cpu"``).
    tensors: list[torch.Tensor]
    #: ``{clean FQN: global shape}`` of every tensor kept, in ``state_dict()`` order.
    shapes: dict[str, torch.Size]
    device_groups: list[DeviceGroup]
    #: Where the schedule lives: the device of the largest group (no host sync per step).
    device: torch.device
    #: Updates so far (0-dim int64 on ``device``).
    step: torch.Tensor
    #: The fixed decay (0-dim float64 on ``device``).
    fixed_decay: torch.Tensor
    #: An EMA in host memory (``fsdp_ema.ema.offload.HostOffload``), or None.
    host: Any = None
    watch: TrainableWatch | None = None
    #: The step on the host as well, counted by eager updates, so that reading it (saves,
    #: snapshots) never waits for the device; None after an update inside a compiled graph
    #: (which cannot count on the host): then ``step`` is read.
    step_host: int | None = 0
    last_decay: torch.Tensor | None = None
    swapped: bool = False
    model_tensors: list[torch.Tensor] = dataclasses.field(default_factory=list)
    fsdp2_modules: list[nn.Module] = dataclasses.field(default_factory=list)
    #: Built on first use: the background saver of ``save(async_=True)``, the teachers of
    #: ``module()`` by their arguments.
    async_saver: Any = None
    teachers: dict = dataclasses.field(default_factory=dict)
    #: EMA profiles kept of the same weights (``ShardedPowerEMA``'s K; 1 otherwise).
    profiles: int = 1

    # --- building ---------------------------------------------------------------------------------

    @classmethod
    def build(cls, model: nn.Module, config: EMAConfig, what: str) -> EMAState:
        """The state of a new EMA of ``model``: slots found, tensors made from the weights,
        bound to them. ``what``: the class name for messages."""
        group = default_group(config.process_group)
        select = (None if config.params == "all" else
                  (lambda fqn, p: bool(p.requires_grad)) if config.params == "trainable"
                  else config.params)
        from torch.distributed.fsdp import FSDPModule

        fsdp2_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        # After a forward without backward FSDP2 leaves the root's parameters unsharded (plain
        # tensors in place of the DTensors): made from them, the EMA would keep whole tensors
        # beside its shards. Resharding first (what the next forward undoes) gives the shards.
        for module in fsdp2_modules:
            module.reshard()
        slots = discover(model, config.include_buffers, config.buffers, select)
        check_slots(model, slots, config.params, select is not None, what)
        shapes = {fqn: shape for slot in slots for fqn, shape in slot.names()}
        with torch.no_grad():
            model_tensors = [slot.get() for slot in slots]
            tensors, host = make_tensors(slots, model_tensors, config, what)
        groups = device_groups(slots, tensors)
        device = max(groups, key=lambda g: sum(tensors[i].numel() for i in g.average)).device
        state = cls(
            config=config, model=model, group=group, slots=slots, tensors=tensors, shapes=shapes,
            device_groups=groups, device=device,
            step=torch.zeros((), dtype=torch.int64, device=device),
            fixed_decay=torch.tensor(config.decay, dtype=torch.float64, device=device),
            host=host, watch=TrainableWatch(model) if config.params == "trainable" else None,
            fsdp2_modules=fsdp2_modules)
        state.bind(model_tensors)
        return state

    # --- binding to the live model ----------------------------------------------------------------

    def bind(self, tensors: list[torch.Tensor]) -> None:
        """Binds the update to the model's tensors now, refusing a sharding or device change."""
        for slot, t, ema in zip(self.slots, tensors, self.tensors):
            why = (f"{slot.describe()} has a local shard of shape {list(t.shape)} here, it had "
                   f"{list(slot.local_shape)}" if t.shape != slot.local_shape
                   else slot.sharding_changed())
            if why is not None:
                raise RuntimeError(
                    f"ShardedEMA: the model's sharding changed since the EMA was made: {why}; "
                    f"make a new ShardedEMA for the new sharding (and load_state_dict() or "
                    f"load() the old one into it)")
            if t.device != ema.device and self.host is None:
                raise RuntimeError(f"ShardedEMA: {slot.describe()} moved from {ema.device} to "
                                   f"{t.device} since the EMA was made")
        self.model_tensors = tensors
        if self.host is not None:
            self.host.rebind(tensors)
        for g in self.device_groups:
            g.model_average = [tensors[i] for i in g.average]
            g.model_copy = [tensors[i] for i in g.copy]
            g.profile_model_copy = g.model_copy * self.profiles

    def refresh(self) -> list[torch.Tensor]:
        """The model's tensors the EMA follows, re-bound if the model replaced or resharded
        them (cheap: attribute reads)."""
        current = [slot.get() for slot in self.slots]
        if any(map(operator.is_not, current, self.model_tensors)):
            self.bind(current)
        return self.model_tensors

    def check_selection(self, what: str) -> None:
        """With ``params="trainable"``: refuses a model whose trainable set changed."""
        if self.watch is not None:
            self.watch.check(what)

    def reshard(self) -> None:
        """Frees unsharded parameters, so that the next forward gathers from the shards.

        FSDP2 keeps the root's parameters unsharded after a forward without backward, FSDP1
        keeps the root's unsharded flat parameter allocated and reuses it without gathering;
        either would make a forward ignore what is written into the shards.
        """
        for module in self.fsdp2_modules:
            module.reshard()
        for slot in self.slots:
            slot.reshard()

    def synchronize(self) -> None:
        """Waits for the update in flight of an EMA in host memory and re-raises its error."""
        if self.host is not None:
            self.host.synchronize()

    # --- the step ---------------------------------------------------------------------------------

    def count_step(self, decay: torch.Tensor) -> None:
        """One update done with ``decay``: the step on the device, and on the host when eager."""
        if torch.compiler.is_compiling():
            self.step_host = None
        elif self.step_host is not None:
            self.step_host += 1
        self.step.add_(1)
        self.last_decay = decay

    def step_count(self) -> int:
        """Updates so far, from the host count when it is known (no wait for the device)."""
        return self.step_host if self.step_host is not None else int(self.step)

    def set_step(self, value: int | torch.Tensor) -> None:
        self.step.copy_(torch.as_tensor(value))
        self.step_host = int(self.step)

    # --- what a save carries ----------------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        """The options that define the average (``store.binding.settings``) as JSON values."""
        from ..store.binding import config_settings

        return config_settings(self.config, self.keeps_floating_buffers())

    def keeps_floating_buffers(self) -> bool:
        return any(slot.buffer and t.is_floating_point()
                   for slot, t in zip(self.slots, self.tensors))

    def position(self) -> Callable[[], dict[str, Any]]:
        """What a save records beside the EMA's tensors so that a load resumes it whole (the
        updates so far and the settings that define the schedule), taken now, read when called:
        after compiled updates (no host count) the step is copied on the device now and read
        only when the record is written (an async save's background thread: no wait here)."""
        settings = self.settings()
        if self.step_host is not None:
            step_now = self.step_host
            return lambda: {"step": step_now, "settings": settings}
        step = self.step.clone()
        return lambda: {"step": int(step), "settings": settings}

    def check_position(self, saved: Any, *, what: str, allow: Sequence[str] = ()) -> int:
        # ``allow``: as ``allowed_changes`` returns it.
        """The step of a saved ``position()``, checked before anything changes: a schedule
        (``SCHEDULE_SETTINGS``) unlike this EMA's is refused unless named in ``allow`` (or
        ``"all"``), since resuming the step under another schedule gives other decays."""
        from ..store.binding import SETTINGS, setting_changes

        if not (isinstance(saved, dict) and isinstance(saved.get("step"), int)
                and saved["step"] >= 0 and isinstance(saved.get("settings", {}), dict)):
            raise ValueError(f"{what}: the checkpoint's {POSITION_KEY!r} metadata is not an "
                             f"EMA position (a step >= 0 and settings): {saved!r}")
        ignored = [s for s in SETTINGS if s not in SCHEDULE_SETTINGS] + list(allow)
        saved_settings, current = saved.get("settings", {}), self.settings()
        # Two fixed decays give the same decay at every step: the step means nothing to either,
        # and taking the weights into an EMA of another decay is a choice, not a resume.
        steps_matter = step_dependent(saved_settings) or step_dependent(current)
        changes = ([] if "all" in allow or not steps_matter else
                   setting_changes(saved_settings, current, ignored))
        if changes:
            raise ValueError(
                f"{what}: the checkpoint's EMA was saved at step {saved['step']} with another "
                f"schedule (" + "; ".join(changes) + "), so its step would give other decays "
                f"here; make the EMA with the saved schedule, or pass allow_changes="
                f"{[c.split(':')[0] for c in changes]!r} (or ['all']) to resume the step under "
                f"the schedule of now")
        return saved["step"]

    # --- what a rank writes -----------------------------------------------------------------------

    def rank_world(self) -> tuple[int, int]:
        return rank_world(self.group)

    def pieces(self, tensors: Sequence[torch.Tensor], rank: int, world: int) -> dict[str, Any]:
        """What this rank writes of ``tensors`` (the EMA's, or the model's), as ``save_shard``
        takes it. Collective for FSDP1 (one all_to_all per unit)."""
        out: dict[str, Any] = {}
        for slot, t in zip(self.slots, tensors):
            out.update(slot.pieces(t.detach(), rank, world))
        return out


def allowed_changes(allow: str | Sequence[str], what: str) -> tuple[str, ...]:
    """``allow_changes`` of a load, checked before anything is read: schedule settings
    (``SCHEDULE_SETTINGS``) or ``"all"``; one name may be given as a string."""
    names = (allow,) if isinstance(allow, str) else tuple(allow)
    unknown = [a for a in names if a != "all" and a not in SCHEDULE_SETTINGS]
    if unknown:
        raise ValueError(f"{what}: allow_changes={allow!r} names {unknown}, which are not "
                         f"schedule settings {list(SCHEDULE_SETTINGS)} (or 'all')")
    return names


def step_dependent(settings: dict[str, Any]) -> bool:
    """Whether settings (``store.binding`` JSON) give a decay that depends on the step: one of
    ``STEPPED_SETTINGS`` away from its default."""
    from ..store.binding import config_settings

    default = config_settings(EMAConfig(), True)
    return any(settings.get(name, default[name]) != default[name] for name in STEPPED_SETTINGS)


def check_slots(model: nn.Module, slots: list[Slot], params: Any, selected: bool,
                what: str) -> None:
    """What the model must hold for an EMA: a selected parameter, a floating one to average,
    no tensor under the step's key."""
    if selected and all(slot.buffer for slot in slots):
        raise ValueError(f"{what}: params={params!r} selects none of the "
                         f"{sum(1 for _ in model.parameters())} parameters of "
                         f"{type(model).__name__}")
    names = [fqn for slot in slots for fqn, _ in slot.names()]
    if STEP_KEY in names:
        raise ValueError(f"{what}: the model has a tensor named {STEP_KEY!r}, the key "
                         f"the EMA keeps its step under")
    if not any(slot.average for slot in slots):
        raise ValueError(f"{what}: {type(model).__name__} has no floating-point "
                         f"parameters to average")


def make_tensors(slots: list[Slot], model_tensors: list[torch.Tensor], config: EMAConfig,
                 what: str) -> tuple[list[torch.Tensor], Any]:
    """The EMA's tensors (beside the weights, or in host memory) holding the weights' values,
    and the host offload (``device="cpu"``) or None."""
    for slot, t in zip(slots, model_tensors):
        if t.is_meta:
            raise ValueError(f"{what}: {slot.describe()} is on the meta device; create "
                             f"the EMA after the weights are materialized")
    from .offload import HostOffload

    dtypes = [(config.dtype or t.dtype) if slot.average else t.dtype
              for slot, t in zip(slots, model_tensors)]
    # device="cpu": host memory, updated on a worker thread, for weights on an accelerator.
    if HostOffload.wanted(config.device, model_tensors):
        return ([HostOffload.host_ema(t, d) for t, d in zip(model_tensors, dtypes)],
                HostOffload(model_tensors, [s.average for s in slots]))
    return [t.detach().to(dtype=d, copy=True).contiguous()
            for t, d in zip(model_tensors, dtypes)], None


def device_groups(slots: list[Slot], tensors: list[torch.Tensor]) -> list[DeviceGroup]:
    """The slots by the device of their EMA tensor, averaged apart from copied."""
    by_device: dict[torch.device, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for i, (slot, t) in enumerate(zip(slots, tensors)):
        by_device[t.device][0 if slot.average else 1].append(i)
    groups = [DeviceGroup(d, a, c) for d, (a, c) in by_device.items()]
    for g in groups:
        g.ema_average = [tensors[i] for i in g.average]
        g.ema_copy = [tensors[i] for i in g.copy]
    return groups
