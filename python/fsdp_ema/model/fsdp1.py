"""FSDP1 FlatParameter layout: from the 1-D slice of a FlatParameter each rank holds to the dim-0
chunks (torch.chunk rows) that state dicts and checkpoint files name, and back.

FSDP1 concatenates a unit's parameters (with alignment padding when ``use_orig_params=True``) into
one flat vector, pads it to a multiple of the world size and gives rank ``r`` the elements
``[r * S, (r + 1) * S)``. An EMA of that slice is exact and costs one tensor per unit, but a
parameter's dim-0 chunk for rank ``q`` generally lives on other ranks. ``to_chunks`` and
``from_chunks`` move exactly those elements with one ``all_to_all_single`` per unit: no rank ever
holds more than its slice and its chunks (no all-gather of the unit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..distributed.groups import comm_device
from .layouts import chunk_rows


class Member(NamedTuple):
    """One original parameter of a FlatParameter."""

    fqn: str            # clean fully qualified name
    shape: torch.Size   # global shape
    start: int          # offset of its first element in the (padded) flat parameter


class _Piece(NamedTuple):
    flat_rank: int      # rank whose flat slice holds these elements
    chunk_rank: int     # rank whose dim-0 chunk holds them
    member: int         # index into members
    begin: int          # flat offsets [begin, end)
    end: int


class FlatLayout:
    """Where the members of one FlatParameter live, in the flat slices and in the dim-0 chunks."""

    def __init__(self, flat_param, handle, fqns: Sequence[str]):
        self.group: dist.ProcessGroup = handle.process_group
        self.rank: int = handle.rank
        self.world_size: int = handle.world_size
        self.sharded: bool = bool(handle.uses_sharded_strategy)
        self.strategy: str = handle._sharding_strategy.name
        self.shard_numel: int = int(flat_param._sharded_size.numel())
        starts, offset = [], 0
        for numel, is_padding in zip(flat_param._numels_with_padding, flat_param._is_padding_mask):
            if not is_padding:
                starts.append(offset)
            offset += numel
        self.members: list[Member] = [
            Member(fqn, torch.Size(shape), start)
            for fqn, shape, start in zip(fqns, flat_param._shapes, starts)]
        self._check_against_fsdp(flat_param)

    def _check_against_fsdp(self, flat_param) -> None:
        # Our offsets must agree with FSDP's own record of what this rank's slice holds.
        lo = self.rank * self.shard_numel if self.sharded else 0
        for member, info in zip(self.members, flat_param._shard_param_infos):
            if not info.in_shard:
                continue
            if member.start + info.intra_param_start_idx - lo != info.offset_in_shard:
                raise RuntimeError(
                    f"ShardedEMA: unexpected FSDP1 FlatParameter layout for {member.fqn!r}: "
                    f"this torch version lays out flat parameters differently than expected")

    def require_sharded(self, what: str, hybrid: bool = True) -> None:
        # NO_SHARD replicates the flat parameter (its own slot, FlatReplicatedSlot); the HYBRID
        # strategies shard it within a replica group (the unit's group): chunks, gathers and
        # checkpoint pieces work within it (``hybrid``), ShardedTensor state dicts do not.
        if not self.sharded or (not hybrid and "HYBRID" in self.strategy):
            raise NotImplementedError(
                f"ShardedEMA.{what}: FSDP1 units with sharding strategy {self.strategy} are not "
                f"supported (update, swap, save, load and export are); use FULL_SHARD or "
                f"SHARD_GRAD_OP, or FSDP2")

    # --- which rank holds what -----------------------------------------------------------------

    def chunk(self, member: Member, rank: int) -> tuple[int, int]:
        """Flat offsets of ``rank``'s dim-0 chunk of ``member`` (a 0-dim member: all of it)."""
        if len(member.shape) == 0:
            return member.start, member.start + 1
        begin, end = chunk_rows(member.shape[0], rank, self.world_size)
        row = math.prod(member.shape[1:])
        return member.start + begin * row, member.start + end * row

    def chunk_shape(self, member: Member, rank: int) -> torch.Size:
        if len(member.shape) == 0:
            return member.shape
        begin, end = chunk_rows(member.shape[0], rank, self.world_size)
        return torch.Size([end - begin, *member.shape[1:]])

    def _pieces(self, scalar_owners: Sequence[int],
                indices: Sequence[int] | None = None) -> list[_Piece]:
        """Every intersection of a chunk with a flat slice, for the members ``indices`` (all by
        default). A 0-dim member's chunk holders are ``scalar_owners`` (every rank when
        gathering, one rank when scattering back)."""
        pieces, size = [], self.shard_numel
        for index in range(len(self.members)) if indices is None else indices:
            member = self.members[index]
            owners = scalar_owners if len(member.shape) == 0 else range(self.world_size)
            for q in owners:
                begin, end = self.chunk(member, q)
                if begin == end:
                    continue
                for r in range(begin // size, (end - 1) // size + 1):
                    lo, hi = max(begin, r * size), min(end, (r + 1) * size)
                    pieces.append(_Piece(r, q, index, lo, hi))
        return pieces

    # --- moving data -----------------------------------------------------------------------------

    def _all_to_all(self, sends: list[torch.Tensor], send_counts: list[int],
                    recv_counts: list[int], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
        """One all_to_all_single of raw bytes (any dtype, any backend)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        dev = comm_device(self.group, device)
        send = (torch.cat([s.reshape(-1) for s in sends]) if sends
                else torch.empty(0, dtype=dtype, device=device))
        send = send.to(dev).view(torch.uint8)
        recv = torch.empty(sum(recv_counts) * itemsize, dtype=torch.uint8, device=dev)
        dist.all_to_all_single(recv, send, [c * itemsize for c in recv_counts],
                               [c * itemsize for c in send_counts], group=self.group)
        return recv.view(dtype).to(device)

    def to_chunks(self, flat_slice: torch.Tensor,
                  indices: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Collective over the unit's group: this rank's dim-0 chunk of every member (0-dim
        members whole, on every rank), from every rank's flat slice. With ``indices`` (increasing
        member indices, the same on every rank), only those members' chunks, so that the
        transient buffers scale with them rather than with the unit."""
        self.require_sharded("state_dict/save")
        members = (self.members if indices is None
                   else [self.members[i] for i in indices])
        pieces = self._pieces(range(self.world_size), indices)
        me, base = self.rank, self.rank * self.shard_numel
        sends = sorted((p for p in pieces if p.flat_rank == me),
                       key=lambda p: (p.chunk_rank, p.begin))
        send_counts = [0] * self.world_size
        for p in sends:
            send_counts[p.chunk_rank] += p.end - p.begin
        recv_counts = [0] * self.world_size
        for p in pieces:
            if p.chunk_rank == me:
                recv_counts[p.flat_rank] += p.end - p.begin
        recv = self._all_to_all([flat_slice[p.begin - base:p.end - base] for p in sends],
                                send_counts, recv_counts, flat_slice.dtype, flat_slice.device)
        # Received in flat order, which is member order: split it into the chunks.
        sizes = [self.chunk_shape(m, me).numel() for m in members]
        return [part.view(self.chunk_shape(m, me))
                for part, m in zip(torch.split(recv, sizes), members)]

    def from_chunks(self, chunks: Sequence[torch.Tensor], flat_slice: torch.Tensor) -> None:
        """Collective over the unit's group: writes every rank's dim-0 chunks of the members into
        the flat slices (the inverse of ``to_chunks``). Padding elements are left as they are."""
        self.require_sharded("load_state_dict/load")
        pieces = self._pieces([0])
        me, base = self.rank, self.rank * self.shard_numel
        sends = sorted((p for p in pieces if p.chunk_rank == me),
                       key=lambda p: (p.flat_rank, p.begin))
        send_counts = [0] * self.world_size
        send_tensors = []
        for p in sends:
            begin, _ = self.chunk(self.members[p.member], me)
            send_tensors.append(chunks[p.member].reshape(-1)[p.begin - begin:p.end - begin])
            send_counts[p.flat_rank] += p.end - p.begin
        recvs = sorted((p for p in pieces if p.flat_rank == me),
                       key=lambda p: (p.chunk_rank, p.begin))
        recv_counts = [0] * self.world_size
        for p in recvs:
            recv_counts[p.chunk_rank] += p.end - p.begin
        dtype = flat_slice.dtype
        recv = self._all_to_all([t.to(dtype) for t in send_tensors], send_counts, recv_counts,
                                dtype, flat_slice.device)
        pos = 0
        for p in recvs:
            n = p.end - p.begin
            flat_slice[p.begin - base:p.end - base].copy_(recv[pos:pos + n])
            pos += n


def sharded_tensor(chunk: torch.Tensor, global_shape: torch.Size, rank: int, world_size: int,
                   group: dist.ProcessGroup):
    """A ShardedTensor over dim-0 chunks (torch.chunk rows), built without communication, as
    FSDP1's SHARDED_STATE_DICT makes them."""
    from torch.distributed._shard.sharded_tensor import (
        Shard,
        ShardedTensor,
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharding_spec import ShardMetadata

    rows = global_shape[0]
    rest = [0] * (len(global_shape) - 1)
    metadata: list[ShardMetadata] = []
    local: list[Shard] = []
    for q in range(world_size):
        begin, end = chunk_rows(rows, q, world_size)
        if end == begin:
            continue  # torch.chunk drops trailing empty chunks; so does FSDP
        device = str(chunk.device) if q == rank else _placement_device(chunk.device, q)
        placement = f"rank:{dist.get_global_rank(group, q)}/{device}"
        metadata.append(ShardMetadata([begin, *rest], [end - begin, *global_shape[1:]], placement))
        if q == rank:
            local.append(Shard.from_tensor_and_offsets(chunk, [begin, *rest], dist.get_rank()))
    properties = TensorProperties(dtype=chunk.dtype, layout=chunk.layout, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, sharded_tensor_metadata=ShardedTensorMetadata(metadata, global_shape, properties),
        process_group=group)


def _placement_device(device: torch.device, rank: int) -> str:
    if device.type == "cpu":
        return "cpu"
    count = torch.accelerator.device_count() or 1
    return f"{device.type}:{rank % count}"
