"""What a model holds, as ``ShardedEMA`` keeps it: model discovery and slots.

``discover`` walks a (wrapped) model once and returns one slot per tensor the EMA keeps on this
rank: ``ReplicatedSlot`` (a parameter or buffer every rank holds whole: plain, DDP, buffers),
``ShardedSlot`` (the local shard of a DTensor: FSDP2) or ``FlatSlot`` (the local slice of an FSDP1
FlatParameter, which holds several named tensors). Each slot knows its names, the
``model.layouts.Layout`` of each of its tensors over the EMA's or the model's storage (what a save
writes, what a load reads), its state-dict values and how its full tensors are produced
(``store.full_state.Part``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .layouts import (
    Layout,
    LoadTarget,
    Part,
    ReadRequest,
    box,
    check_placements,
    chunk_rows,
    is_dtensor,
    on_mesh,
    part_cost,
    rows,
    whole,
)

# Attributes through which wrappers hold the wrapped module; they are not part of clean names.
WRAPPER_ATTRS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})

def join_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def clean_name(fqn: str) -> str:
    return ".".join(part for part in fqn.split(".") if part not in WRAPPER_ATTRS)


def is_ddp(module: nn.Module) -> bool:
    return isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel))


def clean_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once, in ``named_modules`` order, under its clean name: the attributes
    through which torch.compile, FSDP1, activation checkpointing and DDP hold the wrapped module
    (``_orig_mod``, ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``, DDP's ``module``)
    are left out, as ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` does."""
    seen, out = set(), []

    def visit(prefix: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        out.append((prefix, module))
        for name, child in module._modules.items():
            if child is not None:
                skip = name in WRAPPER_ATTRS or (name == "module" and is_ddp(module))
                visit(prefix if skip else join_name(prefix, name), child)

    visit("", root)
    return out


def global_shape(value) -> torch.Size:
    return torch.Size(value.size())


def _rows(value, fqn: str, shape: torch.Size, rank: int, world_size: int) -> torch.Tensor:
    """``torch.chunk(value, world_size)[rank]`` of a full tensor, a DTensor or a ShardedTensor
    (a 0-dim value whole), without gathering when ``value`` is already laid out that way."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(value, DTensor):
        mesh = value.device_mesh
        if (len(shape) > 0 and mesh.ndim == 1 and mesh.size() == world_size
                and mesh.get_local_rank() == rank and len(value.placements) == 1
                and type(value.placements[0]) is Shard and value.placements[0].dim == 0):
            return value._local_tensor
        value = value.full_tensor()
    if len(shape) == 0:
        if isinstance(value, ShardedTensor):
            raise ValueError(f"{fqn!r}: a 0-dim tensor cannot come as a ShardedTensor")
        return value
    begin, end = chunk_rows(shape[0], rank, world_size)
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        if not shards and begin == end:
            return torch.empty(0, *shape[1:], dtype=value.dtype)
        if (len(shards) == 1 and shards[0].metadata.shard_offsets[0] == begin
                and list(shards[0].tensor.shape) == [end - begin, *shape[1:]]):
            return shards[0].tensor
        raise ValueError(
            f"{fqn!r}: the ShardedTensor is not sharded as torch.chunk rows [{begin}, {end}) "
            f"on this rank (rank {rank} of {world_size}); pass a full tensor or a DTensor")
    return value[begin:end]


def dtensor_view(local: torch.Tensor, mesh, placements, shape: torch.Size, stride) -> Any:
    """A DTensor over ``local`` itself, whatever its device (as FSDP2 builds its CPU-offloaded
    parameters): unlike ``DTensor.from_local`` it never moves ``local`` to the mesh's device, so
    it holds no device memory and a ``dcp.load`` into it writes ``local``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements),
                       tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


class Slot:
    """One tensor the EMA keeps, on this rank.

    ``ReplicatedSlot``: a parameter or buffer every rank holds whole (plain, DDP, buffers);
    ``ShardedSlot``: the local shard of a DTensor (FSDP2); ``FlatSlot``: the local slice of an FSDP1
    FlatParameter, which holds several named tensors (its members).
    """

    average: bool              # averaged by update_ (else copied)
    buffer: bool = False       # a buffer (kept whatever ShardedEMA's params selects)
    local_shape: torch.Size
    get: Callable[[], torch.Tensor]  # the live local tensor of the model

    def names(self) -> list[tuple[str, torch.Size]]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def state_items(self, ema: torch.Tensor) -> dict[str, Any]:
        raise NotImplementedError

    def layouts(self, t: torch.Tensor, rank: int,
                world_size: int) -> list[tuple[Layout, int]]:
        """The layout of each tensor of this slot over ``t`` (its EMA or model tensor) and the
        rank its ``piece`` takes, for rank ``rank`` of the EMA's ``world_size`` (collective for
        FSDP1 units: one all_to_all)."""
        raise NotImplementedError

    def pieces(self, t: torch.Tensor, rank: int, world_size: int) -> dict[str, Any]:
        """What this rank writes of this slot's tensors over ``t``."""
        out: dict[str, Any] = {}
        for layout, piece_rank in self.layouts(t, rank, world_size):
            out.update(layout.piece(piece_rank))
        return out

    def local_value(self, fqn: str, value) -> torch.Tensor:
        """The part of a state dict ``value`` this rank keeps (same form as ``file_request``)."""
        raise NotImplementedError

    def file_request(self) -> tuple[int, int]:
        """(rank, world_size) for ``fsdp_ema.checkpoint.load`` to read this slot's tensors."""
        raise NotImplementedError

    def from_file(self, fqn: str, loaded: torch.Tensor) -> torch.Tensor:
        return loaded

    def load_targets(self, t: torch.Tensor) -> list[LoadTarget]:
        """How a checkpoint is read into ``t`` (this slot's EMA or model tensor): by default the
        values come back to ``assign`` (no destination); a slot whose file layout is ``t``'s own
        names ``t`` (or views of it) as the destination, to be read in place."""
        return [LoadTarget(fqn, shape, t.dtype, ReadRequest(self.file_request()))
                for fqn, shape in self.names()]

    def assign(self, ema: torch.Tensor, values: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def full_parts(self, ema: torch.Tensor) -> list[Part]:
        """How ``full_state_dict`` / ``export`` produce this slot's full tensors (``Part``)."""
        raise NotImplementedError

    def sharding_changed(self) -> str | None:
        """Why the model's tensor no longer holds the elements this slot's EMA does, or None
        (only a DTensor's shard can move without changing shape)."""
        return None

    def reshard(self) -> None:
        """Frees an unsharded copy of the model's tensor that a forward would use instead of the
        shard (FSDP1 keeps the root's); nothing for most slots."""


class ReplicatedSlot(Slot):
    kind = "replicated"

    def __init__(self, fqn: str, owner: dict[str, torch.Tensor], name: str, tensor: torch.Tensor,
                 average: bool):
        self.fqn, self.average, self.local_shape = fqn, average, tensor.shape
        self.get = lambda: owner[name]

    def names(self):
        return [(self.fqn, self.local_shape)]

    def describe(self):
        return repr(self.fqn)

    def state_items(self, ema):
        return {self.fqn: ema}

    def layouts(self, t, rank, world_size):
        # Replicated on every rank: each rank writes its torch.chunk rows, so writing is shared.
        return [(whole(self.fqn, t, writers=world_size), rank)]

    def local_value(self, fqn, value):
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        if is_dtensor(value):
            return value.full_tensor()
        if isinstance(value, ShardedTensor):
            shards = value.local_shards()
            if len(shards) == 1 and list(shards[0].tensor.shape) == list(value.size()):
                return shards[0].tensor
            raise ValueError(f"{fqn!r} is replicated on every rank here; pass a full tensor or a "
                             f"DTensor rather than a ShardedTensor")
        return value

    def file_request(self):
        return 0, 1

    def load_targets(self, t):
        return [whole(self.fqn, t).target()]

    def assign(self, ema, values):
        if self.fqn in values:
            whole(self.fqn, ema).assign(values[self.fqn])

    def full_parts(self, ema):
        return [whole(self.fqn, ema).full_part()]


class ShardedSlot(Slot):
    kind = "sharded"

    def __init__(self, fqn: str, owner: dict[str, torch.Tensor], name: str, param, average: bool):
        self.fqn, self.average = fqn, average
        self.mesh, self.placements = param.device_mesh, tuple(param.placements)
        self.global_shape = torch.Size(param.shape)
        # Explicit shape and stride for the DTensors made of the EMA: from_local would infer a
        # wrong global shape from an uneven local shard (and on some ranks an empty one).
        self.global_stride = torch.empty(self.global_shape, device="meta").stride()
        local = param._local_tensor
        self.local_shape = local.shape
        try:
            check_placements(fqn, self.placements, self.mesh)
        except ValueError as e:
            raise ValueError(f"ShardedEMA: {e}") from None
        shape, self.offsets = self._box(self.mesh, self.placements)
        if tuple(shape) != tuple(local.shape):
            raise RuntimeError(
                f"ShardedEMA: {fqn!r} has a local shard of shape {list(local.shape)} where its "
                f"placements {self.placements} imply {list(shape)}")
        # torch.chunk rows of (k, n) where the layout allows, else the whole tensor and the box
        # (offsets clamped for an empty shard, as the checkpoint index stores them).
        self.read = self._layout(local).read()
        self.chunk = self.read.request if self.read.box is None and len(self.global_shape) else None
        # FSDP2 leaves a module's parameters unsharded after a forward without backward (the
        # root's, under no_grad); the sharded DTensor it keeps holds the same (sharded) data.
        self._live = lambda: owner[name] if is_dtensor(owner[name]) else param
        from torch.distributed.tensor import DTensor

        def get() -> torch.Tensor:  # called per slot every update: one call, one lookup
            live = owner[name]
            return (live if isinstance(live, DTensor) else param)._local_tensor

        self.get = get

    def _box(self, mesh, placements) -> tuple[torch.Size, list[int]]:
        """This rank's local shape and offsets in the full tensor under ``mesh`` and
        ``placements`` (offsets clamped for an empty shard, as the checkpoint index stores them)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offsets = compute_local_shape_and_global_offset(self.global_shape, mesh,
                                                               tuple(placements))
        return torch.Size(shape), [min(o, s) for o, s in zip(offsets, self.global_shape)]

    def sharding_changed(self) -> str | None:
        """Why this rank's shard of the model no longer holds the elements the EMA's does (its
        offsets in the full tensor moved: another mesh order, another placement of the same local
        shape), or None. Another mesh that leaves the rank the same elements (a tensor-parallel
        model sharded over a data-parallel dimension of size 1) is no change."""
        live = self._live()
        if live.device_mesh is self.mesh and tuple(live.placements) == self.placements:
            return None
        shape, offsets = self._box(live.device_mesh, live.placements)
        if shape == self.local_shape and offsets == self.offsets:
            return None
        return (f"{self.fqn!r} holds the elements at offsets {offsets} ({tuple(live.placements)} "
                f"on {live.device_mesh}) here, its EMA those at {self.offsets} "
                f"({self.placements} on {self.mesh})")

    def names(self):
        return [(self.fqn, self.global_shape)]

    def describe(self):
        return repr(self.fqn)

    def state_items(self, ema):
        if ema.device.type != self.mesh.device_type:
            # A host-memory EMA (device="cpu") of weights on an accelerator mesh: from_local would
            # move it to the mesh's device; the state dict stays a view of the EMA instead.
            return {self.fqn: dtensor_view(ema, self.mesh, self.placements, self.global_shape,
                                           self.global_stride)}
        return {self.fqn: self._layout(ema).dtensor()}

    def _layout(self, t: torch.Tensor) -> Layout:
        return on_mesh(self.fqn, t, self.mesh, self.placements, self.global_shape,
                       self.global_stride)

    def layouts(self, t, rank, world_size):
        return [(self._layout(t), rank)]  # the mesh coordinate says who writes

    def local_value(self, fqn, value):
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        if is_dtensor(value):
            if value.device_mesh == self.mesh and tuple(value.placements) == self.placements:
                return value._local_tensor
            value = value.full_tensor()
        elif isinstance(value, ShardedTensor):
            if self.chunk is None:
                raise ValueError(f"{fqn!r} is a DTensor with placements {self.placements}; pass "
                                 f"a DTensor or a full tensor rather than a ShardedTensor")
            return _rows(value, fqn, self.global_shape, *self.chunk)
        return box(value, self.offsets, self.local_shape)

    def file_request(self):
        return self.read.request

    def from_file(self, fqn, loaded):
        return self.read.take(loaded)

    def load_targets(self, t):
        # In place for torch.chunk rows (FSDP2 Shard(0)); a box of the whole tensor otherwise.
        return [self._layout(t).target()]

    def assign(self, ema, values):
        if self.fqn in values:
            self._layout(ema).assign(values[self.fqn])

    def full_parts(self, ema):
        return [self._layout(ema).full_part()]


class FlatSlot(Slot):
    kind = "flat"

    def __init__(self, prefix: str, module, flat_param, average: bool):
        from .fsdp1 import FlatLayout

        self.prefix, self.average = prefix, average
        handle = self.handle = module._handle
        self.layout = FlatLayout(flat_param, handle,
                                 [join_name(prefix, clean_name(f)) for f in flat_param._fqns])
        local = getattr(flat_param, "_local_shard", flat_param)
        if local.numel() != self.layout.shard_numel:
            raise RuntimeError(f"ShardedEMA: the FSDP1 unit {prefix or '<root>'!r} is unsharded "
                               f"right now; create the EMA outside forward/summon_full_params")
        self.local_shape = torch.Size([self.layout.shard_numel])
        self.get = lambda: getattr(flat_param, "_local_shard", flat_param)
        # HYBRID_SHARD: the unit is sharded within its group and replicated across groups; the
        # first replica writes checkpoint pieces.
        inter = getattr(module, "_inter_node_pg", None)
        self.replica = (dist.get_rank(inter) if "HYBRID" in self.layout.strategy
                        and inter is not None else 0)

    def names(self):
        return [(m.fqn, m.shape) for m in self.layout.members]

    def describe(self):
        return f"the FSDP1 flat parameter of {self.prefix or '<root>'!r}"

    def state_items(self, ema):
        from .fsdp1 import sharded_tensor

        layout, out = self.layout, {}
        layout.require_sharded("state_dict", hybrid=False)
        for member, chunk in zip(layout.members, layout.to_chunks(ema)):
            if len(member.shape) == 0 or member.shape.numel() == 0:
                out[member.fqn] = chunk
            else:
                out[member.fqn] = sharded_tensor(chunk, member.shape, layout.rank,
                                                 layout.world_size, layout.group)
        return out

    def layouts(self, t, rank, world_size):
        layout = self.layout
        chunks = layout.to_chunks(t)  # collective within the unit's group: every replica
        # Rank 0 of the unit's group writes 0-dim and empty members; only the first replica
        # writes at all.
        return [(rows(member.fqn, chunk, member.shape, layout.rank, layout.world_size,
                      writes=not self.replica), layout.rank)
                for member, chunk in zip(layout.members, chunks)]

    def local_value(self, fqn, value):
        shape = next(m.shape for m in self.layout.members if m.fqn == fqn)
        return _rows(value, fqn, shape, self.layout.rank, self.layout.world_size)

    def file_request(self):
        return self.layout.rank, self.layout.world_size

    def assign(self, ema, values):
        layout = self.layout
        if not any(m.fqn in values for m in layout.members):
            return
        if all(m.fqn in values for m in layout.members):
            chunks = [values[m.fqn] for m in layout.members]
        else:  # non-strict load of part of a unit: keep the other members as they are
            chunks = [values.get(m.fqn, c) for m, c in zip(layout.members, layout.to_chunks(ema))]
        layout.from_chunks(chunks, ema)

    def full_parts(self, ema):
        layout, parts = self.layout, []
        if not layout.sharded:  # NO_SHARD: the flat "slice" is the whole flat parameter
            for m in layout.members:
                value = ema[m.start:m.start + m.shape.numel()].view(m.shape)
                parts.append(Part(m.fqn, m.shape, ema.dtype, "full", value))
            return parts
        layout.require_sharded("full_state_dict/export")
        for index, m in enumerate(layout.members):
            if m.shape.numel() == 0:
                parts.append(Part(m.fqn, m.shape, ema.dtype, "full", ema.new_empty(m.shape)))
            else:
                parts.append(Part(m.fqn, m.shape, ema.dtype, "flat", ema, layout.group,
                                  part_cost(m.shape, ema.dtype, layout.world_size), self, index))
        return parts

    def reshard(self):
        if self.layout.sharded and hasattr(self.handle.flat_param, "_full_param_padded"):
            self.handle.reshard(True)


class FlatReplicatedSlot(FlatSlot):
    kind = "flatreplicated"

    """An FSDP1 NO_SHARD unit (what FSDP1 becomes at one rank): every rank holds the whole flat
    parameter, so each member is a view of it, laid out like a replicated tensor
    (``ReplicatedSlot``: every rank writes its torch.chunk rows of each member; state dicts hold
    plain tensors)."""

    def members(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(m.fqn, flat[m.start:m.start + m.shape.numel()].view(m.shape))
                for m in self.layout.members]

    def state_items(self, ema):
        return dict(self.members(ema))

    def layouts(self, t, rank, world_size):
        return [(whole(fqn, view, writers=world_size), rank) for fqn, view in self.members(t)]

    def local_value(self, fqn, value):
        return ReplicatedSlot.local_value(self, fqn, value)

    def file_request(self):
        return 0, 1

    def load_targets(self, t):
        return [whole(fqn, view).target() for fqn, view in self.members(t)]

    def assign(self, ema, values):
        for fqn, view in self.members(ema):
            if fqn in values:
                whole(fqn, view).assign(values[fqn])


Select = Callable[[str, torch.Tensor], bool]


def flat_selected(slot: FlatSlot, flat_param, select: Select | None) -> bool:
    """Whether an FSDP1 unit is kept: a FlatParameter is one tensor, so its members are kept or
    left out together (``select`` sees each member's name and its original parameter where
    FSDP1 keeps it, ``use_orig_params=True``, else the FlatParameter)."""
    if select is None:
        return True
    names = [fqn for fqn, _ in slot.names()]
    originals = getattr(flat_param, "_params", None)
    if not isinstance(originals, list) or len(originals) != len(names):
        originals = [flat_param] * len(names)
    chosen = [fqn for fqn, p in zip(names, originals) if select(fqn, p)]
    if chosen and len(chosen) != len(names):
        left = sorted(set(names) - set(chosen))
        raise ValueError(
            f"ShardedEMA: params selects {chosen[0]!r} but not {left[0]!r}, which share "
            f"{slot.describe()}; an FSDP1 unit is kept whole (wrap them in separate units, use "
            f"use_orig_params=True with uniform requires_grad per unit, or FSDP2)")
    return bool(chosen)


def discover(model: nn.Module, include_buffers: bool, buffers: str,
              select: Select | None = None) -> list[Slot]:
    """The slots of ``model``: its parameters that ``select(fqn, tensor)`` keeps (all without
    it), then, with ``include_buffers``, its persistent buffers."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import FlatParameter

    slots: list[Slot] = []
    seen, flat_members = set(), set()
    modules = clean_modules(model)
    for prefix, module in modules:
        if isinstance(module, FullyShardedDataParallel) and module._handle is not None:
            flat_param = module._handle.flat_param
            seen.add(id(flat_param))
            sharded = module._handle.uses_sharded_strategy
            slot = (FlatSlot if sharded else FlatReplicatedSlot)(prefix, module, flat_param,
                                                           average=True)
            flat_members.update(fqn for fqn, _ in slot.names())
            if flat_selected(slot, flat_param, select):
                slots.append(slot)
        for name, p in module._parameters.items():
            fqn = join_name(prefix, name)
            if p is None or id(p) in seen or isinstance(p, FlatParameter) or fqn in flat_members:
                continue
            seen.add(id(p))
            if select is None or select(fqn, p):
                slots.append(make_slot(fqn, module._parameters, name, p, average=True))
    if include_buffers:
        for prefix, module in modules:
            for name, b in module._buffers.items():
                if b is None or id(b) in seen or name in module._non_persistent_buffers_set:
                    continue
                seen.add(id(b))
                slot = make_slot(join_name(prefix, name), module._buffers, name, b,
                                  average=buffers == "average")
                slot.buffer = True
                slots.append(slot)
    return slots


def make_slot(fqn: str, owner, name: str, tensor: torch.Tensor, average: bool) -> Slot:
    if tensor.is_complex():
        raise ValueError(f"ShardedEMA: {fqn!r} is complex ({tensor.dtype}); only real floating "
                         f"tensors can be averaged")
    average = average and tensor.is_floating_point()
    if is_dtensor(tensor):
        return ShardedSlot(fqn, owner, name, tensor, average)
    return ReplicatedSlot(fqn, owner, name, tensor, average)



class TrainableWatch:
    """The ``requires_grad`` of every parameter of a model when a ``params="trainable"`` EMA was
    made, to refuse (naming the parameter) an update or save after the trainable set changed:
    the EMA would silently average frozen weights or miss trained ones."""

    def __init__(self, model: nn.Module):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp._flat_param import FlatParameter

        # (name, dict holding the parameter, key, requires_grad then); the dict is read again
        # at check time since FSDP swaps the parameter objects it holds.
        self.entries: list[tuple[str, Mapping[str, Any], str, bool]] = []
        for prefix, module in clean_modules(model):
            if isinstance(module, FullyShardedDataParallel) and module._handle is not None:
                handle = module._handle
                holder = {"flat": handle.flat_param}
                self.entries.append((f"the FSDP1 flat parameter of {prefix or '<root>'!r}", holder,
                                     "flat", bool(handle.flat_param.requires_grad)))
            for name, p in module._parameters.items():
                if p is not None and not isinstance(p, FlatParameter):
                    self.entries.append((join_name(prefix, name), module._parameters, name,
                                         bool(p.requires_grad)))

    def check(self, what: str) -> None:
        for fqn, owner, key, was in self.entries:
            p = owner.get(key)
            if p is not None and bool(p.requires_grad) != was:
                now = "trainable" if p.requires_grad else "frozen"
                raise RuntimeError(
                    f"{what}: parameter {fqn!r} is {now} now but was "
                    f"{'trainable' if was else 'frozen'} when the EMA was made with "
                    f"params='trainable'; make a new ShardedEMA for the new trainable set (and "
                    f"load_state_dict(..., strict=False) the old one into it)")
