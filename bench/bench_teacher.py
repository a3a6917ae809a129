"""The EMA as a teacher (``ShardedEMA.module()``) against DINOv3's by-hand teacher, side by side in
one run: FSDP2, gloo ranks on the CPU (or one GPU per rank).

DINOv3's teacher (``dinov3/train/ssl_meta_arch.py``, ``dinov3/fsdp/ac_compile_parallelize.py``), as
this benchmark builds it: a second model made like the student on the meta device, sharded with
the same ``fully_shard`` units (``reshard_after_forward=True``), ``to_empty`` on the device,
loaded from the student's state dict; its update is ``torch._foreach_mul_(teacher, m)`` then
``torch._foreach_add_(teacher, student, alpha=1 - m)`` over the DTensor parameters, ``m`` a Python
float from the cosine schedule. Ours: ``ShardedEMA(student, schedule=CosineMomentum(...))``,
``teacher = ema.module()``, ``ema.update()``.

Rows:
  update    ours (one fused update_ call over the local shards, momentum on the device) against
            their two _foreach passes over DTensors (target: >= 1.5x on the CPU; by bytes alone
            theirs moves 20 per fp32 element, ours 12)
  forward   the teacher's forward (all-gathers and compute) under no_grad, ours against theirs
            (target: <= 1.05x)
  memory    the bytes of each teacher's tensors on a rank: theirs is a second copy; ours is the
            EMA, so the teacher adds no byte to it (target: ours <= the EMA's bytes)

The model: ``--layers`` transformer-like blocks (LayerNorms, qkv, proj, fc1, fc2: 12 parameters a
block) of width ``--hidden``, each block and the root a fully_shard unit. Defaults: 12 blocks of
width 418 = 144 parameters, 25.2M elements, 12.6M a rank at 2 ranks. Methods run round-robin (a
barrier before each call, the order alternating), ``--repeat`` rounds after ``--warmup``; a
round's time is its slowest rank's; the figures are the rounds' min and median, the ratios min
over min and the median of the rounds' ratios (paired: the two ran back to back, so load that
comes and goes moves both). ``--rows`` picks rows.

    python bench/bench_teacher.py                   # 2 ranks, 1 thread each, CPU
    python bench/bench_teacher.py --repeat 31 --json teacher.json
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))

from ranks import spawn  # noqa: E402
from report import finish  # noqa: E402


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, layers: int, h: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(h) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def dinov3_cosine(base: float, final: float, total: int, it: int) -> float:
    """DINOv3's CosineScheduler (no warmup, no freeze, trunc_extra=0) at iteration ``it``."""
    import math

    if it >= total:
        return final
    return final + 0.5 * (base - final) * (1 + math.cos(math.pi * it / total))


def shard(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    return fully_shard(model, mesh=mesh, reshard_after_forward=True)


def storage_bytes(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        s = t.untyped_storage()
        out[s.data_ptr()] = s.nbytes()
    return out


def rank_main(rank: int, init_file: str, args, queue) -> None:
    import fsdp_ema

    torch.set_num_threads(args.threads)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{init_file}", rank=rank, world_size=args.ranks,
                            timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(0)
    student = shard(Model(args.layers, args.hidden).to(device), device)
    total = 1000
    step = [0]

    # Ours: three lines.
    ema = fsdp_ema.ShardedEMA(student, schedule=fsdp_ema.CosineMomentum(0.996, 1.0,
                                                                        total_steps=total))
    teacher = ema.module()

    # DINOv3's: a second model, built on meta, sharded alike, materialized, loaded.
    with torch.device("meta"):
        theirs = Model(args.layers, args.hidden)
    theirs = shard(theirs, device)
    theirs.to_empty(device=device)
    theirs.load_state_dict(student.state_dict())
    theirs.requires_grad_(False)
    theirs.eval()
    s_params, t_params = list(student.parameters()), list(theirs.parameters())

    def dinov3_update():
        m = dinov3_cosine(0.996, 1.0, total, step[0])
        with torch.no_grad():
            torch._foreach_mul_(t_params, m)
            torch._foreach_add_(t_params, s_params, alpha=1 - m)

    x = torch.randn(args.batch, args.tokens, args.hidden, device=device)

    def forward(model):
        def run():
            with torch.no_grad():
                model(x)
        return run

    rows = {"update": {"ours": ema.update, "DINOv3": dinov3_update},
            "forward": {"ours": forward(teacher), "DINOv3": forward(theirs)}}

    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    results = {}
    for row, fns in rows.items():
        if row not in args.rows:
            continue
        for _ in range(args.warmup):
            for fn in fns.values():
                dist.barrier()
                fn()
        times = {name: [] for name in fns}
        for r in range(args.repeat):
            # Alternate which goes first: whatever the first call of a round pays (caches, the
            # other ranks' timing), both pay it alike.
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                dist.barrier()
                times[name].append(timed(fns[name]))
            step[0] += 1
        # Each round's time is its slowest rank's (the pace of a collective step).
        rounds = torch.tensor(list(times.values()), dtype=torch.float64)
        dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
        results[row] = {name: {"min": min(r), "median": statistics.median(r), "rounds": r}
                        for name, r in zip(fns, rounds.tolist())}

    ema_storages = storage_bytes(ema.state.tensors)
    ours_held = storage_bytes([*teacher.parameters(), *teacher.buffers()])
    theirs_held = storage_bytes([*theirs.parameters(), *theirs.buffers()])
    memory = torch.tensor([ema.nbytes, sum(ema_storages.values()),
                           sum(n for p, n in ours_held.items() if p not in ema_storages),
                           sum(theirs_held.values())], dtype=torch.float64)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    results["memory"] = dict(zip(("ema_nbytes", "ema_storage", "ours_beyond_ema", "theirs"),
                                 memory.tolist()))
    params = list(student.parameters())
    results["model"] = {"params": len(params), "numel": sum(p.numel() for p in params),
                        "local_numel": sum(p.to_local().numel() for p in params)}
    if rank == 0:
        queue.put(results)
    fsdp_ema.destroy_process_group()


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=418)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rows", nargs="+", choices=["update", "forward"],
                        default=["update", "forward"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    before = loadavg()
    results = spawn(rank_main, args, args.ranks)
    after = loadavg()
    m = results["model"]
    print(f"ShardedEMA.module() vs DINOv3's by-hand teacher: FSDP2, {args.ranks} ranks on "
          f"{args.device}, {args.threads} thread(s) per rank, {m['params']} parameters, "
          f"{m['numel'] / 1e6:.1f}M elements ({m['local_numel'] / 1e6:.1f}M on rank 0), fp32; "
          f"min and median of {args.repeat} interleaved rounds (slowest rank); load average "
          f"{before} before, {after} after")
    print(f"\n{'row':<9}{'ours ms min / median':>22}{'DINOv3 ms min / median':>24}"
          f"{'DINOv3/ours: min/min, paired median':>38}")
    ratios = {}
    for row in args.rows:
        ours, theirs = results[row]["ours"], results[row]["DINOv3"]
        # Paired: the two ran back to back in each round, so load that comes and goes moves both.
        paired = statistics.median(t / o for t, o in zip(theirs["rounds"], ours["rounds"]))
        ratios[row] = (theirs["min"] / ours["min"], paired)
        print(f"{row:<9}{ours['min'] * 1e3:>12.2f} / {ours['median'] * 1e3:<7.2f}"
              f"{theirs['min'] * 1e3:>14.2f} / {theirs['median'] * 1e3:<7.2f}"
              f"{ratios[row][0]:>17.2f}x, {ratios[row][1]:.2f}x")
    mem = results["memory"]
    print(f"\nmemory per rank (largest rank): EMA {mem['ema_nbytes'] / 2**20:.2f} MiB "
          f"({mem['ema_storage'] / 2**20:.2f} MiB of storage with FSDP2's padding); our teacher "
          f"adds {mem['ours_beyond_ema']:.0f} bytes to it; DINOv3's teacher holds "
          f"{mem['theirs'] / 2**20:.2f} MiB of its own")
    checks = []
    if "update" in ratios:
        checks.append(("update: DINOv3's two _foreach passes / ours >= 1.5x (paired median)",
                       ratios["update"][1] >= 1.5,
                       f"{ratios['update'][1]:.2f}x (min {ratios['update'][0]:.2f}x)"))
    if "forward" in ratios:
        forward_ratio = 1 / ratios["forward"][1]
        checks.append(("forward: ours / DINOv3's <= 1.05x (paired median)", forward_ratio <= 1.05,
                       f"{forward_ratio:.3f}x (min {1 / ratios['forward'][0]:.3f}x)"))
    checks.append(("memory: our teacher adds nothing to the EMA", mem["ours_beyond_ema"] == 0,
                   f"{mem['ours_beyond_ema']:.0f} bytes beyond the EMA's "
                   f"{mem['ema_storage']:.0f}; DINOv3's teacher {mem['theirs']:.0f}"))
    results["loadavg"] = {"before": before, "after": after}
    finish(results, checks, args.json)


if __name__ == "__main__":
    main()
