"""Sharded checkpoints: thin wrappers over the ``save_shard`` / ``commit_checkpoint`` /
``load_shard`` / ``load_tensors`` / ``checkpoint_info`` operators.

A checkpoint is a directory of ``shard-<rank>-of-<world>.safetensors`` files (one per writing
rank, each a valid safetensors file carrying the metadata torch.distributed.checkpoint's
HuggingFace reader uses) and ``fsdp_ema.index.json``, written last as the commit marker.

Single process::

    fsdp_ema.checkpoint.save("ckpt", {"w": w, "b": b})
    tensors = fsdp_ema.checkpoint.load("ckpt")                  # {"w": ..., "b": ...}

Several ranks (each writes its own slice, then one rank commits after a barrier)::

    fsdp_ema.checkpoint.save_shard("ckpt", {"w": (local_rows, [row0, 0], list(w_global_shape))},
                                   rank=rank, world_size=world)
    dist.barrier()
    if rank == 0:
        fsdp_ema.checkpoint.commit("ckpt", world_size=world)
    mine = fsdp_ema.checkpoint.load("ckpt", rank=rank, world_size=world)  # resharded rows
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
from itertools import chain
from typing import Mapping, Sequence, Tuple, Union

import torch

from .. import _ops

Shard = Union[torch.Tensor, Tuple[torch.Tensor, Sequence[int], Sequence[int]]]

__all__ = ["save_shard", "commit", "save", "load_shard", "load", "load_into", "info",
           "shard_file_name", "open_checkpoint", "OpenCheckpoint"]


def shard_file_name(rank: int, world_size: int) -> str:
    """The file rank ``rank`` of ``world_size`` writes (format/'s rule: ``fsdp_ema/format/
    names.h``)."""
    return _ops.shard_file_name(rank, world_size)


@contextlib.contextmanager
def gc_paused():
    """Bulk calls create or pass 100,000+ tensors; Python's cyclic collector would walk every
    live object several times meanwhile (none of these objects forms a cycle). Only on the main
    thread: gc.disable() is process-wide, and an async save's background write would otherwise
    stop the collector for the training's thread as long as it writes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _flatten(shards: Mapping[str, Shard]):
    values = list(shards.values())
    if all(type(v) is torch.Tensor for v in values):  # the common case: whole tensors, fast
        tensors = [t.detach() if t.requires_grad else t for t in values]
        global_shapes = list(chain.from_iterable(t.shape for t in tensors))
        return list(shards), tensors, [0] * len(global_shapes), global_shapes
    names, tensors, offsets, global_shapes = [], [], [], []
    for name, value in shards.items():
        if isinstance(value, torch.Tensor):
            tensor, off, glob = value, [0] * value.dim(), list(value.shape)
        else:
            tensor, off, glob = value
        if len(off) != tensor.dim() or len(glob) != tensor.dim():
            raise ValueError(f"{name!r}: offsets {list(off)} and global shape {list(glob)} need "
                             f"one entry per dimension of the {tensor.dim()}-dim shard")
        names.append(name)
        tensors.append(tensor.detach())
        offsets.extend(int(o) for o in off)
        global_shapes.extend(int(g) for g in glob)
    return names, tensors, offsets, global_shapes


def save_shard(directory: str | os.PathLike, shards: Mapping[str, Shard], *, rank: int = 0,
               world_size: int = 1, fsync: bool = True, overwrite: bool = False,
               async_: bool = False, if_busy: str = "wait"):
    """Writes this rank's file atomically; returns its size in bytes.

    ``shards`` maps a name to a whole tensor, or to ``(local_shard, global_offsets,
    global_shape)``. A tensor replicated on every rank (a 0-dim one, say) must be written by one
    rank only: the commit refuses pieces that overlap. A committed directory is refused unless
    ``overwrite``: then the file goes under a name the committed index does not reference, and
    the old checkpoint stays loadable until ``commit(..., overwrite=True)`` replaces its index.

    ``async_=True`` stages the tensors into host buffers (reused by the next async
    ``save_shard``) and returns a ``SaveHandle`` whose ``result()`` is the size once the file is
    durable; call ``commit`` only after it (every rank's). One in flight: a new one waits, or
    raises with ``if_busy="raise"``.
    """
    if async_:
        return _save_async("save_shard", directory, shards, rank=rank, world_size=world_size,
                           fsync=fsync, overwrite=overwrite, if_busy=if_busy, and_commit=False)
    # The op creates the directory (with its parents) if missing, and removes what it created when
    # the write fails.
    with gc_paused():
        names, tensors, offsets, global_shapes = _flatten(shards)
        return int(_ops.save_shard(os.fspath(directory), rank, world_size, names, tensors,
                                   offsets, global_shapes, fsync, overwrite))


def commit(directory: str | os.PathLike, world_size: int, *, overwrite: bool = False,
           fsync: bool = True, metadata: Mapping[str, str] | None = None) -> int:
    """Writes the index (the commit marker) once every rank's file is there; with ``overwrite``
    it replaces a committed index in one rename, then removes the files only the old one
    referenced. ``metadata``: strings the index keeps in its ``"metadata"`` object (``info()``
    returns them)."""
    pairs = [s for k, v in (metadata or {}).items() for s in (str(k), str(v))]
    return _ops.commit_checkpoint(os.fspath(directory), world_size, overwrite, fsync, pairs)


def save(directory: str | os.PathLike, tensors: Mapping[str, torch.Tensor], *,
         overwrite: bool = False, fsync: bool = True, async_: bool = False,
         if_busy: str = "wait"):
    """Single-process save: one shard file plus the index. Returns the bytes of the shard file.
    With ``overwrite`` a committed checkpoint in ``directory`` is replaced atomically: a reader
    sees the old one whole until the new index lands, then the new one.

    ``async_=True``: returns a ``SaveHandle`` once the tensors are staged (the caller may modify
    them right away); the file and the index are written on a background thread."""
    if async_:
        return _save_async("save", directory, tensors, rank=0, world_size=1, fsync=fsync,
                           overwrite=overwrite, if_busy=if_busy, and_commit=True)
    nbytes = save_shard(directory, tensors, rank=0, world_size=1, fsync=fsync, overwrite=overwrite)
    commit(directory, 1, overwrite=overwrite, fsync=fsync)
    return nbytes


def _save_async(name: str, directory, shards, *, rank: int, world_size: int, fsync: bool,
                overwrite: bool, if_busy: str, and_commit: bool):
    """Stages ``shards`` on this thread; writes (and with ``and_commit`` commits) in the background.
    Local: no collective (several ranks' ``save_shard`` are joined by the caller's commit)."""
    from .async_save import default_saver

    saver = default_saver(name)
    what = f"fsdp_ema.checkpoint.{name}({os.fspath(directory)!r})"
    saver.check_busy(if_busy, None, what)
    with gc_paused():
        staged, event = saver.staging.stage(shards)

    def job(_group) -> int:
        from .async_save import wait_staged

        wait_staged(event)
        nbytes = save_shard(directory, staged, rank=rank, world_size=world_size, fsync=fsync,
                            overwrite=overwrite)
        if and_commit:
            commit(directory, world_size, overwrite=overwrite, fsync=fsync)
        return nbytes

    return saver.submit(None, what, job)


def load_shard(path: str | os.PathLike, *, verify: bool = True, device=None, mmap: bool = False):
    """One shard file: ``{name: (local_shard, global_offsets, global_shape)}``.

    The tensors are memory the caller owns, read and checksum-verified in one pass, so a file
    truncated or rewritten afterwards changes nothing. ``mmap=True`` (CPU only) returns zero-copy
    views of a private mapping of the file instead, as ``torch.load(mmap=True)`` does, with the
    same risks: the views are verified when loaded, but they are the file's pages, so a change
    made to the file in place afterwards (by any process) shows through them, and truncating the
    file while the tensors live and then touching them kills the process with SIGBUS. A file that
    shrinks while the load itself verifies the mapping raises RuntimeError naming the file.
    """
    names, tensors, offsets, global_shapes = _ops.load_shard(os.fspath(path), verify, device,
                                                             mmap)
    out, pos = {}, 0
    for name, t in zip(names, tensors):
        out[name] = (t, offsets[pos:pos + t.dim()], global_shapes[pos:pos + t.dim()])
        pos += t.dim()
    return out


def info(directory: str | os.PathLike) -> dict:
    """Layout, world size and every tensor's dtype and global shape."""
    return json.loads(_ops.checkpoint_info(os.fspath(directory)))


def load(directory: str | os.PathLike, names: Sequence[str] | None = None, *, rank: int = 0,
         world_size: int = 1, verify: bool = True, device=None, mmap: bool = False) -> dict:
    """Tensors of a committed checkpoint: whole (``world_size=1``), or the dim-0 rows
    ``torch.chunk(t, world_size)[rank]`` would give, whatever world size wrote it.

    Owned memory, read and verified in one pass; ``mmap=True`` opts in to zero-copy views where
    one stored piece holds exactly the rows asked for: verified at load time, but live views of the
    file afterwards (see :func:`load_shard` for the risks)."""
    if names is None:
        names = sorted(info(directory)["tensors"])
    with gc_paused():
        tensors = _ops.load_tensors(os.fspath(directory), list(names), rank, world_size, verify,
                                    device, mmap)
        return dict(zip(names, tensors))


def load_into(directory: str | os.PathLike, tensors: Mapping[str, torch.Tensor], *, rank: int = 0,
              world_size: int = 1, verify: bool = True) -> None:
    """Reads a committed checkpoint into existing tensors, as ``torch.distributed.checkpoint.load``
    does: ``tensors`` maps each name to a destination (CPU or CUDA, any strides) of the stored
    dtype and of the shape :func:`load` would return for ``rank`` of ``world_size``.

    Nothing is allocated and nothing is copied twice, so resuming into a model's parameters costs
    one read. Two passes: every destination is checked and (``verify``) every byte it will read is
    hashed before the first destination is written, so a bad request or a corrupted file leaves
    all of them as they were; then every byte is hashed again as it is read into place, so a file
    that another process changes between the passes, or during the write, makes the call raise
    (destinations may then be partly written, possibly with the changed bytes): it never succeeds
    with bytes other than the stored ones.
    (An ``fstat`` of every file before the write refuses an in-place rewrite early; it is not the
    proof: a write through a shared mapping moves neither mtime nor ctime.)

    Example::

        model = MyModel()
        fsdp_ema.checkpoint.load_into("ckpt", dict(model.state_dict()))
    """
    with torch.no_grad(), gc_paused():
        _ops.load_into_(os.fspath(directory), list(tensors), list(tensors.values()), rank,
                        world_size, verify)


class OpenCheckpoint:
    """A committed checkpoint opened once (the library's ``OpenCheckpoint`` class): its index
    and shard headers are parsed and its files held open until this object is dropped, so that
    several reads see the same files and each stored piece is hashed at most once.

    What a collective load needs: every rank runs ``check_into`` (everything ``load_into``
    checks, every byte it will read hashed, nothing written), the ranks agree, and only then every
    rank runs ``load_into(..., checked=True)``, which skips the check pass and hashes every byte
    again as it reads it into place: a file changed in place between the two calls (by ``pwrite``
    or through a shared mapping, which ``fstat`` cannot see) makes it raise, never load the
    changed bytes. A file replaced by rename meanwhile (an overwrite committed) is read as it was
    opened, or refused ("changed since it was opened") if its descriptor had to be reopened.

    Example::

        ckpt = fsdp_ema.checkpoint.open_checkpoint("ckpt")
        params = dict(model.state_dict())
        ckpt.check_into(params)     # raises, with nothing written, on any mismatch or bad checksum
        ckpt.load_into(params)
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        self._handle = _ops.open_checkpoint(self.directory)

    def info(self) -> dict:
        """:func:`info` of this directory."""
        return json.loads(self._handle.info())

    def check_into(self, tensors: Mapping[str, torch.Tensor], *, rank: int = 0,
                   world_size: int = 1, verify: bool = True) -> None:
        """What :meth:`load_into` checks (every destination) and, with ``verify``, hashes (every
        stored piece it reads); writes nothing."""
        with gc_paused():
            self._handle.check_into(list(tensors), list(tensors.values()), rank, world_size,
                                    verify)

    def load_into(self, tensors: Mapping[str, torch.Tensor], *, rank: int = 0,
                  world_size: int = 1, verify: bool = True, checked: bool = False) -> None:
        """:func:`load_into` from this directory. ``checked=True``: :meth:`check_into` ran with
        the same arguments and passed (on every rank, for a collective load), so the check pass
        is skipped; the write pass still hashes every byte it reads and raises on any change
        since (destinations may then be partly written)."""
        with torch.no_grad(), gc_paused():
            self._handle.load_into_(list(tensors), list(tensors.values()), rank, world_size,
                                    verify, checked)

    def check_unchanged(self) -> None:
        """Raises RuntimeError ("changed since it was opened") when ``fstat`` of a file of this
        checkpoint differs from when it was opened (size, mtime, ctime): an early refusal of a
        rewrite, which ``load_into`` and ``load`` run themselves. Passing it proves nothing (a
        write through a shared mapping moves neither time); the loads' hashes are the proof."""
        self._handle.check_unchanged()

    def load_boxes(self, boxes: Mapping[str, tuple[Sequence[int], Sequence[int]]], *,
                   verify: bool = True) -> dict:
        """Boxes of tensors, ``{name: (offsets, shape)}``, as fresh CPU tensors: only the bytes
        (with block checksums: the blocks) each box touches are read, each verified as read."""
        names = list(boxes)
        offsets = [int(o) for name in names for o in boxes[name][0]]
        shapes = [int(s) for name in names for s in boxes[name][1]]
        with gc_paused():
            return dict(zip(names, self._handle.load_boxes(names, offsets, shapes, verify)))

    def load(self, names: Sequence[str], *, rank: int = 0, world_size: int = 1,
             verify: bool = True) -> dict:
        """:func:`load` (owned CPU tensors) from this directory."""
        with gc_paused():
            return dict(zip(names, self._handle.load(list(names), rank, world_size, verify)))


def open_checkpoint(directory: str | os.PathLike) -> OpenCheckpoint:
    """Opens a committed checkpoint once for several reads (:class:`OpenCheckpoint`)."""
    return OpenCheckpoint(directory)


# Classes carry their public path (repr, pickles, the settings a checkpoint records).
for _cls in (OpenCheckpoint,):
    _cls.__module__ = "fsdp_ema.checkpoint"
