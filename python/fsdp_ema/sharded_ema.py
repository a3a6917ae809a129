"""``ShardedEMA``: an exponential moving average of a model's weights, kept shard by shard.

Works on FSDP2 (``fully_shard``: DTensor parameters), FSDP1 (``FullyShardedDataParallel``, with
``use_orig_params`` True or False), DDP and plain modules. Every rank averages only what it holds
(the local shard of each parameter; for FSDP1 the local slice of each FlatParameter), with one
fused ``torch.ops.fsdp_ema.update_`` call per step. See docs/SHARDED_EMA.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint as _ckpt
from ._dist import check_dtype_kind, chunk_rows, comm_device, raise_if_any_rank_failed

__all__ = ["ShardedEMA", "Warmup"]

_EMA_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Attributes through which wrappers hold the wrapped module; they are not part of clean names.
_WRAPPER_ATTRS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


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


# --- what a model holds --------------------------------------------------------------------------

def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _clean(fqn: str) -> str:
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_ATTRS)


def _is_ddp(module: nn.Module) -> bool:
    return isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel))


def _modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
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
                skip = name in _WRAPPER_ATTRS or (name == "module" and _is_ddp(module))
                visit(prefix if skip else _join(prefix, name), child)

    visit("", root)
    return out


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _global_shape(value) -> torch.Size:
    return torch.Size(value.size())


def _box(t: torch.Tensor, offsets: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    for dim, (begin, size) in enumerate(zip(offsets, shape)):
        t = t.narrow(dim, begin, size)
    return t


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


class _Slot:
    """One tensor the EMA keeps, on this rank.

    ``_Replicated``: a parameter or buffer every rank holds whole (plain, DDP, buffers);
    ``_Sharded``: the local shard of a DTensor (FSDP2); ``_Flat``: the local slice of an FSDP1
    FlatParameter, which holds several named tensors (its members).
    """

    average: bool              # averaged by update_ (else copied)
    local_shape: torch.Size
    get: Callable[[], torch.Tensor]  # the live local tensor of the model

    def names(self) -> list[tuple[str, torch.Size]]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def state_items(self, ema: torch.Tensor) -> dict[str, Any]:
        raise NotImplementedError

    def pieces(self, t: torch.Tensor, rank: int, world_size: int) -> dict[str, Any]:
        raise NotImplementedError

    def local_value(self, fqn: str, value) -> torch.Tensor:
        """The part of a state dict ``value`` this rank keeps (same form as ``file_request``)."""
        raise NotImplementedError

    def file_request(self) -> tuple[int, int]:
        """(rank, world_size) for ``fsdp_ema.checkpoint.load`` to read this slot's tensors."""
        raise NotImplementedError

    def from_file(self, fqn: str, loaded: torch.Tensor) -> torch.Tensor:
        return loaded

    def assign(self, ema: torch.Tensor, values: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError


class _Replicated(_Slot):
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

    def pieces(self, t, rank, world_size):
        # Replicated on every rank: each rank writes its torch.chunk rows, so writing is shared.
        if t.dim() == 0 or t.numel() == 0:
            return {self.fqn: t} if rank == 0 else {}
        begin, end = chunk_rows(t.shape[0], rank, world_size)
        if begin == end:
            return {}
        return {self.fqn: (t[begin:end], [begin] + [0] * (t.dim() - 1), list(t.shape))}

    def local_value(self, fqn, value):
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        if _is_dtensor(value):
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

    def assign(self, ema, values):
        if self.fqn in values:
            ema.copy_(values[self.fqn])


class _Sharded(_Slot):
    def __init__(self, fqn: str, owner: dict[str, torch.Tensor], name: str, param, average: bool):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        self.fqn, self.average = fqn, average
        self.mesh, self.placements = param.device_mesh, tuple(param.placements)
        self.global_shape = torch.Size(param.shape)
        local = param._local_tensor
        self.local_shape = local.shape
        if not all(isinstance(p, (Shard, Replicate)) for p in self.placements):
            raise ValueError(f"ShardedEMA: {fqn!r} has placements {self.placements}; only Shard "
                             f"and Replicate are supported")
        shape, offsets = compute_local_shape_and_global_offset(self.global_shape, self.mesh,
                                                               self.placements)
        if tuple(shape) != tuple(local.shape):
            raise RuntimeError(
                f"ShardedEMA: {fqn!r} has a local shard of shape {list(local.shape)} where its "
                f"placements {self.placements} imply {list(shape)}")
        # An empty shard's offset is clamped to the size, as the checkpoint index expects.
        self.offsets = [min(o, s) for o, s in zip(offsets, self.global_shape)]
        coordinate = self.coordinate = self.mesh.get_coordinate()
        self.first_replica = all(c == 0 for c, p in zip(coordinate, self.placements)
                                 if not isinstance(p, Shard))
        self.chunk = None  # (k, n): the local shard is torch.chunk(t, n)[k]
        shards = [i for i, p in enumerate(self.placements) if isinstance(p, Shard)]
        if (len(self.global_shape) > 0 and len(shards) == 1
                and type(self.placements[shards[0]]) is Shard
                and self.placements[shards[0]].dim == 0):
            k, n = coordinate[shards[0]], self.mesh.size(shards[0])
            begin, end = chunk_rows(self.global_shape[0], k, n)
            if list(local.shape) == [end - begin, *self.global_shape[1:]]:
                self.chunk = (k, n)
        # FSDP2 leaves a module's parameters unsharded after a forward without backward (the
        # root's, under no_grad); the sharded DTensor it keeps holds the same (sharded) data.
        self.get = lambda: (owner[name] if _is_dtensor(owner[name]) else param)._local_tensor

    def names(self):
        return [(self.fqn, self.global_shape)]

    def describe(self):
        return repr(self.fqn)

    def state_items(self, ema):
        from torch.distributed.tensor import DTensor

        # Explicit shape and stride: from_local would infer a wrong global shape from an uneven
        # local shard (and on some ranks an empty one).
        stride = torch.empty(self.global_shape, device="meta").stride()
        return {self.fqn: DTensor.from_local(ema, self.mesh, self.placements, run_check=False,
                                             shape=self.global_shape, stride=stride)}

    def pieces(self, t, rank, world_size):
        if not self.first_replica:
            return {}
        if self.global_shape.numel() == 0 or t.dim() == 0:
            return {self.fqn: t} if not any(self.coordinate) else {}
        if t.numel() == 0:
            return {}
        return {self.fqn: (t, self.offsets, list(self.global_shape))}

    def local_value(self, fqn, value):
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        if _is_dtensor(value):
            if value.device_mesh == self.mesh and tuple(value.placements) == self.placements:
                return value._local_tensor
            value = value.full_tensor()
        elif isinstance(value, ShardedTensor):
            if self.chunk is None:
                raise ValueError(f"{fqn!r} is a DTensor with placements {self.placements}; pass "
                                 f"a DTensor or a full tensor rather than a ShardedTensor")
            return _rows(value, fqn, self.global_shape, *self.chunk)
        return _box(value, self.offsets, self.local_shape)

    def file_request(self):
        return self.chunk if self.chunk is not None else (0, 1)

    def from_file(self, fqn, loaded):
        return loaded if self.chunk is not None else _box(loaded, self.offsets, self.local_shape)

    def assign(self, ema, values):
        if self.fqn in values:
            ema.copy_(values[self.fqn])


class _Flat(_Slot):
    def __init__(self, prefix: str, module, flat_param, average: bool):
        from ._fsdp1 import FlatLayout

        self.prefix, self.average = prefix, average
        handle = self.handle = module._handle
        self.layout = FlatLayout(flat_param, handle,
                                 [_join(prefix, _clean(f)) for f in flat_param._fqns])
        local = getattr(flat_param, "_local_shard", flat_param)
        if local.numel() != self.layout.shard_numel:
            raise RuntimeError(f"ShardedEMA: the FSDP1 unit {prefix or '<root>'!r} is unsharded "
                               f"right now; create the EMA outside forward/summon_full_params")
        self.local_shape = torch.Size([self.layout.shard_numel])
        self.get = lambda: getattr(flat_param, "_local_shard", flat_param)

    def names(self):
        return [(m.fqn, m.shape) for m in self.layout.members]

    def describe(self):
        return f"the FSDP1 flat parameter of {self.prefix or '<root>'!r}"

    def state_items(self, ema):
        from ._fsdp1 import sharded_tensor

        layout, out = self.layout, {}
        for member, chunk in zip(layout.members, layout.to_chunks(ema)):
            if len(member.shape) == 0 or member.shape.numel() == 0:
                out[member.fqn] = chunk
            else:
                out[member.fqn] = sharded_tensor(chunk, member.shape, layout.rank,
                                                 layout.world_size, layout.group)
        return out

    def pieces(self, t, rank, world_size):
        layout, out = self.layout, {}
        for member, chunk in zip(layout.members, layout.to_chunks(t)):
            if len(member.shape) == 0 or member.shape.numel() == 0:
                if layout.rank == 0:
                    out[member.fqn] = chunk if len(member.shape) == 0 else t.new_empty(member.shape)
            elif chunk.numel() > 0:
                begin, _ = chunk_rows(member.shape[0], layout.rank, layout.world_size)
                out[member.fqn] = (chunk, [begin] + [0] * (chunk.dim() - 1), list(member.shape))
        return out

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


def _discover(model: nn.Module, include_buffers: bool, buffers: str) -> list[_Slot]:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import FlatParameter

    slots: list[_Slot] = []
    seen, flat_members = set(), set()
    modules = _modules(model)
    for prefix, module in modules:
        if isinstance(module, FullyShardedDataParallel) and module._handle is not None:
            flat_param = module._handle.flat_param
            seen.add(id(flat_param))
            slot = _Flat(prefix, module, flat_param, average=True)
            flat_members.update(fqn for fqn, _ in slot.names())
            slots.append(slot)
        for name, p in module._parameters.items():
            fqn = _join(prefix, name)
            if p is None or id(p) in seen or isinstance(p, FlatParameter) or fqn in flat_members:
                continue
            seen.add(id(p))
            slots.append(_make_slot(fqn, module._parameters, name, p, average=True))
    if include_buffers:
        for prefix, module in modules:
            for name, b in module._buffers.items():
                if b is None or id(b) in seen or name in module._non_persistent_buffers_set:
                    continue
                seen.add(id(b))
                slots.append(_make_slot(_join(prefix, name), module._buffers, name, b,
                                        average=buffers == "average"))
    return slots


def _make_slot(fqn: str, owner, name: str, tensor: torch.Tensor, average: bool) -> _Slot:
    if tensor.is_complex():
        raise ValueError(f"ShardedEMA: {fqn!r} is complex ({tensor.dtype}); only real floating "
                         f"tensors can be averaged")
    average = average and tensor.is_floating_point()
    if _is_dtensor(tensor):
        return _Sharded(fqn, owner, name, tensor, average)
    return _Replicated(fqn, owner, name, tensor, average)


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


# --- full tensors in bounded buckets --------------------------------------------------------------

#: Default ``bucket_bytes`` of ``full_state_dict`` and ``export``.
DEFAULT_BUCKET_BYTES = 256 << 20
#: Default ``max_file_bytes`` of ``export`` (tensor data per file; Hugging Face's 5 GB).
DEFAULT_MAX_FILE_BYTES = 5 * 1000**3
_GATHER_ALIGN = 16  # gather_shards starts every packed piece 16-byte aligned


class _Part(NamedTuple):
    """One full tensor to produce. ``kind``: ``"full"`` (``value`` is already the full tensor),
    ``"rows"`` (``value`` holds this rank's torch.chunk rows: gathered), ``"flat"`` (the rows
    come from the FSDP1 exchange of ``slot``'s member ``member`` out of the flat slice
    ``value``; a 0-dim member needs no gather), ``"dtensor"`` (``value`` is a DTensor of
    another layout: ``full_tensor()``)."""

    fqn: str
    shape: torch.Size
    dtype: torch.dtype
    kind: str
    value: Any
    group: Any = None       # the process group of "rows" and "flat" parts
    cost: int = 0           # bytes one bucket holds for it (see _part_cost)
    slot: Any = None
    member: int = -1


def _part_cost(shape: torch.Size, dtype: torch.dtype, world: int) -> int:
    """Transient bytes gathering one tensor takes on its device, the same on every rank: the
    full output, this rank's input rows (at most ``ceil(rows / world)``), and gather_shards'
    packed send buffer and ``world`` times larger receive buffer (pieces 16-byte aligned)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(shape) == 0:
        return 2 * itemsize
    row = math.prod(shape[1:]) * itemsize
    chunk = -(-shape[0] // world) * row + _GATHER_ALIGN
    return shape.numel() * itemsize + (world + 2) * chunk


def _full_parts(slot: _Slot, ema: torch.Tensor) -> list[_Part]:
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(slot, _Replicated):
        return [_Part(slot.fqn, ema.shape, ema.dtype, "full", ema)]
    if isinstance(slot, _Sharded):
        shape = slot.global_shape
        if shape.numel() == 0:
            return [_Part(slot.fqn, shape, ema.dtype, "full", ema.new_empty(shape))]
        if len(shape) == 0 or all(isinstance(p, Replicate) for p in slot.placements):
            return [_Part(slot.fqn, shape, ema.dtype, "full", ema)]
        if slot.chunk is not None:
            dim = next(i for i, p in enumerate(slot.placements) if isinstance(p, Shard))
            group = slot.mesh.get_group(dim)
            return [_Part(slot.fqn, shape, ema.dtype, "rows", ema, group,
                          _part_cost(shape, ema.dtype, slot.chunk[1]))]
        return [_Part(slot.fqn, shape, ema.dtype, "dtensor", slot.state_items(ema)[slot.fqn])]
    assert isinstance(slot, _Flat)
    layout, parts = slot.layout, []
    if not layout.sharded:  # NO_SHARD: the flat "slice" is the whole flat parameter
        for m in layout.members:
            value = ema[m.start:m.start + m.shape.numel()].view(m.shape)
            parts.append(_Part(m.fqn, m.shape, ema.dtype, "full", value))
        return parts
    layout.require_sharded("full_state_dict/export")
    for index, m in enumerate(layout.members):
        if m.shape.numel() == 0:
            parts.append(_Part(m.fqn, m.shape, ema.dtype, "full", ema.new_empty(m.shape)))
        else:
            parts.append(_Part(m.fqn, m.shape, ema.dtype, "flat", ema, layout.group,
                               _part_cost(m.shape, ema.dtype, layout.world_size), slot, index))
    return parts


def _gather_bucket(bucket: list[_Part]) -> list[torch.Tensor]:
    """The full tensors of one bucket ("rows"/"flat" parts of one group): the FSDP1 exchange
    for the members it holds (one all_to_all per unit), then one gather_shards call."""
    rows: list[Any] = [p.value if p.kind == "rows" else None for p in bucket]
    by_slot: dict[int, list[int]] = defaultdict(list)
    for pos, p in enumerate(bucket):
        if p.kind == "flat":
            by_slot[id(p.slot)].append(pos)
    for positions in by_slot.values():
        first = bucket[positions[0]]
        chunks = first.slot.layout.to_chunks(first.value, [bucket[i].member for i in positions])
        for pos, chunk in zip(positions, chunks):
            rows[pos] = chunk
    out: list[Any] = list(rows)  # 0-dim FSDP1 members arrive whole from the exchange
    gather = [i for i, p in enumerate(bucket) if len(p.shape) > 0]
    if gather:
        group = bucket[0].group
        device = rows[gather[0]].device
        # CPU shards (CPU-offloaded FSDP2) on a group without a CPU backend go through the
        # accelerator, and come back.
        dev = comm_device(group, device)
        gathered = torch.ops.fsdp_ema.gather_shards(
            [rows[i].to(dev) for i in gather], [bucket[i].shape[0] for i in gather],
            group.group_name)
        for i, t in zip(gather, gathered):
            out[i] = t.to(device)
    return out


def _full_buckets(parts: Sequence[_Part],
                  bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor, bool]]]:
    """Collective (every rank runs the same sequence): ``(fqn, full tensor, fresh)`` a bucket
    at a time; ``fresh`` is False where the tensor is (a view of) the EMA itself. Drop each
    bucket before asking for the next, or the buckets add up.

    Parts that need a gather are grouped in order into buckets of one process group whose
    ``_part_cost`` adds up to at most ``bucket_bytes`` (a part costing more is a bucket of its
    own; a bucket also holds tensors of one device only). Parts already full come as they are,
    in buckets of their own.
    """
    pending: list[_Part] = []
    pending_cost = 0
    for p in parts:
        if p.kind == "full":
            yield [(p.fqn, p.value, False)]
            continue
        if p.kind == "dtensor":
            yield [(p.fqn, p.value.full_tensor(), True)]
            continue
        if pending and (pending_cost + p.cost > bucket_bytes
                        or p.group.group_name != pending[0].group.group_name
                        or p.value.device != pending[0].value.device):
            yield [(q.fqn, t, True) for q, t in zip(pending, _gather_bucket(pending))]
            pending, pending_cost = [], 0
        pending.append(p)
        pending_cost += p.cost
    if pending:
        yield [(q.fqn, t, True) for q, t in zip(pending, _gather_bucket(pending))]


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
    ``torch.ops.fsdp_ema.update_`` call (per device) with the decay computed on the device, so it
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
    """

    #: Key of the update counter in ``state_dict()``.
    STEP_KEY = "fsdp_ema.step"

    def __init__(self, model: nn.Module, decay: float = 0.9999, *,
                 warmup: None | bool | Warmup = None, update_every: int = 1,
                 start_step: int = 0, dtype: torch.dtype | None = torch.float32,
                 include_buffers: bool = True, buffers: str = "average",
                 process_group: dist.ProcessGroup | None = None, schedule: Any = None):
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
        if dtype is not None and dtype not in _EMA_DTYPES:
            raise ValueError(f"ShardedEMA: dtype must be one of {list(_EMA_DTYPES)} or None, got "
                             f"{dtype}")
        if schedule is not None and (warmup is not None or start_step != 0 or not all(
                callable(getattr(schedule, a, None)) for a in ("device_decay", "decay_at"))):
            raise ValueError(f"ShardedEMA: schedule={schedule!r} needs device_decay(t) and "
                             f"decay_at(t), and no warmup or start_step next to it")
        if buffers not in ("average", "copy"):
            raise ValueError(f"ShardedEMA: buffers must be 'average' or 'copy', got {buffers!r}")
        self.model = model
        self.decay, self.warmup, self.schedule = float(decay), warmup, schedule
        self.update_every, self.start_step = int(update_every), int(start_step)
        self.dtype = dtype
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self._group = process_group

        self._slots = _discover(model, include_buffers, buffers)
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
            self._ema = [
                t.detach().to(dtype=(self.dtype or t.dtype) if slot.average else t.dtype,
                              copy=True).contiguous()
                for slot, t in zip(self._slots, model_tensors)]
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
            if t.device != ema.device:
                raise RuntimeError(f"ShardedEMA: {slot.describe()} moved from {ema.device} to "
                                   f"{t.device} since the EMA was made")
        self._model_tensors = tensors
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

    # --- updating ---------------------------------------------------------------------------------

    @torch.no_grad()
    def update(self) -> None:
        """Folds the current weights into the EMA: one ``update_`` call per device."""
        if self._swapped:
            raise RuntimeError("ShardedEMA.update() inside swap(): the model holds the EMA "
                               "weights; update after the swap() block")
        if not torch.compiler.is_compiling():
            self._refresh()
        decay = self._scheduled_decay(self._step)
        for g in self._groups:
            # The op reads a CPU decay on the host (no sync); only a device decay for a group
            # on another device needs a copy (CPU-offloaded shards next to device buffers).
            d = decay if g.device == decay.device or decay.device.type == "cpu" else decay.to(
                g.device)
            self._update_group(g, d)
        self._step.add_(1)
        self._last_decay = decay

    def _update_group(self, g: _DeviceGroup, decay: torch.Tensor) -> None:
        """One device's update (fsdp_ema.ShardedPowerEMA overrides it to update its profiles)."""
        if g.ema_average:
            torch.ops.fsdp_ema.update_(g.ema_average, g.model_average, decay)
        if g.ema_copy:
            torch._foreach_copy_(g.ema_copy, g.model_copy)

    @contextlib.contextmanager
    def swap(self) -> Iterator[nn.Module]:
        """Context manager: the model holds the EMA weights inside, its own weights after.

        Writes into the tensors the model computes from (FSDP2: the local shards of the DTensor
        parameters; FSDP1: the local slices of the FlatParameters; otherwise the parameters and
        buffers), after keeping a copy of them, which is written back bit for bit on exit.
        """
        if self._swapped:
            raise RuntimeError("ShardedEMA.swap() is already active")
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

    def _reshard(self) -> None:
        """Frees unsharded parameters, so that the next forward gathers from the shards.

        FSDP2 keeps the root's parameters unsharded after a forward without backward, FSDP1
        keeps the root's unsharded flat parameter allocated and reuses it without gathering;
        either would make a forward ignore what swap() writes into the shards.
        """
        for module in self._fsdp2_modules:
            module.reshard()
        for slot in self._slots:
            if isinstance(slot, _Flat) and slot.layout.sharded and hasattr(
                    slot.handle.flat_param, "_full_param_padded"):
                slot.handle.reshard(True)

    # --- state dicts ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{clean FQN: EMA value}`` plus ``STEP_KEY``: DTensors for FSDP2 parameters
        (sharing the EMA's memory), ShardedTensors (dim-0 chunks) for FSDP1 parameters, plain
        tensors otherwise. ``torch.distributed.checkpoint`` saves it and reloads it at any world
        size. Collective for FSDP1 models (one all_to_all per FSDP unit)."""
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
        available = {k: _global_shape(v) for k, v in state_dict.items() if k != self.STEP_KEY}
        self._check_names(available, strict, "load_state_dict")
        for slot, ema in zip(self._slots, self._ema):
            values = {fqn: slot.local_value(fqn, state_dict[fqn])
                      for fqn, _ in slot.names() if fqn in state_dict}
            slot.assign(ema, values)
        if self.STEP_KEY in state_dict:
            self._step.copy_(torch.as_tensor(state_dict[self.STEP_KEY]))

    # --- full tensors -----------------------------------------------------------------------------

    def _full_plan(self, bucket_bytes: int, what: str) -> list[_Part]:
        if int(bucket_bytes) != bucket_bytes or bucket_bytes <= 0:
            raise ValueError(f"ShardedEMA.{what}: bucket_bytes must be a positive integer, got "
                             f"{bucket_bytes}")
        # Planned without communication, so a refusal raises on every rank before any gather.
        return [part for slot, ema in zip(self._slots, self._ema)
                for part in _full_parts(slot, ema)]

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = True, cpu_offload: bool = True,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, torch.Tensor]:
        """The full (unsharded) EMA tensors, keyed by clean FQN in ``state_dict()`` order.
        Collective: call it on every rank.

        Sharded tensors are gathered in buckets with ``torch.ops.fsdp_ema.gather_shards`` (one
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
        for bucket in _full_buckets(parts, bucket_bytes):
            if keep:
                for fqn, t, fresh in bucket:
                    out[fqn] = t.to("cpu", copy=not fresh) if cpu_offload else t
            del bucket  # before the next gather
        return {fqn: out[fqn] for fqn in self._shapes} if keep else {}

    @torch.no_grad()
    def export(self, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
               max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES, overwrite: bool = False) -> int:
        """Writes the full EMA weights as a consolidated Hugging Face safetensors directory:
        ``path/model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files plus
        ``model.safetensors.index.json`` when the tensor data exceeds ``max_file_bytes``.
        Collective: every rank gathers the buckets (as ``full_state_dict``); rank 0 of the EMA's
        process group writes each bucket's tensors into place as it arrives, so no rank holds
        more than a bucket. Returns the bytes of tensor data written.

        ``dtype`` (float32/float64/bfloat16/float16) casts the floating tensors; others are
        written as they are. Files are written under hidden temporary names, fsync'd and
        renamed into place, the index last; weight files of an earlier export in ``path`` are
        replaced only with ``overwrite=True``. A failure raises on every rank.
        """
        from . import _hf_export as hf

        path = os.fspath(path)
        what = f"ShardedEMA.export({path!r})"
        if dtype is not None and dtype not in _EMA_DTYPES:
            raise ValueError(f"{what}: dtype must be one of {list(_EMA_DTYPES)} or None, got "
                             f"{dtype}")
        if int(max_file_bytes) != max_file_bytes or max_file_bytes <= 0:
            raise ValueError(f"{what}: max_file_bytes must be a positive integer, got "
                             f"{max_file_bytes}")
        parts = self._full_plan(bucket_bytes, "export")

        def cast(d: torch.dtype) -> torch.dtype:
            return dtype if dtype is not None and d.is_floating_point else d

        plan = hf.Plan([hf.Entry(p.fqn, tuple(p.shape), cast(p.dtype),
                                 p.shape.numel() * torch.empty((), dtype=cast(p.dtype))
                                 .element_size()) for p in parts], int(max_file_bytes))
        writer, error = None, None
        if self._rank_world()[0] == 0:
            try:
                os.makedirs(path, exist_ok=True)
                existing = sorted(n for n in os.listdir(path) if hf.is_export_file(n))
                if existing and not overwrite:
                    raise FileExistsError(f"{path!r} already holds {existing[0]!r}; pass "
                                          f"overwrite=True to replace the export")
                writer = hf.Writer(path, plan)
            except Exception as e:  # noqa: BLE001 (re-raised on every rank below)
                error = e
        self._agree(error, what)
        for bucket in _full_buckets(parts, bucket_bytes):
            # After a write error rank 0 keeps gathering (the other ranks are in the
            # collectives) and reports the error at the end.
            if writer is not None and error is None:
                try:
                    for fqn, t, _ in bucket:
                        to = cast(t.dtype)
                        # Cast where the tensor is smaller: no bucket grows on the device.
                        if to.itemsize <= t.dtype.itemsize:
                            t = t.to(to).cpu()
                        else:
                            t = t.cpu().to(to)
                        writer.write(fqn, t)
                except Exception as e:  # noqa: BLE001
                    error = e
            del bucket
        if writer is not None:
            try:
                if error is None:
                    writer.commit()
            except Exception as e:  # noqa: BLE001
                error = e
            if error is not None:
                writer.abort()
        self._agree(error, what)
        return plan.total_size

    # --- checkpoint directories -------------------------------------------------------------------

    def _rank_world(self) -> tuple[int, int]:
        if self._group is None:
            return 0, 1
        return dist.get_rank(self._group), dist.get_world_size(self._group)

    def _agree(self, error: BaseException | None, what: str) -> None:
        raise_if_any_rank_failed(error, self._group, what, self._device)

    def _save(self, directory, tensors: Sequence[torch.Tensor], overwrite: bool,
              what: str, extra: Mapping[str, torch.Tensor] | None = None) -> int:
        """``extra``: whole tensors written by rank 0 next to the EMA's (snapshot metadata)."""
        directory = os.fspath(directory)
        what = f"{what}({directory!r})"
        rank, world = self._rank_world()
        index = os.path.join(directory, "fsdp_ema.index.json")
        error = None
        try:
            if os.path.exists(index) and not overwrite:
                raise FileExistsError(f"{directory!r} already holds a committed checkpoint; pass "
                                      f"overwrite=True to replace it")
            # An overwrite keeps the old checkpoint whole until the new index lands; the commit
            # then removes the old files (and any of another world size): format/commit.h.
        except Exception as e:  # noqa: BLE001 (re-raised on every rank below)
            error = e
        self._agree(error, what)
        # Collective for FSDP1 (one all_to_all per unit): every rank gets here.
        shards: dict[str, Any] = {}
        for slot, t in zip(self._slots, tensors):
            shards.update(slot.pieces(t.detach(), rank, world))
        if extra and rank == 0:
            shards.update({name: t.detach().cpu() for name, t in extra.items()})
        nbytes, error = 0, None
        try:
            nbytes = _ckpt.save_shard(directory, shards, rank=rank, world_size=world,
                                      overwrite=overwrite)
        except Exception as e:  # noqa: BLE001
            error = e
        self._agree(error, what)  # also the barrier: every rank's file is durable past here
        error = None
        if rank == 0:
            try:
                _ckpt.commit(directory, world, overwrite=overwrite)
            except Exception as e:  # noqa: BLE001
                error = e
        self._agree(error, what)
        return nbytes

    @torch.no_grad()
    def save(self, directory: str | os.PathLike, *, overwrite: bool = False) -> int:
        """Writes the EMA weights as a sharded checkpoint directory (``fsdp_ema.checkpoint``
        format: one safetensors file per rank, the index written last by rank 0 once every rank
        has written its file). Collective. A failure on any rank raises on every rank and leaves
        no index. Names are clean FQNs; the step is not saved (use ``state_dict()`` for that).
        Returns the bytes of this rank's file."""
        return self._save(directory, self._ema, overwrite, "ShardedEMA.save")

    @torch.no_grad()
    def save_shard_weights(self, directory: str | os.PathLike, *,
                           overwrite: bool = False) -> int:
        """Writes the model's own weights (same tensors as the EMA, same format)."""
        return self._save(directory, self._refresh(), overwrite, "ShardedEMA.save_shard_weights")

    def save_ema_shard_weights(self, directory: str | os.PathLike, *,
                               overwrite: bool = False) -> int:
        """Alias of ``save`` (the name of the common ShardEMAModel recipe)."""
        return self.save(directory, overwrite=overwrite)

    @torch.no_grad()
    def load(self, directory: str | os.PathLike, *, strict: bool = True,
             verify: bool = True) -> None:
        """Loads EMA weights from a checkpoint directory written at any world size (``save``,
        ``save_shard_weights``, ``fsdp_ema.checkpoint`` or DCP's HuggingFace writer). Each rank
        reads only the rows it keeps where the layout allows. Collective."""
        directory = os.fspath(directory)
        what = f"ShardedEMA.load({directory!r})"
        # Everything that can fail (reading the index, names, shapes, dtypes, data, checksums)
        # happens on every rank before the agreement; the EMA is written only after it, so one
        # rank's failure raises everywhere and leaves every rank's EMA as it was.
        values, error = [], None
        try:
            info = _ckpt.info(directory)
            available = {k: torch.Size(v["shape"]) for k, v in info["tensors"].items()}
            self._check_names(available, strict, "load")
            requests: dict[tuple[int, int], list[str]] = defaultdict(list)
            for slot in self._slots:
                for fqn, _ in slot.names():
                    if fqn in available:
                        requests[slot.file_request()].append(fqn)
            loaded = {}
            for (rank, world), names in requests.items():
                loaded.update(_ckpt.load(directory, names, rank=rank, world_size=world,
                                         verify=verify))
            for slot, ema in zip(self._slots, self._ema):
                for fqn, _ in slot.names():
                    if fqn in loaded:
                        check_dtype_kind(fqn, loaded[fqn].dtype, ema.dtype)
            values = [{fqn: slot.from_file(fqn, loaded[fqn])
                       for fqn, _ in slot.names() if fqn in loaded} for slot in self._slots]
        except Exception as e:  # noqa: BLE001
            error = e
        self._agree(error, what)
        for slot, ema, v in zip(self._slots, self._ema, values):
            slot.assign(ema, v)

    def __repr__(self) -> str:
        kinds = defaultdict(int)
        for slot in self._slots:
            kinds[type(slot).__name__.lstrip("_").lower()] += 1
        schedule = f"decay={self.decay}"
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
