"""A ``ShardedEMA``'s weights in the live model (one part of the class; ``ema.sharded`` says
which): ``swap()`` (the EMA weights inside a block, the model's own after, bit for bit),
``copy_to()`` (for good), and ``module()`` (the EMA as a model of its own: a teacher,
``ema.teacher``). Each writes into the tensors the model computes from, after freeing the unsharded
parameters FSDP would otherwise reuse.

Reads and writes the EMA through its ``model`` and ``state`` (``EMAState``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class SwapMixin:
    """``swap``, ``copy_to``, ``module``."""

    @contextlib.contextmanager
    def swap(self) -> Iterator[nn.Module]:
        """Context manager: the model holds the EMA weights inside, its own weights after.

        Writes into the tensors the model computes from (FSDP2: the local shards of the DTensor
        parameters; FSDP1: the local slices of the FlatParameters; otherwise the parameters and
        buffers), after keeping a copy of them, which is written back bit for bit on exit.
        """
        state = self.state
        if state.swapped:
            raise RuntimeError("ShardedEMA.swap() is already active")
        state.synchronize()
        state.reshard()
        with torch.no_grad():
            model = state.refresh()
            backup = [torch.empty_like(t) for t in model]
            torch._foreach_copy_(backup, model)
            torch._foreach_copy_(model, state.tensors)
        state.swapped = True
        try:
            yield self.model
        finally:
            # Drop unsharded copies of the EMA values before the weights come back.
            state.reshard()
            with torch.no_grad():
                torch._foreach_copy_(model, backup)
            state.swapped = False

    @torch.no_grad()
    def copy_to(self, model: nn.Module | None = None) -> None:
        """Writes the EMA into the model for good (timm's ``set``, diffusers' ``copy_to``): into
        the tensors it computes from (as ``swap()`` does, with no copy kept), bit for bit where
        the dtypes agree (else cast). ``model``: the EMA's own model (default), or another model
        wrapped and sharded the same way (same names and local shapes) on the same ranks. Only
        what the EMA keeps is written (see ``params`` and ``include_buffers``)."""
        state = self.state
        if state.swapped:
            raise RuntimeError("ShardedEMA.copy_to() inside swap(): the model's own weights "
                               "come back when the block exits; copy after it")
        state.synchronize()  # an EMA in host memory: its update in flight lands first
        state.check_selection("ShardedEMA.copy_to")
        if model is None or model is self.model:
            state.reshard()
            targets = state.refresh()
        else:
            from ..model.apply import matching_tensors

            targets = matching_tensors(model, state.slots, "ShardedEMA.copy_to")
        torch._foreach_copy_(targets, state.tensors)

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

        The teacher computes as the student does (FSDP2: each unit's ``param_dtype``, or the
        student's parameters' dtype where the unit has none). A teacher made trainable
        (``requires_grad_(True)``) is refused before its forward, by ``module()`` and by
        ``update()``; one converted since (``teacher.double()``) refuses to run, and
        ``module()`` builds a new one.

        Args:
            mp_policy: FSDP2: the units' MixedPrecisionPolicy (default: each student unit's, with
                the student's parameters' dtype as ``param_dtype`` where it has none and the EMA
                has another dtype). Refused for a model not sharded with FSDP2.
            reshard_after_forward: FSDP2: as ``fully_shard``'s (True: every unit, the root too,
                frees its gathered parameters after each forward).
            mesh: optional check: the mesh the teacher should run on, which must be the one the
                student's units (and so the EMA's shards) are on.
            compile: True: modules the student compiled (``nn.Module.compile``, or
                ``torch.compile(model)`` at the root) are compiled alike, with the student's
                settings (backend, mode, options, fullgraph, dynamic; torch.compile's defaults,
                with a warning, where they cannot be read); a dict: with those arguments;
                False: none.

        Built once per set of arguments; later calls return the same module.
        """
        from .teacher import module

        return module(self, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                      mesh=mesh, compile=compile)
