"""ShardedEMA.update() on an FSDP2 model against the two ways people keep a sharded EMA today,
measured side by side in one run (gloo ranks on the CPU, or one GPU per rank).

Rows (each updates the EMA of the same FSDP2 model's local shards; one row per method):
  ShardedEMA.update()    one fused fsdp_ema.update_ call over plain local tensors, decay on the
                         device
  seed recipe            the ShardEMAModel recipe: get_model_state_dict() every step (DTensor
                         local shards), then ``e.mul_(d).add_(local, alpha=1 - d)`` per tensor
  torchtitan way         EMA kept as DTensors like the parameters, ``torch._foreach_lerp_(ema,
                         params, 1 - d)`` through DTensor dispatch; with bf16 parameters it first
                         casts them (``p.float()`` per DTensor), as _foreach_lerp_ needs one dtype

The model: ``--layers`` transformer-like blocks (qkv, proj, fc1, fc2 Linear layers and two
LayerNorms: 12 parameters a block) of width ``--hidden``, each block and the root wrapped by
fully_shard. Defaults: 25 blocks of width 256 + an output layer = 302 parameters, 19.8M elements.

Methods run round-robin, ``--repeat`` times after ``--warmup`` untimed rounds; the table shows the
median time per update on each rank (the slowest rank) and ratios measured in this run.

    python bench/bench_sharded_ema.py                       # 2 ranks, 1 thread each, CPU
    python bench/bench_sharded_ema.py --ranks 2 --threads 1 --repeat 21
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

DECAY = 0.999


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)


class Model(nn.Module):
    def __init__(self, layers: int, h: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(h) for _ in range(layers))
        self.out = nn.Linear(h, h)


def build(args, dtype: torch.dtype, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model(args.layers, args.hidden).to(device=device, dtype=dtype)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def methods(model: nn.Module, param_dtype: torch.dtype):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import fsdp_ema

    ours = fsdp_ema.ShardedEMA(model, DECAY, include_buffers=False)

    # The seed recipe: a sharded state dict every step, one mul_ and one add_ per tensor.
    seed_ema = {k: v.to_local().detach().to(torch.float32, copy=True)
                for k, v in get_model_state_dict(model).items()}

    def seed_recipe():
        with torch.no_grad():
            for k, v in get_model_state_dict(model).items():
                seed_ema[k].mul_(DECAY).add_(v.to_local(), alpha=1 - DECAY)

    # torchtitan's way: DTensor EMA, _foreach_lerp_ over DTensors.
    params = [p for p in model.parameters() if p.requires_grad]
    titan_ema = [p.detach().to(torch.float32, copy=True) for p in params]

    def torchtitan_way():
        with torch.no_grad():
            src = params if param_dtype == torch.float32 else [p.float() for p in params]
            torch._foreach_lerp_(titan_ema, src, 1 - DECAY)

    return {"ShardedEMA.update()": ours.update, "seed recipe": seed_recipe,
            "torchtitan way": torchtitan_way}


def rank_main(rank: int, world: int, init_file: str, args, queue) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    results = {}
    for param_dtype in (torch.float32, torch.bfloat16):
        model = build(args, param_dtype, device)
        fns = methods(model, param_dtype)
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        local = sum(p.to_local().numel() for p in params)

        def timed(fn):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        for _ in range(args.warmup):
            for fn in fns.values():
                fn()
        times = {name: [] for name in fns}
        for _ in range(args.repeat):
            for name, fn in fns.items():
                dist.barrier()
                times[name].append(timed(fn))
        medians = torch.tensor([statistics.median(t) for t in times.values()], dtype=torch.float64)
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        results[str(param_dtype).removeprefix("torch.")] = {
            "params": len(params), "numel": numel, "local_numel": local,
            "seconds": dict(zip(fns, medians.tolist()))}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--layers", type=int, default=25)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(args.ranks, os.path.join(tmp, "init"), args, queue),
                           nprocs=args.ranks, join=True, start_method="spawn")
    results = queue.get()

    print(f"ShardedEMA.update() vs the seed recipe vs torchtitan's way: FSDP2, {args.ranks} ranks "
          f"on {args.device}, {args.threads} thread(s) per rank, median of {args.repeat} "
          f"(slowest rank)")
    for dtype, res in results.items():
        print(f"\nparams {dtype}, EMA float32: {res['params']} parameters, "
              f"{res['numel'] / 1e6:.1f}M elements, {res['local_numel'] / 1e6:.1f}M on rank 0")
        ours = res["seconds"]["ShardedEMA.update()"]
        print(f"{'method':<24}{'ms/update':>12}{'ShardedEMA speedup':>22}")
        for name, seconds in res["seconds"].items():
            print(f"{name:<24}{seconds * 1e3:>12.2f}{seconds / ours:>21.2f}x")


if __name__ == "__main__":
    main()
