"""Disk full part-way through a save (an LD_PRELOAD shim fails writes with ENOSPC past a byte
budget): a clear error, no temporary file left, no index, and the previous checkpoint intact."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_ema import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "build" / "lib" / "libfsdp_ema_faultfs.so"

CHILD = r"""
import json, os, sys, torch
sys.path.insert(0, sys.argv[1])
from fsdp_ema import checkpoint as ckpt
g = torch.Generator().manual_seed(1)
tensors = {f"t{i}": torch.randn(1000 + 97 * i, generator=g) for i in range(24)}  # ~200 KB
os.environ["FSDP_EMA_FAULT_ENOSPC_AFTER"] = sys.argv[3]  # armed only now
try:
    ckpt.save(sys.argv[2], tensors)
    print(json.dumps({"ok": True}))
except RuntimeError as e:
    print(json.dumps({"ok": False, "error": str(e)}))
"""


def _previous(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"p{i}": torch.randn(500, generator=g) for i in range(8)}
    ckpt.save(tmp_path / "previous", tensors)
    return tensors


@pytest.mark.parametrize("budget", [0, 100, 4096, 60_000, 150_000])
def test_disk_full_during_save_is_a_clear_error_and_loses_nothing(tmp_path, budget):
    assert SHIM.exists(), "build the tests first (scripts/build.sh builds the shim)"
    previous = _previous(tmp_path)
    target = tmp_path / "new"
    env = dict(os.environ, LD_PRELOAD=str(SHIM))
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "python"), str(target),
                          str(budget)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["ok"], "the save should have run out of space"
    assert "No space left on device" in result["error"], result["error"]
    assert "fsdp_ema::" in result["error"]
    # Nothing half-written is left behind: no temporary, no index.
    leftovers = sorted(p.name for p in target.iterdir()) if target.exists() else []
    assert not [n for n in leftovers if n.startswith(".")], leftovers
    assert "fsdp_ema.index.json" not in leftovers
    if leftovers:  # a complete shard file may exist, but the directory is not a checkpoint
        with pytest.raises(RuntimeError, match="incomplete checkpoint"):
            ckpt.load(target)
    # The previous checkpoint is intact.
    loaded = ckpt.load(tmp_path / "previous")
    assert all(torch.equal(loaded[k], v) for k, v in previous.items())


def test_the_same_save_succeeds_with_space(tmp_path):
    env = dict(os.environ, LD_PRELOAD=str(SHIM))
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "python"),
                          str(tmp_path / "new"), "100000000"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"ok": True}, out.stderr
    assert len(ckpt.load(tmp_path / "new")) == 24
