"""Save at parity (issue 41): fsdp_ema.checkpoint.save against safetensors' save_file, ~1 GiB in
~300 fp32 tensors (bench_checkpoint.py's state) to tmpfs, no fsync on either side, with one or
more builds of the library side by side in the same run (an A/B of two builds: --library).

Each arm lives in its own process (one library per process), holding its own copy of the state;
the parent runs the rounds interleaved, the order rotating each round, one warm-up round first
(not counted); every save writes new files (the previous ones are removed before, untimed).
Prints per arm min and median seconds, the ratio to save_file (min/min, median/median and the
median of the per-round ratios) and the load average before and after.

    python bench/bench_save_parity.py [--rounds 15] [--gigabytes 1] [--dir /dev/shm/...]
        [--library before=/path/to/old/libfsdp_ema.so] [--library after=build/lib/libfsdp_ema.so]

Without --library the arm "fsdp_ema" uses the library fsdp_ema finds (FSDP_EMA_LIBRARY, the
build of this checkout). The target: the median within 1.1x of save_file's.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAFETENSORS = "safetensors save_file"


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def worker(conn, kind: str, library: str | None, gigabytes: float, tensors: int, work: str):
    """One arm: makes the state, then saves to `work` each time the parent asks, replying with
    the wall seconds the save took and the CPU seconds of all the process's threads."""
    if library:
        os.environ["FSDP_EMA_LIBRARY"] = library
    sys.path.insert(0, str(ROOT / "python"))
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_checkpoint import make_state

    state = make_state(gigabytes, tensors)
    path = Path(work)
    if kind == "safetensors":
        from safetensors.torch import save_file

        def save():
            save_file(state, str(path / "model.safetensors"))
    else:
        from fsdp_ema import checkpoint as ckpt

        def save():
            ckpt.save(path / "ckpt", state, fsync=False)

    conn.send("ready")
    while conn.recv() == "save":
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        gc.collect()
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        save()
        conn.send((time.perf_counter() - t0, cpu_seconds() - c0))
    shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm/fsdp_ema_bench_save_parity"))
    parser.add_argument("--library", action="append", default=[], metavar="LABEL=PATH",
                        help="an arm saving with this build of libfsdp_ema.so (repeatable)")
    args = parser.parse_args()
    arms = [(SAFETENSORS, "safetensors", None)]
    for spec in args.library or ["fsdp_ema="]:
        label, _, lib = spec.partition("=")
        if lib and not Path(lib).is_file():
            sys.exit(f"--library {spec!r}: {lib!r} is not a file")
        arms.append((f"fsdp_ema save ({label})" if args.library else "fsdp_ema save", "ours",
                     str(Path(lib).resolve()) if lib else None))
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for i, (_, kind, lib) in enumerate(arms):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker, args=(child, kind, lib, args.gigabytes, args.tensors,
                                             str(args.dir / f"arm{i}")))
        p.start()
        procs.append(p)
        conns.append(parent)
    try:
        for c in conns:
            assert c.recv() == "ready"
        times = [[] for _ in arms]
        cpus = [[] for _ in arms]
        load_before = os.getloadavg()
        for r in range(args.rounds + 1):
            for k in range(len(arms)):
                i = (k + r) % len(arms)
                conns[i].send("save")
                dt, cpu = conns[i].recv()
                if r > 0:
                    times[i].append(dt)
                    cpus[i].append(cpu)
        load_after = os.getloadavg()
    finally:
        for c in conns:
            c.send("stop")
        for p in procs:
            p.join()
        shutil.rmtree(args.dir, ignore_errors=True)

    gib = args.gigabytes
    print(f"save of {gib:g} GiB in {args.tensors} fp32 tensors to {args.dir.parent}, no fsync, "
          f"{args.rounds} interleaved rounds; load average "
          f"{' '.join(f'{x:.2f}' for x in load_before)} before, "
          f"{' '.join(f'{x:.2f}' for x in load_after)} after\n")
    st, st_cpu = times[0], statistics.median(cpus[0])
    print(f"{'arm':28} {'min s':>6} {'median s':>8}   ratio to save_file: min/min  median/median"
          "  paired median   CPU s (median, ratio)")
    for (label, _, _), t, c in zip(arms, times, cpus):
        paired = statistics.median(a / b for a, b in zip(t, st))
        cpu = statistics.median(c)
        print(f"{label:28} {min(t):6.3f} {statistics.median(t):8.3f}   "
              f"{min(t) / min(st):21.3f}x {statistics.median(t) / statistics.median(st):13.3f}x "
              f"{paired:13.3f}x   {cpu:8.3f} {cpu / st_cpu:6.3f}x")


if __name__ == "__main__":
    main()
