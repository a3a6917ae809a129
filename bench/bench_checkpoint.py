"""Save and load of ~1 GB in ~300 tensors: fsdp_ema vs torch.save, dcp.save, safetensors, and the
raw rate of the same bytes, in one run, on a tmpfs directory and on the project's disk.

Save rows: fsdp_ema (save_shard + commit, fsync), torch.save, dcp.save (fsyncs its files),
safetensors save_file, and "raw": the same bytes written as one file with one fsync.
Load rows (warm page cache, every byte read and, where a method checks, verified):
fsdp_ema C++ reader (load_tensors: owned memory, checksums verified in the same pass; and with
mmap=True, the zero-copy opt-in, touched), fsdp_ema load_into (into existing tensors, every
piece hashed before the first write), fsdp_ema load_shard (owned, verified), torch.load,
dcp.load (into existing tensors, as it always loads), safetensors load_file, and "raw": one
sequential read of the shard file into fresh memory.

Each method runs once per round, --repeat rounds, interleaved (this VM is noisy: fresh tmpfs
pages alone move a save 3x between runs); min and median are printed, targets use the median.

    python bench/bench_checkpoint.py [--gigabytes 1] [--places tmpfs,disk] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from bench_update import shard_sizes  # noqa: E402
from rawio import raw_read, raw_write  # noqa: E402
from report import finish  # noqa: E402

import fsdp_ema  # noqa: E402, F401  (loads the operator library)
from fsdp_ema import checkpoint as ckpt  # noqa: E402

warnings.filterwarnings("ignore")


def make_state(gigabytes: float, count: int) -> dict:
    sizes = shard_sizes(int(gigabytes * (1 << 30) / 4), count, world_size=1)
    g = torch.Generator().manual_seed(0)
    return {f"t{i:03d}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def touch(tensors) -> None:
    """Reads every byte of lazily mapped tensors (a load is done when its bytes were read)."""
    for t in tensors:
        if t.numel():
            t.view(torch.uint8).max()


def interleaved(methods: dict, repeat: int) -> dict:
    """{name: (fn, setup or None)} -> {name: [seconds per round]}, one call of each per round."""
    times = {name: [] for name in methods}
    for _ in range(repeat):
        for name, (fn, setup) in methods.items():
            if setup:
                setup()
            gc.collect()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def run_place(place: str, base: Path, state: dict, repeat: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    work = Path(tempfile.mkdtemp(prefix="fsdp_ema_bench_", dir=base))
    size = nbytes(state)
    flat = torch.cat([t.reshape(-1) for t in state.values()])
    names = list(state)
    paths = {k: work / k for k in ("ours", "torch", "dcp", "st", "raw")}

    def fresh(p: Path):
        return lambda: (shutil.rmtree(p, ignore_errors=True), p.mkdir())

    save = {
        "fsdp_ema save (fsync)": (lambda: ckpt.save(paths["ours"], state), fresh(paths["ours"])),
        "torch.save": (lambda: torch.save(state, paths["torch"] / "m.pt"), fresh(paths["torch"])),
        "dcp.save (fsync)": (lambda: dcp.save(state, checkpoint_id=str(paths["dcp"])),
                             fresh(paths["dcp"])),
        "safetensors save_file": (lambda: save_file(state, str(paths["st"] / "m.safetensors")),
                                  fresh(paths["st"])),
        "raw write (fsync)": (lambda: raw_write(paths["raw"] / "raw.bin", flat),
                              fresh(paths["raw"])),
    }
    results = {"save": interleaved(save, repeat), "load": {}, "bytes": size}

    shard = paths["ours"] / ckpt.shard_file_name(0, 1)
    shard_size = os.path.getsize(shard)
    dcp_target = {k: torch.empty_like(v) for k, v in state.items()}
    # load_into reads into tensors that exist already, as dcp.load does: each gets its own set.
    into_target = {k: torch.empty_like(v) for k, v in state.items()}

    def ours_reader():
        out = ckpt.load(paths["ours"], names, verify=True)  # owned, hashed while read
        assert len(out) == len(names)

    def ours_mmap():
        out = ckpt.load(paths["ours"], names, verify=True, mmap=True)  # zero-copy opt-in
        touch(out.values())

    def ours_load_into():
        ckpt.load_into(paths["ours"], into_target, verify=True)  # hashed before any write

    def ours_load_shard():
        out = ckpt.load_shard(shard, verify=True)
        assert len(out) == len(names)

    load = {
        "fsdp_ema C++ reader (owned, verified)": ours_reader,
        "fsdp_ema reader mmap=True (verified, + touch)": ours_mmap,
        "fsdp_ema load_into (existing tensors, verified)": ours_load_into,
        "fsdp_ema load_shard (owned, verified)": ours_load_shard,
        "torch.load": lambda: torch.load(paths["torch"] / "m.pt"),
        "dcp.load": lambda: dcp.load(dcp_target, checkpoint_id=str(paths["dcp"])),
        # load_file maps the file lazily: touch every byte so the load is really done.
        "safetensors load_file (+ touch)": lambda: touch(
            load_file(str(paths["st"] / "m.safetensors")).values()),
        "raw read": lambda: raw_read(shard, shard_size),
    }
    for fn in load.values():  # warm the page cache for every method alike
        fn()
    results["load"] = interleaved({k: (fn, None) for k, fn in load.items()}, repeat)
    shutil.rmtree(work, ignore_errors=True)
    return results


def report(place: str, r: dict) -> list:
    size = r["bytes"]
    print(f"\n{place}: {size / 2**30:.2f} GiB")
    checks = []
    for kind, raw_name, ours_name in (
        ("save", "raw write (fsync)", "fsdp_ema save (fsync)"),
        ("load", "raw read", "fsdp_ema C++ reader (owned, verified)"),
    ):
        runs = r[kind]
        rows = {name: statistics.median(xs) for name, xs in runs.items()}
        print(f"  {kind:5s} {'method':46s} {'min s':>8s} {'median s':>9s} {'GB/s':>7s} "
              f"{'vs ours':>8s}")
        for name, s in rows.items():
            print(f"        {name:46s} {min(runs[name]):8.3f} {s:9.3f} {size / s / 1e9:7.2f} "
                  f"{s / rows[ours_name]:7.2f}x")
        ours = rows[ours_name]
        if kind == "save":
            checks.append((f"{place}: save vs raw write", rows[raw_name] / ours >= 0.8,
                           f"{rows[raw_name] / ours:.0%} of the raw rate (target >= 80%)"))
            if place == "tmpfs":
                ratio = rows["dcp.save (fsync)"] / ours
                checks.append((f"{place}: save vs dcp.save", ratio >= 2.0,
                               f"{ratio:.2f}x (target >= 2x)"))
        else:
            ratio = ours / rows[raw_name]
            checks.append((f"{place}: verified owned load vs raw read", ratio <= 1.2,
                           f"{ratio:.2f}x the raw time (target <= 1.2x)"))
            for other, target in (("torch.load", 1.0), ("safetensors load_file (+ touch)", 1.0),
                                  ("dcp.load", 2.0)):
                ratio = rows[other] / ours
                checks.append((f"{place}: load vs {other}", ratio >= target,
                               f"{ratio:.2f}x (target >= {target}x)"))
            # dcp.load fills tensors the caller allocated (and, repeated, already touched): the
            # like-for-like row is ours into existing tensors too.
            ratio = rows["dcp.load"] / rows["fsdp_ema load_into (existing tensors, verified)"]
            checks.append((f"{place}: load_into vs dcp.load (both into existing tensors)",
                           ratio >= 2.0, f"{ratio:.2f}x (target >= 2.0x)"))
    return checks


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--places", default="tmpfs,disk")
    parser.add_argument("--disk-dir", type=Path, default=ROOT / "build" / "bench-disk")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    state = make_state(args.gigabytes, args.tensors)
    print(f"torch {torch.__version__}, {len(state)} tensors, threads {torch.get_num_threads()}")
    bases = {"tmpfs": Path("/dev/shm"), "disk": args.disk_dir}
    results, checks = {}, []
    for place in args.places.split(","):
        bases[place].mkdir(parents=True, exist_ok=True)
        results[place] = run_place(place, bases[place], state, args.repeat)
        checks += report(place, results[place])
    finish(results, checks, args.json)


if __name__ == "__main__":
    main()
