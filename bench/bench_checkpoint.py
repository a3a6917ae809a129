"""Save and load of ~1 GiB in ~300 fp32 tensors: fsdp_ema vs torch.save/load, dcp.save/load,
safetensors and a raw write/read of the same bytes, under a user's conditions.

The conditions (issue 29: an earlier version of this benchmark reported a tenth of what a user
measured):
- every method's files lie in ONE directory (ours: the shard file and the index beside m.pt,
  m.safetensors, DCP's .metadata and .distcp, raw.bin), so a load lists and skips the others';
- one process; every method runs once per round, rounds interleaved; one warm-up round first
  (imports, first mappings), not counted;
- fresh memory per load: the previous result is dropped and gc'd before the next load starts;
- a load is done when every byte of its result was read (a mapped load reads nothing until
  then): each load is followed, inside the timing, by one pass reading every byte;
- "tmpfs" (/dev/shm) reads from memory; "disk" (--disk-dir, /var/tmp by default) saves with
  fsync and loads cold: before each load every file of the directory is fsync'd and dropped
  from the page cache with posix_fadvise(POSIX_FADV_DONTNEED), file by file (not
  /proc/sys/vm/drop_caches, which would also drop the caches of whoever else uses the machine);
  fincore checks once that the drop worked.

Per method: min / median / max seconds, GB/s of the median, the median's ratio to ours and to
the anchors, and per call (median) the minor and major page faults and the CPU seconds of all
the process's threads (getrusage). --diagnose adds the rows that decompose our owned load (no
verify, one thread, reads into memory faulted in already).

With --places cuda (scripts/gpu_check.sh runs it), loads from the page cache into CUDA memory
against dcp.load, safetensors and torch.load, beside the staging pipeline's two halves alone.

    python bench/bench_checkpoint.py [--gigabytes 1] [--places tmpfs,disk,cuda] [--repeat 5]
                                     [--diagnose] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from bench_update import shard_sizes  # noqa: E402
from rawio import raw_read, raw_write, synced  # noqa: E402
from report import finish  # noqa: E402

import fsdp_ema  # noqa: E402, F401  (loads the operator library)
from fsdp_ema import checkpoint as ckpt  # noqa: E402

warnings.filterwarnings("ignore")

OURS_SAVE = "fsdp_ema save (fsync)"
OURS_LOAD = "fsdp_ema load (owned, verified)"
OURS_MMAP = "fsdp_ema load mmap=True (verified)"
OURS_INTO = "fsdp_ema load_into (verified)"
ST_SAVE, ST_SAVE_NOSYNC = "safetensors save_file + fsync", "safetensors save_file"
ST_LOAD = "safetensors load_file"
OURS_DEV_INTO = "fsdp_ema load_into cuda (verified)"
OURS_DEV_INTO_NOVERIFY = "fsdp_ema load_into cuda (no verify)"
OURS_DEV_LOAD = "fsdp_ema load device=cuda (verified)"
DCP_DEV = "dcp.load (existing cuda tensors)"
READ_ALONE, H2D_ALONE = "read alone (fresh host memory)", "H2D alone (one pinned copy)"


def make_state(gigabytes: float, count: int) -> dict:
    sizes = shard_sizes(int(gigabytes * (1 << 30) / 4), count, world_size=1)
    g = torch.Generator().manual_seed(0)
    return {f"t{i:03d}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def read_every_byte(result) -> None:
    """One pass reading every byte of a load's result (a dict of tensors, or one tensor)."""
    tensors = result.values() if isinstance(result, dict) else [result]
    for t in tensors:
        t = t[0] if isinstance(t, tuple) else t  # load_shard: (tensor, offsets, global shape)
        if t.numel():
            t.view(-1).view(torch.uint8).max()


def drop_cache(directory: Path) -> None:
    """fsync, then POSIX_FADV_DONTNEED, every file of the directory (a cold read follows)."""
    for p in directory.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cached_bytes(directory: Path) -> str:
    files = [str(p) for p in directory.iterdir() if p.is_file()]
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "-o", "RES", *files],
                             capture_output=True, text=True, check=True).stdout
        return f"{sum(int(x) for x in out.split()) / 2**20:.1f} MiB"
    except (OSError, subprocess.CalledProcessError, ValueError):
        return "unknown (no fincore)"


def usage() -> tuple[float, int, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt, r.ru_majflt


def machine_line() -> str:
    load = Path("/proc/loadavg").read_text().split()[:3]
    # top's second sample: CPU shares over the last 0.5 s (its first is since boot).
    out = subprocess.run(["top", "-b", "-n", "2", "-d", "0.5", "-w", "200"],
                         capture_output=True, text=True).stdout
    rows = out.split("PID USER")[-1].splitlines()[1:]
    busy = ", ".join(f"{r.split()[11]} {r.split()[8]}%" for r in rows[:5] if len(r.split()) > 11)
    return f"load average {' '.join(load)}; busiest processes: {busy}"


def run_rounds(methods: dict, repeat: int, before=None, read: bool = True) -> dict:
    """{name: (fn, setup or None)} -> {name: {"s": [...], "minflt": [...], ...}}.

    Each round calls every method once; `before` (untimed, e.g. the cache drop) and the method's
    setup run first. A method's result is read whole inside its timing, then dropped and gc'd.
    One warm-up round is not recorded."""
    runs = {name: {"s": [], "cpu": [], "minflt": [], "majflt": []} for name in methods}
    for r in range(repeat + 1):
        for name, (fn, setup) in methods.items():
            if setup:
                setup()
            if before:
                before()
            gc.collect()
            cpu0, min0, maj0 = usage()
            t0 = time.perf_counter()
            result = fn()
            if read:
                read_every_byte(result)
            seconds = time.perf_counter() - t0
            cpu1, min1, maj1 = usage()
            del result
            gc.collect()
            if r == 0:
                continue
            row = runs[name]
            row["s"].append(seconds)
            row["cpu"].append(cpu1 - cpu0)
            row["minflt"].append(min1 - min0)
            row["majflt"].append(maj1 - maj0)
    return runs


def remove(*paths: Path):
    def setup():
        for p in paths:
            if p.is_dir():
                for q in p.iterdir():
                    q.unlink()
                p.rmdir()
            elif p.exists():
                p.unlink()
    return setup


def run_place(place: str, work: Path, state: dict, repeat: int, diagnose: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    work.mkdir(parents=True, exist_ok=True)
    for p in work.iterdir():  # a previous run's files
        remove(p)()
    size = nbytes(state)
    flat = torch.cat([t.reshape(-1) for t in state.values()])
    names = list(state)
    shard = work / ckpt.shard_file_name(0, 1)
    index = work / "fsdp_ema.index.json"
    pt, st, raw = work / "m.pt", work / "m.safetensors", work / "raw.bin"
    dcp_files = (work / ".metadata", work / "__0_0.distcp")

    save = {
        OURS_SAVE: (lambda: ckpt.save(work, state, fsync=True), remove(shard, index)),
        "fsdp_ema save (no fsync)": (lambda: ckpt.save(work, state, fsync=False),
                                     remove(shard, index)),
        "torch.save + fsync": (synced(lambda: torch.save(state, pt), pt), remove(pt)),
        "dcp.save (fsyncs)": (lambda: dcp.save(state, checkpoint_id=str(work)),
                              remove(*dcp_files)),
        ST_SAVE: (synced(lambda: save_file(state, str(st)), st), remove(st)),
        ST_SAVE_NOSYNC: (lambda: save_file(state, str(st)), remove(st)),
        "raw write + fsync": (lambda: raw_write(raw, flat), remove(raw)),
    }
    results = {"bytes": size, "save": run_rounds(save, repeat, read=False)}
    # The last round of each left its files: every method's file is in `work` for the loads.
    cold = place != "tmpfs"
    if cold:
        drop_cache(work)
        print(f"  {place}: after the drop, {cached_bytes(work)} of the directory's files are in "
              "the page cache")

    # Tensors that exist already (as a model's parameters do), faulted in once, outside timing.
    dcp_target = {k: torch.empty_like(v).zero_() for k, v in state.items()}
    into_target = {k: torch.empty_like(v).zero_() for k, v in state.items()}

    def ours_into():
        ckpt.load_into(work, into_target, verify=True)
        return into_target

    def dcp_load():
        dcp.load(dcp_target, checkpoint_id=str(work))
        return dcp_target

    load = {
        OURS_LOAD: lambda: ckpt.load(work, names, verify=True),
        OURS_MMAP: lambda: ckpt.load(work, names, verify=True, mmap=True),
        OURS_INTO: ours_into,
        "fsdp_ema load_shard (owned, verified)": lambda: ckpt.load_shard(shard, verify=True),
        "torch.load": lambda: torch.load(pt),
        "dcp.load (existing tensors)": dcp_load,
        ST_LOAD: lambda: load_file(str(st)),
        "raw read (fresh memory)": lambda: raw_read(raw, size),
    }
    if diagnose:
        reused = torch.empty(size, dtype=torch.uint8).zero_()
        one_thread = torch.get_num_threads()

        def single(fn):
            def run():
                torch.set_num_threads(1)
                try:
                    return fn()
                finally:
                    torch.set_num_threads(one_thread)
            return run

        def raw_into_reused():
            with open(raw, "rb", buffering=0) as f:
                f.readinto(memoryview(reused.numpy()))
            return reused

        load.update({
            "diag: fsdp_ema load (owned, no verify)": lambda: ckpt.load(work, names, verify=False),
            "diag: fsdp_ema load (owned, verified, 1 thread)":
                single(lambda: ckpt.load(work, names, verify=True)),
            "diag: fsdp_ema load (owned, no verify, 1 thread)":
                single(lambda: ckpt.load(work, names, verify=False)),
            "diag: raw read into faulted-in memory": raw_into_reused,
            "diag: fsdp_ema load_into (no verify)":
                lambda: (ckpt.load_into(work, into_target, verify=False), into_target)[1],
        })
    results["load"] = run_rounds({k: (fn, None) for k, fn in load.items()}, repeat,
                                 before=(lambda: drop_cache(work)) if cold else None)
    for p in list(work.iterdir()):
        remove(p)()
    work.rmdir()
    return results


def run_device(work: Path, state: dict, repeat: int) -> dict:
    """Loads from the page cache (tmpfs) into CUDA memory: ours (staged through two pinned
    buffers, format/read/read_exec.cpp) against dcp.load, safetensors' load_file(device="cuda") and
    torch.load(map_location="cuda"), beside the pipeline's two halves measured alone: a read of
    the same bytes into host memory and one host-to-device copy of them from pinned memory. A
    load is done when the device is (a synchronize inside the timing)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    work.mkdir(parents=True, exist_ok=True)
    size = nbytes(state)
    names = list(state)
    pt, st, raw = work / "m.pt", work / "m.safetensors", work / "raw.bin"
    ckpt.save(work, state)
    torch.save(state, pt)
    save_file(state, str(st))
    dcp.save(state, checkpoint_id=str(work))
    raw_write(raw, torch.cat([t.reshape(-1) for t in state.values()]))
    targets = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
    dcp_targets = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
    pinned = torch.empty(size, dtype=torch.uint8).pin_memory()
    device_bytes = torch.empty(size, dtype=torch.uint8, device="cuda")

    def synced_cuda(fn):
        def run():
            out = fn()
            torch.cuda.synchronize()
            return out
        return run

    def h2d():
        device_bytes.copy_(pinned, non_blocking=True)
        return device_bytes

    load = {
        OURS_DEV_INTO: lambda: (ckpt.load_into(work, targets, verify=True), targets)[1],
        OURS_DEV_INTO_NOVERIFY: lambda: (ckpt.load_into(work, targets, verify=False), targets)[1],
        OURS_DEV_LOAD: lambda: ckpt.load(work, names, verify=True, device="cuda"),
        DCP_DEV: lambda: (dcp.load(dcp_targets, checkpoint_id=str(work)), dcp_targets)[1],
        "safetensors load_file(device=cuda)": lambda: load_file(str(st), device="cuda"),
        "torch.load(map_location=cuda)": lambda: torch.load(pt, map_location="cuda"),
        READ_ALONE: lambda: raw_read(raw, size),
        H2D_ALONE: h2d,
    }
    runs = run_rounds({k: (synced_cuda(fn), None) for k, fn in load.items()}, repeat, read=False)
    for p in list(work.iterdir()):
        remove(p)()
    work.rmdir()
    return {"bytes": size, "load": runs}


def report_device(r: dict) -> list:
    size = r["bytes"]
    print(f"\ncuda (from the page cache): {size / 2**30:.2f} GiB")
    ld = print_rows("load to cuda", r["load"], size, OURS_DEV_INTO,
                    [DCP_DEV, "safetensors load_file(device=cuda)", READ_ALONE, H2D_ALONE])
    floor, total = max(ld[READ_ALONE], ld[H2D_ALONE]), ld[READ_ALONE] + ld[H2D_ALONE]
    return [
        ("cuda: unverified load_into nearer max(read, H2D) than their sum",
         ld[OURS_DEV_INTO_NOVERIFY] <= (floor + total) / 2,
         f"{ld[OURS_DEV_INTO_NOVERIFY]:.3f} s; max {floor:.3f} s, sum {total:.3f} s"),
        ("cuda: verified load_into >= 2x dcp.load", ld[DCP_DEV] >= 2 * ld[OURS_DEV_INTO],
         f"{ld[DCP_DEV] / ld[OURS_DEV_INTO]:.2f}x"),
    ]


def print_rows(title: str, runs: dict, size: int, ours: str, anchors: list[str]) -> dict:
    med = {name: statistics.median(r["s"]) for name, r in runs.items()}
    head = "".join(f" {'/' + a.split()[0][:10]:>11s}" for a in anchors)
    print(f"  {title:46s} {'min s':>7s} {'median':>7s} {'max s':>7s} {'GB/s':>6s} "
          f"{'/ours':>6s}{head} {'minflt':>8s} {'majflt':>7s} {'cpu s':>6s}")
    for name, r in runs.items():
        ratios = "".join(f" {med[name] / med[a]:10.2f}x" for a in anchors)
        print(f"  {name:46s} {min(r['s']):7.3f} {med[name]:7.3f} {max(r['s']):7.3f} "
              f"{size / med[name] / 1e9:6.2f} {med[name] / med[ours]:5.2f}x{ratios} "
              f"{statistics.median(r['minflt']):8.0f} {statistics.median(r['majflt']):7.0f} "
              f"{statistics.median(r['cpu']):6.2f}")
    return med


def report(place: str, r: dict) -> list:
    size = r["bytes"]
    rounds = len(r["load"][OURS_LOAD]["s"])
    print(f"\n{place}: {size / 2**30:.2f} GiB; min / median / max of {rounds} rounds; ratios are "
          "of medians; faults and CPU seconds are medians per call")
    s = print_rows("save", r["save"], size, OURS_SAVE,
                   [ST_SAVE, "dcp.save (fsyncs)", "raw write + fsync"])
    ld = print_rows("load (+ a read of every byte)", r["load"], size, OURS_LOAD,
                    ["torch.load", ST_LOAD, "dcp.load (existing tensors)",
                     "raw read (fresh memory)"])
    ours_min = min(r["load"][OURS_LOAD]["s"])

    def check(name, ok, detail):
        return (f"{place}: {name}", bool(ok), detail)

    return [
        check("verified owned load <= torch.load (median)", ld[OURS_LOAD] <= ld["torch.load"],
              f"{ld[OURS_LOAD]:.3f} s vs {ld['torch.load']:.3f} s "
              f"({ld[OURS_LOAD] / ld['torch.load']:.2f}x)"),
        check("verified owned load median within 1.2x of its min",
              ld[OURS_LOAD] <= 1.2 * ours_min,
              f"median {ld[OURS_LOAD]:.3f} s, min {ours_min:.3f} s "
              f"({ld[OURS_LOAD] / ours_min:.2f}x)"),
        check("verified mmap=True load <= 1.5x safetensors load_file + read",
              ld[OURS_MMAP] <= 1.5 * ld[ST_LOAD], f"{ld[OURS_MMAP] / ld[ST_LOAD]:.2f}x"),
        check("load_into >= 2x dcp.load", ld["dcp.load (existing tensors)"] >= 2 * ld[OURS_INTO],
              f"{ld['dcp.load (existing tensors)'] / ld[OURS_INTO]:.2f}x"),
        check("save (fsync) within 1.1x of safetensors save_file + fsync",
              s[OURS_SAVE] <= 1.1 * s[ST_SAVE], f"{s[OURS_SAVE] / s[ST_SAVE]:.2f}x"),
        check("save (no fsync) within 1.1x of safetensors save_file",
              s["fsdp_ema save (no fsync)"] <= 1.1 * s[ST_SAVE_NOSYNC],
              f"{s['fsdp_ema save (no fsync)'] / s[ST_SAVE_NOSYNC]:.2f}x"),
        check("save >= 1.5x dcp.save (both fsync)", s["dcp.save (fsyncs)"] >= 1.5 * s[OURS_SAVE],
              f"{s['dcp.save (fsyncs)'] / s[OURS_SAVE]:.2f}x"),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--places", default="tmpfs,disk",
                        help="comma-separated: tmpfs, disk, cuda (loads into CUDA memory)")
    parser.add_argument("--disk-dir", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--diagnose", action="store_true",
                        help="add the rows that decompose our owned load")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    state = make_state(args.gigabytes, args.tensors)
    print(f"torch {torch.__version__}, {len(state)} tensors, threads {torch.get_num_threads()}, "
          f"pid {os.getpid()}")
    print(f"start: {machine_line()}")
    bases = {"tmpfs": Path("/dev/shm"), "disk": args.disk_dir}
    results, checks = {}, []
    for place in args.places.split(","):
        work = bases.get(place, bases["tmpfs"]) / f"fsdp_ema_bench_{os.getpid()}"
        if place == "cuda":
            results[place] = run_device(work, state, args.repeat)
            checks += report_device(results[place])
        else:
            results[place] = run_place(place, work, state, args.repeat, args.diagnose)
            checks += report(place, results[place])
        print(f"after {place}: {machine_line()}")
    finish(results, checks, args.json)


if __name__ == "__main__":
    main()
