"""`fsdp-ema verify --strict` passes on every kind of checkpoint our code writes (#34 finding 6):
``ShardedEMA.save`` and ``save_shard_weights`` of FSDP2 and of a replicated (DDP-like) model at 2
ranks, training states (rank 1 of the replicated one has no tensor to write: its file goes at
the commit), power-EMA snapshots, a post-hoc EMA and an export; a single-process
``checkpoint.save``; the PEFT exports (the EMA adapter and the merged weights of an FSDP2 LoRA
model) and the Hugging Face callback's ``save_ema_model`` folder (export, ``config.json``,
``generation_config.json``). ``--strict`` fails on any file the index does not list; the trainer
callbacks' own checkpoints (``checkpoint-N/ema``, an Accelerate ``save_state``'s ``ema/``) are
verified in test_integration_transformers.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from dist_utils import PoolManager
from models import UnevenMLP

import fsdp_ema

CLI = Path(__file__).resolve().parents[1] / "build" / "bin" / "fsdp-ema"


@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


def run_saves(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    sharded = UnevenMLP()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (sharded.inp, sharded.hidden, sharded.head, sharded):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    sharded(torch.randn(4, 6)).sum().backward()
    opt.step()
    ema = fsdp_ema.ShardedEMA(sharded, 0.9)
    ema.update()
    ema.save(os.path.join(root, "fsdp2_ema"))
    ema.save_shard_weights(os.path.join(root, "fsdp2_weights"))
    fsdp_ema.save_training_state(os.path.join(root, "training_state"), model=sharded,
                                 optimizer=opt, ema=ema, extra={"step": 1})
    torch.manual_seed(0)
    replicated = fsdp_ema.ShardedEMA(UnevenMLP(), 0.9)
    replicated.save(os.path.join(root, "replicated_ema"))
    fsdp_ema.save_training_state(os.path.join(root, "replicated_state"), ema=replicated,
                                 rng=False)
    power = fsdp_ema.ShardedPowerEMA(sharded, snapshot_root=os.path.join(root, "snapshots"))
    for _ in range(2):
        power.update()
        power.snapshot()
    ema.export(os.path.join(root, "export"))
    return sorted(os.listdir(os.path.join(root, "replicated_state")))


def verify_strict(directory) -> None:
    done = subprocess.run([str(CLI), "verify", "--strict", str(directory)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("OK:"), (directory, done.stdout,
                                                                    done.stderr)
    assert "warning" not in done.stdout.lower(), (directory, done.stdout)


def test_verify_strict_passes_on_every_checkpoint_we_write(pools, tmp_path):
    assert CLI.exists(), f"{CLI} is missing: scripts/build.sh builds it with the library"
    listing = pools.get(2).run(run_saves, str(tmp_path))[0]
    # A training state writes a replicated EMA from rank 0 alone (ShardedEMA.save shares its
    # rows between the ranks): rank 1 had no tensor to write, and its file went at the commit.
    assert listing == ["fsdp_ema.index.json", "shard-00000-of-00002.safetensors",
                       "training_state.json"], listing
    fsdp_ema.posthoc(tmp_path / "snapshots", sigma_rel=0.08, out=tmp_path / "posthoc")
    kinds = ["fsdp2_ema", "fsdp2_weights", "training_state", "replicated_ema",
             "replicated_state", "posthoc", "export",
             *(f"snapshots/{d}" for d in sorted(os.listdir(tmp_path / "snapshots")))]
    assert len(kinds) == 7 + 4  # two snapshots of two profiles
    for kind in kinds:
        verify_strict(tmp_path / kind)


def run_exports(rank, world, root):
    """The PEFT exports of an FSDP2 LoRA model's EMA, and the Hugging Face callback's
    ``save_ema_model`` (``ShardedEMACallback.save_model``, what ``on_train_end`` calls) of a tiny
    Llama, each rank holding it whole (DDP-like)."""
    import transformers
    from test_lora_ema import build_lora

    from fsdp_ema.integrations.transformers import ShardedEMACallback

    lora = build_lora("fsdp2")
    ema = fsdp_ema.ShardedEMA(lora, 0.9, params="trainable")
    ema.update()
    fsdp_ema.export_peft_adapter(ema, os.path.join(root, "peft_adapter"))
    fsdp_ema.export_merged(ema, os.path.join(root, "peft_merged"), max_file_bytes=200)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))
    cb = ShardedEMACallback(0.9)
    cb.attach(llama)
    cb.update()
    cb.save_model(os.path.join(root, "hf_save_ema_model"))


def test_verify_strict_passes_on_peft_exports_the_hf_ema_model_and_a_single_process_save(
        pools, tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    assert CLI.exists(), f"{CLI} is missing: scripts/build.sh builds it with the library"
    pools.get(2).run(run_exports, str(tmp_path))
    fsdp_ema.checkpoint.save(tmp_path / "single_process",
                             {"w": torch.randn(5, 3), "b": torch.arange(4.0)})
    listings = {kind: sorted(os.listdir(tmp_path / kind)) for kind in (
        "peft_adapter", "peft_merged", "hf_save_ema_model", "single_process")}
    # What each kind is: PEFT's adapter files; several files and their index (max_file_bytes);
    # the export with the model's configs; one shard and the index.
    assert listings["peft_adapter"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert len([f for f in listings["peft_merged"] if f.endswith(".safetensors")]) > 1
    assert "model.safetensors.index.json" in listings["peft_merged"], listings
    assert {"config.json", "generation_config.json"} <= set(listings["hf_save_ema_model"])
    assert listings["single_process"] == ["fsdp_ema.index.json",
                                          "shard-00000-of-00001.safetensors"], listings
    for kind in listings:
        verify_strict(tmp_path / kind)
