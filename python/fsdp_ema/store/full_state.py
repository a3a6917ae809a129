"""Full (unsharded) tensors of the EMA in bounded buckets, and the consolidated export.

``full_buckets`` yields the full tensors a bucket at a time, gathered with
the ``gather_shards`` op (one all-gather per bucket; FSDP1 members first through one
all_to_all per unit); ``export`` streams them into the library's ``ExportWriter``, the
same writer ``fsdp-ema export`` uses (format::ExportWriter), so both give byte-identical files.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .. import _ops
from ..distributed.groups import broadcast_int, comm_device, raise_if_any_rank_failed, rank_world
from ..model.layouts import Part

#: Default ``bucket_bytes`` of ``full_state_dict``, ``export`` and ``posthoc``.
DEFAULT_BUCKET_BYTES = 256 << 20
#: Default ``max_file_bytes`` of ``export`` (tensor data per file; Hugging Face's 5 GB).
DEFAULT_MAX_FILE_BYTES = 5 * 1000**3


def gather_bucket(bucket: list[Part]) -> list[torch.Tensor]:
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
        gathered = _ops.gather_shards([rows[i].to(dev) for i in gather],
                                      [bucket[i].shape[0] for i in gather], group.group_name)
        for i, t in zip(gather, gathered):
            out[i] = t.to(device)
    return out


def full_buckets(parts: Sequence[Part],
                  bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor, bool]]]:
    """Collective (every rank runs the same sequence): ``(fqn, full tensor, fresh)`` a bucket
    at a time; ``fresh`` is False where the tensor is (a view of) the EMA itself. Drop each
    bucket before asking for the next, or the buckets add up.

    Parts that need a gather are grouped in order into buckets of one process group whose
    ``cost`` (``model.layouts.part_cost``) adds up to at most ``bucket_bytes`` (a part costing
    more is a bucket of its own; a bucket also holds tensors of one device only). Parts already
    full come as they are, in buckets of their own.
    """
    pending: list[Part] = []
    pending_cost = 0
    for p in parts:
        if p.kind == "full":
            yield [(p.fqn, p.value, False)]
            continue
        if p.kind == "dtensor":
            yield [(p.fqn, p.value().full_tensor(), True)]
            continue
        if pending and (pending_cost + p.cost > bucket_bytes
                        or p.group.group_name != pending[0].group.group_name
                        or p.value.device != pending[0].value.device):
            yield [(q.fqn, t, True) for q, t in zip(pending, gather_bucket(pending))]
            pending, pending_cost = [], 0
        pending.append(p)
        pending_cost += p.cost
    if pending:
        yield [(q.fqn, t, True) for q, t in zip(pending, gather_bucket(pending))]


def export(parts: Sequence[Part], path: str, *, dtype: torch.dtype | None, max_file_bytes: int,
           bucket_bytes: int, overwrite: bool, group, device: torch.device, what: str,
           names: Mapping[str, str] | None = None,
           transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> int:
    """Collective, the one streaming export (``ShardedEMA.export``, ``export_merged``): every
    rank gathers the buckets of ``parts``; rank 0 of ``group`` streams each bucket's tensors into
    the library's ``ExportWriter`` (planned up front, files staged in ``path``, put in
    place at the end), each under ``names[fqn]`` (the part's name without ``names``) and as
    ``transform(fqn, full tensor)`` gives it (on rank 0 only; the tensor itself without it).
    A failure on any rank raises on every rank. Returns the bytes written, on every rank."""
    writer = rank_world(group)[0] == 0
    out, error = None, None

    def name(fqn: str) -> str:
        return fqn if names is None else names[fqn]

    if writer:
        try:
            like = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in parts]
            out = _ops.export_writer(path, [name(p.fqn) for p in parts], like, dtype,
                                     int(max_file_bytes), overwrite, True)
        except Exception as e:  # noqa: BLE001 (re-raised on every rank below)
            error = e
    raise_if_any_rank_failed(error, group, what, device)
    for bucket in full_buckets(parts, bucket_bytes):
        # After a write error the writer keeps gathering (the other ranks are in the
        # collectives) and reports the error at the end.
        if out is not None and error is None:
            try:
                for fqn, t, _ in bucket:
                    # Cast (if asked) by the writer, as fsdp-ema export does.
                    out.write(name(fqn), t if transform is None else transform(fqn, t))
            except Exception as e:  # noqa: BLE001
                error = e
        del bucket
    total = 0
    if out is not None:
        try:
            if error is None:
                total = out.finish()
        except Exception as e:  # noqa: BLE001
            error = e
        if error is not None:
            out.abort()
    raise_if_any_rank_failed(error, group, what, device)
    return broadcast_int(total, group, device)
