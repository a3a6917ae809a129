"""``EMAConfig``: every option of an EMA in one typed object, validated once and printed whole.

``ShardedEMA``, ``ShardedPowerEMA`` and both trainer callbacks take one (``config=``, or in the
place of the decay) and still take the same options as keywords, which make or replace fields of
it (``EMAConfig.of``). A new option is one field here, with its docstring and its check; the
library and every integration read it from here. The options a resume compares (the ones that
define the average) are the fields marked ``compared`` (``RESUME_SETTINGS``), which
``fsdp_ema._binding`` records with every EMA the integrations save.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Union

import torch

from .._dtypes import check_ema_dtype

__all__ = ["EMAConfig", "Warmup", "RESUME_SETTINGS", "SCHEDULE_SETTINGS", "STEPPED_SETTINGS"]


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

    def _curve(self, s):
        """``1 - (1 + s / gamma) ** -power`` for a float or a float64 tensor ``s``."""
        return 1.0 - (1.0 + s / self.gamma) ** -self.power

    def __call__(self, s: int, decay: float) -> float:
        """The decay at ``s`` as a Python float (for logging and tests)."""
        return min(max(self._curve(s), self.min_decay), decay)

    def device_decay(self, s: torch.Tensor, decay: float) -> torch.Tensor:
        """The decay at ``s`` (a 0-dim float64 tensor): tensor ops only, no host sync."""
        return self._curve(s).clamp(self.min_decay, decay)


def check_schedule_t(what: str, t: int) -> None:
    """A schedule's ``decay_at(t)`` takes ``t >= 1``, the ``t``-th averaging update; the EMA's
    own ``decay_at(k)`` counts ``update()`` calls from 0 (the value of ``step`` when update ``k``
    runs), and update ``k`` averages with the schedule's ``decay_at(k // update_every + 1)``."""
    if t < 1:
        raise ValueError(f"{what}.decay_at: t counts averaging updates from 1 (the t-th one), got "
                         f"{t}; ShardedEMA.decay_at(k) counts update() calls from 0: update k "
                         f"averages with {what}.decay_at(k // update_every + 1), which is "
                         f"ema.decay_at(k)")


# Who the user called, for the errors: "ShardedEMA: decay must be ..." from ShardedEMA(...),
# "EMAConfig: ..." from EMAConfig(...) itself.
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("fsdp_ema_config_caller",
                                                              default="EMAConfig")
_COMPARED = {"compared": True}
# The schedule: which decay each update uses. *stepped*: a value other than the default makes
# that decay depend on the update's step (the fixed decay alone does not).
_SCHEDULE = {"compared": True, "schedule": True}
_STEPPED = {"compared": True, "schedule": True, "stepped": True}


@dataclasses.dataclass(frozen=True)
class EMAConfig:
    """The options of a ``ShardedEMA``, one field each; checked when made (``ValueError`` or
    ``TypeError`` naming the option), immutable (``dataclasses.replace`` makes a changed copy),
    and printed whole by ``repr``. Fields marked *compared* are the settings a trainer
    integration's resume checks (``allow_changes`` names them)."""

    decay: float = dataclasses.field(default=0.9999, metadata=_SCHEDULE)
    """The decay in [0, 1] (the weight of the old average); the upper bound of the warmup when
    there is one. *Compared.*"""

    warmup: Union[None, bool, Warmup] = dataclasses.field(default=None, metadata=_STEPPED)
    """None (a fixed decay), True (``Warmup()``, stored as that) or a ``Warmup``. *Compared.*"""

    schedule: Any = dataclasses.field(default=None, metadata=_STEPPED)
    """Instead of ``decay`` and ``warmup``, an object computing the decay of the ``t``-th
    averaging update (``t`` from 1) on the device: ``device_decay(t)`` (0-dim int64 tensor ->
    0-dim float64 tensor) and ``decay_at(t)`` (float), such as ``fsdp_ema.PowerEMA`` (EDM2's
    power-function EMA) or ``fsdp_ema.CosineMomentum``. ``update()`` call ``k`` (from 0, as
    ``ShardedEMA.decay_at(k)`` counts) is averaging update ``t = k // update_every + 1``. Needs no
    ``warmup`` and ``start_step=0``; ``decay`` is unused. *Compared* (by its type and repr)."""

    update_every: int = dataclasses.field(default=1, metadata=_STEPPED)
    """Average on updates ``k`` with ``k % update_every == 0`` only (``k`` counts ``update()``
    calls from 0); an integer >= 1. *Compared.*"""

    start_step: int = dataclasses.field(default=0, metadata=_STEPPED)
    """For the first ``start_step`` updates the EMA copies the weights; an integer >= 0.
    *Compared.*"""

    dtype: Union[torch.dtype, None] = dataclasses.field(default=torch.float32, metadata=_COMPARED)
    """The EMA dtype of averaged tensors (one of the table's EMA dtypes: float32, float64,
    bfloat16, float16), or None for each tensor's own dtype. Copied tensors keep theirs.
    *Compared.*"""

    params: Union[str, Callable[[str, torch.Tensor], bool]] = dataclasses.field(
        default="all", metadata=_COMPARED)
    """Which parameters the EMA keeps: ``"all"``, ``"trainable"`` (those with ``requires_grad``
    when the EMA is made, e.g. a LoRA model's adapters; ``update()`` and the saves refuse to run
    once that set has changed), or a callable ``(clean fqn, parameter) -> bool``. Buffers follow
    ``include_buffers`` whatever ``params`` is; an FSDP1 unit is kept or left out whole.
    *Compared* (a callable by its name)."""

    buffers: str = dataclasses.field(default="average", metadata=_COMPARED)
    """``"average"`` or ``"copy"``: what the EMA does with floating buffers. *Compared* (as None
    when the EMA keeps no floating buffer)."""

    include_buffers: bool = True
    """Keep persistent buffers too (floating ones as ``buffers`` says; others, such as
    BatchNorm's ``num_batches_tracked``, copied)."""

    device: Union[str, torch.device, None] = None
    """None (the EMA beside the weights) or ``"cpu"``: for weights on an accelerator, the EMA
    lives in pinned host memory, updated on a worker thread from a staged copy (see
    docs/SHARDED_EMA.md); for weights on the CPU, the ordinary EMA."""

    process_group: Any = None
    """The group the EMA's collectives (checkpoints, full weights) run over; None: the default
    group when torch.distributed is initialized, else a single process."""

    def __post_init__(self) -> None:
        what = _CALLER.get()
        # Normalized values (frozen: set through object.__setattr__), then each option's check.
        if self.warmup is True:
            object.__setattr__(self, "warmup", Warmup())
        decay = self.decay
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"{what}: decay must be in [0, 1], got {decay}")
        object.__setattr__(self, "decay", float(decay))
        for check in (self._check_warmup, self._check_counts, self._check_kinds):
            check(what)

    def _check_warmup(self, what: str) -> None:
        warmup, schedule = self.warmup, self.schedule
        if warmup is not None and not isinstance(warmup, Warmup):
            raise TypeError(f"{what}: warmup must be None, True or a Warmup, got {warmup!r}")
        if warmup is not None and not (warmup.gamma > 0 and warmup.power > 0
                                       and 0.0 <= warmup.min_decay <= self.decay):
            raise ValueError(f"{what}: {warmup} needs gamma > 0, power > 0 and "
                             f"0 <= min_decay <= decay ({self.decay})")
        if schedule is not None and (warmup is not None or self.start_step != 0 or not all(
                callable(getattr(schedule, a, None)) for a in ("device_decay", "decay_at"))):
            raise ValueError(f"{what}: schedule={schedule!r} needs device_decay(t) and "
                             f"decay_at(t), and no warmup or start_step next to it")

    def _check_counts(self, what: str) -> None:
        update_every, start_step = self.update_every, self.start_step
        if int(update_every) != update_every or update_every < 1:
            raise ValueError(f"{what}: update_every must be an integer >= 1, got "
                             f"{update_every}")
        if int(start_step) != start_step or start_step < 0:
            raise ValueError(f"{what}: start_step must be an integer >= 0, got {start_step}")
        object.__setattr__(self, "update_every", int(update_every))
        object.__setattr__(self, "start_step", int(start_step))

    def _check_kinds(self, what: str) -> None:
        dtype, buffers, params, device = self.dtype, self.buffers, self.params, self.device
        check_ema_dtype(what, dtype)
        if buffers not in ("average", "copy"):
            raise ValueError(f"{what}: buffers must be 'average' or 'copy', got {buffers!r}")
        if not (params in ("all", "trainable") or callable(params)):
            raise ValueError(f"{what}: params must be 'all', 'trainable' or a callable "
                             f"(name, tensor) -> bool, got {params!r}")
        if device is not None and torch.device(device) != torch.device("cpu"):
            raise ValueError(f"{what}: device must be None (beside the weights) or 'cpu' "
                             f"(host memory), got {device!r}")
        if not isinstance(self.include_buffers, bool):
            raise TypeError(f"{what}: include_buffers must be True or False, got "
                            f"{self.include_buffers!r}")
        group = self.process_group
        if group is not None and not isinstance(group, torch.distributed.ProcessGroup):
            raise TypeError(f"{what}: process_group must be None (the default group) or a "
                            f"torch.distributed.ProcessGroup, got {group!r}")

    @classmethod
    def of(cls, what: str, config: Any = None, options: Mapping[str, Any] | None = None, *,
           allowed: Iterable[str] | None = None) -> EMAConfig:
        """The config a caller named ``what`` was given: ``config`` (an ``EMAConfig``; a number
        is the decay, the positional form ``ShardedEMA(model, 0.999)``; None: the defaults) with
        the fields in ``options`` replaced. An option that is no field (or not in ``allowed``)
        is a ``TypeError``; a bad value raises as ``EMAConfig`` does, naming ``what``."""
        options = dict(options or {})
        if config is not None and not isinstance(config, EMAConfig):
            if "decay" in options:
                raise TypeError(f"{what}: the decay given twice ({config!r} and "
                                f"decay={options['decay']!r})")
            config, options = None, {"decay": config, **options}
        names = [f.name for f in dataclasses.fields(cls)]
        known = names if allowed is None else list(allowed)
        unknown = sorted(set(options) - set(known))
        if unknown:
            whose = "EMAConfig's" if allowed is None else f"{what}'s, of EMAConfig's"
            raise TypeError(f"{what}: unexpected option(s) {', '.join(map(repr, unknown))} (the "
                            f"options are {whose}: {', '.join(known)})")
        with _caller(what):
            return dataclasses.replace(config, **options) if config is not None else cls(
                **options)

    def refuse_others(self, what: str, allowed: Iterable[str]) -> None:
        """``TypeError`` unless every field outside ``allowed`` has its default (for a caller
        that sets the others itself, as ``ShardedPowerEMA`` does the schedule)."""
        default, allowed = EMAConfig(), set(allowed)
        fixed = [f.name for f in dataclasses.fields(self)
                 if f.name not in allowed and getattr(self, f.name) != getattr(default, f.name)]
        if fixed:
            raise TypeError(f"{what}: takes no {', '.join(fixed)} (its options are "
                            f"{', '.join(sorted(allowed))})")


@contextlib.contextmanager
def _caller(what: str) -> Iterator[None]:
    token = _CALLER.set(what)
    try:
        yield
    finally:
        _CALLER.reset(token)


#: The options a resume compares, by name (the fields marked *compared*, in field order).
RESUME_SETTINGS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(EMAConfig) if f.metadata.get("compared"))
#: The options that say which decay each update uses (a load that resumes the step compares
#: them), and those of them that make it depend on the step when not at their default.
SCHEDULE_SETTINGS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(EMAConfig) if f.metadata.get("schedule"))
STEPPED_SETTINGS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(EMAConfig) if f.metadata.get("stepped"))


# Classes carry their public path (repr, pickles, the settings a checkpoint records).
for _cls in (EMAConfig, Warmup):
    _cls.__module__ = "fsdp_ema.config"
