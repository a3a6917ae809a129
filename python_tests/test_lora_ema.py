"""EMA of a parameter subset (``ShardedEMA(params=...)``), LoRA/PEFT fine-tunes and applying the
EMA to a model (``copy_to``, ``fsdp_ema.load_model_weights``) (#16).

The LoRA model comes from peft (PyPI), wrapped with FSDP2 on 2 gloo ranks; references are an EMA
recomputed with torch.lerp from the gathered adapter trajectory (exact) and an unsharded replica
trained in one process (to float32 training noise).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import PoolManager
from models import UnevenMLP
from torch import nn

from fsdp_ema import ShardedEMA

peft = pytest.importorskip("peft")  # pinned in requirements.txt; the reference implementation

STEPS = 5
DECAY = 0.75  # 1 - decay exact in binary: the op and torch.lerp round alike
REPLICA = dict(rtol=1e-5, atol=1e-6)
TARGETS = ["inp", "hidden"]


def lora_config():
    return peft.LoraConfig(r=3, lora_alpha=6, target_modules=TARGETS, lora_dropout=0.0)


def build_lora(kind: str = "plain", seed: int = 0):
    """The same base and adapter weights on every rank and in the replica; ``kind`` "fsdp2"
    shards every adapted layer and the root over all ranks."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(UnevenMLP(), lora_config())
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for name in TARGETS:
            fully_shard(getattr(model.base_model.model, name), mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    return model


def batches(steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g))
            for _ in range(steps)]


def train_step(model, opt, x, y):
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def full_trainable(model) -> dict[str, torch.Tensor]:
    """The full trainable parameters by name (DTensor.full_tensor: independent of fsdp_ema)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def lerp_ema(states, decay=DECAY):
    ema = {n: t.clone() for n, t in states[0].items()}
    for state in states[1:]:
        for n, t in state.items():
            ema[n] = torch.lerp(ema[n], t, 1 - decay)
    return ema


def train_lora_with_ema(kind: str):
    model = build_lora(kind)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2,
                          momentum=0.9)
    ema = ShardedEMA(model, decay=DECAY, params="trainable")
    states = [full_trainable(model)]
    for x, y in batches():
        train_step(model, opt, x, y)
        ema.update()
        states.append(full_trainable(model))
    return model, ema, states


# --- multi-process cases (module level: the ranks import them) ------------------------------------

def run_lora_fsdp2(rank, world):
    model, ema, states = train_lora_with_ema("fsdp2")
    sd = ema.state_dict()
    adapters = sorted(states[0])
    local = {n: v.to_local().clone() for n, v in sd.items() if n != ShardedEMA.STEP_KEY}
    full = ema.full_state_dict(rank0_only=False)
    all_params = ShardedEMA(model, decay=DECAY)
    return dict(keys=sorted(k for k in sd if k != ShardedEMA.STEP_KEY), adapters=adapters,
                reference=lerp_ema(states), full=full, local=local, nbytes=ema.nbytes,
                all_nbytes=all_params.nbytes, repr=repr(ema),
                local_numel=sum(v.numel() for v in local.values()))


@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


# --- params="trainable" on a LoRA model under FSDP2 --------------------------------------------

def test_lora_fsdp2_ema_keeps_only_the_adapters_exact_against_lerp_of_the_trajectory(pools):
    results = pools.get(2).run(run_lora_fsdp2)
    _, replica_ema, replica_states = train_lora_with_ema("plain")
    replica_ref = lerp_ema(replica_states)
    for res in results:
        assert res["keys"] == res["adapters"]
        assert all(".lora_A." in k or ".lora_B." in k for k in res["keys"])
        assert len(res["keys"]) == 2 * len(TARGETS)
        for name, ref in res["reference"].items():
            # The EMA shards gathered equal the torch.lerp EMA of the gathered adapters exactly.
            assert torch.equal(res["full"][name], ref), name
            torch.testing.assert_close(res["full"][name], replica_ref[name], **REPLICA)
        # Memory: the adapters' local shards in float32, far less than an EMA of everything.
        assert res["nbytes"] == 4 * res["local_numel"]
        assert res["nbytes"] < res["all_nbytes"] / 2
        assert "params='trainable'" in res["repr"] and f"nbytes={res['nbytes']}" in res["repr"]
    assert sum(r["local_numel"] for r in results) == sum(
        t.numel() for t in results[0]["reference"].values())
    # The replica's own fsdp_ema (one process) agrees with its lerp reference exactly.
    for name, v in replica_ema.state_dict().items():
        if name != ShardedEMA.STEP_KEY:
            assert torch.equal(v, replica_ref[name]), name


# --- params: a callable, and bad inputs -----------------------------------------------------------

def test_params_callable_selects_by_name_and_keeps_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    ema = ShardedEMA(model, decay=0.5, params=lambda name, p: name.startswith("2."))
    names = sorted(k for k in ema.state_dict() if k != ShardedEMA.STEP_KEY)
    assert names == ["1.num_batches_tracked", "1.running_mean", "1.running_var", "2.bias",
                     "2.weight"]
    expected = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("2.")}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    for n, before in expected.items():
        after = dict(model.named_parameters())[n].detach()
        assert torch.equal(ema.state_dict()[n], torch.lerp(before, after, 0.5)), n
    assert ema.nbytes == 4 * (3 * 2 + 2 + 3 + 3) + 8


def test_params_selecting_no_parameter_is_an_error():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match=r"params=.*selects none of the 4 parameters"):
        ShardedEMA(model, params=lambda name, p: False)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match=r"params='trainable' selects none"):
        ShardedEMA(model, params="trainable")
    with pytest.raises(ValueError, match=r"params must be 'all', 'trainable' or a callable"):
        ShardedEMA(model, params="adapters")


def test_trainable_set_changed_after_construction_is_an_error_naming_the_parameter(tmp_path):
    model = build_lora()
    ema = ShardedEMA(model, params="trainable")
    ema.update()
    base = "base_model.model.head.weight"
    dict(model.named_parameters())[base].requires_grad_(True)
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    with pytest.raises(RuntimeError, match=rf"update: parameter '{base}' is trainable now"):
        ema.update()
    with pytest.raises(RuntimeError, match=rf"save: parameter '{base}' is trainable now"):
        ema.save(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    for k, v in ema.state_dict().items():  # nothing was written
        assert torch.equal(v, before[k]), k
    dict(model.named_parameters())[base].requires_grad_(False)
    lora = "base_model.model.inp.lora_A.default.weight"
    dict(model.named_parameters())[lora].requires_grad_(False)
    with pytest.raises(RuntimeError, match=rf"parameter '{lora}' is frozen now"):
        ema.update()


# --- copy_to and load_model_weights ---------------------------------------------------------------

def run_copy_to_and_load_model_weights(rank, world, kind, directory):
    from test_sharded_ema import batches as net_batches
    from test_sharded_ema import build, full_state
    from test_sharded_ema import train_step as net_step

    import fsdp_ema

    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = ShardedEMA(model, decay=DECAY)
    for x, y in net_batches(torch.float32, 3):
        net_step(model, opt, x, y)
        ema.update()
    model(torch.randn(4, 6))  # FSDP2/FSDP1 keep the root unsharded after this: copy_to reshards
    raw = full_state(model, kind)
    ema.save_shard_weights(directory)
    expected = ema.full_state_dict(rank0_only=False)
    ema.copy_to()
    copied = full_state(model, kind)
    with ema.swap():
        pass  # swap after copy_to writes back what copy_to wrote
    after_swap = full_state(model, kind)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    model.eval()
    with torch.no_grad():
        out_copied = model(x)
    model.train()
    fsdp_ema.load_model_weights(model, directory)
    reloaded = full_state(model, kind)
    return dict(raw=raw, expected=expected, copied=copied, after_swap=after_swap,
                reloaded=reloaded, out_copied=out_copied)


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1_flat", "fsdp1_orig", "ddp"])
def test_copy_to_writes_the_ema_bit_exact_and_load_model_weights_restores(pools, tmp_path, kind):
    from test_sharded_ema import build

    import fsdp_ema

    directory = str(tmp_path / "model")
    results = pools.get(2).run(run_copy_to_and_load_model_weights, kind, directory)
    for res in results:
        assert sorted(res["copied"]) == sorted(res["expected"])
        for name, e in res["expected"].items():
            assert torch.equal(res["copied"][name], e), name
            assert torch.equal(res["after_swap"][name], e), name
            assert torch.equal(res["reloaded"][name], res["raw"][name]), name
    # The same checkpoint into a plain model in one process (another world size).
    plain = build("plain", seed=5)
    fsdp_ema.load_model_weights(plain, directory)
    for name, t in {**dict(plain.named_parameters()), **dict(plain.named_buffers())}.items():
        assert torch.equal(t.detach(), results[0]["raw"][name]), name
    # The EMA weights are in the model: its outputs are the EMA model's outputs.
    ema_model = build("plain", seed=5)
    ema_model.load_state_dict(results[0]["expected"])
    ema_model.eval()
    with torch.no_grad():
        ref = ema_model(torch.randn(8, 6, generator=torch.Generator().manual_seed(3)))
    torch.testing.assert_close(results[0]["out_copied"], ref, rtol=1e-5, atol=1e-6)


def test_load_model_weights_refuses_mismatched_names_and_shapes_and_writes_nothing(tmp_path):
    import fsdp_ema

    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    ShardedEMA(src).save_shard_weights(tmp_path / "w")
    other = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 5))
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(ValueError, match=r"'1.weight' is \[2, 3\] there but \[5, 3\] here"):
        fsdp_ema.load_model_weights(other, tmp_path / "w")
    for n, p in other.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    bigger = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"missing 2 name\(s\)"):
        fsdp_ema.load_model_weights(bigger, tmp_path / "w")
    fsdp_ema.load_model_weights(bigger, tmp_path / "w", strict=False)
    assert torch.equal(bigger[1].weight.detach(), src[1].weight.detach())
    with pytest.raises(ValueError, match=r"has no tensor laid out as"):
        ShardedEMA(src).copy_to(nn.Sequential(nn.Linear(4, 3)))


# --- PEFT exports ---------------------------------------------------------------------------------

def run_lora_exports(rank, world, adapter_dir, merged_dir):
    import fsdp_ema

    _, ema, _ = train_lora_with_ema("fsdp2")
    fsdp_ema.export_peft_adapter(ema, adapter_dir)
    nbytes = fsdp_ema.export_merged(ema, merged_dir, max_file_bytes=200)  # several files
    return dict(full=ema.full_state_dict(rank0_only=False), nbytes=nbytes)


def base_model():
    torch.manual_seed(0)  # the base weights build_lora starts from (LoRA init comes after)
    return UnevenMLP()


def test_peft_adapter_and_merged_exports_load_with_peft_and_match_merge_and_unload(pools,
                                                                                 tmp_path):
    import json

    from safetensors.torch import load_file

    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    results = pools.get(2).run(run_lora_exports, str(adapter_dir), str(merged_dir))
    ema_full = results[0]["full"]
    assert results[0]["nbytes"] == results[1]["nbytes"]

    # The adapter directory loads with peft; its LoRA weights are the EMA's, bit for bit.
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 3
    loaded = peft.PeftModel.from_pretrained(base_model(), str(adapter_dir))
    lora = {n: p for n, p in loaded.named_parameters() if ".lora_" in n}
    assert sorted(lora) == sorted(ema_full)
    for name, p in lora.items():
        assert torch.equal(p.detach(), ema_full[name]), name

    # peft's own merge of the EMA adapters is the reference for the merged export.
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        adapted_out = loaded(x)
    reference = loaded.merge_and_unload()
    files = sorted(p.name for p in merged_dir.glob("model-*.safetensors"))
    assert len(files) > 1 and (merged_dir / "model.safetensors.index.json").is_file()
    merged = {}
    for f in files:
        merged.update(load_file(merged_dir / f))
    plain = UnevenMLP()
    plain.load_state_dict(merged, strict=True)
    for name, t in reference.state_dict().items():
        assert torch.equal(merged[name], t), name
    with torch.no_grad():
        torch.testing.assert_close(plain(x), adapted_out, rtol=1e-5, atol=1e-6)
        assert torch.equal(plain(x), reference(x))
    assert results[0]["nbytes"] == sum(t.numel() * t.element_size() for t in merged.values())


def test_merged_export_in_bf16_base_matches_peft_merge(tmp_path):
    from safetensors.torch import load_file

    import fsdp_ema

    torch.manual_seed(0)
    model = peft.get_peft_model(UnevenMLP().to(torch.bfloat16), lora_config())
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = torch.randn_like(p, dtype=torch.float32)  # B != 0, fp32 adapters
    ema = ShardedEMA(model, params="trainable")
    fsdp_ema.export_merged(ema, tmp_path / "m")
    merged = load_file(tmp_path / "m" / "model.safetensors")
    reference = model.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(reference)
    for name, t in reference.items():
        assert merged[name].dtype == torch.bfloat16 and torch.equal(merged[name], t), name


def test_peft_exports_refuse_an_ema_without_the_adapters(tmp_path):
    import fsdp_ema

    model = build_lora()
    ema = ShardedEMA(model, params=lambda name, p: "head" in name)
    with pytest.raises(ValueError, match=r"does not keep 'base_model.model.inp.lora_A"):
        fsdp_ema.export_peft_adapter(ema, tmp_path / "a")
    with pytest.raises(ValueError, match=r"holds no peft PeftModel"):
        fsdp_ema.export_merged(ShardedEMA(UnevenMLP()), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
