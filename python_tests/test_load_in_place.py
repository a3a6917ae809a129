"""Loads into the tensors the caller has (#11 follow-up): ``ShardedEMA.load`` and
``load_model_weights`` read with ``load_into_`` straight into the EMA's and the model's own
tensors, through one collective sequence (``_collective.load_collective``: check and hash on every
rank, agree, write, agree); ``load_training_state`` reads each tensor once into staging memory,
verified, agrees, then copies into the model's, the optimizer's and the EMA's own tensors
(#41 item 4: ``test_training_state_atomic.py``).

At 2 gloo ranks with FSDP2: the loaded values equal the saved ones (full tensors gathered by
torch.distributed.checkpoint's state-dict API and by ``full_state_dict``, independent of the
checkpoint code), every destination keeps its storage (``data_ptr``; the training state's host
optimizer takes the staged tensors instead), the EMA and weight loads read nothing into fresh
memory and the training state each tensor once (nothing in place), and a
corrupted shard file that only rank 1 reads
raises on both ranks with every rank's EMA, model and optimizer bit for bit as before. In one
process: tied weights (two names, one tensor), a dtype cast (the fallback), an EMA in host
memory with an update in flight, and ``fsdp_ema.checkpoint.OpenCheckpoint`` itself.
"""

from __future__ import annotations

import json
import os
import struct
import time
from contextlib import contextmanager

import pytest
import torch
from dist_utils import PoolManager
from models import UnevenMLP
from torch import nn

import fsdp_ema
from fsdp_ema import ShardedEMA
from fsdp_ema import checkpoint as ckpt


@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


def build(seed, sharded=True):
    """A model (FSDP2 over the ranks, or plain), AdamW after one step, an EMA after one update;
    ``seed`` decides every value."""
    torch.manual_seed(seed)
    model = UnevenMLP()
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for m in (model.inp, model.hidden, model.head):
            fully_shard(m, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = ShardedEMA(model, 0.9)
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 6, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    ema.update()
    return model, opt, ema


def local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def live_tensors(model, opt, ema):
    """The tensors this rank holds: the model's local shards, the optimizer's state and the EMA's
    own (what a load must write into in place)."""
    out = {f"model.{n}": local(p) for n, p in model.named_parameters()}
    for i, state in enumerate(opt.state.values()):
        out.update({f"optim.{i}.{k}": local(v) for k, v in state.items()
                    if isinstance(v, torch.Tensor)})
    out.update({f"ema.{i}": t for i, t in enumerate(ema.state.tensors)})
    return out


def full(model, opt, ema):
    """Every value as full tensors, gathered by torch's state-dict API and full_state_dict."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    out = {f"model.{k}": v.clone() for k, v in get_model_state_dict(model, options=options).items()}
    for fqn, entries in get_optimizer_state_dict(model, opt, options=options)["state"].items():
        out.update({f"optim.{fqn}.{k}": torch.as_tensor(v).clone() for k, v in entries.items()})
    out.update({f"ema.{k}": v.clone() for k, v in ema.full_state_dict(rank0_only=False).items()})
    out["ema_step"] = ema.step.clone()
    return out


def bits(t):
    return (t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).clone())


def same_bits(a, b):
    return a.keys() == b.keys() and all(
        a[k][0] == b[k][0] and a[k][1] == b[k][1] and torch.equal(a[k][2], b[k][2]) for k in a)


def differing(got, expected):
    return sorted(k for k in expected if k not in got or not same_bits(
        {0: bits(got[k])}, {0: bits(expected[k])}))


@contextmanager
def reads(method="load"):
    """The names ``OpenCheckpoint.<method>`` read meanwhile (``load``: into fresh memory)."""
    names: list[str] = []
    real = getattr(ckpt.OpenCheckpoint, method)

    def spy(self, wanted, **kwargs):
        names.extend(wanted)
        return real(self, wanted, **kwargs)

    setattr(ckpt.OpenCheckpoint, method, spy)
    try:
        yield names
    finally:
        setattr(ckpt.OpenCheckpoint, method, real)


def fresh_reads():
    return reads("load")


def flip_data_byte(path, name):
    """Flips one byte in the data of tensor ``name`` of a safetensors file (its header, and so
    the stored checksum, stays as it was)."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        begin, end = header[name]["data_offsets"]
        assert end > begin, name
        f.seek(8 + n + begin)
        byte = f.read(1)
        f.seek(8 + n + begin)
        f.write(bytes([byte[0] ^ 0xFF]))


# --- 2 ranks: in place, equal to the saved values -------------------------------------------------

def run_in_place(rank, world, root):
    src_model, src_opt, src_ema = build(0)
    fsdp_ema.save_training_state(os.path.join(root, "ts"), model=src_model, optimizer=src_opt,
                                 ema=src_ema, extra={"step": 1})
    src_ema.save(os.path.join(root, "ema"))
    src_ema.save_shard_weights(os.path.join(root, "weights"))
    expected = full(src_model, src_opt, src_ema)

    out = {}
    model, opt, ema = build(1)
    before = {k: t.data_ptr() for k, t in live_tensors(model, opt, ema).items()}
    with fresh_reads() as names, reads("check_into") as checked, reads("load_into") as into:
        extra = fsdp_ema.load_training_state(os.path.join(root, "ts"), model=model,
                                             optimizer=opt, ema=ema)
    out["training_state"] = {
        "extra": extra, "differ": differing(full(model, opt, ema), expected),
        "moved": sorted(k for k, t in live_tensors(model, opt, ema).items()
                        if t.data_ptr() != before.get(k)),
        "fresh": sorted(names), "in_place": checked + into,
        "optimizer": sorted(k for k in before if k.startswith("optim."))}

    model, opt, ema = build(2)
    ema_before = [t.data_ptr() for t in ema.state.tensors]
    model_before = [local(p).data_ptr() for p in model.parameters()]
    with fresh_reads() as ema_names:
        ema.load(os.path.join(root, "ema"))
    with fresh_reads() as model_names:
        fsdp_ema.load_model_weights(model, os.path.join(root, "weights"))
    got_ema = {f"ema.{k}": v for k, v in ema.full_state_dict(rank0_only=False).items()}
    got_model = {k: v for k, v in full(model, opt, ema).items() if k.startswith("model.")}
    out["ema"] = {
        "differ": differing(got_ema, {k: v for k, v in expected.items()
                                      if k.startswith("ema.")}),
        "moved": [i for i, t in enumerate(ema.state.tensors) if t.data_ptr() != ema_before[i]],
        "fresh": ema_names}
    # The weights saved are the model's: the EMA's source model at the save.
    out["weights"] = {
        "differ": differing(got_model, {k: v for k, v in expected.items()
                                        if k.startswith("model.")}),
        "moved": [i for i, p in enumerate(model.parameters())
                  if local(p).data_ptr() != model_before[i]],
        "fresh": model_names}
    return out


def test_loads_write_in_place_and_equal_the_saved_values(pools, tmp_path):
    results = pools.get(2).run(run_in_place, str(tmp_path), timeout=240)
    for rank, res in enumerate(results):
        ts = res["training_state"]
        assert ts["extra"] == {"step": 1}
        assert ts["differ"] == [], f"rank {rank}: load_training_state: {ts['differ']} differ"
        # The parameters and the EMA keep their storage; the (host) optimizer holds the staged
        # tensors themselves, handed over instead of copied (those it holds elements of).
        assert ts["moved"] and set(ts["moved"]) <= set(ts["optimizer"]), (rank, ts["moved"])
        # One read of each tensor, into staging memory (then copied): none read twice, none
        # checked or read in place.
        some = {"meta.training_state", f"rng.{rank}", "model.inp.weight",
                "optim.state.inp.weight.exp_avg_sq", "ema.hidden.bias"}
        assert some <= set(ts["fresh"]), ts["fresh"]
        assert len(set(ts["fresh"])) == len(ts["fresh"]) and ts["in_place"] == [], ts
        for what in ("ema", "weights"):
            assert res[what]["differ"] == [], f"rank {rank}: {what}: {res[what]['differ']}"
            assert res[what]["moved"] == [], f"rank {rank}: {what}: {res[what]['moved']} moved"
            assert res[what]["fresh"] == [], f"rank {rank}: {what} read {res[what]['fresh']}"


# --- 2 ranks: a corrupted file that one rank reads ------------------------------------------------

def run_corrupt_on_one_rank(rank, world, root):
    src_model, src_opt, src_ema = build(0)
    ts_dir, ema_dir, weights_dir = (os.path.join(root, n) for n in ("ts", "ema", "weights"))
    fsdp_ema.save_training_state(ts_dir, model=src_model, optimizer=src_opt, ema=src_ema)
    src_ema.save(ema_dir)
    src_ema.save_shard_weights(weights_dir)
    torch.distributed.barrier()
    if rank == 1:  # rows only rank 1 reads (at 2 ranks each reads the file its rank wrote)
        name = ckpt.shard_file_name(1, 2)
        flip_data_byte(os.path.join(ts_dir, name), "model.inp.weight")
        flip_data_byte(os.path.join(ema_dir, name), "hidden.weight")
        flip_data_byte(os.path.join(weights_dir, name), "inp.weight")
    torch.distributed.barrier()

    model, opt, ema = build(1)
    before = {k: bits(t) for k, t in live_tensors(model, opt, ema).items()}
    before_step, before_lr = ema.step.clone(), [g["lr"] for g in opt.param_groups]
    messages = {}
    for what, load in (
            ("training_state", lambda: fsdp_ema.load_training_state(
                ts_dir, model=model, optimizer=opt, ema=ema)),
            ("ema", lambda: ema.load(ema_dir)),
            ("weights", lambda: fsdp_ema.load_model_weights(model, weights_dir))):
        try:
            load()
            messages[what] = None
        except RuntimeError as e:
            messages[what] = str(e)
    after = {k: bits(t) for k, t in live_tensors(model, opt, ema).items()}
    return {"messages": messages, "unchanged": same_bits(before, after),
            "step": torch.equal(before_step, ema.step),
            "lr": before_lr == [g["lr"] for g in opt.param_groups]}


def test_a_corrupted_file_on_one_rank_leaves_every_rank_unchanged(pools, tmp_path):
    results = pools.get(2).run(run_corrupt_on_one_rank, str(tmp_path), timeout=240)
    for rank, res in enumerate(results):
        for what, message in res["messages"].items():
            assert message is not None, f"rank {rank}: {what} loaded a corrupted checkpoint"
            assert "failed on rank(s) [1]" in message, (rank, what, message)
        assert res["unchanged"], f"rank {rank}: the EMA, model or optimizer changed"
        assert res["step"] and res["lr"], f"rank {rank}: the EMA step or the LR changed"
    assert all("checksum mismatch" in m for m in results[1]["messages"].values())


# --- one process ----------------------------------------------------------------------------------

class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_tied_weights_load_through_one_tensor(tmp_path):
    torch.manual_seed(0)
    src = Tied()
    fsdp_ema.save_training_state(tmp_path / "c", model=src, rng=False)
    torch.manual_seed(1)
    dst = Tied()
    ptr = dst.emb.weight.data_ptr()
    fsdp_ema.load_training_state(tmp_path / "c", model=dst, rng=False)
    assert dst.head.weight is dst.emb.weight and dst.emb.weight.data_ptr() == ptr
    assert torch.equal(dst.emb.weight, src.emb.weight)


def test_a_dtype_cast_is_read_fresh_and_copied(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(torch.bfloat16)
    ShardedEMA(model, 0.9, dtype=None).save(tmp_path / "bf16")
    torch.manual_seed(1)
    ema = ShardedEMA(nn.Linear(4, 3), 0.9)  # fp32: the bf16 values are cast on the way in
    ptrs = [t.data_ptr() for t in ema.state.tensors]
    with fresh_reads() as names:
        ema.load(tmp_path / "bf16")
    assert sorted(names) == ["bias", "weight"]
    assert [t.data_ptr() for t in ema.state.tensors] == ptrs
    sd = ema.state_dict()
    assert sd["weight"].dtype == torch.float32
    assert torch.equal(sd["weight"], model.weight.float())
    assert torch.equal(sd["bias"], model.bias.float())


def test_host_memory_ema_waits_for_the_update_in_flight(tmp_path, monkeypatch):
    torch.manual_seed(0)
    saved = nn.Linear(64, 64)
    ShardedEMA(saved, 0.9).save(tmp_path / "e")
    model = nn.Linear(64, 64)
    from fsdp_ema.ema.offload import forced_for_cpu_models

    with forced_for_cpu_models():  # the host-memory path for a CPU model
        ema = ShardedEMA(model, 0.5, device="cpu")
    real = torch.ops.fsdp_ema.update_

    def slow(*args):  # the update in flight lands well after load() starts
        time.sleep(0.5)
        return real(*args)

    monkeypatch.setattr(torch.ops.fsdp_ema, "update_", slow)
    with torch.no_grad():
        model.weight.add_(1)
    ema.update()
    ema.load(tmp_path / "e")
    monkeypatch.undo()
    sd = ema.state_dict()  # synchronizes: an update landing after the load would show here
    assert torch.equal(sd["weight"], saved.weight) and torch.equal(sd["bias"], saved.bias)


def test_open_checkpoint_checks_without_writing_then_loads(tmp_path):
    w = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    ckpt.save(tmp_path / "c", {"w": w, "step": torch.tensor(7)})
    opened = ckpt.open_checkpoint(tmp_path / "c")
    assert opened.info()["tensors"]["w"]["shape"] == [10, 4]
    dst = {"w": torch.zeros(5, 4), "step": torch.zeros((), dtype=torch.int64)}
    opened.check_into(dst, rank=1, world_size=2)
    assert not dst["w"].any() and int(dst["step"]) == 0  # checked, nothing written
    with pytest.raises(RuntimeError, match="out\\[0\\] \\('w'\\) has dtype Double"):
        opened.check_into({"w": torch.zeros(5, 4, dtype=torch.float64)}, rank=1, world_size=2)
    opened.load_into(dst, rank=1, world_size=2)
    assert torch.equal(dst["w"], w[5:]) and int(dst["step"]) == 7
    assert torch.equal(opened.load(["w"], rank=0, world_size=2)["w"], w[:5])


def test_open_checkpoint_refuses_corrupted_data_before_writing(tmp_path):
    w = torch.randn(6, 3)
    ckpt.save(tmp_path / "c", {"w": w})
    flip_data_byte(tmp_path / "c" / ckpt.shard_file_name(0, 1), "w")
    opened = ckpt.open_checkpoint(tmp_path / "c")
    dst = {"w": torch.full((6, 3), 5.0)}
    # Each error names the method the user called, then the file.
    for method, call in (("check_into", lambda: opened.check_into(dst)),
                         ("load_into", lambda: opened.load_into(dst)),
                         ("load", lambda: opened.load(["w"])),
                         ("load_boxes", lambda: opened.load_boxes({"w": ([0, 0], [2, 3])}))):
        with pytest.raises(RuntimeError,
                           match=f"^fsdp_ema::OpenCheckpoint\\.{method}: .*checksum mismatch"):
            call()
    assert torch.equal(dst["w"], torch.full((6, 3), 5.0))
    with pytest.raises(RuntimeError, match="^fsdp_ema::open_checkpoint: .*missing"):
        ckpt.open_checkpoint(tmp_path / "missing")


def test_open_checkpoint_reads_the_files_it_opened_after_an_overwrite(tmp_path):
    old, new = torch.ones(4, 2), torch.full((4, 2), 2.0)
    ckpt.save(tmp_path / "c", {"w": old})
    opened = ckpt.open_checkpoint(tmp_path / "c")
    opened.check_into({"w": torch.empty(4, 2)})
    # Committed meanwhile: new files, a new index, the old files removed.
    ckpt.save(tmp_path / "c", {"w": new}, overwrite=True)
    dst = {"w": torch.zeros(4, 2)}
    opened.load_into(dst)
    assert torch.equal(dst["w"], old)  # what was checked, never a mix with the new checkpoint
    assert torch.equal(ckpt.load(tmp_path / "c")["w"], new)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@needs_cuda
@pytest.mark.parametrize("device", [None, "cpu"])  # the EMA beside the weights, or in host memory
def test_cuda_ema_loads_in_place(tmp_path, device):
    torch.manual_seed(0)
    saved = nn.Linear(64, 48).cuda()
    ShardedEMA(saved, 0.9).save(tmp_path / "e")
    model = nn.Linear(64, 48).cuda()
    ema = ShardedEMA(model, 0.5, device=device)
    with torch.no_grad():
        model.weight.add_(1)
    ema.update()  # in flight on the host worker for device="cpu"
    ptrs = [t.data_ptr() for t in ema.state.tensors]
    with fresh_reads() as names:
        ema.load(tmp_path / "e")
    assert names == [] and [t.data_ptr() for t in ema.state.tensors] == ptrs
    sd = ema.state_dict()
    assert sd["weight"].device.type == ("cpu" if device else "cuda")
    assert torch.equal(sd["weight"].cpu(), saved.weight.cpu())
    assert torch.equal(sd["bias"].cpu(), saved.bias.cpu())
