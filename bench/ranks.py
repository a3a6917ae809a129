"""Shared by the multi-rank benchmarks: one spawned process per rank, and its process group.

``spawn(worker, args, world)`` runs ``worker(rank, init_file, args, queue)`` in ``world``
processes and returns what rank 0 puts on ``queue``. A rank that dies stops the run with its exit
code instead of leaving the parent waiting on the queue forever.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import tempfile

import torch
import torch.multiprocessing as mp


def spawn(worker, args, world: int):
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fsdp_ema_bench_init_") as tmp:
        queue = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, os.path.join(tmp, "init"), args, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        while True:
            try:
                results = queue.get(timeout=1.0)
                break
            except queue_mod.Empty:
                failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode]
                if failed:
                    for p in procs:
                        p.kill()
                    raise SystemExit(
                        f"rank {failed[0][0]} failed (exit code {failed[0][1]})") from None
        for p in procs:
            p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit("a rank failed")
    return results


def shared_tmpdir(base, prefix: str):
    """A new directory under ``base`` made by rank 0, its path handed to every rank
    (collective over the default group)."""
    import tempfile
    from pathlib import Path

    import torch.distributed as dist

    work = None
    if dist.get_rank() == 0:
        Path(base).mkdir(parents=True, exist_ok=True)
        work = tempfile.mkdtemp(prefix=prefix, dir=base)
    box = [work]
    dist.broadcast_object_list(box)
    return Path(box[0])


def init_group(rank: int, init_file: str, world: int, device: str = "cpu") -> torch.device:
    """The default process group (NCCL for CUDA, one GPU per rank; gloo on the CPU); returns the
    rank's device."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    return torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
