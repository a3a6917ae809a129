"""Resharded loads (issue 33): a rank of M loading its rows of a checkpoint written by W ranks
(~1 GiB in ~300 fp32 tensors) against a raw read of exactly that rank's bytes from the same
files (pread of each intersecting run into fresh memory), in one process, rounds interleaved.

Per case W->M: the bytes each load read (the process's rchar, so page-cache reads count) against
the rank's own bytes, and the time (min / median of the rounds, summed over the M ranks) against
the raw read, and against our own load of a checkpoint written by M ranks (each rank's rows one
stored piece: no resharding), which isolates what resharding costs beyond a verified load.
Targets: bytes read <= own bytes + one block per piece edge; time <= 1.1x the raw read.

    python bench/bench_reshard.py [--gigabytes 1] [--repeat 5] [--dir /dev/shm] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import struct
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from bench_update import shard_sizes  # noqa: E402
from report import finish  # noqa: E402

import fsdp_ema  # noqa: E402, F401  (loads the operator library)
from fsdp_ema import checkpoint as ckpt  # noqa: E402

CASES = [(2, 1), (1, 2), (2, 3)]
BLOCK = 256 << 10  # kChecksumBlockBytes (format/include/fsdp_ema/format/checksum.h)


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def chunk(rows: int, rank: int, world: int) -> tuple[int, int]:
    cs = -(-rows // world)
    b = min(rank * cs, rows)
    return b, min(b + cs, rows)


def write(directory: Path, state: dict, writers: int) -> None:
    for r in range(writers):
        pieces = {}
        for name, t in state.items():
            b, e = chunk(t.shape[0], r, writers)
            if e > b:
                pieces[name] = (t[b:e], [b], list(t.shape))
        ckpt.save_shard(directory, pieces, rank=r, world_size=writers, fsync=False)
    ckpt.commit(directory, writers, fsync=False)


def data_offsets(path: Path) -> dict:
    """name -> absolute [begin, end) in the file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def raw_plan(directory: Path, state: dict, writers: int, rank: int, world: int) -> list:
    """Per tensor: (its rows' element count, [(file, offset, length, destination byte)])."""
    files = {w: directory / ckpt.shard_file_name(w, writers) for w in range(writers)}
    offsets = {w: data_offsets(p) for w, p in files.items()}
    plan = []
    for name, t in state.items():
        lo, hi = chunk(t.shape[0], rank, world)
        runs = []
        for w in range(writers):
            pb, pe = chunk(t.shape[0], w, writers)
            a, b = max(lo, pb), min(hi, pe)
            if b > a:
                begin = offsets[w][name][0] + (a - pb) * 4
                runs.append((files[w], begin, (b - a) * 4, (a - lo) * 4))
        plan.append((hi - lo, runs))
    return plan


def raw_read(plan: list) -> list:
    """The rank's bytes and nothing else: one pread per run, into fresh tensors."""
    fds, out = {}, []
    try:
        for numel, runs in plan:
            t = torch.empty(numel, dtype=torch.float32)
            view = memoryview(t.numpy()).cast("B")
            for path, offset, length, at in runs:
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                got = os.preadv(fd, [view[at:at + length]], offset)
                assert got == length
            out.append(t)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def measure(fn) -> tuple[float, int]:
    gc.collect()
    c0, t0 = rchar(), time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    read = rchar() - c0
    del result
    return seconds, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = shard_sizes(int(args.gigabytes * (1 << 30) / 4), args.tensors, world_size=1)
    g = torch.Generator().manual_seed(0)
    state = {f"t{i:03d}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    own_total = sum(t.numel() * 4 for t in state.values())
    work = args.dir / f"fsdp_ema_bench_reshard_{os.getpid()}"
    results, checks = {}, []
    print(f"{len(state)} tensors, {own_total / 2**30:.2f} GiB, files in {args.dir}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.2f}")
    try:
        for writers in sorted({w for c in CASES for w in c}):
            write(work / f"w{writers}", state, writers)
        for writers, world in CASES:
            directory = work / f"w{writers}"
            plans = [raw_plan(directory, state, writers, r, world) for r in range(world)]
            native = work / f"w{world}"
            ours_t, raw_t, native_t = [], [], []
            ours_bytes = raw_bytes = 0
            for rnd in range(args.repeat + 1):  # round 0 warms up
                o = r_ = n_ = 0.0
                ob = rb = 0
                for rank in range(world):
                    s, b = measure(lambda: ckpt.load(directory, rank=rank, world_size=world))
                    o, ob = o + s, ob + b
                    s, b = measure(lambda: raw_read(plans[rank]))
                    r_, rb = r_ + s, rb + b
                    s, _ = measure(lambda: ckpt.load(native, rank=rank, world_size=world))
                    n_ += s
                if rnd > 0:
                    ours_t.append(o)
                    raw_t.append(r_)
                    native_t.append(n_)
                    ours_bytes, raw_bytes = ob, rb
            # Pieces each rank's rows touch: two edges each, one block at most per edge.
            edges = 0
            for rank in range(world):
                for t in state.values():
                    lo, hi = chunk(t.shape[0], rank, world)
                    for w in range(writers):
                        pb, pe = chunk(t.shape[0], w, writers)
                        edges += 2 if min(hi, pe) > max(lo, pb) else 0
            key = f"{writers}->{world}"
            ratio = statistics.median(ours_t) / statistics.median(raw_t)
            native_ratio = statistics.median(ours_t) / statistics.median(native_t)
            results[key] = {"ours_s": ours_t, "raw_s": raw_t, "native_s": native_t,
                            "ours_bytes": ours_bytes,
                            "raw_bytes": raw_bytes, "own_bytes": own_total, "edges": edges}
            print(f"{key}: ours min {min(ours_t):.3f} s median {statistics.median(ours_t):.3f} s"
                  f" | raw read of the rank's bytes min {min(raw_t):.3f} s median "
                  f"{statistics.median(raw_t):.3f} s | ratio {ratio:.2f}x | ours unresharded "
                  f"({world}->{world}) median {statistics.median(native_t):.3f} s, ratio "
                  f"{native_ratio:.2f}x | bytes read "
                  f"{ours_bytes / 2**20:.1f} MiB (raw {raw_bytes / 2**20:.1f} MiB, own "
                  f"{own_total / 2**20:.1f} MiB, {edges} piece edges)")
            checks.append((f"{key}: bytes read <= own bytes + one block per piece edge",
                           ours_bytes <= own_total + edges * BLOCK + (1 << 20),
                           f"{ours_bytes / own_total:.3f}x own bytes"))
            checks.append((f"{key}: time <= 1.1x a raw read of the rank's bytes (median)",
                           ratio <= 1.1, f"{ratio:.2f}x"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    finish(results, checks, args.json)


if __name__ == "__main__":
    main()
