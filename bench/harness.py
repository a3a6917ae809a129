"""What the update benchmarks (bench_update.py, bench_multi_ema.py) share: the device, size and
repeat options, the machine line, and the interleaved timing of their rows."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def size_parser(doc: str, elements_help: str, warmup: int, repeat: int) -> argparse.ArgumentParser:
    """--device, --elements, --tensors, --warmup, --repeat; the caller adds its own options, then
    calls parse_args()."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--elements", type=int, default=None, help=elements_help)
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--repeat", type=int, default=repeat)
    return parser


def parse_args(parser: argparse.ArgumentParser, cpu_elements: int, cuda_elements: int):
    """Adds --json, parses, fills in the device's default element count and prints the machine
    line (the figures compare only within one machine and build)."""
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    if args.elements is None:
        args.elements = cpu_elements if args.device == "cpu" else cuda_elements
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"fsdp_ema CPU kernel ISA {torch.ops.fsdp_ema.cpu_capability()}"
          + (f", GPU {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    return args


def time_once(fn, device: str) -> float:
    """Seconds of one call: CUDA events on the GPU (the call only queues work), else wall time."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_times(fns: dict, device: str, warmup: int, repeat: int) -> dict[str, list[float]]:
    """Seconds of every round per function, warmed up first, then measured round-robin (one call
    of each function per round) so load from other work on the machine hits every row alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            times[name].append(time_once(fn, device))
    return times
