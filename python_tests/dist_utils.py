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


# --- ranks that may be killed ---------------------------------------------------------------------

_FORK_SERVER = r'''
import importlib, os, pickle, sys, traceback
sys.path[:0] = [{here!r}, {python!r}]
import torch
import fsdp_ema  # noqa: F401
for name in {preload!r}:
    importlib.import_module(name)
print("ready", flush=True)
for line in sys.stdin:
    request = line.strip()
    pid = os.fork()
    if pid == 0:
        code = 0
        os.dup2(2, 1)  # the child's prints must not reach the server's answers
        with open(request, "rb") as f:
            fn, args, init, out, rank, world, env = pickle.load(f)
        try:
            import datetime
            import torch.distributed as dist
            os.environ.update(env)
            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method="file://" + init, rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=60))
            result = ("ok", fn(rank, world, *args))
            dist.barrier()
        except BaseException:  # noqa: BLE001 (reported to the parent)
            result, code = ("error", traceback.format_exc()), 1
        with open(out + ".tmp", "wb") as f:
            pickle.dump(result, f)
        os.rename(out + ".tmp", out)
        sys.stdout.flush()
        os._exit(code)  # no interpreter shutdown: gloo's threads may still hold tensors
    print("pid", pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print("exit", status, flush=True)
'''


class ForkRanks:
    """``world`` fork servers, one per rank, that import torch, fsdp_ema and ``preload`` once;
    ``run(fn, *args)`` forks one child per rank, which form a fresh gloo group and run
    ``fn(rank, world, *args)``. A child may SIGKILL itself (a test's kill point): ``run`` returns,
    per rank, ``("ok", value)``, ``("error", traceback)`` or ``("killed", None)``. A killed rank
    costs a fork, not a new interpreter, so a test can kill ranks at many points."""

    def __init__(self, world: int, preload: tuple[str, ...] = ()):
        import subprocess

        self.world = world
        self._tmp = tempfile.TemporaryDirectory(prefix="fsdp_ema_fork_")
        code = _FORK_SERVER.format(here=str(_HERE), python=str(_PYTHON), preload=list(preload))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self._servers = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env)
                         for _ in range(world)]
        for s in self._servers:
            assert self._line(s, 300) == ["ready"], "fork server did not start"
        self._runs = 0

    @staticmethod
    def _line(server, timeout: float) -> list[str]:
        import select

        ready, _, _ = select.select([server.stdout], [], [], timeout)
        assert ready, "fork server did not answer"
        line = server.stdout.readline()
        assert line, "fork server died"
        return line.split()

    def run(self, fn: Callable[..., Any], *args, env: dict[str, str] | None = None,
            timeout: float = 300.0) -> list[tuple[str, Any]]:
        import signal

        self._runs += 1
        base = os.path.join(self._tmp.name, f"run{self._runs}")
        init = base + ".init"
        outs = [f"{base}.rank{r}.out" for r in range(self.world)]
        for r, server in enumerate(self._servers):
            request = f"{base}.rank{r}.request"
            with open(request, "wb") as f:
                pickle.dump((fn, args, init, outs[r], r, self.world, dict(env or {})), f)
            server.stdin.write(request + "\n")
            server.stdin.flush()
        pids = [int(self._line(s, 60)[1]) for s in self._servers]
        statuses: list[int | None] = [None] * self.world
        try:
            for r, server in enumerate(self._servers):
                statuses[r] = int(self._line(server, timeout)[1])
        except AssertionError:
            for pid in pids:  # a rank that hangs: the test fails, no rank is left behind
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for r, server in enumerate(self._servers):
                if statuses[r] is None:
                    self._line(server, 60)
            raise AssertionError(f"{fn.__name__}: a rank did not finish in {timeout} s") from None
        results = []
        for r, status in enumerate(statuses):
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                results.append(("killed", None))
            else:
                with open(outs[r], "rb") as f:
                    results.append(pickle.load(f))
        return results

    def close(self) -> None:
        for s in self._servers:
            try:
                s.stdin.close()
                s.wait(timeout=30)
            except Exception:  # noqa: BLE001
                s.kill()
        self._tmp.cleanup()
