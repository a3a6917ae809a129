"""Training-state checkpoints: model, optimizer, EMA, step, RNG and user state in one directory.

``save_training_state(dir, model=..., optimizer=..., ema=..., extra={...})`` writes every tensor
shard by shard through ``fsdp_ema.checkpoint.save_shard`` (one safetensors file per rank, the
format of docs/FORMAT.md) and the small non-tensor state as JSON text stored in a uint8 tensor of
rank 0's file, so the index written last by rank 0 commits (and checksums) all of it at once.
``load_training_state(dir, model=..., optimizer=..., ema=...)`` restores it at any world size and
returns ``extra``. Layout and usage: docs/TRAINING_STATE.md.

The model and optimizer state dicts come from ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``get_optimizer_state_dict`` and the ``set_*`` counterparts), which
give DTensors for FSDP2, ShardedTensors for FSDP1 and plain tensors otherwise; the EMA's from
``ShardedEMA.state_dict()``. Nothing is pickled.

This module is the public one (``fsdp_ema.training_state``: every public name is here) and holds
the save sequence. The rest lives by responsibility beside it: ``training_doc`` (the names, the
tagged JSON and the document), ``training_rng`` (the RNG states), ``training_state_dicts`` (the
state dicts saved and filled), ``training_load`` (the load sequence) and ``training_listing``
(``latest_checkpoint`` and the ``keep_last`` rotation).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .. import _ops
from ..distributed.groups import default_group, rank_world
from ..model.layouts import layout_of
from . import checkpoint as _ckpt
from .binding import settings
from .collective import save_collective
from .training_doc import (
    EMA_PREFIX,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    META_TENSOR,
    MODEL_PREFIX,
    OPTIM_PREFIX,
    RNG_PREFIX,
    SIDECAR_NAME,
    json_tensor,
    read_doc,
)
from .training_doc import encode as _encode
from .training_listing import latest_checkpoint, rotate
from .training_load import load_training_state
from .training_rng import rng_state as _rng_state
from .training_state_dicts import States, model_state, optim_state

__all__ = ["save_training_state", "load_training_state", "latest_checkpoint",
           "read_training_state_json", "META_TENSOR", "INDEX_NAME", "SIDECAR_NAME"]

# The save's steps reach ``_encode`` and ``_rng_state`` through this module's names, so that
# replacing ``fsdp_ema.training_state._encode`` / ``._rng_state`` changes what a save writes (the
# tests that store a bad ``extra`` or RNG state, to prove a load refuses it, do so).


def read_training_state_json(directory: str | os.PathLike, *, verify: bool = True,
                             info: dict | None = None) -> dict:
    """The JSON document of a committed training-state checkpoint (from rank 0's file,
    checksum verified), tags not decoded. ``info``: ``fsdp_ema.checkpoint.info(directory)``
    if the caller has it."""
    directory = os.fspath(directory)
    return read_doc(_ckpt.open_checkpoint(directory), info, verify)


# --- saving ---------------------------------------------------------------------------------------

def save_training_state(directory: str | os.PathLike, *, model=None, optimizer=None, ema=None,
                        extra: Mapping[str, Any] | None = None, rng: bool = True,
                        keep_last: int | None = None, overwrite: bool = False,
                        async_: bool = False, if_busy: str = "wait"):
    """Writes a training-state checkpoint into ``directory``. Collective: every rank calls it.

    Args:
        model: the (FSDP2, FSDP1, DDP or plain) model; its sharded state dict is saved under
            ``model.<fqn>``.
        optimizer: its optimizer (needs ``model``): state tensors under
            ``optim.state.<fqn>.<key>``, ``param_groups`` hyperparameters in the JSON.
        ema: a ``ShardedEMA``: ``ema.<fqn>`` tensors, its step in the JSON.
        extra: JSON-able user state (step, epoch, ``lr_scheduler.state_dict()``, data-loader
            position...); tuples, non-finite floats, bytes and small tensors are tagged (see
            docs/TRAINING_STATE.md). Returned as it was by ``load_training_state``.
        rng: save every rank's RNG states (torch CPU, CUDA if initialized, Python, NumPy).
        keep_last: after the commit, remove all but the ``keep_last`` last committed
            training-state checkpoints among ``directory``'s siblings (by name order; the new
            one is never removed).
        overwrite: replace a committed checkpoint in ``directory`` (else an error).
        async_: return a ``SaveHandle`` once the state is staged into host buffers (reused
            between saves); the files are written, committed (and older ones rotated) on a
            background thread. ``handle.result()`` returns the bytes or raises on every rank.
        if_busy: with a save of this function still in flight, ``"wait"`` for it or
            ``"raise"`` (on every rank).

    A failure on any rank raises on every rank and leaves ``directory`` uncommitted (no index).
    Returns the bytes of this rank's shard file (or the handle for them).
    """
    directory = os.fspath(directory)
    what = f"save_training_state({directory!r})"
    if keep_last is not None and (int(keep_last) != keep_last or keep_last < 1):
        raise ValueError(f"{what}: keep_last must be an integer >= 1 or None, got {keep_last}")
    if optimizer is not None and model is None:
        raise ValueError(f"{what}: saving an optimizer needs its model (for the FQNs)")
    group = default_group()
    rank, world = rank_world(group)
    # Collective parts first (FSDP1 state dicts all-gather / all_to_all): every rank gets here.
    states = States(model=model_state(model) if model is not None else None,
                    optimizer=optim_state(model, optimizer) if optimizer is not None else None,
                    ema=ema.state_dict() if ema is not None else None)
    save = _Save(directory, what, rank, world, states, optimizer=optimizer, ema=ema, rng=rng,
                 extra=extra, keep_last=keep_last)
    saver = None
    if async_:
        from .async_save import default_saver

        saver = default_saver("save_training_state")
    return save_collective(directory, save.pieces, group=group, device=torch.device("cpu"),
                           what=what, overwrite=overwrite, collective_pieces=False,
                           prepare=save.prepare, after_commit=save.after_commit,
                           async_saver=saver, if_busy=if_busy)


def _optim_key(fqn: str, key: str) -> str:
    return f"{OPTIM_PREFIX}{fqn}.{key}"


def _optimizer_pieces(optim_sd: Mapping[str, Any], optimizer, rank: int,
                      shards: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's part of the document; its state tensors' pieces go into ``shards``."""
    state: dict[str, Any] = {}
    for fqn, entries in optim_sd["state"].items():
        state[fqn] = {}
        for key, v in entries.items():
            if isinstance(v, torch.Tensor):
                name = _optim_key(fqn, key)
                shards.update(layout_of(name, v).piece(rank))
                state[fqn][key] = {"tensor": name}
            else:
                state[fqn][key] = {"value": _encode(v, f"optimizer state {fqn}.{key}")}
    groups = [{k: _encode(v, f"param_groups[{i}][{k!r}]") for k, v in g.items()}
              for i, g in enumerate(optim_sd["param_groups"])]
    return {"type": type(optimizer).__name__, "state": state, "param_groups": groups}


def _ema_pieces(ema, ema_sd: Mapping[str, Any], rank: int,
                shards: dict[str, Any]) -> dict[str, Any]:
    """The EMA's part of the document; its tensors' pieces go into ``shards``."""
    step_key = type(ema).STEP_KEY
    names = [k for k in ema_sd if k != step_key]
    for fqn in names:
        shards.update(layout_of(EMA_PREFIX + fqn, ema_sd[fqn]).piece(rank))
    # The host's count when known: int() of a device step would wait for all the work queued on
    # the stream (an async save would block on the training).
    step = ema.state.step_count() if step_key in ema_sd else None
    # "decay": the fixed decay (a warmup's upper bound), none where a schedule gives every decay
    # (settings.schedule names it); "last_decay": the one the last update used.
    return {"step": step, "decay": None if ema.schedule is not None else ema.decay,
            "last_decay": ema.decay_at(step - 1) if step else None,
            "settings": settings(ema), "tensors": sorted(names)}


class _Save:
    """The steps of one ``save_training_state`` that ``save_collective`` runs: ``pieces`` (with
    the directory check, before any write: what this rank writes, and on rank 0 the document),
    ``prepare`` (once this rank's file is written: the sidecar) and ``after_commit`` (the
    rotation)."""

    def __init__(self, directory: str, what: str, rank: int, world: int, states: States, *,
                 optimizer, ema, rng: bool, extra: Mapping[str, Any] | None,
                 keep_last: int | None):
        self.directory, self.what, self.rank, self.world = directory, what, rank, world
        self.states, self.optimizer, self.ema = states, optimizer, ema
        self.rng, self.extra, self.keep_last = rng, extra, keep_last
        self.sidecar: str | None = None

    def pieces(self) -> dict[str, Any]:
        rank, states, shards = self.rank, self.states, {}
        doc: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION,
                               "world_size": self.world}
        for fqn, v in (states.model or {}).items():
            shards.update(layout_of(MODEL_PREFIX + fqn, v).piece(rank))
        doc["model"] = {"tensors": sorted(states.model)} if states.model is not None else None
        doc["optimizer"] = (None if states.optimizer is None else
                            _optimizer_pieces(states.optimizer, self.optimizer, rank, shards))
        doc["ema"] = None if self.ema is None else _ema_pieces(self.ema, states.ema, rank, shards)
        doc["rng"] = {"ranks": self.world} if self.rng else None
        if self.rng:
            shards[f"{RNG_PREFIX}{rank}"] = json_tensor(_rng_state())
        doc["extra"] = _encode(dict(self.extra or {}))
        if rank == 0:
            shards[META_TENSOR] = json_tensor(doc)
            self.sidecar = json.dumps(doc, indent=1, sort_keys=True)
        return shards

    def prepare(self) -> None:
        if self.sidecar is not None:
            _ops.write_sidecar(self.directory, SIDECAR_NAME, self.sidecar, True)

    def after_commit(self) -> None:
        if self.rank == 0 and self.keep_last is not None:
            # The save is committed: a rotation that fails is a warning, never this save's error.
            try:
                rotate(self.directory, int(self.keep_last))
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"{self.what}: committed, but removing older checkpoints failed: "
                              f"{e}", RuntimeWarning, stacklevel=5)

