"""Sharded training with a compiled EMA step, EMA checkpoints, and an export for a C++ server.

A small decoder-only transformer learns next-token prediction on synthetic sequences (a fixed
second-order rule with noise: x[t+1] = (a * x[t] + b * x[t-1] + c) mod V, a random token with
probability --noise; generated on the fly, nothing downloaded). The model is sharded with FSDP2
(``fully_shard``, the default) or FSDP1 (``--fsdp1``) over every rank, and a
``fsdp_ema.ShardedEMA`` keeps the average of each rank's shards.

What is compiled: forward and backward run eagerly (FSDP's hooks); the optimizer (AdamW, written
out with ``torch._foreach_*`` ops on the local shards, since ``torch.optim``'s ``step()``
graph-breaks by design) and ``ema.update()`` with its warmup schedule form ONE
``torch.compile(fullgraph=True)`` graph that compiles once (the step and decay are device
tensors, so their changing values never recompile). The very first step runs that function
eagerly (see the comment in the loop), every later one compiled.

Every --save-every steps (and at the end) it writes ``OUT/ckpt/step-NNNNNN/`` holding ``model/``
(``ema.save_shard_weights``), ``optim/`` (each rank's AdamW moments) and ``ema/`` (``ema.save``),
the EMA last: a step directory is committed once ``ema/fsdp_ema.index.json`` exists.
``--resume`` continues from the latest committed step directory (others are skipped).

For the C++ server (examples/serve.cpp) rank 0 writes:
  OUT/model.pt      TorchScript of the unwrapped model, every weight NaN: the server replaces all
                    of them from the EMA checkpoint (CheckpointReader::load_into, strict names)
  OUT/model.pt2     with --serve aoti or both: the same model as an AOTInductor package
                    (torch.export + aoti_compile_and_package, runtime constant folding, NaN
                    weights), whose constants the server replaces through the package's
                    constant-update API
  OUT/val/          the validation batch (inputs, targets: int64), an fsdp_ema checkpoint
  OUT/result.json   Python's validation losses (raw and EMA weights, the EMA via ema.swap()),
                    the checkpoint they belong to, steps/s

    torchrun --nproc-per-node 2 examples/train.py [--steps 600] [--fsdp1] [--resume] [--out DIR]
                                                  [--serve torchscript|aoti|both]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import fsdp_ema  # noqa: E402
from fsdp_ema import ShardedEMA, Warmup  # noqa: E402

# FSDP2 warns about any view returned by the root module (our logits); we do no in-place op on it.
warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
warnings.filterwarnings("ignore", message=r".*torch\.jit\.(script|save)` is deprecated.*")


# --- the model (plain nn.Module, scriptable: the same class is exported for C++) ----------------

class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q = q.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; serve.cpp computes exactly this."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- synthetic data ------------------------------------------------------------------------------

def make_batch(n: int, args, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences of the rule x[t+1] = (3 x[t] + 5 x[t-1] + 7) mod V, each token replaced by a
    random one with probability args.noise. Deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    v, t = args.vocab, args.seq + 1
    x = torch.empty(n, t, dtype=torch.int64)
    x[:, :2] = torch.randint(0, v, (n, 2), generator=g)
    noise = torch.rand(n, t, generator=g) < args.noise
    rand = torch.randint(0, v, (n, t), generator=g)
    for i in range(2, t):
        x[:, i] = torch.where(noise[:, i], rand[:, i], (3 * x[:, i - 1] + 5 * x[:, i - 2] + 7) % v)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


# --- checkpoints ---------------------------------------------------------------------------------

STEP_DIR = re.compile(r"^step-(\d{6,})$")


def committed(step_dir: Path) -> bool:
    return all((step_dir / part / "fsdp_ema.index.json").is_file()
               for part in ("model", "optim", "ema"))


def latest_checkpoint(ckpt_root: Path) -> tuple[int, Path] | None:
    """The committed step directory with the highest step; uncommitted ones are skipped."""
    found = []
    for d in ckpt_root.glob("step-*"):
        m = STEP_DIR.match(d.name)
        if m and d.is_dir() and committed(d):
            found.append((int(m.group(1)), d))
    return max(found) if found else None


def save_checkpoint(step_dir: Path, ema: ShardedEMA, state: list[torch.Tensor],
                    rank: int, world: int) -> None:
    """model/, optim/ (rank-local AdamW moments + step), then ema/ last: the commit marker."""
    ema.save_shard_weights(step_dir / "model", overwrite=True)
    # The AdamW moments have the local shards' shapes; each rank writes its own names.
    fsdp_ema.checkpoint.save_shard(step_dir / "optim",
                                   {f"rank{rank}.{i}": t for i, t in enumerate(state)},
                                   rank=rank, world_size=world, overwrite=True)
    dist.barrier()
    if rank == 0:
        fsdp_ema.checkpoint.commit(step_dir / "optim", world, overwrite=True)
    dist.barrier()
    ema.save(step_dir / "ema", overwrite=True)


def local_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What this rank holds of every parameter, as the EMA reads it: FSDP2 DTensors' local
    shards, FSDP1 flat parameters' local slices (``_local_shard`` once FSDP1's lazy init, at the
    first forward, has made it; the parameter itself before)."""
    return [p._local_tensor if hasattr(p, "_local_tensor") else getattr(p, "_local_shard", p)
            for p in model.parameters()]


def local_grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
            for p in model.parameters()]


# --- progress ------------------------------------------------------------------------------------

class Progress:
    """A progress bar on a terminal; a plain line every tenth of the run otherwise."""

    def __init__(self, first: int, last: int, enabled: bool):
        self.first, self.last, self.enabled = first, last, enabled
        self.tty = enabled and sys.stdout.isatty()
        self.t0 = time.perf_counter()
        self.every = max(1, (last - first) // 10)

    def __call__(self, step: int, loss: float | None) -> None:
        if not self.enabled:
            return
        done = step - self.first
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        loss_s = f"loss {loss:.4f}" if loss is not None else ""
        if self.tty:
            width = 30
            fill = int(width * done / max(self.last - self.first, 1))
            print(f"\r  [{'#' * fill}{'.' * (width - fill)}] step {step}/{self.last} {loss_s} "
                  f"{rate:.1f} steps/s ", end="", flush=True)
            if step == self.last:
                print()
        elif done % self.every == 0 or step == self.last:
            print(f"  step {step}/{self.last} {loss_s} {rate:.1f} steps/s", flush=True)


# --- main ----------------------------------------------------------------------------------------

def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model, data and AdamW settings (shared with examples/posthoc_plot.py)."""
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight-decay", type=float, default=0.01)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    add_model_arguments(p)
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--val-size", type=int, default=256)
    p.add_argument("--fsdp1", action="store_true", help="FSDP1 (FullyShardedDataParallel)")
    p.add_argument("--no-compile", action="store_true", help="run the optimizer + EMA eagerly")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest committed OUT/ckpt/step-* directory")
    p.add_argument("--serve", choices=("torchscript", "aoti", "both"), default="torchscript",
                   help="model formats to export for the C++ server (aoti compiles a package: "
                        "about a minute on 2 CPU cores)")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    out = Path(args.out)
    ckpt_root = out / "ckpt"
    say = print if rank == 0 else (lambda *a, **k: None)

    # --- model, sharding, EMA -----------------------------------------------------------------
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = Transformer(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device)
    n_params = sum(t.numel() for t in model.parameters())
    if args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=False,
                     device_id=device)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    params = local_tensors(model)  # for the shapes; read again every step
    exp_avg = [torch.zeros_like(t) for t in params]
    exp_avg_sq = [torch.zeros_like(t) for t in params]
    adam_step = torch.zeros((), device=device)
    ema = ShardedEMA(model, decay=args.ema_decay, warmup=Warmup(power=2 / 3))

    start = 0
    if args.resume:
        found = latest_checkpoint(ckpt_root)
        if found is None:
            say(f"resume: no committed checkpoint under {ckpt_root}; starting from scratch")
        else:
            start, step_dir = found
            fsdp_ema.load_model_weights(model, step_dir / "model")
            ema.load(step_dir / "ema")
            info = fsdp_ema.checkpoint.info(step_dir / "optim")
            names = [f"rank{rank}.{i}" for i in range(2 * len(params))]
            if all(n in info["tensors"] for n in names) and info["world_size"] == world:
                state = fsdp_ema.checkpoint.load(step_dir / "optim", names)
                with torch.no_grad():
                    torch._foreach_copy_(exp_avg + exp_avg_sq, [state[n] for n in names])
            else:
                say("resume: the optimizer state was written by another world size or wrapper; "
                    "AdamW moments restart")
            adam_step.fill_(start)
            # The schedule resumes too: the EMA has seen `start` updates.
            ema.load_state_dict({ShardedEMA.STEP_KEY: torch.tensor(start)}, strict=False)
            say(f"resume: {step_dir} (step {start})")

    # --- the compiled optimizer + EMA step ----------------------------------------------------
    b1, b2, eps, lr, wd = 0.9, 0.95, 1e-8, args.lr, args.weight_decay

    def optimizer_and_ema_step(params, grads, exp_avg, exp_avg_sq, step):
        with torch.no_grad():
            step.add_(1)
            torch._foreach_lerp_(exp_avg, grads, 1 - b1)
            torch._foreach_mul_(exp_avg_sq, b2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - b2)
            bias1 = 1 - b1 ** step
            bias2 = 1 - b2 ** step
            denom = torch._foreach_sqrt(exp_avg_sq)
            torch._foreach_div_(denom, torch.sqrt(bias2))
            torch._foreach_add_(denom, eps)
            update = torch._foreach_div(exp_avg, denom)
            torch._foreach_mul_(update, -lr / bias1)
            torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_add_(params, update)
        ema.update()

    counter = None
    if args.no_compile:
        opt_step = optimizer_and_ema_step
    else:
        from torch._dynamo.testing import CompileCounterWithBackend

        counter = CompileCounterWithBackend("inductor")
        opt_step = torch.compile(optimizer_and_ema_step, backend=counter, fullgraph=True)

    x_val, y_val = make_batch(args.val_size, args, seed=10_000_019)

    def validation_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = loss_fn(model(x_val.to(device)), y_val.to(device)).item()
        model.train()
        return loss

    # --- train --------------------------------------------------------------------------------
    say(f"training: {'FSDP1' if args.fsdp1 else 'FSDP2'} on {world} rank(s), "
        f"{device.type} + {dist.get_backend()}, "
        f"{n_params / 1e6:.2f}M parameters ({sum(t.numel() for t in params)} elements on "
        f"rank 0), steps {start + 1}..{args.steps}, "
        f"{'optimizer + EMA compiled (fullgraph)' if counter else 'eager'}")
    progress = Progress(start, args.steps, rank == 0)
    last_saved = start if args.resume and start else None
    t0 = time.perf_counter()
    t1 = None  # after the first compiled step
    loss = None
    for step in range(start + 1, args.steps + 1):
        # A different batch on every rank and step, the same ones after a resume.
        x, y = make_batch(args.batch, args, seed=args.seed * 1_000_003 + step * 1009 + rank)
        loss_t = loss_fn(model(x.to(device)), y.to(device))
        loss_t.backward()
        # The first step runs eagerly: FSDP1's lazy init (first forward) replaces the tensors
        # the EMA reads by views of the same memory, and an eager update() follows them (a
        # compiled one would guard on the old ones and recompile once).
        step_fn = opt_step if step > start + 1 else optimizer_and_ema_step
        step_fn(local_tensors(model), local_grads(model), exp_avg, exp_avg_sq, adam_step)
        model.zero_grad(set_to_none=True)
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(ckpt_root / f"step-{step:06d}", ema, exp_avg + exp_avg_sq, rank, world)
            last_saved = step
        if rank == 0 and (sys.stdout.isatty() or step == args.steps
                          or (step - start) % progress.every == 0):
            loss = loss_t.item()
        progress(step, loss)
        if t1 is None and step > start + 1:
            t1 = time.perf_counter()
    elapsed = time.perf_counter() - t0
    steps_done = args.steps - start
    steady = (steps_done - 2) / (time.perf_counter() - t1) if steps_done > 2 else None

    # --- evaluate, export ---------------------------------------------------------------------
    raw = validation_loss()
    with ema.swap():
        ema_loss = validation_loss()
    if rank == 0:
        # The unwrapped model, built the same way: its parameter names are the EMA's clean FQNs.
        plain = Transformer(args.vocab, args.dim, args.layers, args.heads, args.seq)
        with torch.no_grad():
            for t in plain.parameters():
                t.fill_(float("nan"))  # no weights baked in: the server must load every one
        exported = []
        if args.serve in ("torchscript", "both"):
            torch.jit.save(torch.jit.script(plain.eval()), str(out / "model.pt"))
            exported.append(f"{out / 'model.pt'} (TorchScript, NaN weights)")
        if args.serve in ("aoti", "both"):
            # Runtime constant folding keeps every weight a replaceable constant: compile-time
            # folding would bake transposed copies of the (NaN) weights into the package.
            program = torch.export.export(plain.eval(), (x_val,))
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(out / "model.pt2"),
                inductor_configs={"aot_inductor.use_runtime_constant_folding": True})
            exported.append(f"{out / 'model.pt2'} (AOTInductor, NaN weights)")
        fsdp_ema.checkpoint.save(out / "val", {"inputs": x_val, "targets": y_val},
                                 overwrite=True)
        final_dir = ckpt_root / f"step-{last_saved:06d}" if last_saved else None
        result = {
            "fsdp": 1 if args.fsdp1 else 2, "world_size": world, "device": device.type,
            "steps": args.steps, "steps_run": steps_done, "seconds": elapsed,
            "steps_per_s": steps_done / elapsed if elapsed > 0 else None,
            "steps_per_s_compiled": steady,
            "compiled_graphs": counter.frame_count if counter else None,
            "final_decay": float(ema.last_decay) if ema.last_decay is not None else None,
            "val_loss_raw": raw, "val_loss_ema": ema_loss,
            "checkpoint": str(final_dir / "ema") if final_dir else None,
            "model": str(out / "model.pt") if args.serve != "aoti" else None,
            "aoti_model": str(out / "model.pt2") if args.serve != "torchscript" else None,
            "val": str(out / "val"),
        }
        (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"done: {steps_done} steps in {elapsed:.1f} s ({result['steps_per_s'] or 0:.1f} "
              f"steps/s{f'; {steady:.1f} steps/s once compiled' if steady else ''}), "
              f"compiled graphs for the optimizer + EMA step: {result['compiled_graphs']}")
        print(f"validation loss (Python), raw weights: {raw:.6f}")
        print(f"validation loss (Python), EMA weights: {ema_loss:.6f}  "
              f"({'better' if ema_loss < raw else 'not better'} than raw; "
              f"final decay {result['final_decay']:.4f})")
        print(f"EMA checkpoint: {result['checkpoint']}  (written by {world} ranks)")
        print(f"exported: {', '.join(exported)}, {out / 'val'}, {out / 'result.json'}")
        if counter and counter.frame_count != 1:
            print(f"warning: the optimizer + EMA step compiled {counter.frame_count} times")
    fsdp_ema.destroy_process_group()  # barrier, destroy, and gloo's clean exit


if __name__ == "__main__":
    main()
