"""``load_training_state`` is all or nothing (#41 item 4): each rank reads its share once into
staging memory, every byte verified in the read that returns it, all ranks agree, and only then
are the model, the optimizer, the EMA and the RNGs written.

At 2 gloo ranks (FSDP2 MLP with uneven rows, AdamW, ShardedEMA), every load's outcome is judged
against clones taken just before the call: either it succeeds and every local tensor, the
optimizer's state and LR, the EMA's tensors and step and the RNG states (torch, Python, NumPy)
are exactly the saved ones, or it raises on both ranks and all of them are exactly as they were.

- The file changes between two reads: right after the read of the last tensor of rank 1's file
  returns, a byte of it is flipped through a MAP_SHARED mapping (a dirty page: fstat cannot see
  it). The two-pass load (check and hash, agree, read in place and hash again) failed in its second
  pass with earlier tensors overwritten and rank 0 wholly loaded; one read succeeds.
- A file corrupted before the load (rank 1's last tensor): rank 1's one read fails after reading
  the earlier pieces; both ranks raise, nothing written on either.
- Another process toggles bytes of both shard files in place while loads run, by pwrite and
  through a shared mapping (test_concurrent_rewrites' writer): every load has one of the two
  outcomes, and once the writers stop the next load succeeds.

In one process: an optimizer's non-tensor state (its state dicts are the optimizer's own) is set
only after the agreement, so a refused load leaves it too; an optimizer with no state yet (torch
steps it at lr 0 to make the state dict's template) has none after a refused load.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import random
import struct

import numpy as np
import pytest
import torch
from dist_utils import PoolManager
from test_concurrent_rewrites import rewriting
from torch import nn

import fsdp_ema
from fsdp_ema import ShardedEMA
from fsdp_ema import checkpoint as ckpt

LOADS = 12  # per writer mode, while another process rewrites the files

@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def build(seed, steps):
    """An FSDP2 MLP (257 and 129 rows: uneven at 2 ranks), AdamW and an EMA after ``steps``
    training steps; ``seed`` decides every value (and the LR)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(96, 257), nn.Tanh(), nn.Linear(257, 129), nn.Linear(129, 3))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for m in (model[0], model[2], model[3]):
        fully_shard(m, mesh=mesh)
    model = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))
    ema = ShardedEMA(model, 0.9)
    for _ in range(steps):
        model(torch.randn(4, 96)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    return model, opt, ema


def snapshot(model, opt, ema):
    """Clones of everything a load restores on this rank: local tensors, LRs, RNG states."""
    names = {p: n for n, p in model.named_parameters()}
    out = {f"model.{n}": local(p).detach().clone() for n, p in model.named_parameters()}
    for p, entries in opt.state.items():
        out.update({f"optim.{names[p]}.{k}": local(v).clone() if torch.is_tensor(v) else v
                    for k, v in entries.items()})
    out["lr"] = [g["lr"] for g in opt.param_groups]
    out.update({f"ema.{k}": local(v).clone() for k, v in ema.state_dict().items()})
    out["rng"] = (torch.get_rng_state(), pickle.dumps(random.getstate()),
                  pickle.dumps(np.random.get_state()))
    return out


def differing(got, want):
    def same(a, b):
        if isinstance(a, tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if torch.is_tensor(a):
            return (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(a.reshape(-1).view(torch.uint8),
                                    b.reshape(-1).view(torch.uint8)))
        return a == b

    return sorted(k for k in want.keys() | got.keys()
                  if k not in got or k not in want or not same(got[k], want[k]))


def put_back(model, opt, ema, snap, ema_sd):
    """Writes ``snap`` (and the EMA's state dict clone ``ema_sd``) back into the objects."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            local(p).copy_(snap[f"model.{n}"])
        names = {p: n for n, p in model.named_parameters()}
        for p, entries in opt.state.items():
            for k, v in entries.items():
                local(v).copy_(snap[f"optim.{names[p]}.{k}"])
    for g, lr in zip(opt.param_groups, snap["lr"]):
        g["lr"] = lr
    ema.load_state_dict(ema_sd)
    torch.set_rng_state(snap["rng"][0])
    random.setstate(pickle.loads(snap["rng"][1]))
    np.random.set_state(pickle.loads(snap["rng"][2]))


def outcome(directory, objs, expected):
    """One load: its error (None if it succeeded) and what differs from what it must leave (the
    saved values, or on an error the values before the call)."""
    before = snapshot(*objs)
    model, opt, ema = objs
    try:
        fsdp_ema.load_training_state(directory, model=model, optimizer=opt, ema=ema)
        error = None
    except Exception as e:  # noqa: BLE001 (judged by the test)
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "differ": differing(snapshot(*objs), before if error else expected)}


def last_state_piece(path):
    """(name, file offset of a byte in the middle) of the state tensor stored last in a shard
    file (not the JSON document, not the RNG states)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    name = max((k for k, v in header.items() if k != "__metadata__"
                and not k.startswith(("meta.", "rng."))
                and v["data_offsets"][1] > v["data_offsets"][0]),
               key=lambda k: header[k]["data_offsets"][1])
    begin, end = header[name]["data_offsets"]
    return name, 8 + n + (begin + end) // 2


class SharedPage:
    """A byte of a file, flipped through a MAP_SHARED mapping whose page is dirtied first (before
    the checkpoint is opened), so that neither mtime nor ctime moves when it is flipped."""

    def __init__(self, path, at):
        self.fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(self.fd, 0, mmap.MAP_SHARED)
        self.at, self.flipped = at, False
        page = at - at % mmap.PAGESIZE
        self.map[page] = self.map[page]

    def flip(self):
        self.map[self.at] ^= 0x40
        self.flipped = not self.flipped

    def close(self):
        if self.flipped:
            self.flip()
        self.map.close()
        os.close(self.fd)


def flip_after_reading(name, page):
    """Wraps every reading method of OpenCheckpoint: once a call that read ``name`` returns,
    ``page`` is flipped (once). Returns the undo."""
    real = {m: getattr(ckpt.OpenCheckpoint, m)
            for m in ("check_into", "load_into", "load", "load_boxes")}

    def wrap(method):
        def spy(self, tensors, **kwargs):
            out = real[method](self, tensors, **kwargs)
            if name in tensors and not page.flipped:
                page.flip()
            return out
        return spy

    for m in real:
        setattr(ckpt.OpenCheckpoint, m, wrap(m))
    return lambda: [setattr(ckpt.OpenCheckpoint, m, f) for m, f in real.items()]


def run_loads(rank, world, root):
    directory = os.path.join(root, "ts")
    src = build(0, steps=2)
    expected = snapshot(*src)  # the RNG states too: the save takes them as they are now
    fsdp_ema.save_training_state(directory, model=src[0], optimizer=src[1], ema=src[2])
    torch.distributed.barrier()
    objs = build(1, steps=1)
    pre, pre_ema = snapshot(*objs), {k: v.clone() for k, v in objs[2].state_dict().items()}
    assert differing(pre, expected), "the objects must differ from the saved state"
    mine = os.path.join(directory, ckpt.shard_file_name(rank, world))
    name, at = last_state_piece(mine)
    out = {}

    # The file changes right after the read that returned the tensor (rank 1's file only).
    page = SharedPage(mine, at)
    undo = flip_after_reading(name, page) if rank == 1 else (lambda: None)
    torch.distributed.barrier()  # every page dirtied before any rank opens the checkpoint
    try:
        out["changed_after_read"] = outcome(directory, objs, expected)
    finally:
        undo()
        page.close()
    put_back(*objs, pre, pre_ema)

    # Corrupted before the load (rank 1's file only).
    page = SharedPage(mine, at)
    if rank == 1:
        page.flip()
    torch.distributed.barrier()
    try:
        out["corrupted"] = outcome(directory, objs, expected)
    finally:
        page.close()
    put_back(*objs, pre, pre_ema)

    # Another process toggles bytes of this rank's file in place meanwhile (test_concurrent_
    # rewrites' writer: pwrite, or a shared mapping whose writes fstat cannot see).
    out["rewritten"] = []
    with open(mine, "rb") as f:
        original = f.read()
    for mode in ("pwrite", "mapped"):
        try:
            with rewriting(mine, mode):
                for _ in range(LOADS):
                    out["rewritten"].append(outcome(directory, objs, expected))
                    put_back(*objs, pre, pre_ema)
        finally:
            with open(mine, "r+b") as f:  # the writer may be killed with a byte toggled
                f.write(original)
    torch.distributed.barrier()  # both writers stopped, both files as saved
    out["after"] = outcome(directory, objs, expected)
    return out


@pytest.fixture(scope="module")
def loads(pools, tmp_path_factory):
    return pools.get(2).run(run_loads, str(tmp_path_factory.mktemp("atomic")), timeout=240)


def test_a_file_changed_after_the_one_read_still_loads_the_saved_state(loads):
    for rank, res in enumerate(loads):
        got = res["changed_after_read"]
        what = "changed by a refused load" if got["error"] else "differ from the saved state"
        assert got["differ"] == [], f"rank {rank}: {got['differ']} {what}"
        assert got["error"] is None, f"rank {rank}: {got['error']}"


def test_a_corrupted_file_on_one_rank_raises_everywhere_and_writes_nothing(loads):
    for rank, res in enumerate(loads):
        got = res["corrupted"]
        assert got["error"] is not None, f"rank {rank} loaded a corrupted checkpoint"
        assert "failed on rank(s) [1]" in got["error"], got["error"]
        assert got["differ"] == [], f"rank {rank}: {got['differ']} changed by a refused load"
    assert "checksum mismatch" in loads[1]["corrupted"]["error"]


def test_loads_while_another_process_rewrites_the_files_are_all_or_nothing(loads):
    for rank, res in enumerate(loads):
        for i, got in enumerate(res["rewritten"]):
            what = "changed by a refused load" if got["error"] else "differ from the saved state"
            assert got["differ"] == [], f"rank {rank}, load {i}: {got['differ']} {what}"
        # Every load raised on both ranks or on neither.
        assert ([g["error"] is None for g in res["rewritten"]]
                == [g["error"] is None for g in loads[0]["rewritten"]])
        assert res["after"] == {"error": None, "differ": []}, res["after"]


# --- one process: an optimizer's non-tensor state -------------------------------------------------

class CountingSGD(torch.optim.SGD):
    """SGD with momentum whose state also counts its steps in a Python int."""

    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["calls"] = self.state[p].get("calls", 0) + 1
        return out


def counting(seed, steps, tied=False):
    torch.manual_seed(seed)
    model = nn.Linear(8, 4)
    if tied:  # a parameter under two names: the load makes its template torch's way (a step)
        model.tie = nn.Linear(8, 4, bias=False)
        model.tie.weight = model.weight
    opt = CountingSGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_an_optimizers_non_tensor_state_is_set_only_after_every_read(tmp_path):
    model, opt = counting(0, steps=3)
    fsdp_ema.save_training_state(tmp_path / "c", model=model, optimizer=opt, rng=False)
    model2, opt2 = counting(1, steps=1)
    path = tmp_path / "c" / ckpt.shard_file_name(0, 1)
    _, at = last_state_piece(path)
    page = SharedPage(path, at)
    page.flip()
    try:
        with pytest.raises(RuntimeError, match="checksum mismatch"):
            fsdp_ema.load_training_state(tmp_path / "c", model=model2, optimizer=opt2, rng=False)
    finally:
        page.close()
    assert [s["calls"] for s in opt2.state.values()] == [1, 1]
    fsdp_ema.load_training_state(tmp_path / "c", model=model2, optimizer=opt2, rng=False)
    assert [s["calls"] for s in opt2.state.values()] == [3, 3]
    assert all(torch.equal(opt2.state[b]["momentum_buffer"], opt.state[a]["momentum_buffer"])
               for a, b in zip(model.parameters(), model2.parameters()))


@pytest.mark.parametrize("tied", [False, True], ids=["template_from_parameters",
                                                    "template_by_torchs_step"])
def test_a_refused_load_leaves_an_optimizer_without_state_without_state(tmp_path, tied):
    model, opt = counting(0, steps=2, tied=tied)
    fsdp_ema.save_training_state(tmp_path / "c", model=model, optimizer=opt, rng=False)
    path = tmp_path / "c" / ckpt.shard_file_name(0, 1)
    _, at = last_state_piece(path)
    page = SharedPage(path, at)
    page.flip()
    model2, opt2 = counting(1, steps=0, tied=tied)
    before = [p.detach().clone() for p in model2.parameters()]
    calls = []
    opt2.register_step_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(RuntimeError, match="checksum mismatch"):
            fsdp_ema.load_training_state(tmp_path / "c", model=model2, optimizer=opt2, rng=False)
    finally:
        page.close()
    assert len(opt2.state) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))
    assert (len(calls) > 0) == tied  # the case each parameter covers
    fsdp_ema.load_training_state(tmp_path / "c", model=model2, optimizer=opt2, rng=False)
    assert all(torch.equal(opt2.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])
               for p, q in zip(model.parameters(), model2.parameters()))
