"""The trainer integrations' cost per training step against the plain ShardedEMA loop (#25).

In each framework, the same training run three ways (one process on the CPU):

  no EMA          the framework's step alone (for scale)
  plain           ``fsdp_ema.ShardedEMA`` made and updated by hand: the LightningModule's own
                  ``on_train_batch_end`` hook / a bare ``TrainerCallback`` calling ``ema.update()``
  callback        ``fsdp_ema.integrations.lightning.ShardedEMA`` /
                  ``fsdp_ema.integrations.transformers.ShardedEMACallback``

A step's time is the time between two consecutive step starts (``on_train_batch_start`` /
``on_step_begin``), so it holds everything the framework and every callback do per step; each
run gives the median of its steps (the first ``--skip`` left out). Runs are interleaved (one of
each way per round, the order rotating) so load from other work hits every row alike; the table
shows the min and median over ``--repeat`` rounds, and the ratio to the plain row: the median of
the rounds' ratios (runs of one round are back to back, so load that comes and goes on a shared
machine moves both alike) and min over min. Target: the callback within 5% of plain. A last
table times the adapter call alone (``on_step_end`` / ``on_train_batch_end`` against
``ema.update()``), interleaved the same way.

    python bench/bench_integrations.py                  # 1 thread, defaults below
    python bench/bench_integrations.py --repeat 9 --steps 40 --hidden 1024 --layers 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))

from report import finish  # noqa: E402

import fsdp_ema  # noqa: E402

DECAY = 0.999
TARGET = 1.05


class MLP(nn.Module):
    def __init__(self, layers: int, hidden: int):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(*[m for _ in range(layers)
                                    for m in (nn.Linear(hidden, hidden), nn.GELU())])
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(self.body(x))


def batches(args):
    g = torch.Generator().manual_seed(1)
    rows = args.batch * (args.steps + 1)
    return torch.randn(rows, args.hidden, generator=g), torch.randn(rows, 1, generator=g)


def step_median(starts: list[float], skip: int) -> float:
    gaps = [b - a for a, b in zip(starts, starts[1:])][skip:]
    return statistics.median(gaps)


# --- Lightning ------------------------------------------------------------------------------------

def lightning_run(args, way: str) -> float:
    import lightning.pytorch as pl

    from fsdp_ema.integrations.lightning import ShardedEMA

    starts: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            starts.append(time.perf_counter())

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = MLP(args.layers, args.hidden)
            self.ema = None

        def on_fit_start(self):
            if way == "plain":
                self.ema = fsdp_ema.ShardedEMA(self, DECAY)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.ema is not None:
                self.ema.update()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    x, y = batches(args)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                       batch_size=args.batch)
    callbacks = [Clock()] + ([ShardedEMA(DECAY)] if way == "callback" else [])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=callbacks)
    trainer.fit(Module(), data)
    return step_median(starts, args.skip)


# --- Hugging Face Trainer -------------------------------------------------------------------------

def transformers_run(args, way: str, tmp: str) -> float:
    import transformers

    from fsdp_ema.integrations.transformers import ShardedEMACallback

    starts: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, a, state, control, **kwargs):
            starts.append(time.perf_counter())

    class Plain(transformers.TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **kwargs):
            self.ema = fsdp_ema.ShardedEMA(model, DECAY)

        def on_step_end(self, a, state, control, **kwargs):
            self.ema.update()

    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = MLP(args.layers, args.hidden)

        def forward(self, x, y):
            return {"loss": F.mse_loss(self.net(x), y)}

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.x, self.y = batches(args)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "y": self.y[i]}

    callbacks = [Clock()] + {"none": [], "plain": [Plain()],
                             "callback": [ShardedEMACallback(DECAY)]}[way]
    targs = transformers.TrainingArguments(
        output_dir=tmp, use_cpu=True, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=1e-3, optim="sgd", lr_scheduler_type="constant", report_to=[],
        disable_tqdm=True, save_strategy="no", logging_strategy="no", remove_unused_columns=False,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=Regression(), args=targs, train_dataset=Rows(),
                                   callbacks=callbacks)
    trainer.remove_callback(transformers.PrinterCallback)  # its end-of-training line
    trainer.train()
    return step_median(starts, args.skip)


# --- the adapter call alone -----------------------------------------------------------------------

def adapter_calls(args) -> dict[str, list[float]]:
    """Seconds of ``ema.update()`` and of each callback's per-step hook on the same model."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from fsdp_ema.integrations.lightning import ShardedEMA
    from fsdp_ema.integrations.transformers import ShardedEMACallback

    model = MLP(args.layers, args.hidden)
    plain = fsdp_ema.ShardedEMA(model, DECAY)
    hf = ShardedEMACallback(DECAY)
    hf.attach(model)
    state, control = TrainerState(), TrainerControl()
    light = ShardedEMA(DECAY)
    fake = SimpleNamespace(global_step=0)
    light.ema = fsdp_ema.ShardedEMA(model, DECAY)  # as on_fit_start makes it, without a fit
    light._update = light.ema.update

    def lightning_hook():
        fake.global_step += 1
        light.on_train_batch_end(fake, model, None, None, 0)

    fns = {"ema.update()": plain.update,
           "ShardedEMACallback.on_step_end": lambda: hf.on_step_end(None, state, control),
           "lightning ShardedEMA.on_train_batch_end": lightning_hook}
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(args.repeat * 10):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="first steps of a run left out")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    warnings.filterwarnings("ignore")
    import logging
    import tempfile

    import lightning
    import transformers

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # after its import sets INFO

    transformers.logging.set_verbosity_error()
    numel = sum(p.numel() for p in MLP(args.layers, args.hidden).parameters())
    load = os.getloadavg()
    print(f"torch {torch.__version__}, lightning {lightning.__version__}, transformers "
          f"{transformers.__version__}, CPU, {args.threads} thread(s); model {numel / 1e6:.1f}M "
          f"parameters (EMA float32), batch {args.batch}, {args.steps} steps a run, median step "
          f"of each run, {args.repeat} interleaved rounds; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start")

    ways = ["none", "plain", "callback"]
    results: dict = {"load_average": load, "numel": numel}
    checks = []
    with tempfile.TemporaryDirectory(prefix="fsdp_ema_bench_integrations_") as tmp:
        for framework, run in (("lightning", lambda w: lightning_run(args, w)),
                               ("transformers", lambda w: transformers_run(args, w, tmp))):
            times = {w: [] for w in ways}
            for r in range(args.repeat):
                for w in ways[r % 3:] + ways[:r % 3]:
                    times[w].append(run(w))
            results[framework] = times
            # Paired by round (the runs of a round are back to back): load that comes and goes
            # on a shared machine moves both sides of a ratio alike.
            paired = {w: statistics.median(t / p for t, p in zip(times[w], times["plain"]))
                      for w in ways}
            print(f"\n{framework}: ms per step")
            print(f"{'way':<12}{'min':>10}{'median':>10}{'/ plain (paired median)':>26}"
                  f"{'/ plain (min)':>16}")
            for w in ways:
                print(f"{w:<12}{min(times[w]) * 1e3:>10.2f}"
                      f"{statistics.median(times[w]) * 1e3:>10.2f}{paired[w]:>25.3f}x"
                      f"{min(times[w]) / min(times['plain']):>15.3f}x")
            ratio_min = min(times["callback"]) / min(times["plain"])
            checks.append((f"{framework} callback step / plain ShardedEMA step",
                           paired["callback"] <= TARGET,
                           f"{paired['callback']:.3f}x (median of the rounds' ratios), "
                           f"{ratio_min:.3f}x (min / min); target <= {TARGET:.2f}x"))

    calls = adapter_calls(args)
    results["calls"] = calls
    base = statistics.median(calls["ema.update()"])
    print("\nthe per-step call alone (us)")
    print(f"{'call':<42}{'min':>10}{'median':>10}{'extra (median)':>18}")
    for name, t in calls.items():
        med = statistics.median(t)
        print(f"{name:<42}{min(t) * 1e6:>10.1f}{med * 1e6:>10.1f}{(med - base) * 1e6:>17.1f}")
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
    finish(results, checks, args.json)


if __name__ == "__main__":
    main()
