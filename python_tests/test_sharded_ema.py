"""ShardedEMA under real torch.distributed (gloo on the CPU, 2 and 3 ranks): FSDP2, FSDP1
(use_orig_params True and False), DDP and plain models against an unsharded replica; swap; compile;
state dicts through DCP and checkpoint directories resharded across world sizes; fault injection.

Each test sends module-level functions to a pool of ranks (dist_utils.WorkerPool) that stays up
for the whole module, so the ranks are spawned twice (2, then 3 ranks), not once per test.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_utils import PoolManager
from torch import nn

import fsdp_ema
from fsdp_ema import ShardedEMA, Warmup

CLI = Path(__file__).resolve().parents[1] / "build" / "bin" / "fsdp-ema"
STEPS = 6
DECAY = 0.8  # low, so that a few steps move the EMA well away from the weights
KINDS = ["fsdp2", "fsdp1_orig", "fsdp1_flat", "ddp", "plain"]
# Tolerances (float32 EMA):
# - against the EMA recomputed from the model's own weights after every step (gathered), the EMA
#   shard must match to the rounding of one float32 lerp per step;
# - against an unsharded replica trained identically, to float32 training noise (FSDP reduces
#   gradients in another order than a single process).
REPLAY = dict(rtol=1e-6, atol=1e-7)
REPLICA = dict(rtol=1e-5, atol=1e-6)


class Net(nn.Module):
    """7 and 5 rows divide by neither 2 nor 3 ranks; the head has 1 row, fewer than the ranks."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 7)
        self.norm = nn.BatchNorm1d(7)
        self.hidden = nn.Linear(7, 5)
        self.head = nn.Linear(5, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(torch.relu(self.norm(self.inp(x))))))


def chunk_rows(rows, rank, world):
    size = -(-rows // world)
    begin = min(rank * size, rows)
    return begin, min(begin + size, rows)


def batches(dtype, steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 6, generator=g).to(dtype), torch.randn(16, 1, generator=g).to(dtype))
            for _ in range(steps)]


def eval_input(dtype):
    return torch.randn(32, 6, generator=torch.Generator().manual_seed(7)).to(dtype)


def build(kind, dtype=torch.float32, seed=0):
    """The same initial weights on every rank and in the replica, then wrapped as ``kind``."""
    torch.manual_seed(seed)
    model = Net().to(dtype)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for m in (model.inp, model.hidden, model.head):
            fully_shard(m, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                    use_orig_params=kind == "fsdp1_orig", device_id=torch.device("cpu"))
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    return model


def train_step(model, opt, x, y):
    F.mse_loss(model(x).float(), y.float()).backward()
    opt.step()
    opt.zero_grad()


def full_state(model, kind):
    """The model's full parameters and buffers, by clean name (independent of fsdp_ema)."""
    if kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            state = {n: t.detach().clone() for n, t in model.named_parameters()}
    else:
        state = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
                 for n, t in model.named_parameters()}
    state.update({n: b.detach().clone() for n, b in model.named_buffers()})
    return {n.replace("_fsdp_wrapped_module.", "").removeprefix("module."): t
            for n, t in state.items()}


def local_entries(state_dict):
    """{name: (layout, local tensor, dim-0 offset)} from ShardedEMA.state_dict() values."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for name, v in state_dict.items():
        if isinstance(v, DTensor):
            assert v.placements == (Shard(0),), (name, v.placements)
            local = v.to_local().detach().clone()
            out[name] = ("dtensor", tuple(v.shape), local)
        elif isinstance(v, ShardedTensor):
            shards = v.local_shards()
            assert len(shards) <= 1
            local = shards[0].tensor.clone() if shards else None
            offset = shards[0].metadata.shard_offsets[0] if shards else None
            out[name] = ("sharded", tuple(v.size()), (local, offset))
        else:
            out[name] = ("full", tuple(v.shape), v.detach().clone())
    return out


def bit_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


def assemble(per_rank_entries):
    """Full tensors from every rank's local_entries (dim-0 chunks concatenated in rank order)."""
    out = {}
    for name, (layout, _, value) in per_rank_entries[0].items():
        if name == ShardedEMA.STEP_KEY:
            continue
        if layout == "full":
            out[name] = value
            continue
        parts = [entries[name][2] for entries in per_rank_entries]
        parts = [p[0] if layout == "sharded" else p for p in parts]
        out[name] = torch.cat([p for p in parts if p is not None])
    return out


def reference_ema(states, decays, dtype=torch.float32):
    """EMA recomputed with torch.lerp from a trajectory of full states."""
    ema = {n: (t.to(dtype) if t.is_floating_point() else t.clone()) for n, t in states[0].items()}
    for state, d in zip(states[1:], decays):
        for n, t in state.items():
            ema[n] = torch.lerp(ema[n], t.to(dtype), 1 - d) if t.is_floating_point() else t.clone()
    return ema


def assert_entries_match(entries, reference, rank, world, tol):
    assert sorted(entries) == sorted([*reference, ShardedEMA.STEP_KEY])
    for name, (layout, shape, value) in entries.items():
        if name == ShardedEMA.STEP_KEY:
            continue
        ref = reference[name]
        assert tuple(ref.shape) == shape, name
        if layout == "full":
            expected, got = ref, value
        else:
            begin, end = chunk_rows(ref.shape[0], rank, world)
            expected = ref[begin:end]
            if layout == "sharded":
                got, offset = value
                if got is None:
                    assert begin == end, (name, rank)
                    continue
                assert offset == begin, (name, rank, offset, begin)
            else:
                got = value
        assert got.shape == expected.shape, (name, rank, got.shape, expected.shape)
        torch.testing.assert_close(got, expected.to(got.dtype), **tol,
                                   msg=lambda m, name=name: f"{name} on rank {rank}: {m}")


# --- functions the ranks run ----------------------------------------------------------------------

def _train_with_ema(rank, world, kind, dtype, ema_kwargs, steps=STEPS):
    model = build(kind, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = ShardedEMA(model, DECAY, **ema_kwargs)
    states = [full_state(model, kind)]
    for x, y in batches(dtype, steps):
        train_step(model, opt, x, y)
        ema.update()
        states.append(full_state(model, kind))
    return model, ema, states


def run_matrix_case(rank, world, kind, dtype):
    model, ema, states = _train_with_ema(rank, world, kind, dtype, {})
    local_model_numel = sum(t.numel() for t in ema.state.refresh())
    return {"entries": local_entries(ema.state_dict()), "states": states,
            "step": int(ema.step), "nbytes": ema.nbytes, "local_numel": local_model_numel,
            "ema_numel": sum(t.numel() for t in ema.state.tensors)}


def run_swap_case(rank, world, kind, dtype):
    model, ema, _ = _train_with_ema(rank, world, kind, dtype, {})
    x = eval_input(dtype)
    model.eval()
    before = [t.clone() for t in ema.state.refresh()]
    with torch.no_grad():
        raw = model(x)
        with ema.swap() as swapped:
            assert swapped is model
            inside = model(x)
            held = [t.clone() for t in ema.state.refresh()]
        after = model(x)
    now = ema.state.refresh()
    return {"raw": raw, "inside": inside, "after": after,
            "restored": all(bit_equal(a, b) for a, b in zip(before, now)),
            "held_is_ema": all(torch.equal(h, e.to(h.dtype))
                               for h, e in zip(held, ema.state.tensors)),
            "entries": local_entries(ema.state_dict())}


def run_made_after_an_evaluation(rank, world):
    """An EMA made after a forward without backward (an evaluation before training), which
    leaves FSDP2's root's parameters unsharded, then trained 2 steps."""
    model = build("fsdp2")
    model.eval()
    with torch.no_grad():
        model(eval_input(torch.float32))
    model.train()
    unsharded = sorted(n for n, p in model.named_parameters() if not hasattr(p, "to_local"))
    ema = ShardedEMA(model, DECAY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states = [full_state(model, "fsdp2")]
    for x, y in batches(torch.float32, 2):
        train_step(model, opt, x, y)
        ema.update()
        states.append(full_state(model, "fsdp2"))
    return unsharded, local_entries(ema.state_dict()), states


def run_compiled_update(rank, world):
    from torch._dynamo.testing import CompileCounterWithBackend

    model = build("fsdp2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager = ShardedEMA(model, 0.999, warmup=Warmup(power=0.75), update_every=2, start_step=3)
    compiled = ShardedEMA(model, 0.999, warmup=Warmup(power=0.75), update_every=2, start_step=3)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    update = torch.compile(compiled.update, backend=counter, fullgraph=True)
    decays = []
    for x, y in batches(torch.float32, 20):
        train_step(model, opt, x, y)
        eager.update()
        update()
        decays.append((float(eager.last_decay), float(compiled.last_decay)))
    same = all(torch.equal(a, b) for a, b in zip(eager.state.tensors, compiled.state.tensors))
    # The host's count of the step: kept by eager updates, given up by compiled ones (the
    # count then comes from the tensor), and set again by load_state_dict.
    step = int(compiled.step)
    counts = {"eager": (eager.state.step_host, eager.state.step_count()),
              "compiled": (compiled.state.step_host, compiled.state.step_count())}
    sd = compiled.state_dict()
    sd[ShardedEMA.STEP_KEY] = torch.tensor(37)
    compiled.load_state_dict(sd)
    counts["loaded"] = (compiled.state.step_host, compiled.state.step_count())
    return {"frames": counter.frame_count, "same": same, "step": step, "decays": decays,
            "counts": counts}


def run_sharding_changed(rank, world):
    from torch.distributed.tensor import Shard, distribute_tensor

    model = build("fsdp2")
    ema = ShardedEMA(model, 0.9)
    ema.update()
    mesh = model.inp.weight.device_mesh
    model.hidden.weight = nn.Parameter(distribute_tensor(torch.randn(9, 7), mesh, [Shard(0)]))
    try:
        ema.update()
    except RuntimeError as e:
        return str(e)
    return None


def run_save_failure(rank, world, directory):
    model = build("fsdp2")
    ema = ShardedEMA(model, 0.9)
    original = fsdp_ema.checkpoint.save_shard

    def failing(*args, **kwargs):
        raise OSError("injected: disk full")

    if rank == 1:
        fsdp_ema.checkpoint.save_shard = failing
    try:
        ema.save(directory)
    except RuntimeError as e:
        message = str(e)
    else:
        message = None
    finally:
        fsdp_ema.checkpoint.save_shard = original
    index_exists = os.path.exists(os.path.join(directory, "fsdp_ema.index.json"))
    torch.distributed.barrier()
    # The directory is not committed, so a second save goes through.
    ema.save(directory)
    return {"message": message, "index_after_failure": index_exists,
            "index_after_retry": os.path.exists(os.path.join(directory, "fsdp_ema.index.json"))}


def run_save_with_a_slow_rank(rank, world, directory):
    """Rank 1 writes its file late: rank 0 must not commit before it (the barrier between the
    writes and the commit), and the index must list both ranks' files."""
    import time

    model = build("fsdp2")
    ema = ShardedEMA(model, 0.9)
    original = fsdp_ema.checkpoint.save_shard

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return original(*args, **kwargs)

    if rank == 1:
        fsdp_ema.checkpoint.save_shard = slow
    try:
        ema.save(directory)
    finally:
        fsdp_ema.checkpoint.save_shard = original
    full = {}
    for name, t in ema.state_dict().items():  # full_tensor(): a collective, in the same order
        if name != ShardedEMA.STEP_KEY:
            full[name] = t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
    return full


def run_save_refuses_committed(rank, world, directory):
    model = build("fsdp1_flat")
    ema = ShardedEMA(model, 0.9)
    ema.save(directory)
    try:
        ema.save(directory)
    except RuntimeError as e:
        refused = str(e)
    else:
        refused = None
    ema.update()
    ema.save(directory, overwrite=True)
    return refused


def run_save_checkpoints(rank, world, kind, directory):
    """Trains, then saves the EMA with DCP and as a checkpoint directory, and the model weights."""
    import torch.distributed.checkpoint as dcp

    model, ema, states = _train_with_ema(rank, world, kind, torch.float32, {})
    dcp.save({"ema": ema.state_dict()}, checkpoint_id=os.path.join(directory, "dcp"))
    ema.save(os.path.join(directory, "ema"))
    ema.save_ema_shard_weights(os.path.join(directory, "ema_alias"))
    ema.save_shard_weights(os.path.join(directory, "weights"))
    return {"entries": local_entries(ema.state_dict()), "states": states}


def run_load_checkpoints(rank, world, kinds, directories):
    """Loads every saved checkpoint into fresh EMAs of every kind; returns their local entries."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for kind in kinds:
        for source, directory in directories.items():
            model = build(kind, seed=123)  # other weights: the load must overwrite them all
            ema = ShardedEMA(model, DECAY)
            state = {"ema": ema.state_dict()}
            dcp.load(state, checkpoint_id=os.path.join(directory, "dcp"))
            ema.load_state_dict(state["ema"])
            from_dcp = (local_entries(ema.state_dict()), int(ema.step))
            ema2 = ShardedEMA(model, DECAY)
            ema2.load(os.path.join(directory, "ema"))
            out[(kind, source)] = {"dcp": from_dcp, "ours": local_entries(ema2.state_dict())}
    return out


# --- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


def replica_ema(dtype, steps=STEPS):
    """The unsharded replica: same initial weights, same data, same optimizer, one process."""
    model = build("plain", dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states = [full_state(model, "plain")]
    for x, y in batches(dtype, steps):
        train_step(model, opt, x, y)
        states.append(full_state(model, "plain"))
    return model, reference_ema(states, [DECAY] * steps)


# --- tests (2 ranks) ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_ema_shards_equal_slices_of_unsharded_replica_fp32(pools, kind):
    results = pools.get(2).run(run_matrix_case, kind, torch.float32)
    _, replica = replica_ema(torch.float32)
    layout = {"fsdp2": "dtensor", "fsdp1_orig": "sharded", "fsdp1_flat": "sharded"}.get(kind,
                                                                                     "full")
    for rank, res in enumerate(results):
        assert res["step"] == STEPS
        for name, (got, _, _) in res["entries"].items():
            is_param = name.endswith(("weight", "bias"))
            assert got == (layout if is_param else "full"), (name, got)
        replay = reference_ema(res["states"], [DECAY] * STEPS)
        assert_entries_match(res["entries"], replay, rank, 2, REPLAY)
        assert_entries_match(res["entries"], replica, rank, 2, REPLICA)
        # Memory: the local numel (FSDP1: the padded flat slices) in float32, buffers aside.
        buffers = 7 * 4 * 2 + 8  # running_mean/var (float32) + num_batches_tracked (int64)
        assert res["nbytes"] == (res["local_numel"] - 7 * 2 - 1) * 4 + buffers
        if kind in ("fsdp2", "fsdp1_orig", "fsdp1_flat"):
            full = sum(t.numel() for n, t in replica.items() if "running" not in n
                       and "num_batches" not in n)
            assert res["ema_numel"] - 15 < full * 0.75  # a shard, not a copy of the model


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1_orig", "fsdp1_flat", "plain"])
def test_bf16_params_fp32_ema_equal_slices_of_replica(pools, kind):
    results = pools.get(2).run(run_matrix_case, kind, torch.bfloat16)
    _, replica = replica_ema(torch.bfloat16)
    for rank, res in enumerate(results):
        for _, _, value in res["entries"].values():
            tensor = value[0] if isinstance(value, tuple) else value
            assert tensor is None or tensor.dtype in (torch.float32, torch.int64)
        # The replay is exact whatever the training noise: it averages this run's own weights.
        replay = reference_ema(res["states"], [DECAY] * STEPS)
        assert_entries_match(res["entries"], replay, rank, 2, REPLAY)
        # bf16 training: the replica agrees to bf16 noise.
        assert_entries_match(res["entries"], replica, rank, 2, dict(rtol=2e-2, atol=2e-2))


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1_orig", "fsdp1_flat", "ddp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swap_evaluates_with_ema_and_restores_bit_exact(pools, kind, dtype):
    results = pools.get(2).run(run_swap_case, kind, dtype)
    x = eval_input(dtype)
    for res in results:
        assert res["restored"], "weights after swap() differ from before"
        assert res["held_is_ema"], "inside swap() the model did not hold the EMA values"
        assert torch.equal(res["after"], res["raw"])
        assert not torch.equal(res["inside"], res["raw"])
        # Inside the swap the model computes what the replica computes with the EMA weights.
        replica = build("plain", dtype)
        replica.load_state_dict({n: t.to(dtype) if t.is_floating_point() else t
                                 for n, t in assemble([r["entries"] for r in results]).items()})
        replica.eval()
        with torch.no_grad():
            expected = replica(x)
        torch.testing.assert_close(res["inside"], expected, rtol=0, atol=0)


def test_compiled_update_compiles_once_over_20_steps_fsdp2(pools):
    for res in pools.get(2).run(run_compiled_update):
        assert res["frames"] == 1
        assert res["same"], "compiled EMA differs from eager"
        assert res["step"] == 20
        assert res["counts"] == {"eager": (20, 20), "compiled": (None, 20),
                                 "loaded": (37, 37)}
        # The schedule written out (not decay_at, and not eager against compiled: same code):
        # copies before start_step=3, every other update, warmup 1 - (1 + s) ** -0.75 with s
        # counted from start_step.
        for k, (eager, compiled) in enumerate(res["decays"]):
            if k < 3:
                expected = 0.0
            elif k % 2:
                expected = 1.0
            else:
                expected = min(1 - (1 + (k - 3)) ** -0.75, 0.999)
            assert eager == pytest.approx(expected, rel=0, abs=1e-12), k
            assert compiled == pytest.approx(expected, rel=0, abs=1e-12), k


def test_made_after_a_forward_without_backward_keeps_shards_fsdp2(pools):
    results = pools.get(2).run(run_made_after_an_evaluation)
    for rank, (unsharded, entries, states) in enumerate(results):
        assert unsharded == ["norm.bias", "norm.weight"]  # the root's, left unsharded
        assert all(layout == "dtensor" for name, (layout, _, _) in entries.items()
                   if name.endswith(("weight", "bias"))), entries.keys()
        assert_entries_match(entries, reference_ema(states, [DECAY] * 2), rank, 2, REPLAY)


def test_sharding_changed_since_the_ema_was_made_is_an_error(pools):
    for message in pools.get(2).run(run_sharding_changed):
        assert message is not None
        assert "sharding changed" in message and "'hidden.weight'" in message


def test_failure_on_one_rank_during_save_raises_on_every_rank_and_leaves_no_index(pools,
                                                                                  tmp_path):
    results = pools.get(2).run(run_save_failure, str(tmp_path / "ckpt"))
    for rank, res in enumerate(results):
        assert res["message"] is not None, f"rank {rank} did not raise"
        assert "failed on rank(s) [1]" in res["message"]
        assert not res["index_after_failure"]
        assert res["index_after_retry"]
    assert "injected: disk full" in results[1]["message"]


def test_save_waits_for_a_slow_rank_before_committing(pools, tmp_path):
    import json

    directory = tmp_path / "ckpt"
    results = pools.get(2).run(run_save_with_a_slow_rank, str(directory))
    index = json.loads((directory / "fsdp_ema.index.json").read_text())
    files = {p["file"] for t in index["tensors"].values() for p in t["pieces"]}
    assert files == {"shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"}
    loaded = fsdp_ema.checkpoint.load(directory)
    assert sorted(loaded) == sorted(results[0])
    for name, t in results[0].items():
        assert torch.equal(loaded[name], t), name


def test_save_refuses_a_committed_directory_unless_overwrite(pools, tmp_path):
    directory = tmp_path / "ckpt"
    for refused in pools.get(2).run(run_save_refuses_committed, str(directory)):
        assert refused is not None and "already holds a committed checkpoint" in refused
    assert fsdp_ema.checkpoint.info(directory)["world_size"] == 2


# --- checkpoints: written at 2 ranks, read at 3 and at 1 ------------------------------------------

SAVED_KINDS = ["fsdp2", "fsdp1_flat", "plain"]


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for kind in SAVED_KINDS:
        directory = root / kind
        results = pools.get(2).run(run_save_checkpoints, kind, str(directory))
        out[kind] = (directory, results[0]["states"])
    return out


def expected_ema(states):
    return reference_ema(states, [DECAY] * STEPS)


def test_checkpoints_written_at_2_ranks_read_at_3_ranks_every_kind(pools, saved):
    directories = {kind: str(d) for kind, (d, _) in saved.items()}
    kinds = ["fsdp2", "fsdp1_orig", "fsdp1_flat"]
    results = pools.get(3).run(run_load_checkpoints, kinds, directories)
    for rank, res in enumerate(results):
        for (_, source), got in res.items():
            reference = expected_ema(saved[source][1])
            entries, step = got["dcp"]
            assert step == STEPS
            assert_entries_match(entries, reference, rank, 3, REPLAY)
            assert_entries_match(got["ours"], reference, rank, 3, REPLAY)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("source", SAVED_KINDS)
def test_checkpoints_written_at_2_ranks_read_at_1(saved, source):
    import torch.distributed.checkpoint as dcp

    directory, states = saved[source]
    reference = expected_ema(states)
    names = sorted(reference)
    # DCP into a single-process EMA.
    ema = ShardedEMA(build("plain", seed=123), DECAY)
    state = {"ema": ema.state_dict()}
    dcp.load(state, checkpoint_id=str(directory / "dcp"))
    ema.load_state_dict(state["ema"])
    assert int(ema.step) == STEPS
    got = ema.state_dict()
    for name in names:
        torch.testing.assert_close(got[name], reference[name].to(got[name].dtype), **REPLAY)
    # Our directory, through the reader the C++ API uses (fsdp_ema.checkpoint.load, whole tensors).
    for sub in ("ema", "ema_alias"):
        assert fsdp_ema.checkpoint.info(directory / sub)["world_size"] == 2
        tensors = fsdp_ema.checkpoint.load(directory / sub)
        assert sorted(tensors) == names
        for name in names:
            torch.testing.assert_close(tensors[name], reference[name].to(tensors[name].dtype),
                                       **REPLAY)
    ema2 = ShardedEMA(build("plain", seed=123), DECAY)
    ema2.load(directory / "ema")
    for name, t in ema2.state_dict().items():
        if name != ShardedEMA.STEP_KEY:
            torch.testing.assert_close(t, reference[name].to(t.dtype), **REPLAY)
    # The C++ reader with no Python: the fsdp-ema tool verifies and consolidates the directory.
    # Every build makes it (tools/ is not optional), so a missing one is a failure, not a skip.
    from safetensors.torch import load_file

    assert CLI.exists(), f"{CLI} is missing: scripts/build.sh builds it with the library"
    out = directory / "exported"
    for command in (["verify", str(directory / "ema")],
                    ["export", "-q", str(directory / "ema"), str(out)]):
        done = subprocess.run([str(CLI), *command], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    exported = load_file(str(out / "model.safetensors"))
    assert sorted(exported) == names
    for name in names:
        torch.testing.assert_close(exported[name], reference[name].to(exported[name].dtype),
                                   **REPLAY)
    # save_shard_weights wrote the trained model's own weights.
    weights = fsdp_ema.checkpoint.load(directory / "weights")
    for name, t in states[-1].items():
        assert torch.equal(weights[name], t), name


def test_load_resumes_the_saved_step_and_refuses_another_step_dependent_schedule(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(5, 4)
    ema = ShardedEMA(model, 0.99, warmup=True)
    for _ in range(5):
        with torch.no_grad():
            model.weight.add_(0.1)
        ema.update()
    ema.save(tmp_path / "e")
    again = ShardedEMA(nn.Linear(5, 4), 0.99, warmup=True)
    again.load(tmp_path / "e")
    assert int(again.step) == 5 and again.decay_at(5) == ema.decay_at(5)
    assert all(torch.equal(a, b) for a, b in zip(again.state.tensors, ema.state.tensors))
    # Another warmup, or a fixed decay where the warmup was: refused, naming both, nothing changed.
    for other in (ShardedEMA(nn.Linear(5, 4), 0.99, warmup=Warmup(power=0.75)),
                  ShardedEMA(nn.Linear(5, 4), 0.99)):
        before = [t.clone() for t in other.state.tensors]
        with pytest.raises(ValueError,
                           match=r"another schedule \(warmup: .* when saved, .* now") as e:
            other.load(tmp_path / "e")
        assert "allow_changes=['warmup']" in str(e.value)
        assert int(other.step) == 0
        assert all(torch.equal(a, b) for a, b in zip(before, other.state.tensors))
        other.load(tmp_path / "e", allow_changes=["warmup"])
        assert int(other.step) == 5
    with pytest.raises(ValueError, match="not schedule settings"):
        again.load(tmp_path / "e", allow_changes=["dtype"])
    # Two fixed decays: no step gives either another decay; the weights and step are taken.
    ShardedEMA(model, 0.9).save(tmp_path / "fixed")
    fixed = ShardedEMA(nn.Linear(5, 4), 0.5)
    fixed.load(tmp_path / "fixed")
    assert int(fixed.step) == 0 and torch.equal(fixed.state.tensors[0], model.weight)
    # An asynchronous save records the position taken with the tensors it staged.
    handle = ema.save(tmp_path / "async", async_=True)
    ema.update()  # after staging: in neither the tensors nor the step saved
    handle.result()
    late = ShardedEMA(nn.Linear(5, 4), 0.99, warmup=True)
    late.load(tmp_path / "async")
    assert int(late.step) == 5 and torch.equal(late.state.tensors[0], again.state.tensors[0])
    # A checkpoint without a position (the model's weights) leaves the step as it is.
    ema.save_shard_weights(tmp_path / "weights")
    again.load(tmp_path / "weights")
    assert int(again.step) == 5
