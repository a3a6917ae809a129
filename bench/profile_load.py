"""Where a training-state load's time goes (issue 41, item 4): bench_training_state.py's state
(FSDP2 MLP + AdamW + fp32 EMA, 2 gloo ranks, tmpfs), ``load_training_state`` and ``dcp.load``
(+ set_state_dict) in interleaved rounds, each load with its wall time, its CPU time and its
minor page faults (``resource.getrusage`` around it, rank 0), and ours split into the staged read
(``OpenCheckpoint.load`` of the state's tensors: allocation, read, hash) and the rest (templates,
agreements, the copies into place, set_state_dict).

    python bench/profile_load.py [--megabytes 512] [--rounds 7]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_training_state import WORLD, build, dcp_load, state_dicts  # noqa: E402
from ranks import init_group, shared_tmpdir, spawn  # noqa: E402


def measured(fn):
    """(wall s, CPU s, minor page faults) of fn() on this process."""
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, cpu, after.ru_minflt - before.ru_minflt


def worker(rank, init_file, args, out_queue):
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp

    import fsdp_ema
    from fsdp_ema import checkpoint as ckpt

    torch.set_num_threads(1)
    init_group(rank, init_file, WORLD)
    model, opt, ema = build(int(args.megabytes * 2**20))
    work = shared_tmpdir(Path("/dev/shm"), "fsdp_ema_profile_load_")
    ours, dcp_dir = work / "ours", work / "dcp"

    fsdp_ema.save_training_state(ours, model=model, optimizer=opt, ema=ema)
    dcp.save(state_dicts(model, opt, ema), checkpoint_id=str(dcp_dir))
    read_s = []
    real_load = ckpt.OpenCheckpoint.load

    def timed_load(self, names, **kwargs):  # the staged read of the state's tensors
        t0 = time.perf_counter()
        out = real_load(self, names, **kwargs)
        if len(names) > 1:
            read_s.append(time.perf_counter() - t0)
        return out

    ckpt.OpenCheckpoint.load = timed_load

    def ours_load():
        fsdp_ema.load_training_state(ours, model=model, optimizer=opt, ema=ema)

    def dcp_loads():
        dcp_load(dcp_dir, model, opt, ema)

    rows = {"ours": [], "dcp": []}
    for fn in (ours_load, dcp_loads):
        fn()
    for _ in range(args.rounds):
        for name, fn in (("ours", ours_load), ("dcp", dcp_loads)):
            read_s.clear()
            dist.barrier()
            wall, cpu, faults = measured(fn)
            dist.barrier()
            rows[name].append((wall, cpu, faults, sum(read_s)))
    if rank == 0:
        out_queue.put(rows)
        shutil.rmtree(work, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows = spawn(worker, args, WORLD)
    print(f"rank 0, {args.rounds} interleaved rounds, medians (min):")
    for name, runs in rows.items():
        cols = list(zip(*runs))
        med = [statistics.median(c) for c in cols]
        low = [min(c) for c in cols]
        line = (f"  {name:5s} wall {med[0]:.3f} s ({low[0]:.3f})  cpu {med[1]:.3f} s  "
                f"minor faults {med[2]:.0f}")
        if name == "ours":
            line += f"  staged read {med[3]:.3f} s ({low[3]:.3f})"
        print(line)


if __name__ == "__main__":
    main()
