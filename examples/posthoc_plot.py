"""Post-hoc EMA on the demo's model: validation loss against sigma_rel, as a PNG.

Trains examples/train.py's transformer (same model, data and AdamW settings; one process, no
FSDP, so it runs anywhere in a minute or two) with a ``fsdp_ema.ShardedPowerEMA`` keeping the two
EDM2 profiles sigma_rel = 0.05 and 0.10, snapshots every --snapshot-every steps, and three more
power EMAs tracked directly (0.03, 0.15, 0.25) as a check. Then, for a grid of sigma_rel,
``fsdp_ema.posthoc`` synthesizes the EMA from the snapshots, and the validation loss of each is
plotted with the directly tracked ones and the raw weights' loss.

    python examples/posthoc_plot.py [--steps 600] [--out build/posthoc_demo]
        [--png docs/posthoc_ema.png]
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))
from png_plot import LinePlot  # noqa: E402
from train import Transformer, add_model_arguments, loss_fn, make_batch  # noqa: E402

import fsdp_ema  # noqa: E402

TRACKED = (0.03, 0.15, 0.25)
GRID = (0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.10, 0.12, 0.15, 0.18, 0.21, 0.25, 0.28)


@torch.no_grad()
def val_loss(model, weights, val):
    m = copy.deepcopy(model)
    m.load_state_dict(weights, strict=True)
    return loss_fn(m(val[0]), val[1]).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--snapshot-every", type=int, default=50)
    p.add_argument("--batch", type=int, default=32)
    add_model_arguments(p)
    p.add_argument("--out", default=str(HERE.parent / "build" / "posthoc_demo"))
    p.add_argument("--png", default=str(HERE.parent / "docs" / "posthoc_ema.png"))
    args = p.parse_args()

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(0)
    model = Transformer(args.vocab, args.dim, args.layers, args.heads, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    ema = fsdp_ema.ShardedPowerEMA(model, (0.05, 0.10), snapshot_every=args.snapshot_every,
                                   snapshot_root=out / "snapshots")
    tracked = {s: fsdp_ema.ShardedEMA(model, schedule=fsdp_ema.PowerEMA(s)) for s in TRACKED}
    val = make_batch(256, args, seed=10**6)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = make_batch(args.batch, args, seed=step)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update()
        for t in tracked.values():
            t.update()
        ema.maybe_snapshot(step)
        if step % 100 == 0:
            print(f"step {step}/{args.steps} loss {loss.item():.4f}", flush=True)
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.1f} s; snapshots: "
          f"{len(list((out / 'snapshots').iterdir()))}")

    raw = val_loss(model, model.state_dict(), val)
    posthoc = {}
    for s in GRID:
        fsdp_ema.posthoc(out / "snapshots", sigma_rel=s, out=out / f"posthoc-{s:.3f}")
        posthoc[s] = val_loss(model, fsdp_ema.checkpoint.load(out / f"posthoc-{s:.3f}"), val)
    direct = {}
    for s, t in tracked.items():
        with t.swap() as m:
            direct[s] = loss_fn(m(val[0]), val[1]).item()
    best = min(posthoc, key=posthoc.get)
    print(f"validation loss, raw weights: {raw:.5f}")
    for s in GRID:
        mark = "  <- best" if s == best else ""
        extra = f"   (tracked directly: {direct[s]:.5f})" if s in direct else ""
        print(f"  sigma_rel {s:.3f}: post-hoc {posthoc[s]:.5f}{extra}{mark}")
    (out / "losses.json").write_text(json.dumps(
        {"raw": raw, "posthoc": {str(k): v for k, v in posthoc.items()},
         "tracked": {str(k): v for k, v in direct.items()}}, indent=2))

    plot = LinePlot(720, 440, x_label="sigma_rel", y_label="validation loss",
                    title=f"post-hoc EMA, demo model, {args.steps} steps")
    plot.series(list(posthoc), list(posthoc.values()), color=(31, 119, 180),
                label="post-hoc (2 profiles)", markers=True)
    plot.series(list(direct), list(direct.values()), color=(214, 39, 40),
                label="tracked directly", markers=True, line=False)
    plot.hline(raw, color=(140, 140, 140), label="raw weights")
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    plot.save(args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
