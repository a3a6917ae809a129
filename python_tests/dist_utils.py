"""A pool of gloo ranks on the CPU that stays up across tests.

Spawning ranks and initializing a process group costs seconds, so a test module keeps one pool
per world size and sends it functions to run: ``pool.run(fn, *args)`` runs ``fn(rank, world_size,
*args)`` on every rank at once and returns the per-rank results (pickled, tensors included). A
rank that raises or hangs fails the call with every rank's traceback, and the pool is replaced so
that the next test starts from ranks in step with each other.

``fn`` must be importable by the ranks (a module-level function of a test module under
python_tests/).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

_HERE = Path(__file__).resolve().parent
_PYTHON = _HERE.parent / "python"


def _worker(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    for path in (str(_HERE), str(_PYTHON)):
        if path not in sys.path:
            sys.path.insert(0, path)
    import torch
    import torch.distributed as dist

    import fsdp_ema  # noqa: F401  (registers the operators)

    torch.set_num_threads(1)  # the ranks share a few cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args, kwargs = pickle.loads(task)
            try:
                results.put((rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs))))
            except BaseException:  # noqa: BLE001 (reported to the parent)
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="fsdp_ema_pool_")
        init_file = os.path.join(self._tmp.name, "init")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, init_file, self._tasks[r],
                                              self._results), daemon=True)
            for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args, timeout: float = 180.0, **kwargs) -> list[Any]:
        """``[fn(rank, world_size, *args, **kwargs) for every rank]``, run concurrently."""
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put(payload)
        values: list[Any | None] = [None] * self.world_size
        errors = {}
        pending = set(range(self.world_size))
        while pending:
            try:
                rank, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                dead = [r for r in pending if not self._procs[r].is_alive()]
                errors.update({r: "died" if r in dead else f"no result in {timeout} s"
                               for r in pending})
                break
            pending.discard(rank)
            if ok:
                values[rank] = pickle.loads(value)
            else:
                errors[rank] = value
        if errors:
            self._restart()
            details = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on rank(s) {sorted(errors)}:\n{details}")
        return values

    def _restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self._tmp.cleanup()


class PoolManager:
    """Keeps at most one pool alive (the ranks share a few cores) and switches world sizes."""

    def __init__(self):
        self._pool: WorkerPool | None = None

    def get(self, world_size: int) -> WorkerPool:
        if self._pool is not None and self._pool.world_size != world_size:
            self._pool.close()
            self._pool = None
        if self._pool is None:
            self._pool = WorkerPool(world_size)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
