"""``fsdp_ema.integrations.diffusers.EMAModel`` (#42) against diffusers' own ``EMAModel`` (the
anchor, pinned in requirements.txt) and an independent float64 EMA: a plain tiny ``UNet2DModel``
in this process, FSDP2 and FSDP1 on 2 gloo ranks (one pool for the file), the state dicts across
world sizes, ``save_pretrained`` -> ``UNet2DModel.from_pretrained``, the memory a rank holds and
the refusals."""

from __future__ import annotations

import os
import re

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


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny models run fastest on one thread (the machine's cores are the ranks')."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    if ema is not None and kind == "fsdp2":
        ema.state_dict()  # made whole now; remade sharded (its values kept) once sharded
    model = shard(model, kind)
    if ema is None:
        ema = EMAModel(model, **SETTINGS)
        # diffusers' validation before the first step: the EMA's first use (made there) follows
        # a forward without backward, after which FSDP2 keeps the root's parameters unsharded.
        with torch.no_grad():
            model(batches(1)[0], 3)
        ema.store(model.parameters())
        ema.copy_to(model.parameters())
        ema.restore(model.parameters())
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


def trained(steps: int, **options):
    """A plain UNet trained ``steps`` steps and our EMAModel of it."""
    model = unet()
    ema = EMAModel(model, **SETTINGS, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x in batches(steps):
        train_step(model, opt, x)
        ema.step(model.parameters())
    return model, ema


def test_copy_to_store_restore_round_trip():
    model, ema = trained(4)
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
    _, ema = trained(3, model_cls=UNet2DModel, model_config=unet().config)
    ema.save_pretrained(tmp_path / "ema")
    loaded = UNet2DModel.from_pretrained(tmp_path / "ema")
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), ema.shadow_params))
    back = EMAModel.from_pretrained(tmp_path / "ema", UNet2DModel)
    assert back.optimization_step == 3 and back.power == 0.75 and back.update_after_step == 2
    assert all(torch.equal(a, b) for a, b in zip(back.shadow_params, ema.shadow_params))
    theirs = DiffusersEMA.from_pretrained(tmp_path / "ema", UNet2DModel)
    assert theirs.optimization_step == 3 and theirs.decay == 0.9


def test_save_pretrained_over_an_earlier_sharded_save_loads_the_new_weights(tmp_path):
    """A folder that holds diffusers' own sharded save (shards and their index) of other
    weights: from_pretrained reads an index whenever there is one, so the save removes them."""
    folder = tmp_path / "unet_ema"
    unet(7).save_pretrained(folder, max_shard_size="10KB")
    stale = sorted(os.listdir(folder))
    assert "diffusion_pytorch_model.safetensors.index.json" in stale
    assert any(re.fullmatch(r"diffusion_pytorch_model-\d{5}-of-\d{5}\.safetensors", n)
               for n in stale)
    (folder / "notes.txt").write_text("kept")
    _, ema = trained(3, model_cls=UNet2DModel, model_config=unet().config)
    ema.save_pretrained(folder)
    assert sorted(os.listdir(folder)) == ["config.json", "diffusion_pytorch_model.safetensors",
                                          "notes.txt"]
    loaded = UNet2DModel.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), ema.shadow_params))


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
    before = list(model.parameters())
    ema.step(before)
    model.conv_in.weight = torch.nn.Parameter(model.conv_in.weight.detach().clone())
    with pytest.raises(ValueError, match="not those of the model"):
        ema.step(before)  # the model's parameters of before: one of them is no longer its own
    ema.step(reversed(list(model.parameters())))  # its own, in any order
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
    with pytest.raises(ValueError, match="holds 113 tensors, the EMA 114"):
        ema.load_state_dict({"shadow_params": ema.shadow_params[1:]})
    with pytest.raises(ValueError, match="list of tensors"):
        ema.load_state_dict({"shadow_params": [1.0] * 114})
    with pytest.raises(ValueError, match="dtype must be floating"):
        ema.to(dtype=torch.int32)
    ema.store(model.parameters())
    with pytest.raises(ValueError, match="not the 114 that store"):
        ema.restore(list(model.parameters())[1:])


def test_to_dtype_keeps_the_values():
    _, ema = trained(3)
    before = [t.clone() for t in ema.shadow_params]
    ema.to(device="cpu", dtype=torch.float64)
    assert ema.optimization_step == 3
    assert all(t.dtype == torch.float64 and torch.equal(t, b.double())
               for t, b in zip(ema.shadow_params, before))


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


def _rank_ddp_saves(rank, world, folder):
    """A DDP model's EMA (whole on every rank): save_pretrained on the main process only, as
    the training scripts call it, then on every rank, then ShardedEMA.export collectively."""
    model = unet()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ema = EMAModel(ddp, model_cls=UNet2DModel, model_config=model.config, **SETTINGS)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for x in batches(3):
        train_step(ddp, opt, x + rank)  # other data per rank: DDP averages the gradients
        ema.step(ddp.parameters())
    if rank == 0:
        ema.save_pretrained(os.path.join(folder, "main_only"))
    torch.distributed.barrier()
    ema.save_pretrained(os.path.join(folder, "every_rank"))
    ema.ema.export(os.path.join(folder, "collective"))
    torch.distributed.barrier()
    return [t.clone() for t in ema.shadow_params]


def test_ddp_save_pretrained_on_the_main_process_only(pools, tmp_path):
    """diffusers' scripts save the EMA under ``if accelerator.is_main_process:``: a whole EMA
    is written by rank 0 alone, with no collective (it used to wait forever for the other
    ranks), and called on every rank it is written once, the same bytes as the export."""
    results = pools.get(2).run(_rank_ddp_saves, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
    for name in ("main_only", "every_rank"):
        loaded = UNet2DModel.from_pretrained(tmp_path / name)
        assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), results[0]))
        assert (tmp_path / name / "diffusion_pytorch_model.safetensors").read_bytes() == (
            tmp_path / "collective" / "model.safetensors").read_bytes()


def accelerate_state(rank: int = 0, world: int = 1):
    """accelerate's process state (its logging needs one) over the process group there is."""
    from accelerate import PartialState

    if world > 1:  # the pool's ranks (gloo initialized): accelerate reuses the process group
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="29500")
    return PartialState(cpu=True)


def _local_export_refused(ema, path) -> bool:
    """Written by one rank (``export(local=True)``): only for an EMA held whole."""
    try:
        ema.ema.export(path, local=True)
    except ValueError as e:
        return "local=True needs an EMA held whole" in str(e)
    return False


def _rank_round_trips(rank, world, kind, folder):
    from accelerate.checkpointing import save_custom_state

    accelerate_state(rank, world)
    model = unet()
    ema = EMAModel(model, model_cls=UNet2DModel, model_config=model.config, **SETTINGS)
    model = shard(model, kind)
    if kind == "fsdp1":  # a new root around the model the EMAModel was made from: refused
        try:
            ema.step(model.parameters())
        except RuntimeError as e:
            assert "make the EMAModel from the model accelerator.prepare returns" in str(e)
        else:
            raise AssertionError("an EMAModel of the model FSDP1 wrapped was not refused")
        ema = EMAModel(model, model_cls=UNet2DModel, model_config=unet().config, **SETTINGS)
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
    refused = []
    for attempt in (lambda: ema.shadow_params,
                    lambda: ema.load_state_dict({"fsdp_ema.sharded": {"folder": "x"}}),
                    lambda: ema.load_state_dict({"fsdp_ema.sharded": {"folder": "../x"}})):
        try:
            attempt()
        except (RuntimeError, ValueError) as e:
            refused.append(str(e))
    ok = ok and len(refused) == 3 and "this rank's shards only" in refused[0] and (
        "load it with accelerator.load_state" in refused[1]) and "must name a folder" in refused[2]
    # accelerate's save of a registered object: each rank writes its shards.
    save_custom_state(ema, os.path.join(folder, "accelerate"), 0)
    # An object holding the EMA, registered in its place: the EMA's state_dict is not the one
    # accelerate saves, so it writes no folder under that object's index (two EMAs held by one
    # object shared it).
    class Holder:
        def state_dict(self):
            return {"ema": ema.state_dict()}

    held = Holder().state_dict()["ema"]
    os.makedirs(os.path.join(folder, "held"), exist_ok=True)
    save_custom_state(Holder(), os.path.join(folder, "held"), 1)
    ok = ok and "fsdp_ema.sharded" not in held and "shadow_params" in held and not (
        os.path.exists(os.path.join(folder, "held", "custom_checkpoint_1_ema")))
    # Outside accelerate: DTensors / ShardedTensors, which DCP saves and reshards.
    import torch.distributed.checkpoint as dcp

    dcp.save(ema.state_dict(), checkpoint_id=os.path.join(folder, "dcp"))
    ema.save_pretrained(os.path.join(folder, "pretrained"))
    # diffusers' scripts' resume: from_pretrained (whole, every rank), then into the sharded EMA.
    again = EMAModel(model, decay=0.5)
    again.load_state_dict(EMAModel.from_pretrained(os.path.join(folder, "pretrained"),
                                                   UNet2DModel).state_dict())
    ok = ok and again.optimization_step == 4 and again.decay == 0.9 and all(
        torch.equal(a, b) for a, b in zip(full_ema(again, kind, names), values))
    if kind == "fsdp2":  # the model's parameters of before, one of them replaced since
        before = list(model.parameters())
        model.conv_in.weight = torch.nn.Parameter(model.conv_in.weight.detach().clone())
        try:
            ema.step(before)
        except ValueError as e:
            ok = ok and "not those of the model" in str(e)
        else:
            ok = False
    ok = ok and _local_export_refused(ema, os.path.join(folder, f"local-{rank}"))
    sd = ema.state_dict()
    return ok, values, sorted(k for k in sd if k != "shadow_params"), type(sd["shadow_params"][0])


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_sharded_round_trips_and_two_ranks_to_one(pools, tmp_path, kind):
    from accelerate.checkpointing import load_custom_state

    results = pools.get(2).run(_rank_round_trips, kind, str(tmp_path))
    assert all(r[0] for r in results)
    accelerate_state()
    values = results[0][1]
    assert results[0][3].__name__ in ("DTensor", "ShardedTensor")
    # The 2-rank save, loaded in this one process into a plain model's EMA.
    ema = EMAModel(unet(9), decay=0.5)
    load_custom_state(ema, str(tmp_path / "accelerate"), 0)
    assert ema.optimization_step == 4 and ema.decay == 0.9 and ema.update_after_step == 2
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow_params, values))
    loaded = UNet2DModel.from_pretrained(tmp_path / "pretrained")
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), values))
    import torch.distributed.checkpoint as dcp

    by_dcp = EMAModel(unet(9), decay=0.5)
    state = by_dcp.state_dict()   # its shadow_params are the EMA's own tensors: loaded in place
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    by_dcp.load_state_dict(state)
    assert by_dcp.optimization_step == 4 and by_dcp.decay == 0.9
    assert all(torch.equal(a, b) for a, b in zip(by_dcp.shadow_params, values))


# --- LoRA ---------------------------------------------------------------------------------------

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def cond_unet(seed: int = 0):
    torch.manual_seed(seed)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16),
        layers_per_block=1, norm_num_groups=4, cross_attention_dim=8, attention_head_dim=2,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))


def lora_unet(kind: str = "plain"):
    """diffusers' LoRA scripts' model: the base frozen, ``add_adapter(LoraConfig(...))``."""
    from peft import LoraConfig

    model = cond_unet()
    model.requires_grad_(False)
    torch.manual_seed(1)
    model.add_adapter(LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian",
                                 target_modules=LORA_TARGETS))
    return shard(model, kind)


def train_lora(kind: str, steps: int = 5):
    """Trains the adapters with our EMAModel(params="trainable") beside diffusers' EMAModel of
    the adapter parameters (on gathered copies); returns the largest difference, the EMA's
    adapters by name and what its names are."""
    model = lora_unet(kind)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ema = EMAModel(model, params="trainable", model_cls=diffusers.UNet2DConditionModel,
                   model_config=cond_unet().config, **SETTINGS)
    copies = [full(p).requires_grad_(True) for _, p in trainable]
    ref = DiffusersEMA(copies, **SETTINGS)
    opt = torch.optim.SGD([p for _, p in trainable], lr=0.5)
    g = torch.Generator().manual_seed(2)
    worst = 0.0
    for _ in range(steps):
        x, e = torch.randn(2, 1, 8, 8, generator=g), torch.randn(2, 3, 8, generator=g)
        model(x, 3, encoder_hidden_states=e).sample.square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.step(model.parameters())
        with torch.no_grad():
            for c, (_, p) in zip(copies, trainable):
                c.copy_(full(p))
        ref.step(copies)
        ours = ema.ema.full_state_dict(rank0_only=False)
        worst = max(worst, *((ours[n] - s).abs().max().item()
                             for (n, _), s in zip(trainable, ref.shadow_params)))
    return worst, ours, sorted(ema.ema.shapes), [n for n, _ in trainable], ema


def check_lora_exports(folder, values: dict[str, torch.Tensor]):
    """What save_lora_adapter and save_pretrained wrote, read back by diffusers and peft."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    # diffusers: load_lora_adapter into the base model; peft: PeftModel.from_pretrained.
    by_diffusers = cond_unet()
    by_diffusers.load_lora_adapter(str(folder / "adapter"), prefix=None, use_safetensors=True)
    by_peft = PeftModel.from_pretrained(cond_unet(), str(folder / "adapter"))
    for model in (by_diffusers, by_peft.base_model.model):
        loaded = {re.sub(r"\.(lora_[AB])\.[^.]+\.", r".\1.default.", n): p
                  for n, p in model.named_parameters() if ".lora_" in n}  # any adapter name
        assert sorted(loaded) == sorted(values)
        assert all(torch.equal(loaded[n], v) for n, v in values.items())
    # Merged: W + scale * B @ A with the EMA's A and B, every other tensor the base model's.
    merged = diffusers.UNet2DConditionModel.from_pretrained(folder / "merged")
    base, got = dict(cond_unet().named_parameters()), dict(merged.named_parameters())
    layers = {n: m for n, m in lora_unet().named_modules() if isinstance(m, LoraLayer)}
    assert len(layers) == len(values) // 2 == 32  # q, k, v, out of 2 attentions x 4 blocks
    for name, weight in base.items():
        owner = name.rpartition(".")[0]
        if owner in layers and name.endswith("weight"):
            a, b = (values[f"{owner}.lora_{x}.default.weight"] for x in "AB")
            expect = weight + layers[owner].scaling["default"] * (b @ a)
            assert torch.allclose(got[name], expect, rtol=0, atol=1e-6), name
        else:
            assert torch.equal(got[name], weight), name


def test_lora_ema_of_the_adapters_exports(tmp_path):
    worst, values, names, trainable, ema = train_lora("plain")
    assert worst < TO_DIFFUSERS
    assert names == sorted(trainable) and all(".lora_" in n for n in names)
    held = sum(v.numel() * v.element_size() for v in values.values())
    assert ema.ema.nbytes == held  # the adapters only
    ema.save_lora_adapter(tmp_path / "adapter")
    ema.save_pretrained(tmp_path / "merged")
    check_lora_exports(tmp_path, values)


def _rank_lora(rank, world, folder):
    worst, values, names, trainable, ema = train_lora("fsdp2")
    ema.save_lora_adapter(os.path.join(folder, "adapter"))
    ema.save_pretrained(os.path.join(folder, "merged"))
    return worst, values, names == sorted(trainable), ema.ema.nbytes


def test_lora_fsdp2_exports(pools, tmp_path):
    results = pools.get(2).run(_rank_lora, str(tmp_path))
    worst, values, names_ok, held = results[0]
    assert all(r[0] < TO_DIFFUSERS and r[2] for r in results)
    assert sum(r[3] for r in results) == sum(v.numel() * v.element_size()
                                             for v in values.values())
    check_lora_exports(tmp_path, values)


def test_import_without_diffusers_names_the_extra(monkeypatch):
    import sys

    for name in [m for m in sys.modules if m == "diffusers" or m.startswith("diffusers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "diffusers", None)
    monkeypatch.delitem(sys.modules, "fsdp_ema.integrations.diffusers")
    with pytest.raises(ImportError, match=r'pip install "fsdp-ema\[diffusers\]"'):
        import fsdp_ema.integrations.diffusers  # noqa: F401
