"""Tensor layouts: which piece of a tensor this rank writes, and what it asks the checkpoint for.

One module for both directions, used by ``ShardedEMA`` (its slots), the training state and the
export. A piece is what ``fsdp_ema.checkpoint.save_shard`` takes: a whole tensor, or
``(local, global_offsets, global_shape)``; every element of a tensor is written by exactly one
rank (the commit refuses overlaps). A read request is ``(rank, world_size)`` for
``fsdp_ema.checkpoint.load`` (``torch.chunk`` dim-0 rows of any world size, ``(0, 1)`` for the
whole tensor) plus, for a whole-tensor read that is not this rank's layout, the box to cut out;
``_collective.load_collective`` reads them. The row rule itself is C++'s
(``fsdp_ema/format/rows.h``), mirrored by ``chunk_rows``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch


def chunk_rows(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[begin, end)`` of ``torch.chunk(t, world_size)[rank]`` (empty past the last chunk).

    This is FSDP2's ``Shard(0)`` layout, FSDP1's sharded state dict layout and the layout
    ``fsdp_ema.checkpoint.load`` returns.
    """
    size = -(-rows // world_size)
    begin = min(rank * size, rows)
    return begin, min(begin + size, rows)


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


# --- pieces this rank writes ----------------------------------------------------------------------

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


def dtensor_pieces(name: str, local: torch.Tensor, mesh, placements: Sequence[Any],
                   shape: torch.Size) -> dict[str, Any]:
    """The piece of a DTensor (local shard ``local`` on ``mesh`` with ``placements``, global
    ``shape``) this rank writes: its box where this rank is the first replica and the box holds
    elements; a 0-dim or empty tensor whole, from mesh coordinate 0 only."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not in the mesh
        return {}
    check_placements(name, placements, mesh)
    if len(shape) == 0 or shape.numel() == 0:
        if any(coordinate):
            return {}
        return {name: local if len(shape) == 0 else torch.empty(shape, dtype=local.dtype)}
    if any(c for c, p in zip(coordinate, placements) if not is_shard(p)):
        return {}  # another replica writes it
    if local.numel() == 0:
        return {}
    local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    if tuple(local_shape) != tuple(local.shape):
        raise RuntimeError(f"{name!r}: local shard {list(local.shape)} where the placements "
                           f"{tuple(placements)} imply {list(local_shape)}")
    return {name: (local, list(offsets), list(shape))}


def rows_piece(name: str, rows: torch.Tensor, begin: int, shape: Sequence[int]) -> dict[str, Any]:
    """Dim-0 rows ``[begin, begin + len(rows))`` of a tensor of global ``shape`` (nothing for
    no rows)."""
    if rows.numel() == 0:
        return {}
    return {name: (rows, [begin] + [0] * (rows.dim() - 1), list(shape))}


def replicated_pieces(name: str, t: torch.Tensor, rank: int, writers: int) -> dict[str, Any]:
    """The piece of a tensor every rank holds whole: the first ``writers`` ranks share its
    ``torch.chunk`` rows (``writers=1``: rank 0 writes it all); a 0-dim or empty one comes whole
    from rank 0."""
    if t.dim() == 0 or t.numel() == 0:
        return {name: t} if rank == 0 else {}
    if rank >= writers:
        return {}
    begin, end = chunk_rows(t.shape[0], rank, writers)
    return rows_piece(name, t[begin:end], begin, t.shape)


def sharded_tensor_pieces(name: str, value, rank: int) -> dict[str, Any]:
    """The piece of a ShardedTensor (FSDP1 state dicts) this rank writes: its one non-empty local
    shard; an empty tensor whole from rank 0."""
    shape = list(value.size())
    if math.prod(shape) == 0:
        return {name: torch.empty(shape, dtype=value.dtype)} if rank == 0 else {}
    shards = [s for s in value.local_shards() if s.tensor.numel() > 0]
    if len(shards) > 1:
        raise ValueError(f"{name!r}: a ShardedTensor with {len(shards)} local shards on one "
                         f"rank is not supported")
    if not shards:
        return {}
    return {name: (shards[0].tensor, list(shards[0].metadata.shard_offsets), shape)}


def pieces_of(name: str, value, rank: int) -> dict[str, Any]:
    """What this rank writes of a state-dict value: a DTensor, a ShardedTensor, or a plain tensor
    every rank holds (rank 0 writes it)."""
    if is_dtensor(value):
        return dtensor_pieces(name, value._local_tensor, value.device_mesh,
                              tuple(value.placements), torch.Size(value.shape))
    if is_sharded_tensor(value):
        return sharded_tensor_pieces(name, value, rank)
    if isinstance(value, torch.Tensor):
        return replicated_pieces(name, value, rank, writers=1)
    raise TypeError(f"{name!r}: not a tensor ({type(value).__name__})")


# --- what this rank reads -------------------------------------------------------------------------

class ReadRequest(NamedTuple):
    """``request``: ``(rank, world_size)`` for ``fsdp_ema.checkpoint.load``; ``box``:
    ``(offsets, shape)`` to cut out of a whole tensor read, or None."""

    request: tuple[int, int]
    box: tuple[list[int], list[int]] | None = None

    def take(self, loaded: torch.Tensor) -> torch.Tensor:
        return loaded if self.box is None else box(loaded, *self.box)


def dtensor_read(mesh, placements: Sequence[Any], shape: torch.Size,
                 local_shape: torch.Size) -> ReadRequest:
    """The read of a DTensor's local shard: its ``torch.chunk`` rows where it is sharded on dim
    0 over one mesh dimension (FSDP2; other mesh dimensions replicate), else the whole tensor and
    the local box (offsets of an empty shard clamped to the size, as the index stores them)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    coordinate = mesh.get_coordinate()
    shards = [i for i, p in enumerate(placements) if is_shard(p)]
    if (len(shape) > 0 and coordinate is not None and len(shards) == 1
            and type(placements[shards[0]]) is Shard and placements[shards[0]].dim == 0):
        k, n = coordinate[shards[0]], mesh.size(shards[0])
        begin, end = chunk_rows(shape[0], k, n)
        if list(local_shape) == [end - begin, *shape[1:]]:
            return ReadRequest((k, n))
    if len(shape) == 0:
        return ReadRequest((0, 1))
    _, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return ReadRequest((0, 1), ([min(o, s) for o, s in zip(offsets, shape)], list(local_shape)))


def sharded_tensor_read(shape: torch.Size, offsets: Sequence[int], local_shape: torch.Size,
                        rank: int, world: int) -> ReadRequest:
    """The read of a ShardedTensor's local shard at ``offsets``: ``torch.chunk`` rows where it is
    laid out that way, else the whole tensor and the box."""
    begin, end = chunk_rows(shape[0], rank, world)
    if (offsets[0] == begin and not any(offsets[1:])
            and list(local_shape) == [end - begin, *shape[1:]]):
        return ReadRequest((rank, world))
    return ReadRequest((0, 1), (list(offsets), list(local_shape)))
