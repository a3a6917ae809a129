"""Benchmark of the fused EMA update against what people use today, measured in one run.

Rows (all update the same 500 EMA tensors of a transformer-like shard-size distribution):
  fsdp_ema.update_       one fused op call for every tensor
  per-tensor mul_/add_   ``for e, p: e.mul_(d).add_(p, alpha=1 - d)`` (the seed recipe)
  _foreach_lerp_         ``torch._foreach_lerp_(ema, params, 1 - d)`` (timm, torchtitan, swa)
                         with bf16 params it needs a cast pass first (``p.float()`` per tensor)
  limit                  the same arithmetic as one plain OpenMP loop over one contiguous buffer
                         (CPU), or a device-to-device copy of the same element count (GPU)
Bytes moved are counted per method (reads + writes, the real traffic of each way), so GB/s
compare honestly; speedups compare wall time for the same update.

    python bench/bench_update.py --device cpu              # 50M elements
    python bench/bench_update.py --device cuda             # 1B elements (scripts/gpu_check.sh)
"""

from __future__ import annotations

import ctypes
import math
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from harness import interleaved_times, parse_args, size_parser  # noqa: E402
from report import finish  # noqa: E402

import fsdp_ema  # noqa: E402

DECAY = 0.999


def shard_sizes(target_elements: int, count: int = 500, world_size: int = 2) -> list[int]:
    """Per-rank dim-0 shard sizes of a GPT-like model with `count` parameters in total."""

    def model_sizes(h: int) -> list[int]:
        vocab = 32000
        layer = [3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h, h, h]
        layers = (count - 3) // len(layer)
        sizes = [vocab * h] + layer * layers + [h, h]
        sizes += [h] * (count - len(sizes))
        return sizes

    def shard_total(h: int) -> int:
        return sum(math.ceil(n / world_size) for n in model_sizes(h))

    lo, hi = 8, 1 << 16
    while lo < hi:  # smallest hidden size that reaches the target
        mid = (lo + hi) // 2
        if shard_total(mid) < target_elements:
            lo = mid + 1
        else:
            hi = mid
    return [math.ceil(n / world_size) for n in model_sizes(lo)]


def count_kernel_launches(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(
        1
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and "memcpy" not in e.name.lower()
        and "memset" not in e.name.lower()
    )


def cpu_limit_fn(library: Path, model_dtype: torch.dtype, elements: int):
    """The limit row: a plain OpenMP loop (bench/limit.cpp) over one contiguous buffer."""
    lib = ctypes.CDLL(str(library))
    ema = torch.randn(elements)
    if model_dtype == torch.float32:
        model, fn = torch.randn(elements), lib.fsdp_ema_limit_f32
    else:
        model, fn = torch.randn(elements).to(model_dtype), lib.fsdp_ema_limit_bf16
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]
    w = ctypes.c_float(1.0 - DECAY)
    return lambda: fn(ema.data_ptr(), model.data_ptr(), elements, w)


def run_case(args, model_dtype: torch.dtype, sizes: list[int]) -> dict:
    device = args.device
    elements = sum(sizes)
    # Drawn on the device itself: 1B CPU draws would take longer than the whole GPU run.
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(n, generator=g, device=device).to(model_dtype) for n in sizes]
    ema = [p.to(torch.float32, copy=True) for p in params]
    esize, msize = 4, torch.tensor([], dtype=model_dtype).element_size()
    d, w = DECAY, 1.0 - DECAY
    decay_t = torch.tensor(DECAY, device=device)

    def ours():
        fsdp_ema.update_(ema, params, decay_t)

    def loop():
        for e, p in zip(ema, params):
            e.mul_(d).add_(p, alpha=w)

    def foreach_lerp():
        if model_dtype == torch.float32:
            torch._foreach_lerp_(ema, params, w)
        else:
            torch._foreach_lerp_(ema, [p.float() for p in params], w)

    fused_bytes = elements * (2 * esize + msize)
    rows = [
        ("fsdp_ema.update_", ours, fused_bytes),
        ("per-tensor mul_/add_", loop, elements * (2 * esize + 2 * esize + msize)),
        (
            "_foreach_lerp_" if model_dtype == torch.float32 else "cast + _foreach_lerp_",
            foreach_lerp,
            fused_bytes + (0 if model_dtype == torch.float32 else elements * (msize + esize)),
        ),
    ]
    if device == "cpu":
        rows.append(("limit (plain OpenMP loop)",
                     cpu_limit_fn(args.limit_library, model_dtype, elements), fused_bytes))
    else:
        src = torch.empty(elements, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        rows.append(("limit (device-to-device copy)", lambda: dst.copy_(src), elements * 8))
    with torch.no_grad():
        times = interleaved_times({name: fn for name, fn, _ in rows}, device, args.warmup,
                                  args.repeat)
    results = {name: {"seconds": statistics.median(times[name]), "bytes": nbytes}
               for name, _, nbytes in rows}
    if device == "cuda":
        results["fsdp_ema.update_"]["kernel_launches"] = count_kernel_launches(ours)
        # The launch bound holds up to 800 tensors (one table-fill launch + the update).
        small = [torch.randn(1000 + i, device=device) for i in range(800)]
        small_model = [t.to(model_dtype, copy=True) for t in small]
        results["fsdp_ema.update_"]["kernel_launches_800"] = count_kernel_launches(
            lambda: fsdp_ema.update_(small, small_model, decay_t))
    return {"elements": elements, "tensors": len(sizes), "rows": results}


def report(case: str, r: dict) -> list[tuple[str, bool, str]]:
    rows = r["rows"]
    ours = rows["fsdp_ema.update_"]
    limit_name = next(k for k in rows if k.startswith("limit"))
    print(f"\n{case}: {r['tensors']} tensors, {r['elements'] / 1e6:.1f}M elements")
    print(f"  {'method':32s} {'ms':>9s} {'B/elem':>7s} {'GB/s':>8s} {'time vs ours':>13s}")
    for name, row in rows.items():
        gbs = row["bytes"] / row["seconds"] / 1e9
        row["gb_per_s"] = gbs
        print(f"  {name:32s} {row['seconds'] * 1e3:9.2f} {row['bytes'] / r['elements']:7.1f} "
              f"{gbs:8.2f} {row['seconds'] / ours['seconds']:12.2f}x")
    if "kernel_launches" in ours:
        print(f"  fsdp_ema.update_ kernel launches for {r['tensors']} tensors: "
              f"{ours['kernel_launches']}, for 800 small tensors: {ours['kernel_launches_800']}")
    checks = []
    cuda = "cuda" in case
    frac = ours["gb_per_s"] / rows[limit_name]["gb_per_s"]
    frac_target = 0.90 if cuda else 0.85
    checks.append((f"{case}: GB/s vs {limit_name}", frac >= frac_target,
                   f"{frac:.1%} (target >= {frac_target:.0%})"))
    for name, row in rows.items():
        if name == "fsdp_ema.update_" or name.startswith("limit"):
            continue
        speedup = row["seconds"] / ours["seconds"]
        if name == "per-tensor mul_/add_":
            target = 3.0 if cuda else 1.5
        elif name.startswith("cast"):
            target = 2.0 if cuda else 1.6
        else:
            target = 1.3 if cuda else 1.1
        checks.append((f"{case}: speedup vs {name}", speedup >= target,
                       f"{speedup:.2f}x (target >= {target}x)"))
    for key, count in (("kernel_launches", r["tensors"]), ("kernel_launches_800", 800)):
        if key in ours:
            checks.append((f"{case}: kernel launches for {count} tensors", ours[key] <= 2,
                           f"{ours[key]} (target <= 2)"))
    return checks


def main():
    parser = size_parser(__doc__, "EMA elements in total (default 50M on CPU, 1B on CUDA)",
                         warmup=3, repeat=20)
    parser.add_argument("--limit-library", type=Path,
                        default=ROOT / "build" / "lib" / "libfsdp_ema_bench_limit.so")
    args = parse_args(parser, cpu_elements=50_000_000, cuda_elements=1_000_000_000)
    sizes = shard_sizes(args.elements, args.tensors)
    results, checks = {}, []
    for label, dtype in (("fp32 EMA / fp32 params", torch.float32),
                         ("fp32 EMA / bf16 params", torch.bfloat16)):
        case = f"{args.device} {label}"
        results[case] = run_case(args, dtype, sizes)
        checks += report(case, results[case])
        if args.device == "cuda":
            torch.cuda.empty_cache()
    finish(results, checks, args.json)


if __name__ == "__main__":
    main()
