"""The one collective save sequence of a sharded checkpoint directory, and the failure agreement
every save and load step goes through (``agreed``).

``ShardedEMA.save``, ``save_shard_weights`` and ``save_training_state`` all save through
``save_collective``: every rank checks the directory, all agree, every rank writes its file, all
agree (the barrier: every rank's file is durable past it), rank 0 commits, all agree. A failure on
any rank raises on every rank and leaves no index. Every file-system rule (creating the directory,
the lock, stale temporaries, what an overwrite replaces, the commit) is format/'s, reached through
the ops (``fsdp_ema/format/layout.h``). Reads go through ``_layouts.read_requests``.

An asynchronous save (``async_saver``) runs the same sequence: the pieces are staged on the
caller's thread, the check, write and commit steps on the background thread of ``_async``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import checkpoint as _ckpt
from ._dist import raise_if_any_rank_failed

T = TypeVar("T")


def rank_world(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_fresh(directory: str, overwrite: bool) -> None:
    """Creates ``directory`` if missing; FileExistsError if it holds a committed checkpoint and
    ``overwrite`` is off."""
    if torch.ops.fsdp_ema.prepare_checkpoint(directory) and not overwrite:
        raise FileExistsError(f"{directory!r} already holds a committed checkpoint; pass "
                              f"overwrite=True to replace it")


def agreed(fn: Callable[[], T], *, group, device: torch.device, what: str) -> T:
    """Collective: ``fn()`` on every rank, then the failure agreement: if it raised on any rank,
    every rank raises (naming the ranks that failed; a single process re-raises the error
    itself). Every step of every save and load goes through it, so that one rank's failure can
    never leave the others waiting in a later collective, and nothing is written before every
    rank has read and checked what it will write."""
    value, error = None, None
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 (re-raised on every rank below)
        error = e
    raise_if_any_rank_failed(error, group, what, device)
    return value


def save_collective(directory: str | os.PathLike, pieces: Callable[[], Mapping[str, Any]], *,
                    group, device: torch.device, what: str, overwrite: bool,
                    collective_pieces: bool = True, prepare: Callable[[], None] | None = None,
                    after_commit: Callable[[], None] | None = None, fsync: bool = True,
                    async_saver=None, if_busy: str = "wait"):
    """Collective: check, agree, write, agree, commit on rank 0, agree. Returns the bytes of this
    rank's file, or with ``async_saver`` (an ``_async.AsyncSaver``) a ``SaveHandle`` for them.

    ``pieces()`` gives this rank's ``save_shard`` input. With ``collective_pieces`` it runs after
    the first agreement on every rank (it may run collectives: FSDP1's exchange); without, it runs
    with the check, before it, so that its failure on one rank stops every rank before any file
    is written. ``prepare()`` runs in the check, after the directory exists (sidecar files);
    ``after_commit()`` once the commit is agreed (its error is the caller's to soften).

    Asynchronously, ``pieces()`` runs and its tensors are staged on the caller's thread (so the
    caller may modify its tensors as soon as this returns), and the same check, write and commit
    steps run on the background thread over its own process group; a failure of ``pieces()`` or
    of the staging is carried into the check's agreement, so it raises on every rank's handle."""
    directory = os.fspath(directory)
    rank, world = rank_world(group)

    def sequence(run_group, ready, staged_error=None, staged_event=None) -> int:
        run = functools.partial(agreed, group=run_group, device=device, what=what)

        def check() -> Mapping[str, Any] | None:
            if staged_error is not None:
                raise staged_error
            check_fresh(directory, overwrite)
            if staged_event is not None:
                from ._async import wait_staged

                wait_staged(staged_event)
            shards = ready if ready is not None or collective_pieces else pieces()
            if prepare is not None:
                prepare()
            return shards

        def write() -> int:
            # An overwrite keeps the old checkpoint whole until the new index lands (the new
            # files go under names the old index does not reference; the commit removes the old
            # ones after).
            shards = ready if ready is not None else pieces()
            return _ckpt.save_shard(directory, shards, rank=rank, world_size=world,
                                    overwrite=overwrite, fsync=fsync)

        def commit() -> None:
            if rank == 0:
                _ckpt.commit(directory, world, overwrite=overwrite, fsync=fsync)

        ready = run(check)
        nbytes = run(write)  # also the barrier: every rank's file is durable past here
        run(commit)
        if after_commit is not None:
            after_commit()
        return nbytes

    if async_saver is None:
        return sequence(group, None)

    async_saver.check_busy(if_busy, group, what)
    staged, event, error = None, None, None
    try:
        shards = pieces()
        with _ckpt._gc_paused():
            staged, event = async_saver.staging.stage(shards)
    except Exception as e:  # noqa: BLE001 (agreed, and re-raised on every rank's handle)
        error = e
    return async_saver.submit(
        group, what, lambda bg: sequence(bg, staged if error is None else {}, error, event))
