"""Post-hoc EMA (EDM2, Karras et al. 2024, Algorithm 3) for sharded runs: combine the snapshots
``ShardedPowerEMA.snapshot()`` wrote into the power-function EMA of any ``sigma_rel``, shard by
shard, at any world size, and write it as a normal EMA checkpoint.

The plan (which snapshots, their steps and gammas, the least-squares weights, the checks that
they are one model at one world size) comes from the ``posthoc_plan`` op, i.e. from
format/posthoc/posthoc.cpp, the same code ``fsdp-ema posthoc`` runs, so both solve the same weights.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from .. import _dtypes, _ops
from ..distributed.groups import default_group, rank_world
from ..model.layouts import chunk_rows
from . import checkpoint as _ckpt
from .collective import agreed, save_collective
from .full_state import DEFAULT_BUCKET_BYTES  # one bucket's default, as full_state_dict's

__all__ = ["DEFAULT_BUCKET_BYTES", "posthoc", "posthoc_plan"]



def posthoc_plan(snapshot_root: str | os.PathLike, sigma_rel: float,
                 step: int | None = None, *, out: str | os.PathLike | None = None
                 ) -> dict[str, Any]:
    """The reconstruction plan as a dict: ``snapshots`` (``dir``, ``step``, ``gamma``, sorted by
    step), ``weights`` (one per snapshot), ``step``, ``gamma``, ``sigma_rel``, ``world_size``
    (of the snapshots), ``tensors`` (the EMA tensor names) and ``skipped`` (incomplete snapshot
    directories, without an index). Raises RuntimeError naming the problem: no snapshots,
    sigma_rel out of (0, 1/sqrt(12)], a step past the last snapshot, snapshots of different
    models or world sizes; with ``out``, an output that is a snapshot, inside one or inside the
    snapshot root (compared by device and inode: links and ``s002/.`` are caught)."""
    return json.loads(_ops.posthoc_plan(os.fspath(snapshot_root), float(sigma_rel),
                                        None if step is None else int(step),
                                        None if out is None else os.fspath(out)))


def _buckets(names, nbytes, limit):
    bucket, size = [], 0
    for name in names:
        if bucket and size + nbytes[name] > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(name)
        size += nbytes[name]
    if bucket:
        yield bucket


@torch.no_grad()
def posthoc(snapshot_root: str | os.PathLike, *, sigma_rel: float, out: str | os.PathLike,
            step: int | None = None, process_group: dist.ProcessGroup | None = None,
            overwrite: bool = False, verify: bool = True,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, Any]:
    """Synthesizes the power-function EMA of ``sigma_rel`` at ``step`` (default: the last
    snapshot's) from the snapshots under ``snapshot_root`` and writes it to ``out`` as a normal
    sharded EMA checkpoint (the snapshots' tensor names, dtypes and shapes; ``ShardedEMA.load``,
    ``fsdp-ema export`` and the C++ reader take it).

    Collective over ``process_group`` (default: the default group when torch.distributed is
    initialized, else this process alone), at any world size: rank ``r`` of ``W`` reads only its
    ``torch.chunk`` rows of every tensor from every snapshot, in buckets of about
    ``bucket_bytes`` of rows, combines them (``sum_i w_i * snapshot_i`` in float64, in snapshot
    order, rounded once to the tensor's dtype; integer tensors come from the last snapshot) and
    writes its shard file; rank 0 commits. A rank keeps its rows of the result (1/W of the model)
    until its file is written. A failure on any rank raises on every rank, before anything is
    written where possible. Returns the plan (see ``posthoc_plan``).
    """
    process_group = default_group(process_group)
    rank, world = rank_world(process_group)
    what = f"fsdp_ema.posthoc({os.fspath(snapshot_root)!r} -> {os.fspath(out)!r})"
    device = torch.device("cpu")
    if int(bucket_bytes) != bucket_bytes or bucket_bytes <= 0:
        raise ValueError(f"{what}: bucket_bytes must be a positive integer, got {bucket_bytes}")
    run = functools.partial(agreed, group=process_group, device=device, what=what)

    def plan_and_layout():
        # format/'s rule: out is no snapshot and not in the root, compared by device and inode.
        plan = posthoc_plan(snapshot_root, sigma_rel, step, out=out)
        return plan, _ckpt.info(plan["snapshots"][-1]["dir"])["tensors"]

    plan, info = run(plan_and_layout)
    names = plan["tensors"]
    dtypes = {n: _dtypes.from_name(info[n]["torch_dtype"], repr(n)) for n in names}
    shapes = {n: list(info[n]["shape"]) for n in names}

    def local_bytes(n):
        shape = shapes[n]
        numel = 1
        if shape:
            begin, end = chunk_rows(shape[0], rank, world)
            numel = end - begin
        for d in shape[1:]:
            numel *= d
        return numel * torch.empty((), dtype=dtypes[n]).element_size()

    nbytes = {n: local_bytes(n) for n in names}

    def combine() -> dict[str, Any]:
        shards: dict[str, Any] = {}
        snaps, weights = plan["snapshots"], plan["weights"]
        for bucket in _buckets(names, nbytes, int(bucket_bytes)):
            acc: dict[str, torch.Tensor] = {}
            for i, (snap, w) in enumerate(zip(snaps, weights)):
                last = i == len(snaps) - 1
                loaded = _ckpt.load(snap["dir"], bucket, rank=rank, world_size=world,
                                    verify=verify)
                for n in bucket:
                    x = loaded.pop(n)
                    if not dtypes[n].is_floating_point:
                        if last:
                            acc[n] = x
                        continue
                    # Product, then sum, each rounded once, in snapshot order: format/posthoc/
                    # (the CLI) does exactly this, so both give the same bits.
                    p = x.to(torch.float64).mul_(w)
                    acc[n] = p if n not in acc else acc[n].add_(p)
            for n in bucket:
                t = acc.pop(n)
                if dtypes[n].is_floating_point:
                    t = t.to(dtypes[n])
                shape = shapes[n]
                if not shape:
                    if rank == 0:
                        shards[n] = t
                    continue
                begin, end = chunk_rows(shape[0], rank, world)
                if end > begin or (shape[0] == 0 and rank == 0):
                    shards[n] = (t, [begin] + [0] * (len(shape) - 1), shape)
        return shards

    # The one save sequence (store.collective.save_collective): the output is checked (refused when
    # committed, unless overwrite) before anything is combined; the combination runs with that
    # check, so a failure on any rank stops every rank before a file is written.
    save_collective(out, combine, group=process_group, device=device, what=what,
                    overwrite=overwrite, collective_pieces=False)
    return plan
