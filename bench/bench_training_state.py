"""Save and load of a full training state (FSDP2 model + AdamW state + fp32 ShardedEMA) at 2
ranks (gloo, CPU): fsdp_ema.save_training_state / load_training_state vs dcp.save / dcp.load of
the same state dicts (get_model_state_dict + get_optimizer_state_dict + ShardedEMA.state_dict,
then set_* / load_state_dict), and the raw rate (each rank writes / reads its share of the bytes
as one file), in one run, on tmpfs (/dev/shm) and on the project's disk.

Times are wall times of the slowest rank (barrier before and after). Saves: medians of --repeat
runs each. Loads: --repeat paired rounds, each round one load of every kind in turn
(interleaved, so that a busy machine slows all alike), min and median per kind, and the median
of the per-round ratios dcp.load / ours (the target's figure). Saves fsync (ours and DCP's
FileSystemWriter both do; raw: one fsync). Loads run with a warm page cache (nothing drops caches
on a shared machine); ours reads each byte once into staging memory, verified in that read, then
copies into place once every rank has read (the "diag" row without checksums shows the hashing
cost). The "bound" row is what no all-or-nothing load can go below: this rank's file read once by
the kernel into memory used before, then the model's share copied (its parameters keep their
storage, so their bytes can only be written after every rank has agreed); dcp.load over it is the
largest ratio any such load could reach in this run.

Resume (--resume-rounds, on tmpfs): each load in 2 fresh rank processes, into a model, an
optimizer without state and an EMA made as a restarted job makes them; ours and DCP's recipe
(get_state_dict, which initializes the optimizer's state with torch's step at lr 0, dcp.load,
set_state_dict) alternate, paired by round.

    python bench/bench_training_state.py [--megabytes 1024] [--places tmpfs,disk]
                                         [--resume-rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
import rawio  # noqa: E402
from ranks import init_group, shared_tmpdir, spawn  # noqa: E402

WORLD = 2
BOUND = "bound: read once + copy model"


def build(total_bytes: int, world: int = WORLD, device: str = "cpu", trained: bool = True):
    """An FSDP2 MLP on ``device`` whose fp32 weights + AdamW moments + fp32 EMA take ~total_bytes
    over ``world`` ranks (4 copies of the weights), with AdamW state after one step (``trained``;
    else as a restarted job makes them: an optimizer without state, an EMA never updated)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fsdp_ema

    width = 2048
    layers = max(1, round(total_bytes / 16 / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    mesh = init_device_mesh(device, (world,))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if not trained:
        return model, opt, fsdp_ema.ShardedEMA(model, 0.999)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad()
    ema = fsdp_ema.ShardedEMA(model, 0.999)
    ema.update()
    return model, opt, ema


def timed(fn, repeat, setup=None):
    return statistics.median(timed_runs(fn, repeat, setup))


def timed_runs(fn, repeat, setup=None) -> list[float]:
    import torch.distributed as dist

    times = []
    for _ in range(repeat):
        if setup:
            setup()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


def interleaved(fns: dict, rounds: int) -> dict[str, list[float]]:
    """``rounds`` rounds of one run of each of ``fns`` in turn: the times by name."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name] += timed_runs(fn, 1)
    return times


def state_dicts(model, opt, ema) -> dict:
    """What DCP saves and loads: the model's, the optimizer's and the EMA's state dicts."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
            "ema": ema.state_dict()}


def dcp_load(directory: Path, model, opt, ema) -> None:
    """dcp.load into the state dicts, then each put back into its object."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sd = state_dicts(model, opt, ema)
    dcp.load(sd, checkpoint_id=str(directory))
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    ema.load_state_dict(sd["ema"])


def bound_row(own_file: Path, share: int, model_bytes: int):
    """The bound of an all-or-nothing load: this rank's file read once by the kernel into memory
    used before (no page faults, no checksums, nothing parsed), then the model's share copied
    (FSDP2 parameters keep their storage, so after the agreement their bytes must be copied in;
    the optimizer's are handed over and the EMA's could be)."""
    reused = torch.ones(share, dtype=torch.uint8)
    model_copy = torch.ones(model_bytes, dtype=torch.uint8)

    def bound():
        rawio.read_into(own_file, reused, threads=os.cpu_count() or 1)
        model_copy.copy_(reused[:model_bytes])

    return bound


def worker(rank, init_file, args, out_queue):
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp

    import fsdp_ema

    torch.set_num_threads(1)
    init_group(rank, init_file, WORLD)
    model, opt, ema = build(int(args.megabytes * 2**20))
    local = sum(t.numel() * t.element_size() for t in
                [p._local_tensor for p in model.parameters()]) * 4
    total = torch.tensor(local)
    dist.all_reduce(total)
    results = {"bytes": int(total), "places": {}}

    for place in args.places.split(","):
        base = Path("/dev/shm") if place == "tmpfs" else args.disk_dir
        work = shared_tmpdir(base, "fsdp_ema_bench_ts_")
        ours, dcp_dir, raw_dir = work / "ours", work / "dcp", work / "raw"

        def fresh(p):
            def setup():
                if rank == 0:
                    shutil.rmtree(p, ignore_errors=True)
                    p.mkdir()
                dist.barrier()
            return setup

        def ours_save():
            fsdp_ema.save_training_state(ours, model=model, optimizer=opt, ema=ema,
                                         extra={"step": 1})

        def dcp_save():
            dcp.save(state_dicts(model, opt, ema), checkpoint_id=str(dcp_dir))

        # The raw rate: this rank's share of the bytes (its shard file's size) in one file.
        row = {"save": {}, "load": {}}
        row["save"]["fsdp_ema save_training_state"] = timed(ours_save, args.repeat, fresh(ours))
        row["save"]["dcp.save (get_state_dict)"] = timed(dcp_save, args.repeat, fresh(dcp_dir))
        share = os.path.getsize(ours / fsdp_ema.checkpoint.shard_file_name(rank, WORLD))
        payload = torch.randint(0, 255, (share,), dtype=torch.uint8)
        raw_file = raw_dir / f"rank{rank}.bin"

        def raw_write():
            rawio.raw_write(raw_file, payload)

        def raw_read():
            rawio.raw_read(raw_file, share)

        row["save"]["raw write (fsync)"] = timed(raw_write, args.repeat, fresh(raw_dir))

        def ours_load(verify=True):  # verify=False: a diagnostic (the hash pass's cost)
            fsdp_ema.load_training_state(ours, model=model, optimizer=opt, ema=ema, verify=verify)

        loads = {"fsdp_ema load_training_state": ours_load,
                 "dcp.load (+ set_state_dict)": lambda: dcp_load(dcp_dir, model, opt, ema),
                 "diag: ours, verify=False": lambda: ours_load(False), "raw read": raw_read,
                 BOUND: bound_row(ours / fsdp_ema.checkpoint.shard_file_name(rank, WORLD),
                                  share, local // 4)}
        for fn in loads.values():  # warm the page cache alike
            fn()
            dist.barrier()
        times = interleaved(loads, args.repeat)
        row["load"] = {name: statistics.median(ts) for name, ts in times.items()}
        row["load_min"] = {name: min(ts) for name, ts in times.items()}
        row["load_rounds"] = times
        results["places"][place] = row
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    if rank == 0:
        out_queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


# --- resume: each load in fresh processes, into objects a restarted job has just made ------------

def resume_save(rank, init_file, args, out_queue):
    """Writes the state once, ours and DCP's, under args.resume_dir."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fsdp_ema

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    init_group(rank, init_file, WORLD)
    model, opt, ema = build(int(args.megabytes * 2**20))
    fsdp_ema.save_training_state(Path(args.resume_dir) / "ours", model=model, optimizer=opt,
                                 ema=ema, extra={"step": 1})
    dcp.save(state_dicts(model, opt, ema), checkpoint_id=str(Path(args.resume_dir) / "dcp"))
    if rank == 0:
        out_queue.put(True)
    dist.barrier()
    dist.destroy_process_group()


def resume_load(rank, init_file, job, out_queue):
    """One timed load (job = (kind, args)) into a fresh model, optimizer (no state) and EMA."""
    import torch.distributed as dist

    import fsdp_ema

    kind, args = job
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    init_group(rank, init_file, WORLD)
    model, opt, ema = build(int(args.megabytes * 2**20), trained=False)
    directory = Path(args.resume_dir) / kind
    dist.barrier()
    t0 = time.perf_counter()
    if kind == "ours":
        fsdp_ema.load_training_state(directory, model=model, optimizer=opt, ema=ema)
    else:
        dcp_load(directory, model, opt, ema)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        out_queue.put(elapsed)
    dist.barrier()
    dist.destroy_process_group()


def resume_rounds(args) -> dict[str, list[float]]:
    """``args.resume_rounds`` paired rounds on tmpfs: ours, then dcp.load's recipe, each in
    fresh processes (a restart: the optimizer has no state; DCP's recipe makes its template with
    torch's step at lr 0, ours from the parameters)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fsdp_ema_bench_resume_", dir="/dev/shm") as d:
        args.resume_dir = d
        spawn(resume_save, args, WORLD)
        times: dict[str, list[float]] = {"ours": [], "dcp": []}
        for _ in range(args.resume_rounds):
            for kind in times:
                times[kind].append(spawn(resume_load, (kind, args), WORLD))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=1024,
                        help="weights + AdamW moments + EMA over all ranks (default 1024)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--places", default="tmpfs,disk")
    parser.add_argument("--disk-dir", type=Path, default=ROOT / "build" / "bench-disk")
    parser.add_argument("--resume-rounds", type=int, default=5,
                        help="paired resumes in fresh processes, on tmpfs (0: none)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from report import finish

    results = spawn(worker, args, WORLD)
    if args.resume_rounds:
        results["resume"] = resume_rounds(args)
    size = results["bytes"]
    print(f"torch {torch.__version__}, {WORLD} ranks (gloo, CPU, 1 thread each), FSDP2 MLP: "
          f"weights + AdamW exp_avg/exp_avg_sq + fp32 EMA = {size / 2**20:.0f} MiB")
    checks = []
    for place, row in results["places"].items():
        print(f"\n{place}:")
        for kind, ours_name, dcp_name, raw_name in (
                ("save", "fsdp_ema save_training_state", "dcp.save (get_state_dict)",
                 "raw write (fsync)"),
                ("load", "fsdp_ema load_training_state", "dcp.load (+ set_state_dict)",
                 "raw read")):
            rows, mins = row[kind], row.get(f"{kind}_min")
            print(f"  {kind:5s} {'method':34s} {'s':>8s} {'GB/s':>8s} {'vs ours':>8s}"
                  + (f" {'min s':>8s}" if mins else ""))
            for name, s in rows.items():
                print(f"        {name:34s} {s:8.3f} {size / s / 1e9:8.2f} "
                      f"{s / rows[ours_name]:7.2f}x" + (f" {mins[name]:8.3f}" if mins else ""))
            ours = rows[ours_name]
            ratio = rows[dcp_name] / ours
            if kind == "load":  # paired: each round's dcp.load over the same round's ours
                pairs = sorted(d / o for d, o in zip(row["load_rounds"][dcp_name],
                                                     row["load_rounds"][ours_name]))
                ratio = statistics.median(pairs)
                print(f"        dcp.load / ours per round: {' '.join(f'{r:.2f}' for r in pairs)}"
                      f" (median {ratio:.2f}x)")
                bounds = sorted(d / b for d, b in zip(row["load_rounds"][dcp_name],
                                                      row["load_rounds"][BOUND]))
                print(f"        dcp.load / bound per round: "
                      f"{' '.join(f'{r:.2f}' for r in bounds)} (median "
                      f"{statistics.median(bounds):.2f}x: no all-or-nothing load can beat "
                      f"dcp.load by more here)")
            if place == "tmpfs":
                what = "load into live objects" if kind == "load" else kind
                checks.append((f"{place}: {what} vs DCP", ratio >= 1.5,
                               f"{ratio:.2f}x faster (target >= 1.5x)"))
            else:
                ratio = rows[raw_name] / ours
                checks.append((f"{place}: {kind} vs raw", ratio >= 0.8,
                               f"{ratio:.0%} of the raw rate (target >= 80%)"))
    if "resume" in results:
        times = results["resume"]
        print(f"\nresume on tmpfs ({args.resume_rounds} paired rounds, each load in 2 fresh rank "
              f"processes into a fresh model, optimizer without state and EMA):")
        for name, label in (("ours", "fsdp_ema load_training_state"),
                            ("dcp", "dcp.load (+ get/set_state_dict)")):
            ts = times[name]
            print(f"        {label:34s} min {min(ts):.3f} s, median {statistics.median(ts):.3f} s")
        pairs = sorted(d / o for d, o in zip(times["dcp"], times["ours"]))
        ratio = statistics.median(pairs)
        print(f"        dcp / ours per round: {' '.join(f'{r:.2f}' for r in pairs)} "
              f"(median {ratio:.2f}x)")
        checks.append(("tmpfs: resume vs DCP", ratio >= 1.5,
                       f"{ratio:.2f}x faster (target >= 1.5x)"))
    finish(results, checks, args.json)


if __name__ == "__main__":
    main()
