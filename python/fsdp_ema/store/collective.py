"""The one collective save sequence and the one collective load sequence of a sharded checkpoint
directory, and the failure agreement every save and load step goes through (``agreed``).

``ShardedEMA.save``, ``save_shard_weights`` and ``save_training_state`` all save through
``save_collective``: every rank checks the directory, all agree, every rank writes its file, all
agree (the barrier: every rank's file is durable past it), rank 0 commits, all agree. A failure on
any rank raises on every rank and leaves no index. Every file-system rule (creating the directory,
the lock, stale temporaries, what an overwrite replaces, the commit) is format/'s, reached through
the ops (``fsdp_ema/format/layout.h``).

``ShardedEMA.load``, ``load_model_weights`` and ``load_training_state`` all load through
``load_collective``: every rank opens the checkpoint once, checks every name, shape and dtype,
and hashes every stored piece it will read (``OpenCheckpoint.check_into``, nothing written); all
agree; only then does every rank read into its tensors in place (``load_into``, from the same open
files, the pieces already hashed); all agree. So a bad checkpoint on one rank (a corrupted file
only it reads, a dtype it cannot take) raises on every rank with every rank's tensors untouched.
``staged=True`` (``load_training_state``) reads every piece once, verified in that read, into
fresh memory in the check step and returns the values after the agreement, for the caller to copy:
no read can fail once a destination is written, whatever another process does to the files.

An asynchronous save (``async_saver``) runs the same sequence: the pieces are staged on the
caller's thread, the check, write and commit steps on the background thread of ``store.async_save``.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from .. import _dtypes, _ops
from ..distributed.groups import check_dtype_kind, raise_if_any_rank_failed, rank_world
from ..model.layouts import LoadTarget
from ..model.slots import Slot
from . import checkpoint as _ckpt

T = TypeVar("T")


def check_fresh(directory: str, overwrite: bool) -> None:
    """FileExistsError if ``directory`` holds a committed checkpoint and ``overwrite`` is off.
    Creates nothing: ``save_shard`` creates the directory when it writes (and removes it again if
    its write fails), so a save that fails before writing leaves no trace."""
    if _ops.is_committed(directory) and not overwrite:
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
                    async_saver=None, if_busy: str = "wait",
                    metadata: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None):
    """Collective: check, agree, write, agree, commit on rank 0, agree. Returns the bytes of this
    rank's file, or with ``async_saver`` (a ``store.async_save.AsyncSaver``) a ``SaveHandle`` for
    them.

    ``pieces()`` gives this rank's ``save_shard`` input. With ``collective_pieces`` it runs after
    the first agreement on every rank (it may run collectives: FSDP1's exchange); without, it runs
    with the check, before it, so that its failure on one rank stops every rank before any file
    is written. ``prepare()`` runs in the write step, once this rank's file is written (sidecar
    files); ``after_commit()`` once the commit is agreed (its error is the caller's to soften).
    ``metadata``: what rank 0's commit records in the index (``checkpoint.commit``), or a
    function giving it, called at the commit (on the background thread of an async save).

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
                from .async_save import wait_staged

                wait_staged(staged_event)
            return ready if ready is not None or collective_pieces else pieces()

        def write() -> int:
            # An overwrite keeps the old checkpoint whole until the new index lands (the new
            # files go under names the old index does not reference; the commit removes the old
            # ones after).
            shards = ready if ready is not None else pieces()
            nbytes = _ckpt.save_shard(directory, shards, rank=rank, world_size=world,
                                      overwrite=overwrite, fsync=fsync)
            if prepare is not None:
                prepare()
            return nbytes

        def commit() -> None:
            if rank == 0:
                _ckpt.commit(directory, world, overwrite=overwrite, fsync=fsync,
                             metadata=metadata() if callable(metadata) else metadata)

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
        with _ckpt.gc_paused():
            staged, event = async_saver.staging.stage(shards)
    except Exception as e:  # noqa: BLE001 (agreed, and re-raised on every rank's handle)
        error = e
    return async_saver.submit(
        group, what, lambda bg: sequence(bg, staged if error is None else {}, error, event))


# --- the collective load --------------------------------------------------------------------------

def _in_place(t: LoadTarget, stored: torch.dtype) -> bool:
    """Whether ``load_into_`` can fill ``t.dest`` straight from the file: the stored dtype (no
    cast), the rows of a ``(rank, world)`` request (no box cut out of a whole tensor), memory it
    can write (any strides)."""
    return (t.dest is not None and t.read is not None and t.read.box is None
            and t.dest.dtype == stored and t.dest.device.type in ("cpu", "cuda"))


def _overlapping(targets: Sequence[LoadTarget]) -> set[str]:
    """Names of the destinations that share memory with another (tied weights in a state dict:
    two names, one tensor), which ``load_into_`` refuses as destinations of one call: they are
    filled by a copy instead. The rule is ops/common/memory.h's (the ``overlapping`` op): exact for
    interleaved views, sorted extents. The op first checks that each destination is memory a load
    can write (dense, inside its storage, no two of its own elements sharing memory), raising
    with its name: this is where the ones filled by a copy are checked before any rank writes."""
    if not targets:
        return set()
    tied = _ops.overlapping([t.dest for t in targets], [t.name for t in targets])
    return {targets[i].name for i in tied}


def load_collective(checkpoint: str | os.PathLike | _ckpt.OpenCheckpoint,
                    plan: Callable[[Mapping[str, Any]], Sequence[LoadTarget]], *, group,
                    device: torch.device, what: str, verify: bool = True,
                    info: Mapping[str, Any] | None = None,
                    before_write: Callable[[], None] | None = None,
                    staged: bool = False) -> dict[str, torch.Tensor]:
    """Collective: check, agree, write, agree. Returns the checked values of the targets without
    ``dest`` (the caller writes them), by name; ``staged``: of every target (see below).

    Check (every rank, nothing written): open the checkpoint once (or take ``checkpoint`` open),
    ``plan(info)`` gives the targets (it may raise: names, the caller's own rules), every name,
    global shape and dtype kind is checked, every destination ``load_into_`` can fill is checked
    and its stored pieces hashed (``check_into``), and the others (a dtype to cast to, a box of a
    whole tensor, no destination) are read into fresh memory, verified. Agree. Write:
    ``before_write()``, then ``load_into`` of the in-place destinations from the same open files
    (the pieces are hashed already). Agree. Then the fresh values are copied into their
    destinations. A failure in the check on any rank raises on every rank before any rank
    writes. Just before the write, every rank checks its open files with ``fstat`` (size, mtime,
    ctime) and all agree: an early refusal, with nothing written, of a file rewritten in place
    since the check. The write pass hashes every byte again as it reads it, so a change ``fstat``
    cannot see (a write through a shared mapping) or one during the write raises on every rank
    too (its destinations may then be partly written); no rank ever loads changed bytes.

    ``staged=True``: one read, and nothing written. The check reads every target into fresh
    memory (this rank's share of the targets, in host memory), each byte verified in the read that
    returns it, and checks the values' shapes against the destinations; agree; ``before_write()``
    (agreed); return every target's value: the caller copies them into their destinations (or
    hands them over). Nothing is read after the agreement, so a file changed at any time (before,
    during or after the read) either is read as stored or makes the check raise on every rank,
    before the caller writes anything."""
    run = functools.partial(agreed, group=group, device=device, what=what)

    def check():
        ckpt = (checkpoint if isinstance(checkpoint, _ckpt.OpenCheckpoint)
                else _ckpt.open_checkpoint(checkpoint))
        meta = info if info is not None else ckpt.info()
        available = meta["tensors"]
        targets = list(plan(meta))
        in_place, fresh = [], []
        for t in targets:
            entry = available.get(t.name)
            if entry is None:
                raise KeyError(f"{t.name!r} is not in the checkpoint")
            if list(entry["shape"]) != list(t.shape):
                raise ValueError(f"{t.name!r} is {list(entry['shape'])} in the checkpoint but "
                                 f"{list(t.shape)} here")
            stored = _dtypes.from_name(entry["torch_dtype"], f"{t.name!r}")
            check_dtype_kind(t.name, stored, t.dtype)
            if t.read is not None:
                (in_place if not staged and _in_place(t, stored) else fresh).append(t)
        # Staged, every destination is filled by a copy after the agreement; the op still checks
        # each is memory that copy can write, and names sharing memory are simply copied twice.
        shared = _overlapping(in_place + [t for t in fresh if t.dest is not None])
        if shared:
            fresh += [t for t in in_place if t.name in shared]
            in_place = [t for t in in_place if t.name not in shared]
        by_request: dict[tuple[int, int], dict[str, torch.Tensor]] = defaultdict(dict)
        for t in in_place:
            by_request[t.read.request][t.name] = t.dest
        for (rank, world), tensors in by_request.items():
            ckpt.check_into(tensors, rank=rank, world_size=world, verify=verify)
        # Fresh reads: a box (a tensor-parallel piece) reads only what it touches; rows by request.
        fresh_by_request: dict[tuple[int, int], list[LoadTarget]] = defaultdict(list)
        boxes = [t for t in fresh if t.read.box is not None]
        for t in fresh:
            if t.read.box is None:
                fresh_by_request[t.read.request].append(t)
        loaded = {}
        if boxes:
            loaded = ckpt.load_boxes({t.name: t.read.box for t in boxes}, verify=verify)
        for (rank, world), ts in fresh_by_request.items():
            loaded.update(ckpt.load([t.name for t in ts], rank=rank, world_size=world,
                                    verify=verify))
        values: dict[str, torch.Tensor] = {}
        for ts in (boxes, *fresh_by_request.values()):
            for t in ts:
                value = loaded[t.name] if t.read.box is not None else t.read.take(loaded[t.name])
                if t.dest is not None and value.shape != t.dest.shape:
                    raise ValueError(f"{t.name!r}: {list(value.shape)} read for a local tensor "
                                     f"of {list(t.dest.shape)}")
                values[t.name] = value
        return ckpt, by_request, fresh, values

    ckpt, by_request, fresh, values = run(check)

    def write() -> None:
        if before_write is not None:
            before_write()
        for (rank, world), tensors in by_request.items():
            ckpt.load_into(tensors, rank=rank, world_size=world, verify=verify, checked=True)

    if staged:
        if before_write is not None:
            run(before_write)
        return values
    run(ckpt.check_unchanged)  # a file rewritten in place since the check: refused everywhere
    run(write)
    with torch.no_grad():
        for t in fresh:
            if t.dest is not None:
                t.dest.copy_(values.pop(t.name))
    return values


def list_names(names: Sequence[str], limit: int = 8) -> str:
    """Up to ``limit`` of ``names``, sorted and quoted, and how many more there are."""
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_names(shapes: Mapping[str, torch.Size], available: Mapping[str, torch.Size],
                strict: bool, what: str) -> None:
    """Refuses a checkpoint's ``available`` tensors (global shapes by name) for destinations of
    ``shapes``: with ``strict`` the names must match exactly; shapes always must."""
    missing = [n for n in shapes if n not in available]
    unexpected = [n for n in available if n not in shapes]
    problems = []
    if strict and missing:
        problems.append(f"missing {len(missing)} name(s): {list_names(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected {len(unexpected)} name(s): {list_names(unexpected)}")
    wrong = [f"{n!r} is {list(available[n])} there but {list(s)} here"
             for n, s in shapes.items() if n in available and available[n] != s]
    if wrong:
        problems.append(f"{len(wrong)} shape mismatch(es): " + "; ".join(wrong[:8]))
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))


def load_slots(directory: str, slots: list[Slot], tensors: list[torch.Tensor], *,
               check_names: Callable[[Mapping[str, torch.Size]], None], group,
               device: torch.device, what: str, verify: bool,
               before_write: Callable[[], None] | None = None,
               check_info: Callable[[Mapping[str, Any]], None] | None = None) -> None:
    """Collective: a checkpoint into ``tensors`` (one per slot: the EMA's, or the model's own for
    ``load_model_weights``) through ``store.collective.load_collective``; ``check_names(available)``
    (global shapes by name) raises on names or shapes the caller refuses. In place where the
    file's layout is the tensor's, else read, agreed, then assigned (FSDP1 units: collective)."""
    def plan(info):
        available = {k: torch.Size(v["shape"]) for k, v in info["tensors"].items()}
        check_names(available)
        if check_info is not None:  # the index's metadata, checked with the rest
            check_info(info)
        return [target for slot, t in zip(slots, tensors) for target in slot.load_targets(t)
                if target.name in available]

    values = load_collective(directory, plan, group=group, device=device, what=what,
                             verify=verify, before_write=before_write)
    with torch.no_grad():
        for slot, t in zip(slots, tensors):
            mine = {fqn: slot.from_file(fqn, values[fqn]) for fqn, _ in slot.names()
                    if fqn in values}
            if mine:  # the same slots on every rank: FSDP1's exchange runs everywhere
                slot.assign(t, mine)
