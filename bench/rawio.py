"""The "raw" rows of the I/O benchmarks: the same bytes as one plain file write or read."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def fsync_path(path: Path) -> None:
    """fsync of a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



def synced(save, path: Path):
    """save(), then fsync of ``path`` and of its directory: another library's save at our save's
    fsync policy."""
    def run():
        save()
        fsync_path(path)
        fsync_path(path.parent)
    return run


def raw_write(path: Path, data: torch.Tensor) -> None:
    """One write of a contiguous CPU tensor's bytes, fsync of the file and of its directory."""
    with open(path, "wb") as f:
        f.write(memoryview(data.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    fsync_path(path.parent)


def read_into(path: Path, buf: torch.Tensor, threads: int = 2,
              chunk: int = 8 << 20) -> None:
    """The file's bytes into ``buf`` (a contiguous uint8 CPU tensor, memory used before: no page
    faults), ``chunk`` bytes per ``os.preadv`` on ``threads`` threads: the kernel's copy out of
    the page cache, the least any load that reads its bytes once can spend."""
    from concurrent.futures import ThreadPoolExecutor

    view = memoryview(buf.numpy())
    size = len(view)
    fd = os.open(path, os.O_RDONLY)
    try:
        def job(first: int) -> None:
            for at in range(first * chunk, size, threads * chunk):
                end = min(at + chunk, size)
                if os.preadv(fd, [view[at:end]], at) != end - at:
                    raise OSError(f"{path}: short read at {at}")

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(job, range(threads)))
    finally:
        os.close(fd)


def raw_read(path: Path, size: int) -> torch.Tensor:
    """One sequential read of the file into freshly allocated memory, as any load must do."""
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return buf
