"""The demo end to end, shortened: scripts/demo.sh trains a tiny transformer for a few steps with
FSDP2 on 2 gloo ranks (torchrun), the C++ server (examples/serve.cpp, built against the installed
package) loads the EMA shards into the TorchScript model and into the AOTInductor package
(--serve both), and both validation losses must equal Python's. Then `fsdp-ema export`
turns the same EMA checkpoint into a model.safetensors that loads into the model with
safetensors + load_state_dict(strict=True)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("FSDP_EMA_BUILD", ROOT / "build"))
CLI = BUILD / "bin" / "fsdp-ema"
TORCHRUN = Path(sys.executable).parent / "torchrun"
# Small enough for ~30 s of training on 2 CPU cores (most of it compiling the step).
TINY = dict(steps=6, save_every=3, dim=32, layers=1, heads=2, seq=16, vocab=16, val_size=64)
# C++ and Python evaluate the same float32 graph on the same weights; observed equal to ~1e-9.
TOLERANCE = 1e-5


def _train_module():
    spec = importlib.util.spec_from_file_location("demo_train", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not CLI.exists() or not TORCHRUN.exists(),
                    reason="needs the built tree (build/bin/fsdp-ema) and torchrun in the venv")
def test_demo_cpp_loss_equals_python_ema_loss_and_cli_export_loads_strict(tmp_path):
    out = tmp_path / "demo"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()] + ["--serve=both"]
    env = dict(os.environ, FSDP_EMA_DEMO_OUT=str(out))
    run = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), *args], env=env,
                         capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    for kind in ("TorchScript", "AOTInductor"):
        assert f"C++ ({kind}) == Python" in run.stdout, log[-3000:]
    assert "MISMATCH" not in run.stdout, log[-3000:]

    # The same comparisons, from the files the demo wrote.
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == 2 and result["fsdp"] == 2
    assert result["compiled_graphs"] == 1, "the optimizer + EMA step recompiled"
    for served in ("serve.txt", "serve_aoti.txt"):
        text = (out / served).read_text()
        cpp = float(re.search(r"^loss=(\S+)$", text, re.M).group(1))
        assert abs(cpp - result["val_loss_ema"]) <= TOLERANCE * max(1.0,
                                                                   abs(result["val_loss_ema"]))
    assert "(AOTInductor package)" in (out / "serve_aoti.txt").read_text()
    assert abs(result["val_loss_raw"] - result["val_loss_ema"]) > 0, "EMA equals raw weights?"
    # Every save is a committed step directory: model/, optim/, ema/ with their indexes.
    steps = sorted(p.name for p in (out / "ckpt").iterdir())
    assert steps == ["step-000003", "step-000006"]
    for step in steps:
        for part in ("model", "optim", "ema"):
            assert (out / "ckpt" / step / part / "fsdp_ema.index.json").is_file()
    ckpt = Path(result["checkpoint"])
    assert ckpt == out / "ckpt" / "step-000006" / "ema"
    assert len(list(ckpt.glob("shard-*-of-*.safetensors"))) == 2

    # fsdp-ema export -> model.safetensors -> the model, strict.
    hf = tmp_path / "hf"
    subprocess.run([str(CLI), "export", "-q", str(ckpt), str(hf)], check=True, timeout=120)
    from safetensors.torch import load_file

    state = load_file(str(hf / "model.safetensors"))
    train = _train_module()
    model = train.Transformer(TINY["vocab"], TINY["dim"], TINY["layers"], TINY["heads"],
                              TINY["seq"])
    model.load_state_dict(state, strict=True)
    # The weights are the EMA's: the Python EMA loss again, from the exported file.
    sys.path.insert(0, str(ROOT / "python"))
    import fsdp_ema

    val = fsdp_ema.checkpoint.load(out / "val")
    with torch.no_grad():
        loss = train.loss_fn(model.eval()(val["inputs"]), val["targets"]).item()
    assert abs(loss - result["val_loss_ema"]) <= TOLERANCE * max(1.0, abs(loss))
