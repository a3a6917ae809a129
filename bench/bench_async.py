"""Asynchronous training-state saves (issue 17): how long a save blocks a training loop, and how
much it slows the loop down in all, for fsdp_ema.save_training_state (sync and ``async_=True``),
dcp.save and dcp.async_save, at 2 ranks (gloo, CPU, 1 thread per rank) or on GPUs (--device cuda:
NCCL, one GPU per rank, pinned staging), in one run.

The state: an FSDP2 MLP whose fp32 weights + AdamW moments + fp32 ShardedEMA take --megabytes
over the ranks (default 1024). The loop: --steps steps of a fixed compute (matmuls on their own
tensors) that also modify the state in place (one row of every weight and moment); one save at
step 1; async saves are waited for after the last step. Per save:

- blocked: the time the save call takes (what the loop waits for);
- slowdown: loop time with the save minus the loop time without one, paired in each repeat
  (for async saves: the background write's competition for the CPU, plus any final wait).

Anchor: a plain memcpy of this rank's state bytes (one ``copy_`` into a warm buffer; on a GPU, a
device-to-host copy into a warm pinned buffer, synchronized). On a GPU, *blocked* is the host's
time in the call: ours enqueues its copies on the current stream and returns, so the device
still spends the copy's time, in stream order before the next step's kernels (the *slowdown*
column shows it). DCP's
async_save gets a DefaultStager kept across saves (its buffers are cached; pinned where CUDA
exists, else pageable) and a gloo process group of its own, as ours has; the "default stager"
row is dcp.async_save without one (a new stager each save). Methods run interleaved, every
repeat in the same order after one warm-up round; min and median over --repeat repeats.

    python bench/bench_async.py [--megabytes 1024] [--repeat 5] [--steps 40] [--device cuda]
"""

from __future__ import annotations

import argparse
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
from bench_training_state import build  # noqa: E402
from ranks import init_group, shared_tmpdir, spawn  # noqa: E402

METHODS = ["none", "ours sync", "ours async", "dcp.save", "dcp.async_save",
           "dcp.async_save (default stager)"]


def worker(rank, init_file, args, out_queue):
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    import fsdp_ema

    torch.set_num_threads(1)
    world = args.ranks
    cuda = args.device == "cuda"
    device = init_group(rank, init_file, world, args.device)
    model, opt, ema = build(int(args.megabytes * 2**20), world, args.device)
    locals_ = [p._local_tensor for p in model.parameters()]
    # The local tensors (indexing a sharded DTensor would redistribute and write a temporary).
    moments = [getattr(m, "_local_tensor", m) for p in model.parameters()
               for m in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    local = sum(t.numel() * t.element_size() for t in locals_) * 4
    total = torch.tensor(local, device=device)
    dist.all_reduce(total)

    # The fixed compute of a step, on tensors of its own.
    g = torch.Generator().manual_seed(rank)
    a, b = (torch.randn(args.width, args.width, generator=g).to(device) for _ in range(2))

    def step():
        x = a
        for _ in range(args.matmuls):
            x = torch.tanh(x @ b)
        for t in locals_ + moments:  # training keeps modifying the state
            if t.numel():
                t[0].add_(1e-6)

    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=cuda))
    dcp_group = dist.new_group(backend="gloo")

    def state_dicts():
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                "ema": ema.state_dict()}

    def save(method, directory):
        """Returns something to wait on after the loop, or None."""
        if method == "ours sync":
            fsdp_ema.save_training_state(directory, model=model, optimizer=opt, ema=ema,
                                         rng=False)
        elif method == "ours async":
            return fsdp_ema.save_training_state(directory, model=model, optimizer=opt, ema=ema,
                                                rng=False, async_=True).result
        elif method == "dcp.save":
            dcp.save(state_dicts(), checkpoint_id=directory)
        elif method == "dcp.async_save":
            return dcp.async_save(state_dicts(), checkpoint_id=directory,
                                  process_group=dcp_group, async_stager=stager).result
        elif method == "dcp.async_save (default stager)":
            return dcp.async_save(state_dicts(), checkpoint_id=directory,
                                  process_group=dcp_group).result
        return None

    work = shared_tmpdir(args.dir, "fsdp_ema_bench_async_")

    def loop(method, directory):
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
        dist.barrier()
        wait, blocked = None, 0.0
        t0 = time.perf_counter()
        for i in range(args.steps):
            if i == 1 and method != "none":
                t = time.perf_counter()
                wait = save(method, str(directory))
                blocked = time.perf_counter() - t
            step()
        if wait is not None:
            wait()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        dist.barrier()
        return blocked, elapsed

    # Anchor: a plain memcpy of this rank's state bytes into a warm buffer.
    src = torch.empty(local, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty(local, dtype=torch.uint8, pin_memory=cuda).fill_(0)
    memcpy = []
    raw = {m: {"blocked": [], "loop": []} for m in METHODS}
    for rep in range(args.repeat + 1):  # round 0 warms up (groups, staging buffers)
        for i, method in enumerate(METHODS):
            blocked, elapsed = loop(method, work / f"m{i}")
            if rep:
                raw[method]["blocked"].append(blocked)
                raw[method]["loop"].append(elapsed)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        if rep:
            memcpy.append(time.perf_counter() - t)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)
    # Per rank figures; the slowest rank's blocked time is what the loop of a synchronous job
    # waits for, so report the max over the ranks of each repeat.
    gathered = [None] * world
    dist.all_gather_object(gathered, {"raw": raw, "memcpy": memcpy})
    if rank == 0:
        out_queue.put({"bytes": int(total), "local": local, "ranks": gathered,
                       "device": torch.cuda.get_device_name(device) if cuda else "CPU"})
    dist.barrier()
    stager.close()
    dist.destroy_process_group()


def stats(xs):
    return min(xs), statistics.median(xs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=1024,
                        help="weights + AdamW moments + EMA over all ranks (default 1024)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--matmuls", type=int, default=40, help="matmuls per step")
    parser.add_argument("--width", type=int, default=None,
                        help="the step's matmuls are width x width (default 256; 4096 on CUDA)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks", type=int, default=None,
                        help="default 2 on the CPU; on CUDA min(2, GPUs)")
    parser.add_argument("--dir", type=Path, default=ROOT / "build" / "bench-disk")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from report import finish

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    if args.ranks is None:
        args.ranks = min(2, torch.cuda.device_count()) if args.device == "cuda" else 2
    if args.width is None:
        args.width = 4096 if args.device == "cuda" else 256
    results = spawn(worker, args, args.ranks)
    ranks = results["ranks"]
    n = len(ranks[0]["memcpy"])

    def worst(method, key):  # max over ranks, per repeat
        return [max(r["raw"][method][key][i] for r in ranks) for i in range(n)]

    memcpy = [max(r["memcpy"][i] for r in ranks) for i in range(n)]
    none = worst("none", "loop")
    where = ("gloo, CPU, 1 thread each" if args.device == "cpu" else
             f"NCCL, one {results['device']} each, pinned staging")
    print(f"torch {torch.__version__}, {args.ranks} ranks ({where}), FSDP2 MLP: "
          f"weights + AdamW exp_avg/exp_avg_sq + fp32 EMA = {results['bytes'] / 2**20:.0f} MiB "
          f"({results['local'] / 2**20:.0f} MiB per rank), written to {args.dir}")
    print(f"loop: {args.steps} steps, no save: min {min(none):.3f} s, median "
          f"{statistics.median(none):.3f} s; memcpy of a rank's state: min {min(memcpy):.3f} s, "
          f"median {statistics.median(memcpy):.3f} s; {n} interleaved repeats (slowest rank)")
    print(f"\n  {'method':34} {'blocked min':>11} {'median':>8} {'vs memcpy':>9} "
          f"{'slowdown min':>12} {'median':>8}")
    out = {"memcpy": memcpy, "none": none}
    for method in METHODS[1:]:
        blocked = worst(method, "blocked")
        slow = [x - y for x, y in zip(worst(method, "loop"), none)]
        out[method] = {"blocked": blocked, "slowdown": slow}
        bmin, bmed = stats(blocked)
        smin, smed = stats(slow)
        print(f"  {method:34} {bmin:11.3f} {bmed:8.3f} "
              f"{bmed / statistics.median(memcpy):8.2f}x {smin:12.3f} {smed:8.3f}")
    ours = statistics.median(out["ours async"]["blocked"])
    mc = statistics.median(memcpy)
    checks = [
        ("ours async blocks <= 1.3x a memcpy of the state", ours <= 1.3 * mc,
         f"{ours / mc:.2f}x (median {ours:.3f} s vs {mc:.3f} s)")]
    for method in ("dcp.async_save", "dcp.async_save (default stager)"):
        theirs = statistics.median(out[method]["blocked"])
        checks.append((f"ours async blocks >= 3x less than {method}", theirs >= 3 * ours,
                       f"{theirs / ours:.2f}x less (median {ours:.3f} s vs {theirs:.3f} s)"))
    finish(out, checks, args.json)


if __name__ == "__main__":
    main()
