"""Asynchronous saves: staging into reusable host buffers, a background writer, the handle.

An async save (``ShardedEMA.save(..., async_=True)``, ``save_training_state(..., async_=True)``,
``fsdp_ema.checkpoint.save/save_shard(..., async_=True)``) runs the same collective sequence as a
synchronous one (``store.collective.save_collective``: check, agree, write, agree, commit on rank 0,
agree), split in two:

- on the caller's thread, the pieces are computed and *staged*: every tensor is copied into a
  host buffer this saver keeps between saves (pinned for CUDA tensors, copied on the current
  stream, so later in-place updates on that stream come after the copy; CPU tensors copied
  before the call returns). The call then returns a ``SaveHandle``;
- on a background thread, the staged tensors are written and committed. The agreements run over
  a gloo process group made for the background thread alone (one per set of ranks), so they
  never wait on, or interleave with, the training's collectives. Saves run on that thread in
  the order they were submitted, which is the same on every rank (saves are collective calls).

A failure anywhere (pieces, staging, check, write, commit) is agreed in the background, so
``handle.result()`` raises on every rank if any rank failed, and nothing is committed.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

IF_BUSY = ("wait", "raise")


class SaveHandle:
    """The future of one asynchronous save. ``result()`` waits for the commit and returns this
    rank's file size in bytes, or raises (on every rank, if any rank failed)."""

    def __init__(self, what: str):
        self.what = what
        self._future: concurrent.futures.Future = concurrent.futures.Future()

    def result(self, timeout: float | None = None) -> Any:
        """Waits (at most ``timeout`` seconds: TimeoutError after) and returns the save's value;
        re-raises its error."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Waits for the save to finish, without raising its error."""
        concurrent.futures.wait([self._future], timeout)

    def __repr__(self) -> str:
        state = "pending" if not self.done() else (
            "failed" if self._future.exception() else "done")
        return f"SaveHandle({self.what}, {state})"


# --- the background writers -----------------------------------------------------------------------

class _Writer:
    """One background thread running jobs in submission order, with its own process group."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        # The default group this writer's group was made under: destroy_process_group() destroys
        # every group, so a writer made before it must not be reused after a new init.
        self.world = dist.group.WORLD if group is not None else None
        self._cv = threading.Condition()
        self._jobs: list[tuple[SaveHandle, Callable[[], Any]]] = []
        self._pending = 0
        self._thread = threading.Thread(target=self._loop, name="fsdp_ema-async-save",
                                        daemon=True)
        self._thread.start()

    def submit(self, handle: SaveHandle, job: Callable[[], Any]) -> None:
        with self._cv:
            self._jobs.append((handle, job))
            self._pending += 1
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                handle, job = self._jobs.pop(0)
            try:
                handle._future.set_result(job())
            except BaseException as e:  # noqa: BLE001 (the handle re-raises it)
                if self.stale():
                    err = RuntimeError(
                        f"{handle.what}: the process group was destroyed before this "
                        f"asynchronous save finished, so nothing was committed; call the "
                        f"handle's result() before dist.destroy_process_group()")
                    err.__cause__ = e
                    e = err
                handle._future.set_exception(e)
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()

    def stale(self) -> bool:
        """Whether the process groups this writer was made under are gone."""
        return self.world is not None and dist.group.WORLD is not self.world

    def drain(self) -> None:
        with self._cv:
            while self._pending:
                self._cv.wait()


_WRITERS: dict[Any, _Writer] = {}
_WRITERS_LOCK = threading.Lock()


def init_async_groups(rank_sets) -> None:
    """Makes the background process groups of async saves over subgroups up front: collective
    over the default group, every rank passing the same rank lists (as ``dist.new_subgroups_by_
    enumeration`` takes them), e.g. ``[[0, 1], [2, 3]]`` for two subgroups' EMAs.

    Without it, the first async save over a strict subgroup makes that group with only the
    members taking part (``use_local_synchronization=True``); torch counts group creations on
    the ranks that take part, so a later ``dist.new_group`` by every rank can get different
    names on members and non-members and hang. Saves over the whole world need nothing."""
    sets = [sorted({int(r) for r in ranks}) for ranks in rank_sets]
    world = dist.get_world_size()
    for ranks in sets:
        if not ranks or ranks[0] < 0 or ranks[-1] >= world:
            raise ValueError(f"init_async_groups: {ranks} is not a set of ranks of a world of "
                             f"{world}")
    me = dist.get_rank()
    for ranks in sets:
        background = dist.new_group(ranks, backend="gloo")  # every rank, in the same order
        if me in ranks:
            with _WRITERS_LOCK:
                w = _WRITERS.get(tuple(ranks))
                if w is None or w.stale():
                    _WRITERS[tuple(ranks)] = _Writer(background)


def _writer(group: dist.ProcessGroup | None) -> _Writer:
    """The writer for ``group``'s ranks. Collective over ``group`` the first time (it makes the
    background process group: only the members take part; see ``init_async_groups``)."""
    if group is None:
        key: Any = None
    else:
        key = tuple(dist.get_process_group_ranks(group))
    with _WRITERS_LOCK:
        w = _WRITERS.get(key)
        if w is None or w.stale():
            background = None
            if key is not None:
                background = dist.new_group(list(key), backend="gloo",
                                            use_local_synchronization=True)
            w = _WRITERS[key] = _Writer(background)
        return w


@atexit.register
def _drain_all() -> None:
    # A save submitted before exit is finished rather than cut off (it would be left
    # uncommitted: safe, but lost).
    for w in list(_WRITERS.values()):
        w.drain()


# --- staging --------------------------------------------------------------------------------------

class Staging:
    """Host buffers, one per staged name, reused while the name's shape and dtype stay the same
    (so a steady save pays no allocation and no page faults after the first)."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, t: torch.Tensor) -> torch.Tensor:
        pin = t.device.type == "cuda"
        buf = self.buffers.get(name)
        if (buf is None or buf.shape != t.shape or buf.dtype != t.dtype
                or buf.is_pinned() != pin):
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        return buf

    def stage(self, shards: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        """Copies every tensor of a ``save_shard`` input into this staging's buffers; returns
        the staged input (same keys, offsets and global shapes) and a CUDA event to wait on
        before reading the buffers (None when every source is on the CPU)."""
        buffers: dict[str, torch.Tensor] = {}
        out: dict[str, Any] = {}
        cpu_dst, cpu_src, dev_dst, dev_src = [], [], [], []
        for name, value in shards.items():
            t = value if isinstance(value, torch.Tensor) else value[0]
            t = t.detach()
            if t.layout != torch.strided:
                raise TypeError(f"{name!r}: only strided tensors can be staged, got {t.layout}")
            buf = buffers[name] = self._buffer(name, t)
            (dev_dst if t.device.type != "cpu" else cpu_dst).append(buf)
            (dev_src if t.device.type != "cpu" else cpu_src).append(t)
            out[name] = buf if isinstance(value, torch.Tensor) else (buf, value[1], value[2])
        self.buffers = buffers  # names no longer saved release their buffers
        if cpu_dst:
            torch._foreach_copy_(cpu_dst, cpu_src)
        event = None
        if dev_dst:
            # Per source device: copies on its current stream, then one event per device.
            # One call for every tensor (100k+ per rank at scale: no Python loop on the caller's
            # thread); each copy runs on its source's current stream.
            torch._foreach_copy_(dev_dst, dev_src, non_blocking=True)
            devices = {t.device for t in dev_src}
            # Blocking events: the background thread's wait sleeps instead of spinning a core.
            event = [torch.cuda.Event(blocking=True) for _ in devices]
            for ev, d in zip(event, devices):
                ev.record(torch.cuda.current_stream(d))
        return out, event


def wait_staged(event) -> None:
    for ev in event or ():
        ev.synchronize()


# --- one object's async saves ---------------------------------------------------------------------

class AsyncSaver:
    """What an object that saves asynchronously keeps: its staging buffers and its save in
    flight (at most one: a new save waits for it, or raises with ``if_busy="raise"``)."""

    def __init__(self):
        self.staging = Staging()
        self.in_flight: SaveHandle | None = None

    def check_busy(self, if_busy: str, group: dist.ProcessGroup | None, what: str) -> None:
        """Collective with ``if_busy="raise"`` (one flag, so that every rank decides alike)."""
        if if_busy not in IF_BUSY:
            raise ValueError(f"{what}: if_busy must be one of {IF_BUSY}, got {if_busy!r}")
        prev = self.in_flight
        if if_busy == "wait":
            if prev is not None:
                prev.wait()
            return
        busy = prev is not None and not prev.done()
        if group is not None:
            flag = torch.tensor([int(busy)], dtype=torch.int32,
                                device=_flag_device(group))
            dist.all_reduce(flag, group=group)
            busy = bool(flag.item())
        if busy:
            desc = prev.what if prev is not None else "on another rank"
            raise RuntimeError(f"{what}: the previous asynchronous save ({desc}) is still in "
                               f"flight (if_busy='raise'); call its handle's result() first")
        if prev is not None:
            prev.wait()  # done on this rank; another rank may still be agreeing

    def submit(self, group: dist.ProcessGroup | None, what: str,
               job: Callable[[dist.ProcessGroup | None], Any]) -> SaveHandle:
        """Runs ``job(background_group)`` on the background thread; returns its handle."""
        handle = SaveHandle(what)
        writer = _writer(group)
        self.in_flight = handle
        writer.submit(handle, lambda: job(writer.group))
        return handle


def _flag_device(group) -> torch.device:
    from ..distributed.groups import comm_device

    return comm_device(group, torch.device("cpu"))


_DEFAULT_SAVERS: dict[str, AsyncSaver] = {}


def default_saver(name: str) -> AsyncSaver:
    """The saver of a module-level function (``save_training_state``, the checkpoint helpers):
    one per function and process."""
    saver = _DEFAULT_SAVERS.get(name)
    if saver is None:
        saver = _DEFAULT_SAVERS[name] = AsyncSaver()
    return saver
