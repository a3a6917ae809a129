"""gather_shards (one collective for every tensor) vs a DTensor.full_tensor() loop (one
collective per tensor), 2 ranks with gloo on the CPU, 200 parameters, measured in the same run.
With --device cuda (one GPU, a one-rank NCCL group, as scripts/gpu_check.sh runs it): the
bandwidth of the pack and unpack kernels (profiler device time) against a device-to-device copy
of the same bytes, and the whole call's time.

    python bench/bench_gather.py [--params 200] [--elements 20000000] [--world 2]
    python bench/bench_gather.py --device cuda [--elements 400000000]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def sizes_for(params: int, elements: int) -> list[tuple[int, int]]:
    """(rows, cols) of `params` matrices and vectors, transformer-like, about `elements` in all."""
    shapes = []
    for i in range(params):
        shapes.append((4, 1) if i % 4 == 3 else (4, 4))  # 3 of 4 are matrices, 1 is a bias
    unit = sum(r * c for r, c in shapes)
    h = max(1, int(math.sqrt(elements / unit)))
    return [(r * h + 3, c * h if c > 1 else 1) for r, c in shapes]  # +3: uneven dim 0


def worker(rank, world, init_file, args, out):
    sys.path.insert(0, str(ROOT / "python"))
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    import fsdp_ema  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    fulls = [torch.randn(r, c).squeeze(-1) if c == 1 else torch.randn(r, c)
             for r, c in sizes_for(args.params, args.elements)]
    dts = [distribute_tensor(t, mesh, [Shard(0)]) for t in fulls]
    locals_ = [d.to_local() for d in dts]
    rows = [t.shape[0] for t in fulls]
    name = dist.group.WORLD.group_name

    def ours():
        return torch.ops.fsdp_ema.gather_shards(locals_, rows, name)

    def loop():
        return [d.full_tensor() for d in dts]

    got = ours()
    assert all(torch.equal(a, b) for a, b in zip(got, fulls))
    times = {"gather_shards (one call)": [], "full_tensor() loop": []}
    fns = {"gather_shards (one call)": ours, "full_tensor() loop": loop}
    for fn in fns.values():
        fn()
    for _ in range(args.repeat):
        for k, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    if rank == 0:
        out.put({k: statistics.median(v) for k, v in times.items()})
    dist.destroy_process_group()


def cuda_main(args):
    """Pack/unpack kernel bandwidth on one GPU (one-rank NCCL group) vs a device copy."""
    sys.path.insert(0, str(ROOT / "python"))
    import torch.distributed as dist

    import fsdp_ema  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/init", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        g = torch.Generator(device="cuda").manual_seed(0)
        # Every third tensor bf16: pieces start at 2-byte multiples in the outputs.
        fulls = [torch.randn(r, c, generator=g, device="cuda").squeeze(-1)
                 .to(torch.bfloat16 if i % 3 == 2 else torch.float32)
                 for i, (r, c) in enumerate(sizes_for(args.params, args.elements))]
        rows = [t.shape[0] for t in fulls]
        name = dist.group.WORLD.group_name

        def ours():
            return torch.ops.fsdp_ema.gather_shards(fulls, rows, name)

        assert all(torch.equal(a, b) for a, b in zip(ours(), fulls))
        nbytes = sum(t.numel() * t.element_size() for t in fulls)
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)

        def timed(fn):
            for _ in range(3):
                fn()
            times = []
            for _ in range(args.repeat):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)

        call_s, copy_s = timed(ours), timed(lambda: dst.copy_(src))
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            ours()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        copy_us = [e.time_range.elapsed_us() for e in kernels if "batched_copy_kernel" in e.name]
        fill_us = sum(e.time_range.elapsed_us() for e in kernels if "fill_table" in e.name)
        dist.destroy_process_group()
    copy_gbs = 2 * nbytes / copy_s / 1e9
    print(f"1 rank, NCCL, {torch.cuda.get_device_name()}, {args.params} tensors, "
          f"{nbytes / 1e6:.0f} MB gathered")
    print(f"  device-to-device copy of the same bytes: {copy_s * 1e3:.3f} ms, {copy_gbs:.0f} GB/s")
    print(f"  gather_shards call: {call_s * 1e3:.3f} ms")
    checks = []
    if len(copy_us) != 2:
        checks.append(("pack and unpack are one batched_copy launch each", False,
                       f"{len(copy_us)} launches"))
    for what, us in zip(("pack", "unpack"), copy_us):
        gbs = 2 * nbytes / (us / 1e6) / 1e9
        print(f"  {what} kernel: {us / 1e3:.3f} ms, {gbs:.0f} GB/s")
        checks.append((f"{what} kernel GB/s vs device copy", gbs >= 0.8 * copy_gbs,
                       f"{gbs / copy_gbs:.1%} (target >= 80%)"))
    print(f"  table fill kernels: {fill_us / 1e3:.3f} ms in all")
    print("\ntargets:")
    for what, ok, detail in checks:
        print(f"  [{'PASS' if ok else 'MISS'}] {what}: {detail}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--params", type=int, default=200)
    parser.add_argument("--elements", type=int, default=None,
                        help="elements in all (default 20M on the CPU, 400M on CUDA)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    if args.elements is None:
        args.elements = 20_000_000 if args.device == "cpu" else 400_000_000
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device")
        cuda_main(args)
        return
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.world, f"{tmp}/init", args, out), nprocs=args.world,
                           start_method="spawn")
    result = out.get()
    nbytes = sum(r * c for r, c in sizes_for(args.params, args.elements)) * 4
    ours = result["gather_shards (one call)"]
    print(f"{args.world} ranks, gloo, {args.params} tensors, {nbytes / 1e6:.0f} MB gathered")
    print(f"  {'method':28s} {'ms':>9s} {'time vs ours':>13s}")
    for k, v in result.items():
        print(f"  {k:28s} {v * 1e3:9.2f} {v / ours:12.2f}x")
    ratio = result["full_tensor() loop"] / ours
    print(f"\ntargets:\n  [{'PASS' if ratio >= 3 else 'MISS'}] speedup vs full_tensor() loop: "
          f"{ratio:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
