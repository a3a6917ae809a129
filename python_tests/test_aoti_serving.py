"""Serving an EMA checkpoint from C++ through an AOTInductor package (examples/serve.cpp, built by
the ctest examples_build): the constant-update path replaces every weight, and a package whose
weights were folded at compile time is refused with the fix named."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

import fsdp_ema

ROOT = Path(__file__).resolve().parents[1]
SERVE = Path(os.environ.get("FSDP_EMA_BUILD", ROOT / "build")) / "examples" / "build" / "serve"

pytestmark = pytest.mark.skipif(not SERVE.exists(),
                                reason="needs examples/serve built (ctest -R examples_build)")


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 5)
        self.register_buffer("temperature", torch.ones(5))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) / self.temperature


def compile_package(path: Path, example: torch.Tensor, runtime_folding: bool) -> None:
    model = Classifier().eval()
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(float("nan"))  # nothing the server may keep: every weight comes from the EMA
    configs = {"aot_inductor.use_runtime_constant_folding": True} if runtime_folding else {}
    torch._inductor.aoti_compile_and_package(torch.export.export(model, (example,)),
                                             package_path=str(path), inductor_configs=configs)


def write_inputs(tmp_path: Path):
    gen = torch.Generator().manual_seed(0)
    ema = Classifier()
    with torch.no_grad():
        for t in ema.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=gen))
    x = torch.randn(16, 6, generator=gen)
    y = torch.randint(0, 5, (16,), generator=gen)
    # The EMA as two ranks wrote it (dim-0 rows each), the validation batch as one checkpoint.
    state = ema.state_dict()
    for rank in range(2):
        shards = {}
        for name, t in state.items():
            rows = t.chunk(2)[rank]
            start = t.chunk(2)[0].shape[0] * rank
            shards[name] = (rows, [start] + [0] * (t.dim() - 1), list(t.shape))
        fsdp_ema.checkpoint.save_shard(tmp_path / "ema", shards, rank=rank, world_size=2)
    fsdp_ema.checkpoint.commit(tmp_path / "ema", world_size=2)
    fsdp_ema.checkpoint.save(tmp_path / "val", {"inputs": x, "targets": y})
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(ema.eval()(x), y).item()
    return x, expected


def serve(tmp_path: Path, package: Path):
    return subprocess.run([str(SERVE), str(package), str(tmp_path / "ema"), str(tmp_path / "val")],
                          capture_output=True, text=True, timeout=300, check=False)


def test_aoti_package_serves_the_ema_weights_and_refuses_a_folded_package(tmp_path):
    (tmp_path / "ema").mkdir()
    x, expected = write_inputs(tmp_path)

    compile_package(tmp_path / "model.pt2", x, runtime_folding=True)
    run = serve(tmp_path, tmp_path / "model.pt2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "(AOTInductor package)" in run.stdout
    loss = float(re.search(r"^loss=(\S+)$", run.stdout, re.MULTILINE).group(1))
    assert abs(loss - expected) <= 1e-5 * max(1.0, abs(expected)), (loss, expected)

    # Compile-time folding keeps only fc weights that were not folded: strict loading refuses.
    compile_package(tmp_path / "folded.pt2", x, runtime_folding=False)
    run = serve(tmp_path, tmp_path / "folded.pt2")
    assert run.returncode == 1
    assert "into the AOTInductor package: it has no constant for" in run.stderr, run.stderr
    assert "aot_inductor.use_runtime_constant_folding" in run.stderr
