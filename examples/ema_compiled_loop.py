"""A compiled training loop that keeps an EMA of the weights with one fused fsdp_ema op per step.

Trains a small MLP on a synthetic regression task with deliberately noisy SGD, then compares the
validation loss of the raw weights with that of the EMA weights. The optimizer step and the EMA
update are one torch.compile(fullgraph=True) graph; the decay follows a warmup schedule and is a
0-dim tensor, so its changing value never triggers a recompile.

    python examples/ema_compiled_loop.py [--steps 400] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.testing import CompileCounterWithBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import fsdp_ema  # noqa: E402,F401  (registers torch.ops.fsdp_ema)


def warmup_decay(step: torch.Tensor, max_decay: float, gamma: float = 1.0, power: float = 2 / 3):
    """timm/diffusers warmup: 1 - (1 + step / gamma) ** -power, at most max_decay."""
    return torch.clamp(1 - (1 + step / gamma) ** -power, min=0.0, max=max_decay)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--decay", type=float, default=0.99)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)

    # Synthetic task: y = sin(x @ A) @ B + noise.
    a, b = torch.randn(32, 64) / 4, torch.randn(64, 8) / 8
    def batch(n, g):
        x = torch.randn(n, 32, generator=g)
        y = torch.sin(x @ a) @ b + 0.5 * torch.randn(n, 8, generator=g)
        return x.to(device), y.to(device)
    x_val, y_val = batch(4096, torch.Generator().manual_seed(1))

    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 8)).to(device)
    params = list(model.parameters())
    ema = [p.detach().clone() for p in params]  # fp32 EMA, one tensor per parameter
    step = torch.zeros((), device=device)

    def optimizer_and_ema_step():
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-args.lr)
            step.add_(1)
            torch.ops.fsdp_ema.update_(ema, params, warmup_decay(step, args.decay))

    counter = CompileCounterWithBackend("inductor")
    compiled_step = torch.compile(optimizer_and_ema_step, backend=counter, fullgraph=True)

    g = torch.Generator().manual_seed(2)
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        x, y = batch(16, g)  # small, noisy batches: the raw weights jitter, the EMA smooths them
        model.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(model(x), y).backward()
        compiled_step()
        if i % max(1, args.steps // 10) == 0 or i == args.steps:
            print(f"\rtraining: step {i}/{args.steps}", end="", flush=True)
    elapsed = time.perf_counter() - t0
    print()

    with torch.no_grad():
        raw_loss = torch.nn.functional.mse_loss(model(x_val), y_val).item()
        saved = [p.detach().clone() for p in params]
        torch._foreach_copy_(params, ema)
        ema_loss = torch.nn.functional.mse_loss(model(x_val), y_val).item()
        torch._foreach_copy_(params, saved)

    print(f"steps: {args.steps} on {device} in {elapsed:.1f} s "
          f"({args.steps / elapsed:.0f} steps/s)")
    print(f"compiled graphs for the optimizer + EMA step: {counter.frame_count} "
          f"(decay changed every step; 1 means no recompiles)")
    print(f"final decay: {warmup_decay(step, args.decay).item():.4f}")
    print(f"validation loss, raw weights: {raw_loss:.5f}")
    print(f"validation loss, EMA weights: {ema_loss:.5f}  "
          f"({'better' if ema_loss < raw_loss else 'not better'} than raw)")
    if counter.frame_count != 1:
        sys.exit("unexpected recompilation")


if __name__ == "__main__":
    main()
