"""The host-memory EMA on a GPU (issue 17): the step time of a small FSDP2 training loop and the
device memory its EMA holds, for

  no EMA                     the loop alone;
  EMA on device              ShardedEMA(model): an fp32 EMA beside the bf16 weights, the fused
                             CUDA update after every step;
  ours offloaded             ShardedEMA(model, device="cpu"): the fp32 EMA in pinned host memory;
                             the bf16 local shards copied device-to-host on a side stream, the
                             fused CPU update on a worker thread, overlapped with the next step;
  ours offloaded, every N    the same with update_every=N;
  torchtitan offload_to_cpu  torchtitan's recipe (components/ema.py), written again here: the EMA
                             as pinned host copies of the local shards, in the weights' dtype as
                             torchtitan keeps it; per update, on a side stream, host-to-device into
                             a device scratch the size of the weights, ``_foreach_lerp_`` there,
                             device-to-host back;

in one run: one rank per GPU (NCCL), methods interleaved, min and median over --repeat repeats of
--steps steps each (CUDA-synchronized, the last pending EMA update waited for). Also printed: the
fused CPU update alone (the offload worker's work per update, one call on the host), which must
take less than a step for the offloaded EMA to keep up.

Targets: ours offloaded adds <= 5% to the step time of the loop alone at update_every=1 (medians),
and holds no device memory (allocated bytes with the EMA minus without, after its steps: 0).

    python bench/bench_host_ema.py [--width 4096] [--layers 8] [--tokens 65536] [--repeat 5]
    python bench/bench_host_ema.py --device cpu --width 128 --layers 2 --tokens 64 --steps 2 \\
        --repeat 1      # the same logic on the CPU (forced offload path); figures meaningless
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from ranks import init_group, spawn  # noqa: E402

DECAY = 0.999


class TitanOffload:
    """torchtitan's ``offload_to_cpu`` update, re-written for the comparison (not imported:
    torchtitan is not a dependency). Note what it costs beside the PCIe traffic both ways: a
    device scratch as large as the weights, and no wait of the training stream on the side
    stream (the next step's optimizer may overwrite the weights while the lerp reads them)."""

    def __init__(self, params):
        self.local = [p.to_local().detach() for p in params]
        self.ema = [t.detach().cpu().pin_memory() for t in self.local]
        self.scratch = [torch.empty_like(t) for t in self.local]
        self.stream = torch.cuda.Stream()
        self.pending = None

    @torch.no_grad()
    def update(self) -> None:
        self.synchronize()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            torch._foreach_copy_(self.scratch, self.ema, non_blocking=True)
            torch._foreach_lerp_(self.scratch, self.local, 1.0 - DECAY)
            torch._foreach_copy_(self.ema, self.scratch, non_blocking=True)
            self.pending = torch.cuda.Event()
            self.pending.record(self.stream)

    def synchronize(self) -> None:
        if self.pending is not None:
            self.pending.synchronize()
            self.pending = None


def worker(rank, init_file, args, out_queue):
    import warnings

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fsdp_ema
    from fsdp_ema.ema.offload import forced_for_cpu_models

    warnings.filterwarnings("ignore")
    cuda = args.device == "cuda"
    device = init_group(rank, init_file, args.ranks, args.device)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width, bias=False), nn.GELU()]
    model = nn.Sequential(*layers).to(device=device, dtype=torch.bfloat16)
    mesh = init_device_mesh(args.device, (args.ranks,))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    x = torch.randn(args.tokens, args.width, device=device, dtype=torch.bfloat16)
    params = list(model.parameters())
    local_numel = sum(p.to_local().numel() for p in params)

    def step():
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists before anything is measured

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def allocated():
        sync()
        return torch.cuda.memory_allocated(device) if cuda else 0

    def make(method):
        """(update after a step, wait for what is pending) of a method."""
        if method == "no EMA":
            return (lambda: None), (lambda: None)
        if method == "torchtitan offload_to_cpu":
            t = TitanOffload(params)
            return t.update, t.synchronize
        kw = {}
        if method.startswith("ours offloaded"):
            kw = {"device": "cpu"}
            if "every" in method:
                kw["update_every"] = args.update_every
        # The host-memory path (staging, worker thread), forced for a CPU model too.
        with forced_for_cpu_models():
            ema = fsdp_ema.ShardedEMA(model, DECAY, **kw)
        return ema.update, ema.synchronize

    methods = ["no EMA", "EMA on device", "ours offloaded"]
    if args.update_every > 1:
        methods.append(f"ours offloaded, every {args.update_every}")
    if cuda:
        methods.append("torchtitan offload_to_cpu")

    # Device memory the EMA holds (one method alive at a time), after a few of its steps.
    held = {}
    for method in methods:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        before = allocated()
        update, wait = make(method)
        for _ in range(2):
            step()
            update()
        wait()
        held[method] = allocated() - before
        peak = torch.cuda.max_memory_allocated(device) - before if cuda else 0
        held[method + " (peak over steps)"] = peak
        del update, wait
    gc.collect()

    # Step times, methods interleaved, every EMA alive.
    alive = {m: make(m) for m in methods}
    times = {m: [] for m in methods}
    for rep in range(args.repeat + 1):  # round 0 warms up
        for method in methods:
            update, wait = alive[method]
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
                update()
            wait()
            sync()
            if rep:
                times[method].append((time.perf_counter() - t0) / args.steps)

    # The offload worker's share of an update: the fused CPU kernel alone, on host tensors.
    staged = [torch.empty(p.to_local().shape, dtype=p.dtype, pin_memory=cuda).normal_()
              for p in params]
    host = [torch.zeros(t.shape, dtype=torch.float32) for t in staged]
    decay = torch.tensor(DECAY, dtype=torch.float64)
    cpu_update = []
    for _ in range(args.repeat + 1):
        t0 = time.perf_counter()
        torch.ops.fsdp_ema.update_(host, staged, decay)
        cpu_update.append(time.perf_counter() - t0)
    gathered = [None] * args.ranks
    dist.all_gather_object(gathered, {"times": times, "held": held,
                                      "cpu_update": cpu_update[1:]})
    if rank == 0:
        out_queue.put({"ranks": gathered, "local_numel": local_numel,
                       "device": torch.cuda.get_device_name(device) if cuda else "CPU",
                       "threads": torch.get_num_threads()})
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--ranks", type=int, default=None, help="default: min(2, GPUs); CPU 1")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=65536, help="rows of the batch per step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--update-every", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from report import finish

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_host_ema: no CUDA device here; the host-memory EMA's step-time rows need a "
              "GPU (run with --device cpu to exercise the logic)")
        return
    if args.ranks is None:
        args.ranks = min(2, torch.cuda.device_count()) if args.device == "cuda" else 1
    results = spawn(worker, args, args.ranks)
    ranks = results["ranks"]
    n = args.repeat
    methods = list(ranks[0]["times"])

    def worst(method):  # slowest rank per repeat
        return [max(r["times"][method][i] for r in ranks) for i in range(n)]

    base = statistics.median(worst("no EMA"))
    params_m = results["local_numel"] * args.ranks / 1e6
    print(f"torch {torch.__version__}, {args.ranks} rank(s) on {results['device']}, FSDP2 MLP "
          f"{args.layers} x {args.width}x{args.width} bf16 ({params_m:.0f}M weights, fp32 EMA), "
          f"{args.tokens} rows per step, AdamW; {args.steps} steps x {n} interleaved repeats "
          f"(slowest rank)")
    print(f"\n  {'method':34} {'ms/step min':>11} {'median':>8} {'vs no EMA':>9} "
          f"{'EMA device MiB':>14} {'+peak MiB':>9}")
    out = {"no EMA": worst("no EMA")}
    held = {m: max(r["held"][m] for r in ranks) for m in ranks[0]["held"]}
    peak = " (peak over steps)"  # +peak: beyond the same steps' peak without an EMA
    for method in methods:
        t = worst(method)
        out[method] = t
        print(f"  {method:34} {min(t) * 1e3:11.2f} {statistics.median(t) * 1e3:8.2f} "
              f"{statistics.median(t) / base:8.3f}x {held[method] / 2**20:14.1f} "
              f"{(held[method + peak] - held['no EMA' + peak]) / 2**20:9.1f}")
    cpu = [max(r["cpu_update"][i] for r in ranks) for i in range(n)]
    print(f"\n  fused CPU update alone ({results['threads']} threads): min {min(cpu) * 1e3:.2f} "
          f"ms, median {statistics.median(cpu) * 1e3:.2f} ms (a step of the loop alone: "
          f"{base * 1e3:.2f} ms)")
    ours = statistics.median(out["ours offloaded"])
    checks = [
        ("ours offloaded adds <= 5% to the step time (update_every=1)", ours <= 1.05 * base,
         f"{(ours / base - 1) * 100:+.1f}% (median {ours * 1e3:.2f} ms vs {base * 1e3:.2f} ms)"),
        ("ours offloaded holds no device memory", held["ours offloaded"] <= 0,
         f"{held['ours offloaded']} bytes (EMA on device: {held['EMA on device']} bytes)")]
    if args.device == "cpu":
        print("\n(--device cpu: the offload logic ran on the CPU; the figures say nothing about a "
              "GPU, so no target is judged)")
        checks = []
    finish({"times": out, "held": held, "cpu_update": cpu}, checks, args.json)


if __name__ == "__main__":
    main()
