"""Power-function EMA (Karras et al., "Analyzing and Improving the Training Dynamics of Diffusion
Models", EDM2, 2024): ``PowerEMA``, a ``ShardedEMA`` schedule computed on the device, and
``ShardedPowerEMA``, several power-EMA profiles of one model updated from one read of the weights
(the ``update_multi_`` op), with snapshots for post-hoc reconstruction
(``fsdp_ema.posthoc``). See docs/POSTHOC_EMA.md.

The profile of gamma averages the weights of steps ``1..t`` with weights proportional to
``tau ** gamma``; as a recurrence, the ``t``-th update uses ``beta_t = (1 - 1/t) ** (gamma + 1)``
(``beta_1 = 0``: the first update copies the weights). ``sigma_rel``, the profile's standard
deviation relative to its length, picks gamma (the paper's cubic, solved by format/posthoc/
through the ``power_ema_gamma`` op, the one implementation the CLI uses too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import _ops
from ..model.slots import global_shape
from .config import EMAConfig, check_schedule_t
from .sharded import ShardedEMA

__all__ = ["SNAPSHOT_GAMMA_KEY", "SNAPSHOT_STEP_KEY", "PowerEMA", "ShardedPowerEMA"]

#: Names of the 0-dim tensors every snapshot records next to the EMA tensors (format/posthoc/).
SNAPSHOT_STEP_KEY = "fsdp_ema.snapshot.step"
SNAPSHOT_GAMMA_KEY = "fsdp_ema.snapshot.gamma"


class PowerEMA:
    """EDM2's power-function EMA as a ``ShardedEMA`` schedule: ``beta_t = (1 - 1/t) ** (gamma +
    1)`` for the ``t``-th averaging update (``t`` from 1).

    Give ``sigma_rel`` (in ``(0, 1/sqrt(12)]``; the paper uses 0.05 to 0.15) or ``gamma``
    (``>= 0``). ``device_decay`` is tensor arithmetic with the exponent a Python constant, so a
    compiled step that calls ``ShardedEMA.update()`` compiles once.
    """

    def __init__(self, sigma_rel: float | None = None, *, gamma: float | None = None):
        if (sigma_rel is None) == (gamma is None):
            raise ValueError("PowerEMA: give exactly one of sigma_rel and gamma")
        if sigma_rel is not None:
            self.sigma_rel = float(sigma_rel)
            self.gamma = float(_ops.power_ema_gamma(self.sigma_rel))
        else:
            self.gamma = float(gamma)
            self.sigma_rel = float(_ops.power_ema_sigma_rel(self.gamma))
        self._exponent = self.gamma + 1.0

    def decay_at(self, t: int) -> float:
        """``beta_t`` as a Python float (``t >= 1``)."""
        check_schedule_t("PowerEMA", t)
        return (1.0 - 1.0 / t) ** self._exponent

    def device_decay(self, t: torch.Tensor) -> torch.Tensor:
        """``beta_t`` for a 0-dim int64 tensor ``t >= 1``, as a float64 tensor on its device."""
        return (1.0 - 1.0 / t.to(torch.float64)) ** self._exponent

    def __repr__(self) -> str:
        return f"PowerEMA(sigma_rel={self.sigma_rel:.6g}, gamma={self.gamma:.6g})"


def _profiles(sigma_rels: Sequence[float] | None,
              gammas: Sequence[float] | None) -> list[PowerEMA]:
    if gammas is not None:
        profiles = [PowerEMA(gamma=g) for g in gammas]
    elif sigma_rels is not None:
        profiles = [PowerEMA(s) for s in sigma_rels]
    else:
        raise ValueError("ShardedPowerEMA: give sigma_rels or gammas")
    if not profiles:
        raise ValueError("ShardedPowerEMA: at least one profile (two for post-hoc EMA)")
    if len({p.gamma for p in profiles}) != len(profiles):
        raise ValueError(f"ShardedPowerEMA: the profiles must differ, got {profiles}")
    return profiles


class ShardedPowerEMA(ShardedEMA):
    """Several power-function EMA profiles of one model, kept shard by shard, all updated by one
    ``update_multi_`` call per device and step (the weights are read once for all profiles).

    Everything ``ShardedEMA`` does works on profile 0 (``swap()``, ``save()``, ``export()``...),
    and ``swap(profile=k)`` / ``save(dir, profile=k)`` on the others. ``snapshot()`` saves every
    profile as a sharded checkpoint under ``snapshot_root`` with its step and gamma recorded;
    ``fsdp_ema.posthoc`` later combines the snapshots into the EMA of any sigma_rel.

    Args:
        model: as ``ShardedEMA``.
        sigma_rels: the profiles' relative standard deviations (EDM2 keeps 0.05 and 0.10), or
        gammas: their gammas instead. Distinct values.
        snapshot_every: ``maybe_snapshot()`` saves when the update count is a multiple of it.
        snapshot_root: where snapshots go: ``<root>/step-<t>.profile-<k>/``.
        config: an ``fsdp_ema.EMAConfig`` of the options the profiles leave open (``OPTIONS``:
            ``update_every``, ``dtype``, ``include_buffers``, ``buffers``, ``process_group``;
            the others keep their defaults: the profiles are the schedule).
        **options: those options as keywords, replacing the config's.
    """

    #: ``state_dict()`` keys of profile k >= 1: ``f"{PROFILE_KEY}{k}.{fqn}"``.
    PROFILE_KEY = "fsdp_ema.profile"
    #: The ``EMAConfig`` fields a ``ShardedPowerEMA`` takes (its profiles set the schedule).
    OPTIONS = ("update_every", "dtype", "include_buffers", "buffers", "process_group")

    def __init__(self, model: nn.Module, sigma_rels: Sequence[float] | None = (0.05, 0.10), *,
                 gammas: Sequence[float] | None = None, snapshot_every: int | None = None,
                 snapshot_root: str | os.PathLike | None = None,
                 config: EMAConfig | None = None, **options: Any):
        what = type(self).__name__
        config = EMAConfig.of(what, config, options, allowed=self.OPTIONS)
        config.refuse_others(what, self.OPTIONS)
        profiles = _profiles(sigma_rels, gammas)
        if snapshot_every is not None and (int(snapshot_every) != snapshot_every
                                           or snapshot_every < 1):
            raise ValueError(f"ShardedPowerEMA: snapshot_every must be an integer >= 1, got "
                             f"{snapshot_every}")
        if snapshot_every is not None and snapshot_root is None:
            raise ValueError("ShardedPowerEMA: snapshot_every needs snapshot_root")
        super().__init__(model, dataclasses.replace(config, schedule=profiles[0]))
        taken = [n for n in (SNAPSHOT_STEP_KEY, SNAPSHOT_GAMMA_KEY) if n in self.state.shapes]
        if taken:
            raise ValueError(f"ShardedPowerEMA: the model has a tensor named {taken[0]!r}, a name "
                             f"snapshots keep their metadata under")
        self.profiles = profiles
        self.snapshot_every = snapshot_every
        self.snapshot_root = None if snapshot_root is None else os.fspath(snapshot_root)
        state = self.state
        with torch.no_grad():
            self._profile_emas = [state.tensors] + [[t.clone() for t in state.tensors]
                                                    for _ in profiles[1:]]
        state.profiles = len(profiles)
        for g in state.device_groups:
            g.profile_average = [e[i] for e in self._profile_emas for i in g.average]
            g.profile_copy = [e[i] for e in self._profile_emas for i in g.copy]
            g.profile_model_copy = g.model_copy * len(profiles)

    # --- the schedule -----------------------------------------------------------------------------

    def _scheduled_decay(self, k: torch.Tensor) -> torch.Tensor:
        """The K decays of update ``k``: a (K,) float64 tensor, tensor ops only."""
        t = k // self.update_every + 1
        d = torch.stack([p.device_decay(t) for p in self.profiles])
        if self.update_every > 1:
            d = torch.where(k % self.update_every == 0, d, 1.0)
        return d

    def decay_at(self, step: int) -> list[float]:  # type: ignore[override]
        """The K decays update number ``step`` (from 0) uses."""
        if step % self.update_every:
            return [1.0] * len(self.profiles)
        return [p.decay_at(step // self.update_every + 1) for p in self.profiles]

    def _update_group(self, g, decay: torch.Tensor) -> None:
        if g.ema_average:
            _ops.update_multi_(g.profile_average, g.model_average, list(decay.unbind(0)))
        if g.ema_copy:
            torch._foreach_copy_(g.profile_copy, g.profile_model_copy)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self._profile_emas for t in e)

    def _check_profile(self, profile: int) -> None:
        if not 0 <= profile < len(self.profiles):
            raise IndexError(f"ShardedPowerEMA: profile must be in [0, {len(self.profiles)}), "
                             f"got {profile}")

    @contextlib.contextmanager
    def _as_profile(self, profile: int) -> Iterator[None]:
        """ShardedEMA's methods read ``state.tensors``: pointed at profile ``profile`` meanwhile."""
        self._check_profile(profile)
        state = self.state
        saved = state.tensors
        state.tensors = self._profile_emas[profile]
        try:
            yield
        finally:
            state.tensors = saved

    def profile_tensors(self, profile: int) -> list[torch.Tensor]:
        """This rank's EMA tensors of profile ``profile`` (the live tensors, in slot order)."""
        self._check_profile(profile)
        return list(self._profile_emas[profile])

    @contextlib.contextmanager
    def swap(self, profile: int = 0) -> Iterator[nn.Module]:  # type: ignore[override]
        """``ShardedEMA.swap()`` with the weights of profile ``profile``."""
        with self._as_profile(profile), super().swap() as model:
            yield model

    @torch.no_grad()
    def save(self, directory: str | os.PathLike, *, overwrite: bool = False,  # type: ignore[override]
             profile: int = 0) -> int:
        """``ShardedEMA.save()`` of profile ``profile``: its weights (the step is every
        profile's, so it is not recorded with one profile: see ``load``)."""
        self._check_profile(profile)
        return self._save(directory, self._profile_emas[profile], overwrite,
                          "ShardedPowerEMA.save")

    @torch.no_grad()
    def load(self, directory: str | os.PathLike, *, strict: bool = True,  # type: ignore[override]
             verify: bool = True, profile: int = 0) -> None:
        """``ShardedEMA.load()`` into profile ``profile``: its weights only. The step, which every
        profile shares, is not taken from one profile's weights (it would leave the others at
        another length); ``state_dict()`` (DCP) and ``save_training_state`` carry every profile
        with the step."""
        with self._as_profile(profile):
            self._load(directory, strict=strict, verify=verify, allow=(), position=False)

    # --- snapshots --------------------------------------------------------------------------------

    def _averaged_updates(self, updates: int) -> int:
        """``t`` of the last averaging update after ``updates`` calls of ``update()``."""
        return 0 if updates <= 0 else (updates - 1) // self.update_every + 1

    @torch.no_grad()
    def snapshot(self, root: str | os.PathLike | None = None, *,
                 updates: int | None = None) -> list[str]:
        """Saves every profile as a sharded checkpoint ``<root>/step-<t>.profile-<k>/`` (the
        format ``save()`` writes) plus two 0-dim tensors: ``SNAPSHOT_STEP_KEY`` (t, the
        averaging updates so far: the profile's length) and ``SNAPSHOT_GAMMA_KEY``. Collective.
        ``updates``: the number of ``update()`` calls so far, if the caller knows it (else the
        host's count of eager updates, or the device's step after compiled ones). Returns the
        directories written."""
        root = self.snapshot_root if root is None else os.fspath(root)
        if root is None:
            raise ValueError("ShardedPowerEMA.snapshot: no root given and no snapshot_root set")
        n = self.state.step_count() if updates is None else int(updates)
        t = self._averaged_updates(n)
        if t < 1:
            raise RuntimeError("ShardedPowerEMA.snapshot: no update yet; a snapshot needs at "
                               "least one")
        dirs = []
        for k, p in enumerate(self.profiles):
            d = os.path.join(root, f"step-{t:09d}.profile-{k}")
            extra = {SNAPSHOT_STEP_KEY: torch.tensor(t, dtype=torch.int64),
                     SNAPSHOT_GAMMA_KEY: torch.tensor(p.gamma, dtype=torch.float64)}
            self._save(d, self._profile_emas[k], False, "ShardedPowerEMA.snapshot", extra)
            dirs.append(d)
        return dirs

    def maybe_snapshot(self, updates: int | None = None) -> list[str]:
        """``snapshot()`` when the update count is a positive multiple of ``snapshot_every``
        (call it after ``update()``, outside a compiled region). Pass ``updates`` (your loop's
        count of ``update()`` calls) if ``update()`` runs compiled (the step is then read from
        the device)."""
        if self.snapshot_every is None:
            return []
        n = self.state.step_count() if updates is None else int(updates)
        if n <= 0 or n % self.snapshot_every:
            return []
        return self.snapshot(updates=n)

    # --- state dicts ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``ShardedEMA.state_dict()`` (profile 0 and the step) plus every other profile under
        ``f"{PROFILE_KEY}{k}.{fqn}"``, in the same forms (DCP saves and reshards all of it)."""
        out = super().state_dict()
        for k in range(1, len(self.profiles)):
            for slot, ema in zip(self.state.slots, self._profile_emas[k]):
                out.update({f"{self.PROFILE_KEY}{k}.{n}": v
                            for n, v in slot.state_items(ema).items()})
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """The inverse of ``state_dict()``; every profile's names are checked before any is
        loaded."""
        parts: list[dict[str, Any]] = [{} for _ in self.profiles]
        for name, value in state_dict.items():
            k, key = 0, name
            if name.startswith(self.PROFILE_KEY):
                head, _, rest = name[len(self.PROFILE_KEY):].partition(".")
                if head.isdigit() and rest:
                    k, key = int(head), rest
                    if not 1 <= k < len(self.profiles):
                        raise ValueError(f"ShardedPowerEMA.load_state_dict: {name!r} is for "
                                         f"profile {k}, but there are {len(self.profiles)}")
            parts[k][key] = value
        for part in parts:
            available = {n: global_shape(v) for n, v in part.items() if n != self.STEP_KEY}
            self._check_names(available, strict, "load_state_dict")
        for k, part in enumerate(parts):
            with self._as_profile(k):
                super().load_state_dict(part, strict)

    def __repr__(self) -> str:
        return (f"ShardedPowerEMA(profiles={self.profiles}, update_every={self.update_every}, "
                f"dtype={self.dtype}, nbytes={self.nbytes})")


# Classes carry their public path (repr, pickles, the settings a checkpoint records).
for _cls in (PowerEMA, ShardedPowerEMA):
    _cls.__module__ = "fsdp_ema.power_ema"
