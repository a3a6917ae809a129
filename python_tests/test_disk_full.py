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


def _child_tensors():
    g = torch.Generator().manual_seed(1)  # the tensors CHILD saves
    return {f"t{i}": torch.randn(1000 + 97 * i, generator=g) for i in range(24)}


def _run_child(target, budget):
    env = dict(os.environ, LD_PRELOAD=str(SHIM))
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "python"), str(target),
                          str(budget)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _previous(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"p{i}": torch.randn(500, generator=g) for i in range(8)}
    ckpt.save(tmp_path / "previous", tensors)
    return tensors


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    """Bytes of tensor data and of the whole shard file of the save CHILD runs."""
    d = tmp_path_factory.mktemp("sizes") / "ck"
    assert _run_child(d, 100_000_000) == {"ok": True}
    data = sum(t.numel() * t.element_size() for t in _child_tensors().values())
    return {"data": data, "file": os.path.getsize(d / ckpt.shard_file_name(0, 1))}


# Fixed budgets fail during the data; "header" lets the data through and fails the header
# written last into the shard file; "index" lets the shard file through and fails the commit.
@pytest.mark.parametrize("budget", [0, 100, 4096, 60_000, 150_000, "header", "index"])
def test_disk_full_during_save_is_a_clear_error_and_loses_nothing(tmp_path, budget, sizes):
    assert SHIM.exists(), "build the tests first (scripts/build.sh builds the shim)"
    if budget == "header":
        budget = sizes["data"] + 16
    elif budget == "index":
        budget = sizes["file"] + 16
    previous = _previous(tmp_path)
    target = tmp_path / "new"
    result = _run_child(target, budget)
    assert not result["ok"], "the save should have run out of space"
    assert "No space left on device" in result["error"], result["error"]
    assert "fsdp_ema::" in result["error"]
    # Nothing half-written is left behind: no temporary, no index.
    leftovers = sorted(p.name for p in target.iterdir()) if target.exists() else []
    assert not [n for n in leftovers if n.startswith(".")], leftovers
    assert "fsdp_ema.index.json" not in leftovers
    # A file under its final name is complete: it opens with checksums verified and holds
    # exactly the tensors saved (a name alone would not show a file renamed before it was
    # written in full).
    expected = _child_tensors()
    for name in leftovers:
        got = ckpt.load_shard(target / name, verify=True)
        assert sorted(got) == sorted(expected), name
        for key, (t, _, _) in got.items():
            assert torch.equal(t, expected[key]), (name, key)
    if budget == sizes["file"] + 16:
        assert leftovers == [ckpt.shard_file_name(0, 1)]  # only the commit failed
    if leftovers:  # a complete shard file may exist, but the directory is not a checkpoint
        with pytest.raises(RuntimeError, match="incomplete checkpoint"):
            ckpt.load(target)
    # The previous checkpoint is intact.
    loaded = ckpt.load(tmp_path / "previous")
    assert all(torch.equal(loaded[k], v) for k, v in previous.items())


def test_the_same_save_succeeds_with_space(tmp_path):
    assert _run_child(tmp_path / "new", 100_000_000) == {"ok": True}
    loaded = ckpt.load(tmp_path / "new")
    assert len(loaded) == 24
    assert all(torch.equal(loaded[k], v) for k, v in _child_tensors().items())
