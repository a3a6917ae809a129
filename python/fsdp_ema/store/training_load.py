"""The load of a training-state checkpoint, in three steps: read and check the document, ``extra``
and this rank's RNG states (agreed across ranks); check every tensor against the state dicts and
read this rank's share of them once, verified in that read, into staging memory
(``load_collective(..., staged=True)``), agree, copy into (or hand over to) the state dicts; put
the state dicts and the RNG states back into their objects. Nothing is read from the files once
anything is written, so a failure on any rank, or a file changed by another process at any time,
raises on every rank and leaves every object (and the RNGs) as it was.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..distributed.groups import default_group, rank_world
from ..ema.state import allowed_changes
from ..model.layouts import LoadTarget, is_dtensor, layout_of, on_mesh
from . import checkpoint as _ckpt
from .collective import agreed, load_collective
from .training_doc import EMA_PREFIX, MODEL_PREFIX, RNG_PREFIX, decode, read_doc, tensor_json
from .training_rng import checked_rng_state, set_rng_state
from .training_state_dicts import (
    States,
    fresh_optim_state,
    load_optim_state,
    model_state,
    optim_state,
    state_options,
)


def load_training_state(directory: str | os.PathLike, *, model=None, optimizer=None, ema=None,
                        rng: bool = True, strict: bool = True, verify: bool = True,
                        allow_changes: str | Sequence[str] = ()) -> dict:
    """Restores what ``save_training_state`` wrote, at the same or another world size, into
    ``model``, ``optimizer`` and ``ema`` (each optional), and returns ``extra``. Collective.

    Each rank reads only the rows it holds (its rank and world size) where the layout is
    torch.chunk dim-0 rows (FSDP2, FSDP1), whole tensors otherwise, once, into staging memory
    (host memory of the size of what it reads: its share of the state), every byte verified
    against the stored checksums in the read that returns it; once every rank has read and
    checked everything, the staged values are copied into the state dicts' tensors (for FSDP2
    and plain models the parameters' and the EMA's own, which keep their storage; the
    optimizer's too where they are on a device), and an optimizer's host tensors of the stored
    dtype are replaced by the staged ones (no copy). RNG states: rank ``r`` restores the state
    rank ``r`` saved; ranks past the saved world size keep theirs. A failure on any rank (a
    corrupted file, or one that another process changes in place while the load reads it) raises
    on every rank and leaves every object (and the RNGs) as it was. ``verify=False`` skips the
    checksums (nothing else).

    The EMA resumes the step it was saved at; one saved under another schedule (where either
    schedule's decay depends on the step) is refused, naming both, as ``ShardedEMA.load`` refuses
    it, unless ``allow_changes`` names the settings that may differ (``"decay"``, ``"warmup"``,
    ``"schedule"``, ``"update_every"``, ``"start_step"``, or ``"all"``).
    """
    directory = os.fspath(directory)
    what = f"load_training_state({directory!r})"
    if optimizer is not None and model is None:
        raise ValueError(f"{what}: loading an optimizer needs its model (for the FQNs)")
    allow_changes = allowed_changes(allow_changes, what)  # as ShardedEMA.load checks them
    group = default_group()
    rank, _ = rank_world(group)
    given = {"model": model, "optimizer": optimizer, "ema": ema}
    # Nothing is written until every rank has read and checked everything it will restore (the
    # JSON document, extra, its RNG states, every tensor's data and dtype) and all ranks agree:
    # a failure anywhere raises on every rank and leaves model, optimizer, EMA and RNGs as they
    # were.
    ckpt, info, doc, extra, rng_state = agreed(
        lambda: _read_checked(directory, given, rank, rng, verify, what, allow_changes),
        group=group, device=torch.device("cpu"), what=what)
    # Templates (collective for FSDP1). An optimizer without state (a resumed job's) gets its
    # template from its parameters and the checkpoint; where they do not say what the state is,
    # torch initializes the state to make one (a step at lr 0), and a refused load empties it
    # again, as it was.
    fresh_optimizer = optimizer is not None and len(optimizer.state) == 0
    optim_sd = None
    if fresh_optimizer:
        optim_sd = fresh_optim_state(model, optimizer, doc["optimizer"], info["tensors"])
    made_fresh = optim_sd is not None
    try:
        if optimizer is not None and optim_sd is None:
            optim_sd = optim_state(model, optimizer)
        states = States(model=model_state(model) if model is not None else None,
                        optimizer=optim_sd, ema=ema.state_dict() if ema is not None else None)
        # Every rank checks every tensor (names, shapes, dtypes) and reads its share once into
        # staging memory, verified as read; all agree; only then does anything reach the state
        # dicts (for FSDP2 and plain models the parameters', the optimizer's and the EMA's own).
        plan = _LoadPlan(doc, states, ema, strict)
        staged = load_collective(ckpt, plan.targets, info=info, group=group,
                                 device=torch.device("cpu"), what=what, verify=verify,
                                 staged=True)
    except BaseException:
        if fresh_optimizer:
            optimizer.state.clear()
        raise
    plan.write(staged)
    _restore(plan.states, model, optimizer, ema, rng_state, strict, made_fresh)
    return extra


def _read_checked(directory: str, given: Mapping[str, Any], rank: int, rng: bool, verify: bool,
                  what: str, allow_changes: Sequence[str],
                  ) -> tuple[_ckpt.OpenCheckpoint, dict, dict, dict, Any]:
    """Step 1 of a load (agreed): the document, ``extra`` and this rank's RNG states, read and
    checked from one open of the checkpoint (every later read sees the same files); the EMA's
    saved step and schedule against the EMA's (``EMAState.check_position``)."""
    ckpt = _ckpt.open_checkpoint(directory)
    info = ckpt.info()
    doc = read_doc(ckpt, info, verify)
    for part, value in given.items():
        if value is not None and doc.get(part) is None:
            raise ValueError(f"the checkpoint holds no {part} state")
    extra = decode(doc.get("extra"), f"{directory}: extra")
    if not isinstance(extra, dict):
        raise ValueError(f"extra is a {type(extra).__name__}, not a dict")
    if given["ema"] is not None and doc["ema"]["step"] is not None and (
            type(doc["ema"]["step"]) is not int or doc["ema"]["step"] < 0):
        raise ValueError(f"the EMA step {doc['ema']['step']!r} is not a count")
    if given["ema"] is not None and doc["ema"]["step"] is not None:
        settings = doc["ema"].get("settings")  # absent from an older fsdp_ema's: not compared
        saved = {"step": doc["ema"]["step"],
                 "settings": settings if isinstance(settings, dict) else {}}
        given["ema"].state.check_position(saved, what=what, allow=allow_changes)
    rng_state = None
    if rng and doc.get("rng") and rank < doc["rng"]["ranks"]:
        name = f"{RNG_PREFIX}{rank}"
        if name not in info["tensors"]:
            raise KeyError(f"{name!r} (rank {rank}'s RNG states) is not in the checkpoint")
        rng_state = checked_rng_state(tensor_json(ckpt.load([name], verify=verify)[name]),
                                      f"{directory}: {name}")
    return ckpt, info, doc, extra, rng_state


class _LoadPlan:
    """Step 2 of a load (in the collective load's check): the names checked against the
    document and the tensors to read (``targets``), the model's state dict cut to the saved
    names and the EMA's step set (``states``: new dicts). The optimizer's entries, whose dicts are
    the optimizer's own, are written only by ``write``, after the agreement."""

    def __init__(self, doc: Mapping[str, Any], states: States, ema, strict: bool):
        self.doc, self.states, self.ema, self.strict = doc, states, ema, strict
        self.made: list[LoadTarget] = []
        self.values: list[tuple[dict, str, Any]] = []  # non-tensor (entries, key, value) to set
        self.entries: dict[str, tuple[dict, str]] = {}  # optimizer tensors: (entries, key)

    def write(self, staged: dict[str, torch.Tensor]) -> None:
        """Step 3 (after the agreement): each staged value into its state dict. An optimizer's
        tensor on the host, of the stored dtype, becomes the staged one itself (as
        ``Optimizer.load_state_dict`` installs what it is given: no copy); every other value is
        copied into its destination (the parameters' and the EMA's keep their storage)."""
        with torch.no_grad():
            for t in self.made:
                value = staged.pop(t.name, None)
                if value is None:
                    continue  # nothing of it on this rank
                entries, key = self.entries.get(t.name, (None, None))
                taken = None if entries is None else _handed_over(t, entries[key], value)
                if taken is not None:
                    entries[key] = taken
                else:
                    t.dest.copy_(value)
        for entries, key, value in self.values:
            entries[key] = value

    def targets(self, _info) -> list[LoadTarget]:
        targets: list[LoadTarget] = []
        if self.states.model is not None:
            targets += self._model_targets()
        if self.states.optimizer is not None:
            targets += self._optimizer_targets()
            self._param_groups()
        if self.states.ema is not None:
            targets += self._ema_targets()
        self.made = targets
        return targets

    def _model_targets(self) -> list[LoadTarget]:
        saved = set(self.doc["model"]["tensors"])
        _check_names("model", set(self.states.model), saved, self.strict)
        model_sd = {k: v for k, v in self.states.model.items() if k in saved}
        self.states = self.states._replace(model=model_sd)
        return [layout_of(MODEL_PREFIX + k, v).target() for k, v in model_sd.items()]

    def _optimizer_targets(self) -> list[LoadTarget]:
        optim_sd, saved_state = self.states.optimizer, self.doc["optimizer"]["state"]
        _check_names("optimizer state", set(optim_sd["state"]), set(saved_state), self.strict)
        targets = []
        for fqn, entries in optim_sd["state"].items():
            if fqn not in saved_state:
                continue
            for key, v in list(entries.items()):
                entry = saved_state[fqn].get(key)
                where = f"optimizer state {fqn}.{key}"
                if entry is None:
                    raise KeyError(f"{where} is not in the checkpoint")
                if "tensor" in entry:
                    if not isinstance(v, torch.Tensor):
                        raise TypeError(f"{where} is a tensor in the checkpoint but a "
                                        f"{type(v).__name__} here")
                    targets.append(layout_of(entry["tensor"], v).target())
                    self.entries[entry["tensor"]] = (entries, key)
                    continue
                value = decode(entry["value"], where)
                if isinstance(v, torch.Tensor) or type(value) is not type(v):
                    raise TypeError(f"{where} is a {type(value).__name__} in the checkpoint "
                                    f"but a {type(v).__name__} here")
                self.values.append((entries, key, value))
        return targets

    def _param_groups(self) -> None:
        optim_sd = self.states.optimizer
        saved_groups = [decode(g, f"param_groups[{i}]")
                        for i, g in enumerate(self.doc["optimizer"]["param_groups"])]
        if len(saved_groups) != len(optim_sd["param_groups"]):
            raise ValueError(f"the checkpoint has {len(saved_groups)} param groups, the "
                             f"optimizer {len(optim_sd['param_groups'])}")
        for mine, theirs in zip(optim_sd["param_groups"], saved_groups):
            if sorted(mine["params"]) != sorted(theirs["params"]):
                raise ValueError("the optimizer's param groups hold other parameters than the "
                                 "checkpoint's")
            mine.update({k: v for k, v in theirs.items() if k != "params"})

    def _ema_targets(self) -> list[LoadTarget]:
        ema_sd, step_key = self.states.ema, type(self.ema).STEP_KEY
        saved = set(self.doc["ema"]["tensors"])
        mine = {k for k in ema_sd if k != step_key}
        _check_names("EMA", mine, saved, self.strict)
        if self.doc["ema"]["step"] is not None:
            ema_sd[step_key] = torch.tensor(self.doc["ema"]["step"], dtype=torch.int64)
        return [layout_of(EMA_PREFIX + k, ema_sd[k]).target() for k in mine if k in saved]


def _handed_over(target: LoadTarget, v, value: torch.Tensor):
    """What the optimizer can hold in place of its tensor ``v``: the staged ``value`` itself
    where ``v`` is a host tensor of its dtype (a DTensor on a CPU mesh: wrapped alike) and the
    read is its own rows or the whole tensor; else None (copied). Device tensors are copied into
    (no second copy of the optimizer's state in device memory)."""
    if target.read.box is not None or value.dtype != v.dtype:
        return None
    if is_dtensor(v):
        if v.device_mesh.device_type != "cpu" or v.to_local().device.type != "cpu":
            return None
        return on_mesh(target.name, value, v.device_mesh, v.placements, v.shape,
                       v.stride()).dtensor()
    return value if type(v) is torch.Tensor and v.device.type == "cpu" else None


def _restore(states: States, model, optimizer, ema, rng_state, strict: bool,
             fresh_optimizer: bool) -> None:
    """Step 3 of a load, once every tensor is read: the state dicts into their objects, then
    the RNG states. ``fresh_optimizer``: the optimizer's state dict is ``fresh_optim_state``'s
    (``load_optim_state`` puts it in)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if states.model is not None:
        set_model_state_dict(model, states.model, options=StateDictOptions(strict=strict))
    if states.optimizer is not None and fresh_optimizer:
        load_optim_state(optimizer, states.optimizer)
    elif states.optimizer is not None:
        set_optimizer_state_dict(model, optimizer, states.optimizer, options=state_options())
    if states.ema is not None:
        ema.load_state_dict(states.ema, strict=strict)
    if rng_state is not None:
        set_rng_state(rng_state)


def _check_names(what: str, mine: set[str], saved: set[str], strict: bool) -> None:
    if not strict:
        return
    missing, unexpected = sorted(mine - saved), sorted(saved - mine)
    if missing or unexpected:
        raise ValueError(f"{what}: missing from the checkpoint {missing[:8]}, only in the "
                         f"checkpoint {unexpected[:8]}")
