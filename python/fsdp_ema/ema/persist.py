"""A ``ShardedEMA``'s state dicts and checkpoint directories (one part of the class;
``ema.sharded`` says which): ``state_dict`` / ``load_state_dict`` (what DCP saves and reshards),
``save`` and its seed-recipe aliases, ``load``, and ``model_fingerprint`` (the pieces a save
would write, hashed). The collective sequences are ``store.collective``'s, the layouts
``model.slots``'.

Reads and writes the EMA through its ``state`` (``EMAState``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..model.slots import global_shape
from ..store.collective import check_names, load_slots, save_collective
from .state import POSITION_KEY, allowed_changes


class CheckpointMixin:
    """``state_dict``, ``load_state_dict``, ``save``, ``save_shard_weights``,
    ``save_ema_shard_weights``, ``load``, ``model_fingerprint``."""

    STEP_KEY: str  # ShardedEMA's

    # --- state dicts ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{clean FQN: EMA value}`` plus ``STEP_KEY``: DTensors for FSDP2 parameters
        (sharing the EMA's memory), ShardedTensors (dim-0 chunks) for FSDP1 parameters, plain
        tensors otherwise. ``torch.distributed.checkpoint`` saves it and reloads it at any world
        size. Collective for FSDP1 models (one all_to_all per FSDP unit)."""
        self.synchronize()
        out: dict[str, Any] = {}
        state = self.state
        for slot, ema in zip(state.slots, state.tensors):
            out.update(slot.state_items(ema))
        out[self.STEP_KEY] = state.step
        return out

    def _check_names(self, available: Mapping[str, torch.Size], strict: bool, what: str) -> None:
        check_names(self.state.shapes, available, strict, f"ShardedEMA.{what}")

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Loads EMA values from a state dict keyed by clean FQNs, whatever each value is: a
        full tensor, a DTensor or a ShardedTensor (FSDP1 layout), e.g. after ``dcp.load`` into
        ``state_dict()`` at any world size. ``STEP_KEY``, if present, sets the step. Collective
        for FSDP1 models. With ``strict``, the names must match exactly; shapes always must."""
        self.synchronize()
        available = {k: global_shape(v) for k, v in state_dict.items() if k != self.STEP_KEY}
        self._check_names(available, strict, "load_state_dict")
        state = self.state
        for slot, ema in zip(state.slots, state.tensors):
            values = {fqn: slot.local_value(fqn, state_dict[fqn])
                      for fqn, _ in slot.names() if fqn in state_dict}
            slot.assign(ema, values)
        if self.STEP_KEY in state_dict:
            state.set_step(state_dict[self.STEP_KEY])

    # --- checkpoint directories -------------------------------------------------------------------

    def _save(self, directory, tensors: Sequence[torch.Tensor], overwrite: bool,
              what: str, extra: Mapping[str, torch.Tensor] | None = None, *,
              async_: bool = False, if_busy: str = "wait", position: bool = False):
        """``extra``: whole tensors written by rank 0 next to the EMA's (snapshot metadata).
        ``position``: the index records the EMA's ``state.position()`` (its step and schedule,
        taken now, with the tensors), which ``load`` resumes."""
        state = self.state
        state.synchronize()
        state.check_selection(what)
        rank, world = state.rank_world()

        def pieces() -> dict[str, Any]:  # collective for FSDP1 (one all_to_all per unit)
            out = state.pieces(tensors, rank, world)
            if extra and rank == 0:
                out.update({name: t.detach().cpu() for name, t in extra.items()})
            return out

        saver = None
        if async_:
            from ..store.async_save import AsyncSaver

            if state.async_saver is None:
                state.async_saver = AsyncSaver()
            saver = state.async_saver
        if position:  # taken with the tensors; written (read, for a device step) at the commit
            now = state.position()
            metadata = lambda: {POSITION_KEY: json.dumps(now(), sort_keys=True)}  # noqa: E731
        else:
            metadata = None
        return save_collective(directory, pieces, group=state.group, device=state.device,
                               what=f"{what}({os.fspath(directory)!r})", overwrite=overwrite,
                               async_saver=saver, if_busy=if_busy, metadata=metadata)

    @torch.no_grad()
    def save(self, directory: str | os.PathLike, *, overwrite: bool = False,
             async_: bool = False, if_busy: str = "wait"):
        """Writes the EMA weights as a sharded checkpoint directory (``fsdp_ema.checkpoint``
        format: one safetensors file per rank, the index written last by rank 0 once every rank
        has written its file). Collective. A failure on any rank raises on every rank and leaves
        no index. Names are clean FQNs. The index's metadata records the EMA's position (the
        updates so far and the schedule's settings, under ``POSITION_KEY``), so that ``load``
        resumes the schedule where it was. Returns the bytes of this rank's file.

        ``async_=True`` returns a ``SaveHandle`` once the EMA is staged into host buffers this
        EMA reuses between saves (``update()`` may run right away); the file is written and
        committed on a background thread, and ``handle.result()`` returns the bytes or raises on
        every rank. One save in flight per EMA: a new one waits for it, or with
        ``if_busy="raise"`` raises on every rank (see docs/SHARDED_EMA.md)."""
        return self._save(directory, self.state.tensors, overwrite, "ShardedEMA.save",
                          async_=async_, if_busy=if_busy, position=True)

    @torch.no_grad()
    def save_shard_weights(self, directory: str | os.PathLike, *, overwrite: bool = False,
                           async_: bool = False, if_busy: str = "wait"):
        """Writes the model's own weights (same tensors as the EMA, same format)."""
        return self._save(directory, self.state.refresh(), overwrite,
                          "ShardedEMA.save_shard_weights", async_=async_, if_busy=if_busy)

    def save_ema_shard_weights(self, directory: str | os.PathLike, *,
                               overwrite: bool = False, async_: bool = False,
                               if_busy: str = "wait"):
        """Alias of ``save`` (the name of the common ShardEMAModel recipe)."""
        return self.save(directory, overwrite=overwrite, async_=async_, if_busy=if_busy)

    @torch.no_grad()
    def load(self, directory: str | os.PathLike, *, strict: bool = True,
             verify: bool = True, allow_changes: str | Sequence[str] = ()) -> None:
        """Loads EMA weights from a checkpoint directory written at any world size (``save``,
        ``save_shard_weights``, ``fsdp_ema.checkpoint`` or DCP's HuggingFace writer). Each rank
        reads only the rows it keeps where the layout allows, straight into the EMA's tensors
        where the stored dtype is the EMA's. Collective: every rank checks everything (checksums
        included) before any rank writes, so a failure anywhere leaves every EMA as it was.

        A checkpoint ``save`` wrote also gives back the step, so a scheduled EMA (warmup,
        ``schedule=``, ``update_every``, ``start_step``) resumes where it was; one saved under
        another schedule (where either schedule's decay depends on the step: two fixed decays
        differ at no step) is refused, naming both, unless ``allow_changes`` names the settings
        that may differ (``"decay"``, ``"warmup"``, ``"schedule"``, ``"update_every"``,
        ``"start_step"``, or ``"all"``). A checkpoint without a recorded position (the model's
        weights, an older fsdp_ema, DCP) loads the weights and leaves the step as it is."""
        self._load(directory, strict=strict, verify=verify,
                   allow=allowed_changes(allow_changes, "ShardedEMA.load"), position=True)

    def _load(self, directory: str | os.PathLike, *, strict: bool, verify: bool,
              allow: tuple[str, ...], position: bool) -> None:
        """``load``; ``position``: resume the step the checkpoint records (checked first)."""
        # An EMA in host memory: the update in flight lands before the load writes the tensors.
        self.synchronize()
        directory = os.fspath(directory)
        # Every rank checks everything (the index, names, shapes, dtypes, every destination and
        # every checksum it will read) before the agreement, and reads into the EMA in place only
        # after it (store.collective.load_collective): one rank's failure raises everywhere and
        # leaves every rank's EMA as it was.
        state = self.state
        what = f"ShardedEMA.load({directory!r})"
        step: list[int] = []

        def check_info(info: Mapping[str, Any]) -> None:
            saved = (info.get("metadata") or {}).get(POSITION_KEY)
            if saved is not None and position:
                try:
                    record = json.loads(saved)
                except ValueError as e:
                    raise ValueError(f"{what}: the index's {POSITION_KEY!r} metadata is not "
                                     f"JSON ({e})") from None
                step.append(state.check_position(record, what=what, allow=allow))

        load_slots(directory, state.slots, state.tensors,
                   check_names=lambda available: self._check_names(available, strict, "load"),
                   group=state.group, device=state.device, what=what, verify=verify,
                   check_info=check_info)
        if step:
            state.set_step(step[0])

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
        from ..store.binding import fingerprint

        state = self.state
        state.synchronize()
        rank, world = state.rank_world()
        pieces = state.pieces(state.refresh(), rank, world)
        return fingerprint(pieces, group=state.group, device=state.device)
