"""Benchmark of update_multi_ (K EMA profiles from one read of the weights, issue #18) against
K separate update_ calls and K torch._foreach_lerp_ calls, measured in one run.

Rows (the same 500 tensors as bench_update.py, a GPT-like shard-size distribution; fp32 EMAs):
  update_multi_          one call for the K profiles: reads the model once
  K x update_            one fused call per profile: reads the model K times
  K x _foreach_lerp_     timm / torchtitan / swa_utils, once per profile (with bf16 params the
                         model is first cast to fp32 once per step, as those need one dtype)
Bytes per element: (m + 8K) for update_multi_ against K (m + 8) for K update_ calls (m = 4 for
fp32 params, 2 for bf16), so the bytes-bound speedup is K (m + 8) / (m + 8K): 1.20x (K=2) and
1.29x (K=3) for fp32 params, 1.11x and 1.15x for bf16. Target: >= 90% of that bound's gain
(speedup - 1 >= 0.9 (bound - 1)).

Rows run round-robin (interleaved), so load from other work on the machine hits every row alike;
min and median of the repeats are printed, and the targets use the median over rounds of the
ratio within each round (rows of one round run back to back, so load that comes and goes between
rounds cancels out of each ratio).

    python bench/bench_multi_ema.py --device cpu            # 50M elements per profile
    python bench/bench_multi_ema.py --device cuda           # 500M elements per profile
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from bench_update import shard_sizes  # noqa: E402
from harness import interleaved_times, parse_args, size_parser  # noqa: E402
from report import finish  # noqa: E402

import fsdp_ema  # noqa: E402, F401  (loads the operator library)

DECAYS = (0.999, 0.99, 0.9999)


def run_case(args, model_dtype: torch.dtype, k: int, sizes: list[int]) -> dict:
    device = args.device
    elements = sum(sizes)
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(n, generator=g, device=device).to(model_dtype) for n in sizes]
    emas = [[p.to(torch.float32, copy=True) for p in params] for _ in range(k)]
    flat = [t for e in emas for t in e]
    decays = [torch.tensor(d, device=device) for d in DECAYS[:k]]
    weights = [1.0 - d for d in DECAYS[:k]]
    msize = torch.tensor([], dtype=model_dtype).element_size()

    def multi():
        torch.ops.fsdp_ema.update_multi_(flat, params, decays)

    def separate():
        for e, d in zip(emas, decays):
            torch.ops.fsdp_ema.update_(e, params, d)

    def foreach_lerp():
        model = params if model_dtype == torch.float32 else [p.float() for p in params]
        for e, w in zip(emas, weights):
            torch._foreach_lerp_(e, model, w)

    cast_bytes = 0 if model_dtype == torch.float32 else elements * (msize + 4)
    lerp_model = msize if model_dtype == torch.float32 else 4
    rows = [
        ("update_multi_", multi, elements * (msize + 8 * k)),
        (f"{k} x update_", separate, elements * k * (msize + 8)),
        ((f"{k} x _foreach_lerp_" if model_dtype == torch.float32 else
          f"cast + {k} x _foreach_lerp_"), foreach_lerp,
         cast_bytes + elements * k * (lerp_model + 8)),
    ]
    with torch.no_grad():
        times = interleaved_times({name: fn for name, fn, _ in rows}, device, args.warmup,
                                  args.repeat)
    results = {name: {"min": min(times[name]), "median": statistics.median(times[name]),
                      "bytes": nbytes, "times": times[name]} for name, _, nbytes in rows}
    return {"elements": elements, "tensors": len(sizes), "k": k, "msize": msize,
            "rows": results}


def report(case: str, r: dict) -> list[tuple[str, bool, str]]:
    rows, k, m = r["rows"], r["k"], r["msize"]
    ours = rows["update_multi_"]
    bound = k * (m + 8) / (m + 8 * k)
    print(f"\n{case}: K={k}, {r['tensors']} tensors, {r['elements'] / 1e6:.1f}M elements per "
          f"profile (bytes bound vs {k} x update_: {bound:.3f}x)")
    print(f"  {'method':30s} {'min ms':>9s} {'median ms':>10s} {'B/elem':>7s} {'GB/s(min)':>10s} "
          f"{'time vs ours (min / median)':>28s}")
    for name, row in rows.items():
        gbs = row["bytes"] / row["min"] / 1e9
        print(f"  {name:30s} {row['min'] * 1e3:9.2f} {row['median'] * 1e3:10.2f} "
              f"{row['bytes'] / r['elements']:7.1f} {gbs:10.2f} "
              f"{row['min'] / ours['min']:14.3f}x / {row['median'] / ours['median']:.3f}x")
    def paired(name):
        # Ratio within each round (the two rows ran back to back), then the median over rounds:
        # load that comes and goes between rounds cancels out of each ratio.
        return statistics.median(a / b for a, b in zip(rows[name]["times"], ours["times"]))

    checks = []
    sep = f"{k} x update_"
    target = 1 + 0.9 * (bound - 1)
    speedup = paired(sep)
    print(f"  paired median speedup vs {sep}: {speedup:.3f}x (bound {bound:.3f}x)")
    checks.append((f"{case}: speedup vs {sep} (paired median)", speedup >= target,
                   f"{speedup:.3f}x; min/min {rows[sep]['min'] / ours['min']:.3f}x, median/median "
                   f"{rows[sep]['median'] / ours['median']:.3f}x (bound {bound:.3f}x, target >= "
                   f"{target:.3f}x = 90% of the gain; {(speedup - 1) / (bound - 1):.0%} of the "
                   f"gain reached)"))
    name = next(n for n in rows if "foreach" in n)
    fl = paired(name)
    checks.append((f"{case}: speedup vs {name} (paired median)", fl >= target,
                   f"{fl:.3f}x; min/min {rows[name]['min'] / ours['min']:.3f}x "
                   f"(target >= {target:.3f}x)"))
    return checks


def main():
    parser = size_parser(__doc__, "elements per profile (default 50M on CPU, 500M on CUDA)",
                         warmup=2, repeat=15)
    parser.add_argument("--ks", default="2,3")
    args = parse_args(parser, cpu_elements=50_000_000, cuda_elements=500_000_000)
    sizes = shard_sizes(args.elements, args.tensors)
    results, checks = {}, []
    for label, dtype in (("fp32 params", torch.float32), ("bf16 params", torch.bfloat16)):
        for k in (int(x) for x in args.ks.split(",")):
            case = f"{args.device} fp32 EMAs / {label}"
            key = f"{case} K={k}"
            results[key] = run_case(args, dtype, k, sizes)
            checks += report(case, results[key])
            if args.device == "cuda":
                torch.cuda.empty_cache()
    finish(results, checks, args.json)


if __name__ == "__main__":
    main()
