"""``fsdp_ema.integrations.diffusers.EMAModel`` (#42) against diffusers' own ``EMAModel`` (the
anchor, pinned in requirements.txt) and an independent float64 EMA: a plain tiny ``UNet2DModel``
in this process, FSDP2 and FSDP1 on 2 gloo ranks (one pool for the file), the state dicts across
world sizes, ``save_pretrained`` -> ``UNet2DModel.from_pretrained``, the memory a rank holds and
the refusals."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import PoolManager

diffusers = pytest.importorskip("diffusers")
from diffusers import UNet2DModel  # noqa: E402
from diffusers.training_utils import EMAModel as DiffusersEMA  # noqa: E402

from fsdp_ema.integrations.diffusers import EMAModel  # noqa: E402

STEPS = 8
SETTINGS = dict(decay=0.9, use_ema_warmup=True, inv_gamma=1.0, power=0.75, update_after_step=2)
TO_DIFFUSERS = 1e-6   # diffusers' float32 sub_(mul) rounding against the op's lerp
TO_FLOAT64 = 1e-7     # each step's, relative to the weight's magnitude where it exceeds 1


def unet(seed: int = 0) -> UNet2DModel:
    torch.manual_seed(seed)
    return UNet2DModel(sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16),
                       layers_per_block=1, norm_num_groups=4,
                       down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"))


def batches(steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 1, 8, 8, generator=g) for _ in range(steps)]


def train_step(model, opt, x):
    model(x, 3).sample.square().mean().backward()
    opt.step()
    opt.zero_grad()


def decay_of(k: int, decay, min_decay=0.0, update_after_step=0, use_ema_warmup=False,
             inv_gamma=1.0, power=2 / 3) -> float:
    """diffusers 0.42.1's get_decay, written out again from its documentation."""
    s = max(0, k - update_after_step - 1)
    if s == 0:
        return 0.0
    d = 1 - (1 + s / inv_gamma) ** -power if use_ema_warmup else (1 + s) / (10 + s)
    return max(min(d, decay), min_decay)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def shard(model, kind: str):
    """``kind``: "plain", "fsdp2" (every down/up block and the root), "fsdp1" (the root)."""
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in [*model.down_blocks, *model.up_blocks]:
            fully_shard(block)
        return fully_shard(model)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, use_orig_params=False, device_id=torch.device("cpu"))
    return model


def run_against_references(kind: str, made_before_sharding: bool = True):
    """Trains ``kind`` for STEPS steps with our EMAModel beside diffusers' (stepped on a plain
    replica holding the gathered weights) and a float64 EMA; returns the largest differences
    and what each rank's EMA holds."""
    model, replica = unet(), unet()
    ema = EMAModel(model, **SETTINGS) if made_before_sharding else None
    model = shard(model, kind)
    if ema is None:
        ema = EMAModel(model, **SETTINGS)
    ref = DiffusersEMA(replica.parameters(), **SETTINGS)
    names = [n for n, _ in replica.named_parameters()]
    prev = None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    to_diffusers = to_float64 = 0.0
    for k, x in enumerate(batches(), start=1):
        train_step(model, opt, x)
        ema.step(model.parameters())
        weights = replica_weights(model, kind, names)
        with torch.no_grad():
            for p, w in zip(replica.parameters(), weights):
                p.copy_(w)
        ref.step(replica.parameters())
        d = decay_of(k, **SETTINGS)
        assert ema.cur_decay_value == ref.cur_decay_value == d
        # The float64 EMA step from our previous EMA: the decay's weight formed in double.
        w64 = [w.double() for w in weights]
        ema64 = w64 if prev is None else [torch.lerp(e.double(), w, 1 - d)
                                          for e, w in zip(prev, w64)]
        ours = prev = full_ema(ema, kind, names)
        to_diffusers = max(to_diffusers, *((a - b).abs().max().item()
                                           for a, b in zip(ours, ref.shadow_params)))
        # Relative above 1: float32 itself spaces values 1.2e-7 apart there.
        to_float64 = max(to_float64, *((a.double() - b).abs().div(b.abs().clamp_min(1)).max()
                                       .item() for a, b in zip(ours, ema64)))
    held = ema.ema.nbytes
    ref_bytes = sum(p.numel() * p.element_size() for p in ref.shadow_params)
    return to_diffusers, to_float64, held, ref_bytes, ema.optimization_step


def replica_weights(model, kind: str, names: list[str]) -> list[torch.Tensor]:
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            params = dict(model.module.named_parameters())
            return [params[n].detach().clone() for n in names]
    return [full(p) for p in model.parameters()]


def full_ema(ema: EMAModel, kind: str, names: list[str]) -> list[torch.Tensor]:
    values = ema.ema.full_state_dict(rank0_only=False)
    return [values[n] for n in names]


# --- one process --------------------------------------------------------------------------------

def test_get_decay_is_diffusers():
    for settings in (SETTINGS, dict(decay=0.999), dict(decay=0.5, min_decay=0.6),
                     dict(decay=0.99, update_after_step=5, min_decay=0.1)):
        ours, theirs = EMAModel(unet(), **settings), DiffusersEMA(unet().parameters(), **settings)
        for k in range(0, 40):
            assert ours.get_decay(k) == theirs.get_decay(k) == decay_of(k, **settings)
            if k >= 1:
                device = ours.schedule.device_decay(torch.tensor(k))
                assert device.dtype == torch.float64
                assert device.item() == pytest.approx(theirs.get_decay(k), abs=1e-15)


def test_plain_matches_diffusers_and_float64():
    to_diffusers, to_float64, held, ref_bytes, steps = run_against_references("plain")
    assert to_diffusers < TO_DIFFUSERS and to_float64 < TO_FLOAT64
    assert held == ref_bytes and steps == STEPS


def test_copy_to_store_restore_round_trip():
    model = unet()
    ema = EMAModel(model, **SETTINGS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x in batches(4):
        train_step(model, opt, x)
        ema.step(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    ema.store(model.parameters())
    ema.copy_to(model.parameters())
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), ema.shadow_params))
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    ema.restore(model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(RuntimeError, match="no `store\\(\\)`ed weights"):
        ema.restore(model.parameters())
    other = unet(5)
    ema.copy_to(other.parameters())  # another model laid out alike
    assert all(torch.equal(p, e) for p, e in zip(other.parameters(), ema.shadow_params))


def test_state_dict_is_diffusers_both_ways():
    model = unet()
    ema, ref = EMAModel(model, **SETTINGS), DiffusersEMA(model.parameters(), **SETTINGS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x in batches(3):
        train_step(model, opt, x)
        ema.step(model.parameters())
        ref.step(model.parameters())
    ours = ema.state_dict()
    theirs = ref.state_dict()
    assert {k: v for k, v in ours.items() if k not in ("shadow_params", "shadow_names")} == {
        k: v for k, v in theirs.items() if k != "shadow_params"}
    fresh = EMAModel(unet(7), decay=0.5)
    fresh.load_state_dict(theirs)   # diffusers' own state dict: its order is parameters()
    assert fresh.optimization_step == 3 and fresh.decay == 0.9 and fresh.use_ema_warmup
    assert all(torch.equal(a, b) for a, b in zip(fresh.shadow_params, ref.shadow_params))
    back = DiffusersEMA(unet(7).parameters())
    back.load_state_dict(ours)      # ours into diffusers'
    assert all(torch.equal(a, b) for a, b in zip(back.shadow_params, ema.shadow_params))


def test_save_pretrained_loads_with_from_pretrained(tmp_path):
    model = unet()
    ema = EMAModel(model, model_cls=UNet2DModel, model_config=model.config, **SETTINGS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x in batches(3):
        train_step(model, opt, x)
        ema.step(model.parameters())
    ema.save_pretrained(tmp_path / "ema")
    loaded = UNet2DModel.from_pretrained(tmp_path / "ema")
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), ema.shadow_params))
    back = EMAModel.from_pretrained(tmp_path / "ema", UNet2DModel)
    assert back.optimization_step == 3 and back.power == 0.75 and back.update_after_step == 2
    assert all(torch.equal(a, b) for a, b in zip(back.shadow_params, ema.shadow_params))
    theirs = DiffusersEMA.from_pretrained(tmp_path / "ema", UNet2DModel)
    assert theirs.optimization_step == 3 and theirs.decay == 0.9


def test_refusals():
    model = unet()
    with pytest.raises(TypeError, match="pass the model itself"):
        EMAModel(model.parameters())
    with pytest.raises(ValueError, match="decay must be in"):
        EMAModel(model, decay=1.5)
    with pytest.raises(ValueError, match="inv_gamma must be > 0"):
        EMAModel(model, inv_gamma=0)
    ema = EMAModel(model)
    with pytest.raises(ValueError, match="not those of the model"):
        ema.step(unet(1).parameters())
    with pytest.raises(ValueError, match="model_cls"):
        ema.save_pretrained("/nonexistent")
    with pytest.raises(ValueError, match="shadow_params\\[0\\]"):
        ema.load_state_dict({"shadow_params": [torch.zeros(3)] + ema.shadow_params[1:]})
    with pytest.raises(ValueError, match="optimization_step must be int"):
        ema.load_state_dict({"optimization_step": 1.5})
    with pytest.raises(ValueError, match="not on meta"):
        ema.to("meta")
    with pytest.raises(ValueError, match="other shapes"):
        ema.copy_to(list(model.parameters())[1:])


# --- 2 ranks ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


def _rank_references(rank, world, kind, made_before):
    return run_against_references(kind, made_before)


@pytest.mark.parametrize("kind,made_before", [("fsdp2", True), ("fsdp2", False),
                                              ("fsdp1", False)])
def test_sharded_matches_diffusers_and_float64(pools, kind, made_before):
    results = pools.get(2).run(_rank_references, kind, made_before)
    for to_diffusers, to_float64, held, ref_bytes, steps in results:
        assert to_diffusers < TO_DIFFUSERS and to_float64 < TO_FLOAT64 and steps == STEPS
        # This rank's shards only: about half of diffusers' full copy.
        assert held < 0.6 * ref_bytes
    assert abs(sum(r[2] for r in results) - results[0][3]) < 0.1 * results[0][3]


def _rank_round_trips(rank, world, kind, folder):
    from accelerate.checkpointing import save_custom_state

    model = unet()
    ema = EMAModel(model, model_cls=UNet2DModel, model_config=model.config, **SETTINGS)
    model = shard(model, kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x in batches(4):
        train_step(model, opt, x)
        ema.step(model.parameters())
    names = [n for n, _ in unet().named_parameters()]
    values = full_ema(ema, kind, names)
    # copy_to / store / restore: shard into shard, bit for bit.
    before = replica_weights(model, kind, names)
    ema.store(model.parameters())
    ema.copy_to(model.parameters())
    copied = replica_weights(model, kind, names)
    ema.restore(model.parameters())
    restored = replica_weights(model, kind, names)
    ok = (all(torch.equal(a, b) for a, b in zip(copied, values))
          and all(torch.equal(a, b) for a, b in zip(restored, before)))
    # accelerate's save of a registered object: each rank writes its shards.
    save_custom_state(ema, os.path.join(folder, "accelerate"), 0)
    ema.save_pretrained(os.path.join(folder, "pretrained"))
    sd = ema.state_dict()
    return ok, values, sorted(k for k in sd if k != "shadow_params"), type(sd["shadow_params"][0])


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_sharded_round_trips_and_two_ranks_to_one(pools, tmp_path, kind):
    from accelerate.checkpointing import load_custom_state

    results = pools.get(2).run(_rank_round_trips, kind, str(tmp_path))
    assert all(r[0] for r in results)
    values = results[0][1]
    assert results[0][3].__name__ in ("DTensor", "ShardedTensor")
    # The 2-rank save, loaded in this one process into a plain model's EMA.
    ema = EMAModel(unet(9), decay=0.5)
    load_custom_state(ema, str(tmp_path / "accelerate"), 0)
    assert ema.optimization_step == 4 and ema.decay == 0.9 and ema.update_after_step == 2
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow_params, values))
    loaded = UNet2DModel.from_pretrained(tmp_path / "pretrained")
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), values))
