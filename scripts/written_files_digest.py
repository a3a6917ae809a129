"""The SHA-256 of every file ShardedEMA.save, save_training_state and ShardedEMA.export write for
an FSDP2, an FSDP1 (flat and use_orig_params) and a plain model on 2 gloo ranks, with
deterministic weights and steps: a refactor that must not change what is written compares this
output before and after (docs/DEVELOPMENT.md, "Refactors").

    python scripts/written_files_digest.py > before.json   # ... change ...
    python scripts/written_files_digest.py > after.json && diff before.json after.json
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["plain", "fsdp2", "fsdp1_flat", "fsdp1_orig"]


class Net(nn.Module):
    """Rows that divide by neither 2 ranks' chunks evenly, a BatchNorm buffer, a 1-row head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 7)
        self.norm = nn.BatchNorm1d(7)
        self.hidden = nn.Linear(7, 5)
        self.head = nn.Linear(5, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(torch.relu(self.norm(self.inp(x))))))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in (model.inp, model.hidden, model.head):
            fully_shard(m, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                    use_orig_params=kind == "fsdp1_orig", device_id=torch.device("cpu"))
    return model


def digests(directory: Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def rank_main(rank: int, world: int, init_file: str, out_dir: str, queue) -> None:
    sys.path.insert(0, str(ROOT / "python"))
    import random

    import numpy

    import fsdp_ema

    torch.set_num_threads(1)
    random.seed(rank)  # the training state saves every RNG's state
    numpy.random.seed(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    result = {}
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g))
               for _ in range(4)]
    for kind in KINDS:
        model = build(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ema = fsdp_ema.ShardedEMA(model, decay=0.8)
        for x, y in batches:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            ema.update()
        base = Path(out_dir) / kind
        ema.save(base / "ema")
        fsdp_ema.save_training_state(base / "state", model=model, optimizer=opt, ema=ema)
        ema.export(base / "export")
        dist.barrier()
        if rank == 0:
            result[kind] = digests(base)
    if rank == 0:
        queue.put(result)
    fsdp_ema.destroy_process_group()


def main() -> None:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        queue = ctx.Queue()
        init_file = os.path.join(tmp, "init")
        out_dir = os.path.join(tmp, "out")
        procs = [ctx.Process(target=rank_main, args=(r, 2, init_file, out_dir, queue))
                 for r in range(2)]
        for p in procs:
            p.start()
        result = queue.get(timeout=600)
        for p in procs:
            p.join()
    json.dump(result, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
