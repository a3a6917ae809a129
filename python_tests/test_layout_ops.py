"""The directory-layout ops and the ExportWriter class: the Python front's only way to touch a
checkpoint directory (rules in format/include/fsdp_ema/format/layout.h), and a check that
python/fsdp_ema does no file-system work of its own on checkpoint directories."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

import fsdp_ema
from fsdp_ema import checkpoint as ckpt

ops = torch.ops.fsdp_ema
PACKAGE = Path(fsdp_ema.__file__).resolve().parent


def test_names_come_from_format():
    assert ops.index_file_name() == "fsdp_ema.index.json"
    assert ckpt.shard_file_name(3, 8) == "shard-00003-of-00008.safetensors"
    assert ckpt.shard_file_name(7, 123456) == "shard-00007-of-123456.safetensors"
    with pytest.raises(RuntimeError,
                       match=r"rank must be in \[0, world_size\), got rank 2 with world_size 2"):
        ops.shard_file_name(2, 2)


def test_gather_alignment_comes_from_the_gather_op():
    """The alignment of gather_shards' packed pieces (ops/gather/gather_shards.cpp), which the
    Python front's bucket sizes follow: 16 bytes, the width of its vector copies."""
    assert ops.gather_alignment() == 16


def test_overlapping_reports_tied_tensors_exactly():
    """The memory rule of the in-place ops (ops/common/memory.h), as a query: the collective load
    sends tied destinations (one tensor under two names) to a copy instead of load_into_."""
    base = torch.zeros(64)
    other = torch.zeros(8)
    tied = [base, base.view(8, 8), other, base[0::2], base[1::2]]
    assert ops.overlapping(tied, []) == [0, 1, 3, 4]
    assert ops.overlapping([base[0::2], base[1::2], other], []) == []  # interleaved, disjoint
    assert ops.overlapping([base[:32], base[31:40], base[40:]], []) == [0, 1]
    assert ops.overlapping([torch.zeros(0), base, torch.zeros(0)], []) == []
    assert ops.overlapping([], []) == []
    # Linear-ish at scale: 100,000 distinct tensors and one tied pair among them.
    many = [torch.zeros(1) for _ in range(100_000)]
    many.append(many[12_345])
    assert ops.overlapping(many, []) == [12_345, 100_000]


def test_overlapping_refuses_a_destination_no_load_can_write():
    """#41: each tensor is first checked as memory a load writes, named: a tensor whose own
    elements share memory (expanded, or as_strided that torch calls "too hard"), a sparse one."""
    for bad in (torch.zeros(107).as_strided((100, 8), (1, 1)), torch.zeros(1).expand(4)):
        with pytest.raises(RuntimeError, match=r"tensors\[1\] \('w'\) has internally overlapping"):
            ops.overlapping([torch.zeros(3), bad], ["b", "w"])
    with pytest.raises(RuntimeError, match=r"tensors\[0\] is a Sparse tensor"):
        ops.overlapping([torch.zeros(2, 2).to_sparse()], [])
    with pytest.raises(RuntimeError, match="names has 1 entries but tensors has 2"):
        ops.overlapping([torch.zeros(1), torch.zeros(1)], ["a"])
    # Views torch cannot decide but that are disjoint: a transposed slice, columns of a grid.
    grid = torch.zeros(6, 10)
    assert ops.overlapping([grid.t()[::2], grid[:, 1::3], grid.as_strided((3, 2), (2, 3))],
                           []) == [0, 1, 2]


def test_prepare_creates_and_reports_committed(tmp_path):
    d = tmp_path / "a" / "b"
    assert ops.prepare_checkpoint(str(d)) is False and d.is_dir()
    ckpt.save(d, {"w": torch.ones(2)})
    assert ops.prepare_checkpoint(str(d)) is True
    (tmp_path / "f").write_text("x")
    with pytest.raises(RuntimeError, match="fsdp_ema::prepare_checkpoint: .*f: not a directory"):
        ops.prepare_checkpoint(str(tmp_path / "f"))


def test_sidecar_is_atomic_and_refuses_layout_names(tmp_path):
    ops.write_sidecar(str(tmp_path), "notes.json", '{"a": 1}', False)
    assert json.loads((tmp_path / "notes.json").read_text()) == {"a": 1}
    assert sorted(os.listdir(tmp_path)) == ["notes.json"]  # no temporary left
    for bad in ("fsdp_ema.index.json", "shard-00000-of-00001.safetensors", "../x", ".h"):
        with pytest.raises(RuntimeError, match="sidecar name"):
            ops.write_sidecar(str(tmp_path), bad, "x", False)


def test_committed_checkpoints_and_remove_checkpoint(tmp_path):
    for n in ("b", "a"):
        ckpt.save(tmp_path / n, {"w": torch.ones(2)})
    ckpt.save_shard(tmp_path / "partial", {"w": torch.ones(2)})
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert ops.committed_checkpoints(str(tmp_path)) == ["a", "b", "link"]
    assert ops.committed_checkpoints(str(tmp_path), False) == ["a", "b"]
    with pytest.raises(RuntimeError, match="cannot open the checkpoint directory"):
        ops.remove_checkpoint(str(tmp_path / "link"))
    ops.remove_checkpoint(str(tmp_path / "b"))
    assert sorted(os.listdir(tmp_path)) == ["a", "link", "partial"]
    assert torch.equal(ckpt.load(tmp_path / "a")["w"], torch.ones(2))


def test_export_writer_validates_before_writing(tmp_path):
    like = [torch.empty(2, 3, device="meta")]
    with pytest.raises(RuntimeError, match="names has 2 entries but like has 1"):
        torch.classes.fsdp_ema.ExportWriter(str(tmp_path), ["a", "b"], like, None, 0, False, True)
    with pytest.raises(RuntimeError, match="'u' has dtype UInt16, which safetensors cannot"):
        torch.classes.fsdp_ema.ExportWriter(str(tmp_path), ["u"],
                                            [torch.empty(2, dtype=torch.uint16, device="meta")],
                                            None, 0, False, True)
    assert os.listdir(tmp_path) == []
    w = torch.classes.fsdp_ema.ExportWriter(str(tmp_path / "o"), ["a"], like, None, 0, False,
                                            True)
    with pytest.raises(RuntimeError, match="'a' comes as Double but was planned as Float"):
        w.write("a", torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="'z' is not a tensor the export was planned with"):
        w.write("z", torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="has 0 of its 6 elements written"):
        w.finish()
    w.abort()
    # The staging directory went with the abort, and so did the output directory it created.
    assert not (tmp_path / "o").exists()


def test_sharded_ema_export_refuses_dtypes_the_format_cannot_store(tmp_path):
    model = torch.nn.Linear(2, 2)
    model.register_buffer("u", torch.zeros(3, dtype=torch.uint16))
    ema = fsdp_ema.ShardedEMA(model, 0.5)
    with pytest.raises(RuntimeError, match="'u' has dtype UInt16, which safetensors cannot"):
        ema.export(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything was created


# Calls that create, list, rename or remove files, or open them for writing.
_FILE_WORK = re.compile(r"\bos\.(remove|unlink|rename|replace|rmdir|removedirs|makedirs|mkdir|"
                        r"listdir|scandir|walk|open|fsync)\b|\bshutil\.|\bglob\.|^import glob|"
                        r"\.iterdir\(|\.unlink\(|\.rename\(|\.mkdir\(|\bopen\(")


def test_python_does_no_file_system_work_on_checkpoint_directories():
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "_library.py":  # finds libfsdp_ema.so, not a checkpoint
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _FILE_WORK.search(line.split("#")[0]):
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert offenders == []
