"""One tensor's layout: which piece of it this rank writes, what it reads back, and where.

``Layout`` (one per tensor, made by ``layout_of`` from a state-dict value, or by ``whole``,
``on_mesh`` and ``rows`` from a slot's tensor) is the one route by which a tensor reaches a
checkpoint and comes back: ``ShardedEMA.save``/``load`` (through its slots), the training state,
and the full-state gather. A piece is what ``fsdp_ema.checkpoint.save_shard`` takes: a whole
tensor, or ``(local, global_offsets, global_shape)``; every element of a tensor is written by
exactly one rank (the commit refuses overlaps). A read is a ``ReadRequest``: ``(rank,
world_size)`` for ``fsdp_ema.checkpoint.load`` (``torch.chunk`` dim-0 rows of any world size,
``(0, 1)`` for the whole tensor) plus, for a whole-tensor read that is not this rank's layout, the
box to cut out; ``store.collective.load_collective`` reads the ``LoadTarget``s made of them. The row
rule itself is C++'s (``fsdp_ema/format/rows.h``), reached through the ``chunk_rows`` op.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import _ops


@functools.lru_cache(maxsize=1 << 16)
def chunk_rows(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[begin, end)`` of ``torch.chunk(t, world_size)[rank]`` (empty past the last chunk):
    FSDP2's ``Shard(0)`` layout, FSDP1's sharded state dict layout and the layout
    ``fsdp_ema.checkpoint.load`` returns. The ``chunk_rows`` op's answer (format/core/rows.cpp),
    cached: a training state asks for the same few row counts thousands of times."""
    begin, end = _ops.chunk_rows(rows, rank, world_size)
    return begin, end


class Part(NamedTuple):
    """One full tensor to produce. ``kind``: ``"full"`` (``value`` is already the full tensor),
    ``"rows"`` (``value`` holds this rank's torch.chunk rows: gathered), ``"flat"`` (the rows
    come from the FSDP1 exchange of ``slot``'s member ``member`` out of the flat slice
    ``value``; a 0-dim member needs no gather), ``"dtensor"`` (``value()`` makes a DTensor of
    another layout, only when its turn comes: ``full_tensor()``)."""

    fqn: str
    shape: torch.Size
    dtype: torch.dtype
    kind: str
    value: Any
    group: Any = None       # the process group of "rows" and "flat" parts
    cost: int = 0           # bytes one bucket holds for it (see model.layouts.part_cost)
    slot: Any = None
    member: int = -1


def part_cost(shape: torch.Size, dtype: torch.dtype, world: int) -> int:
    """Transient bytes gathering one tensor takes on its device, the same on every rank: the
    full output, this rank's input rows (at most rank 0's: the row rule's ``ceil(rows /
    world)``), and gather_shards' packed send buffer and ``world`` times larger receive buffer
    (pieces aligned to ``_ops.gather_align()``)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(shape) == 0:
        return 2 * itemsize
    row = math.prod(shape[1:]) * itemsize
    begin, end = chunk_rows(shape[0], 0, world)
    chunk = (end - begin) * row + _ops.gather_align()
    return shape.numel() * itemsize + (world + 2) * chunk


@functools.cache
def _types() -> tuple[type, type]:
    """DTensor and ShardedTensor, imported once: the checks below run per tensor (100,000+ in a
    training state), and an import statement costs microseconds even when cached."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    return DTensor, ShardedTensor


def is_dtensor(v) -> bool:
    return isinstance(v, _types()[0])


def is_sharded_tensor(v) -> bool:
    return isinstance(v, _types()[1])


def box(t: torch.Tensor, offsets: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """The ``shape`` box of ``t`` starting at ``offsets``."""
    for dim, (begin, size) in enumerate(zip(offsets, shape)):
        t = t.narrow(dim, begin, size)
    return t


# --- placements ----------------------------------------------------------------------------------

def is_shard(p) -> bool:
    """A placement that splits a tensor dim: ``Shard`` or ``_StridedShard`` (FSDP2 over a TP
    ``Shard`` of the same dim), which is not a ``Shard`` subclass."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(p, (Shard, _StridedShard))


def check_placements(name: str, placements: Sequence[Any], mesh=None) -> None:
    """Shard and Replicate anywhere; ``_StridedShard(d, split_factor=k)`` only as FSDP2 lays it
    out over tensor parallelism: a later mesh dim of size ``k`` holds ``Shard(d)``, so each
    rank's piece is one box of the tensor (rows of one TP chunk), as ``compute_local_shape_and_
    global_offset`` gives it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for i, p in enumerate(placements):
        if isinstance(p, (Shard, Replicate)):
            continue
        if isinstance(p, _StridedShard) and mesh is not None:
            later = [j for j in range(i + 1, len(placements))
                     if type(placements[j]) is Shard and placements[j].dim == p.dim]
            if len(later) == 1 and mesh.size(later[0]) == p.split_factor:
                continue
        raise ValueError(f"{name!r} has placements {tuple(placements)}: {p} is not supported "
                         f"(Shard, Replicate, and _StridedShard as FSDP2 over tensor-parallel "
                         f"Shard of the same dim are)")


# --- what a rank reads --------------------------------------------------------------------------

class ReadRequest(NamedTuple):
    """``request``: ``(rank, world_size)`` for ``fsdp_ema.checkpoint.load``; ``box``:
    ``(offsets, shape)`` to cut out of a whole tensor read, or None."""

    request: tuple[int, int]
    box: tuple[list[int], list[int]] | None = None

    def take(self, loaded: torch.Tensor) -> torch.Tensor:
        return loaded if self.box is None else box(loaded, *self.box)


class LoadTarget(NamedTuple):
    """One tensor of a collective load. ``name`` and ``shape`` (global) as the checkpoint must hold
    them; ``dtype``: of the tensor the values go to (the stored dtype must be of its kind);
    ``read``: what this rank reads (``ReadRequest``), or None where it holds none of it (then only
    name, shape and dtype are checked); ``dest``: the tensor filled in place, or None to have the
    checked values returned to the caller (FSDP1 flat parameters, whose layout is not one the
    checkpoint can be read into)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    read: ReadRequest | None
    dest: torch.Tensor | None = None


# --- one tensor's layout --------------------------------------------------------------------------

class Layout:
    """One tensor's layout on this rank: ``name``, global ``shape``, ``dtype`` and ``local``, this
    rank's storage of it (None where it holds none). ``piece(rank)`` is what this rank writes of
    it, ``read()`` what it reads back (``target()``: the same as a ``LoadTarget`` filling
    ``local`` in place), ``assign(value)`` writes a read value into ``local``. Made by
    ``layout_of`` (a state-dict value), ``whole``, ``on_mesh`` or ``rows``."""

    def __init__(self, name: str, shape: torch.Size, dtype: torch.dtype,
                 local: torch.Tensor | None):
        self.name, self.shape, self.dtype, self.local = name, torch.Size(shape), dtype, local

    def piece(self, rank: int) -> dict[str, Any]:
        """``{name: piece}`` (``save_shard``'s input) or ``{}``. ``rank``: this rank among the
        ranks that hold the tensor alike (the save's rank; an FSDP1 unit's rank in its group):
        rank 0 writes what is written whole (a 0-dim or empty tensor)."""
        raise NotImplementedError

    def read(self) -> ReadRequest | None:
        """What this rank reads into ``local``, or None where it holds none of the tensor."""
        raise NotImplementedError

    def target(self) -> LoadTarget:
        """The read as one tensor of a collective load (``store.collective.load_collective``)."""
        return LoadTarget(self.name, self.shape, self.dtype, self.read(), self.local)

    def assign(self, value: torch.Tensor) -> None:
        """Writes ``value`` (``read().take`` of what the checkpoint gave) into ``local``."""
        self.local.copy_(value)

    def full_part(self) -> Part:
        """How ``full_state_dict``, ``export`` and the PEFT exports produce the full tensor
        (``store.full_state.Part``): as it is here, by default."""
        return Part(self.name, self.shape, self.dtype, "full", self.local)


class _Whole(Layout):
    """A tensor every rank holds whole: the first ``writers`` ranks share its ``torch.chunk``
    rows (``writers=1``: rank 0 writes it all); a 0-dim or empty one comes whole from rank 0."""

    def __init__(self, name: str, t: torch.Tensor, writers: int):
        super().__init__(name, t.shape, t.dtype, t)
        self.writers = writers

    def piece(self, rank):
        t = self.local
        if t.dim() == 0 or t.numel() == 0:
            return {self.name: t} if rank == 0 else {}
        if rank >= self.writers:
            return {}
        begin, end = chunk_rows(t.shape[0], rank, self.writers)
        return _rows_piece(self.name, t[begin:end], begin, t.shape)

    def read(self):
        return ReadRequest((0, 1))


class _OnMesh(Layout):
    """A DTensor's local shard ``local`` on ``mesh`` with ``placements`` (any mesh: FSDP2, HSDP,
    tensor parallelism)."""

    def __init__(self, name: str, local: torch.Tensor, mesh, placements: Sequence[Any],
                 shape: torch.Size, stride: Sequence[int] | None = None):
        super().__init__(name, shape, local.dtype, local)
        self.mesh, self.placements, self.stride = mesh, tuple(placements), stride
        self.coordinate = mesh.get_coordinate()  # None: not in the mesh

    def piece(self, rank):
        """Its box where this rank is the first replica and the box holds elements; a 0-dim or
        empty tensor whole, from mesh coordinate 0 only."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        name, local, shape, coordinate = self.name, self.local, self.shape, self.coordinate
        if coordinate is None:
            return {}
        check_placements(name, self.placements, self.mesh)
        if len(shape) == 0 or shape.numel() == 0:
            if any(coordinate):
                return {}
            return {name: local if len(shape) == 0 else torch.empty(shape, dtype=local.dtype)}
        if any(c for c, p in zip(coordinate, self.placements) if not is_shard(p)):
            return {}  # another replica writes it
        if local.numel() == 0:
            return {}
        local_shape, offsets = compute_local_shape_and_global_offset(shape, self.mesh,
                                                                     self.placements)
        if tuple(local_shape) != tuple(local.shape):
            raise RuntimeError(f"{name!r}: local shard {list(local.shape)} where the placements "
                               f"{self.placements} imply {list(local_shape)}")
        return {name: (local, list(offsets), list(shape))}

    def read(self):
        """Its ``torch.chunk`` rows where it is sharded on dim 0 over one mesh dimension (FSDP2;
        other mesh dimensions replicate), else the whole tensor and the local box (offsets of an
        empty shard clamped to the size, as the index stores them)."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, mesh, placements = self.shape, self.mesh, self.placements
        coordinate = self.coordinate
        if coordinate is None:
            return None
        shards = [i for i, p in enumerate(placements) if is_shard(p)]
        if (len(shape) > 0 and len(shards) == 1 and type(placements[shards[0]]) is Shard
                and placements[shards[0]].dim == 0):
            k, n = coordinate[shards[0]], mesh.size(shards[0])
            begin, end = chunk_rows(shape[0], k, n)
            if list(self.local.shape) == [end - begin, *shape[1:]]:
                return ReadRequest((k, n))
        if len(shape) == 0:
            return ReadRequest((0, 1))
        _, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        return ReadRequest((0, 1), ([min(o, s) for o, s in zip(offsets, shape)],
                                    list(self.local.shape)))

    def full_part(self):
        """Whole where it is (0-dim, replicated); gathered as ``torch.chunk`` rows over the
        sharded mesh dimension where ``read`` reads rows; else ``full_tensor()`` of the DTensor,
        made only when its turn comes (for a host tensor, a device copy)."""
        from torch.distributed.tensor import Replicate, Shard

        name, shape, local = self.name, self.shape, self.local
        if shape.numel() == 0:
            return Part(name, shape, self.dtype, "full", local.new_empty(shape))
        if len(shape) == 0 or all(isinstance(p, Replicate) for p in self.placements):
            return Part(name, shape, self.dtype, "full", local)
        read = self.read()
        if read is not None and read.box is None:
            dim = next(i for i, p in enumerate(self.placements) if isinstance(p, Shard))
            return Part(name, shape, self.dtype, "rows", local, self.mesh.get_group(dim),
                        part_cost(shape, self.dtype, read.request[1]))
        return Part(name, shape, self.dtype, "dtensor", self.dtensor)

    def dtensor(self):
        """The local shard as a DTensor on the mesh's device (a device copy of a host tensor),
        for collectives over the mesh; shape and stride explicit (``from_local`` would infer a
        wrong global shape from an uneven or empty local shard)."""
        from torch.distributed.tensor import DTensor

        stride = (self.stride if self.stride is not None
                  else torch.empty(self.shape, device="meta").stride())
        return DTensor.from_local(self.local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=stride)


class _Rows(Layout):
    """A local shard at ``offsets`` (a ShardedTensor's, or an FSDP1 flat-parameter member's
    ``torch.chunk`` rows after the unit's exchange); ``writes``: False on all but the first
    replica (FSDP1 HYBRID_SHARD); ``position``: ``(rank, world_size)`` of the rows, or the
    process group that gives it (asked only on a read)."""

    def __init__(self, name: str, shape: torch.Size, dtype: torch.dtype,
                 local: torch.Tensor | None, offsets: Sequence[int], position, *,
                 writes: bool = True):
        super().__init__(name, shape, dtype, local)
        self.offsets, self.position, self.writes = list(offsets), position, writes

    def piece(self, rank):
        shape, local = self.shape, self.local
        if not self.writes:
            return {}
        if len(shape) == 0:
            return {self.name: local} if rank == 0 else {}
        if shape.numel() == 0:
            return {self.name: torch.empty(shape, dtype=self.dtype)} if rank == 0 else {}
        if local is None or local.numel() == 0:
            return {}
        return {self.name: (local, self.offsets, list(shape))}

    def full_part(self):
        # Rows alone do not say where the rest lives: an FSDP1 unit's members are gathered
        # through the unit's exchange (``_slots._Flat.full_parts``).
        raise NotImplementedError(f"{self.name!r}: the full tensor of a row layout is gathered "
                                  f"by its owner (an FSDP1 unit), not by the layout")

    def read(self):
        """Its ``torch.chunk`` rows where it is laid out that way, else the whole tensor and the
        box."""
        if self.local is None or self.local.numel() == 0:
            return None
        shape, offsets = self.shape, self.offsets
        if len(shape) == 0:
            return ReadRequest((0, 1))
        if isinstance(self.position, tuple):
            rank, world = self.position
        else:
            rank, world = dist.get_rank(self.position), dist.get_world_size(self.position)
        begin, end = chunk_rows(shape[0], rank, world)
        if (offsets[0] == begin and not any(offsets[1:])
                and list(self.local.shape) == [end - begin, *shape[1:]]):
            return ReadRequest((rank, world))
        return ReadRequest((0, 1), (offsets, list(self.local.shape)))


def _rows_piece(name: str, rows: torch.Tensor, begin: int, shape: Sequence[int]) -> dict[str, Any]:
    if rows.numel() == 0:
        return {}
    return {name: (rows, [begin] + [0] * (rows.dim() - 1), list(shape))}


def whole(name: str, t: torch.Tensor, *, writers: int = 1) -> Layout:
    """A tensor every rank holds whole (plain models, DDP, buffers, FSDP1 NO_SHARD members)."""
    return _Whole(name, t, writers)


def on_mesh(name: str, local: torch.Tensor, mesh, placements: Sequence[Any],
            shape: torch.Size, stride: Sequence[int] | None = None) -> Layout:
    """A DTensor's local shard (the DTensor itself, or another tensor laid out as it is);
    ``stride``: the global stride, if known (else computed when a DTensor is made)."""
    return _OnMesh(name, local, mesh, placements, shape, stride)


def rows(name: str, local: torch.Tensor, shape: torch.Size, rank: int, world: int, *,
         writes: bool = True) -> Layout:
    """Rank ``rank``'s ``torch.chunk`` rows of ``world`` (an FSDP1 flat-parameter member after the
    unit's exchange; a 0-dim member whole)."""
    begin = chunk_rows(shape[0], rank, world)[0] if len(shape) else 0
    return _Rows(name, shape, local.dtype, local, [begin] + [0] * max(len(shape) - 1, 0),
                 (rank, world), writes=writes)


def _sharded_tensor(name: str, value) -> Layout:
    shape = torch.Size(value.size())
    shards = [s for s in value.local_shards() if s.tensor.numel() > 0]
    if len(shards) > 1:
        raise ValueError(f"{name!r}: a ShardedTensor with {len(shards)} local shards on one "
                         f"rank is not supported")
    if not shards:
        return _Rows(name, shape, value.dtype, None, [], value._process_group)
    shard = shards[0]
    return _Rows(name, shape, shard.tensor.dtype, shard.tensor, shard.metadata.shard_offsets,
                 value._process_group)


def layout_of(name: str, value) -> Layout:
    """The layout of a state-dict value: a DTensor (any mesh), a ShardedTensor (FSDP1 state
    dicts) or a plain tensor every rank holds (rank 0 writes it)."""
    if is_dtensor(value):
        return _OnMesh(name, value._local_tensor, value.device_mesh, tuple(value.placements),
                       torch.Size(value.shape))
    if is_sharded_tensor(value):
        return _sharded_tensor(name, value)
    if isinstance(value, torch.Tensor):
        return _Whole(name, value, writers=1)
    raise TypeError(f"{name!r}: not a tensor ({type(value).__name__})")
