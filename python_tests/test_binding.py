"""What ties an EMA checkpoint to its training state (``fsdp_ema.store.binding``, #34): the model
fingerprint is the same at any world size and sharding (FSDP2 over 3 gloo ranks with uneven
and empty shards, a plain model in one process) and changes with any bit, any moved
element and any renamed tensor; the settings name what a resume compares; and
``ShardedEMA.export(prefix=)`` writes a submodule's tensors under its own names."""

from __future__ import annotations

import pytest
import torch
from dist_utils import PoolManager
from models import UnevenMLP

import fsdp_ema
from fsdp_ema.store import binding as _binding


@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(UnevenMLP(), torch.nn.BatchNorm1d(1))
    with torch.no_grad():  # buffers with values of their own
        m[1].running_mean.fill_(0.25)
        m[1].running_var.fill_(3.0)
    return m


def run_fingerprint(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (m[0].inp, m[0].hidden, m[0].head, m):
        fully_shard(layer, mesh=mesh)
    ema = fsdp_ema.ShardedEMA(m, 0.9)
    before = ema.model_fingerprint()
    with torch.no_grad():  # one element of one rank's shard, by one ulp
        local = m[0].inp.weight._local_tensor
        if rank == world - 1:
            local.view(torch.int32)[-1, -1] += 1
    return before, ema.model_fingerprint()


def test_fingerprint_is_the_same_at_any_world_size_and_sees_every_change(pools):
    plain = fsdp_ema.ShardedEMA(model(), 0.9)
    reference = plain.model_fingerprint()
    assert len(reference) == 16 and int(reference, 16) > 0
    for world in (3,):  # uneven shards (3, 3, 1 rows) and empty ones (the 1-row head)
        results = pools.get(world).run(run_fingerprint)
        assert [r[0] for r in results] == [reference] * world, (world, results)
        changed = {r[1] for r in results}
        assert len(changed) == 1 and changed != {reference}, (world, results)

    m = model()
    ema = fsdp_ema.ShardedEMA(m, 0.9)
    assert ema.model_fingerprint() == reference
    w = m[0].inp.weight
    with torch.no_grad():
        w[[0, 1]] = w[[1, 0]].clone()  # two rows swapped: same values, other places
        assert ema.model_fingerprint() != reference
        w[[0, 1]] = w[[1, 0]].clone()
        assert ema.model_fingerprint() == reference
        m[1].running_var.fill_(3.5)  # a buffer the EMA keeps
        assert ema.model_fingerprint() != reference
        m[1].running_var.fill_(3.0)
    # The EMA's own values and its updates are not part of it: only the model's weights.
    ema.update()
    assert ema.model_fingerprint() == reference
    # Equal tensors under other names (a renamed module) differ.
    renamed = torch.nn.Sequential()
    renamed.add_module("a", model()[0])
    renamed.add_module("b", model()[1])
    assert fsdp_ema.ShardedEMA(renamed, 0.9).model_fingerprint() != reference


def test_fingerprint_hashes_every_dtype_by_its_bits():
    pieces = {"f": torch.tensor([0.0, -0.0]), "b": torch.tensor([0.0], dtype=torch.bfloat16),
              "d": torch.tensor([1.0], dtype=torch.float64), "i": torch.tensor([3, 4]),
              "flag": torch.tensor([True, False]), "s": torch.tensor(2.0)}
    base = _binding.fingerprint(pieces, group=None, device=torch.device("cpu"))
    for name, other in (("f", torch.tensor([0.0, 0.0])),  # -0.0 and 0.0 differ in bits
                        ("b", torch.tensor([1.0], dtype=torch.bfloat16)),
                        ("d", torch.tensor([1.0 + 2**-52], dtype=torch.float64)),
                        ("i", torch.tensor([4, 3])), ("flag", torch.tensor([False, True])),
                        ("s", torch.tensor(2.5))):
        assert _binding.fingerprint({**pieces, name: other}, group=None,
                                    device=torch.device("cpu")) != base, name
    # A tensor given as two row pieces hashes as the whole tensor.
    whole = torch.arange(12.0).view(4, 3)
    split = {"w": (whole[:1], [0, 0], [4, 3])}
    rest = {"w": (whole[1:], [1, 0], [4, 3])}
    fp = _binding.fingerprint({"w": whole}, group=None, device=torch.device("cpu"))
    p1 = _binding._piece_sums(*split["w"])
    p2 = _binding._piece_sums(*rest["w"])
    assert [(a + b) % _binding._P for a, b in zip(p1, p2)] == _binding._piece_sums(whole, [0, 0],
                                                                                    [4, 3])
    assert fp == _binding.fingerprint({"w": (whole, [0, 0], [4, 3])}, group=None,
                                      device=torch.device("cpu"))


def test_settings_and_what_differs_are_named_by_the_options():
    m = model()
    ema = fsdp_ema.ShardedEMA(m, 0.99, warmup=fsdp_ema.Warmup(power=0.75), update_every=2,
                              start_step=3, dtype=torch.float64, buffers="copy")
    s = _binding.settings(ema)
    assert s == {"decay": 0.99, "warmup": {"gamma": 1.0, "power": 0.75, "min_decay": 0.0},
                 "schedule": None, "update_every": 2, "start_step": 3, "dtype": "float64",
                 "params": "all", "buffers": "copy"}
    other = _binding.settings(fsdp_ema.ShardedEMA(m, 0.9, schedule=fsdp_ema.PowerEMA(gamma=7)))
    assert other["schedule"].startswith("fsdp_ema.power_ema.PowerEMA: PowerEMA(") and (
        other["warmup"] is None and other["buffers"] == "average")
    changes = _binding.setting_changes(s, other)
    assert [c.split(":")[0] for c in changes] == ["decay", "warmup", "schedule", "update_every",
                                                  "start_step", "dtype", "buffers"]
    assert changes[0] == "decay: 0.99 when saved, 0.9 now"
    assert _binding.setting_changes(s, other, allow=set(_binding.SETTINGS)) == []
    assert _binding.setting_changes({"decay": 0.9}, other) == []  # older checkpoints: what is there
    assert _binding.name_changes(["a", "b"], ["b", "c"]) == [
        "1 tensor(s) not in the checkpoint: ['c']", "1 tensor(s) only in the checkpoint: ['a']"]
    b = _binding.Binding(4, "00ff00ff00ff00ff", s)
    assert _binding.Binding.from_json(b.to_json()) == b
    assert _binding.Binding.from_json({"global_step": "4", "fingerprint": "x"}) is None
    assert _binding.Binding.from_json(None) is None


def test_export_prefix_writes_a_submodule_under_its_own_names(tmp_path):
    from safetensors.torch import load_file

    m = model()
    ema = fsdp_ema.ShardedEMA(m, 0.5)
    ema.export(tmp_path / "sub", prefix="0.")
    exported = load_file(str(tmp_path / "sub" / "model.safetensors"))
    assert sorted(exported) == sorted(UnevenMLP().state_dict())
    for name, t in exported.items():
        assert torch.equal(t, m[0].state_dict()[name]), name
    with pytest.raises(ValueError, match="no tensor name starts with 'nope.'"):
        ema.export(tmp_path / "none", prefix="nope.")
    assert not (tmp_path / "none").exists()
