"""Loads return memory the caller owns (read and verified in one pass): a checkpoint file that is
truncated or rewritten afterwards (another node rotating checkpoints, ``rsync --inplace``) can
neither crash the process nor change values. Zero-copy is an explicit ``mmap=True`` opt-in with
the risk ``torch.load(mmap=True)`` documents. Plus the format edges an attack found, through the
ops: a DCP directory missing a rank's file, zero-element shapes whose strides overflow."""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from load_state import mixed_state

from fsdp_ema import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]


def reference():
    return mixed_state(3, 300)


def shard_path(directory):
    return os.path.join(directory, ckpt.shard_file_name(0, 1))


def test_owned_loads_survive_truncation_and_in_place_rewrite(tmp_path):
    ref = reference()
    ckpt.save(tmp_path, ref)
    whole = ckpt.load(tmp_path)
    rows = ckpt.load(tmp_path, ["w"], rank=1, world_size=3)
    shard = ckpt.load_shard(shard_path(tmp_path))
    # Rewritten in place with other bytes, then truncated to nothing.
    with open(shard_path(tmp_path), "r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * 40000)
    os.truncate(shard_path(tmp_path), 0)
    for name, t in ref.items():  # touches every element
        assert torch.equal(whole[name], t), name
        assert torch.equal(shard[name][0], t), name
    assert torch.equal(rows["w"], torch.chunk(ref["w"], 3)[1])
    # A new load is refused with the file named, never a crash.
    with pytest.raises(RuntimeError, match=r"shard-00000-of-00001\.safetensors"):
        ckpt.load(tmp_path)


def test_owned_load_detects_corruption_in_the_same_pass(tmp_path):
    ckpt.save(tmp_path, reference())
    raw = bytearray(Path(shard_path(tmp_path)).read_bytes())
    raw[-300] ^= 0x10  # inside the last tensor's data
    Path(shard_path(tmp_path)).write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        ckpt.load_shard(shard_path(tmp_path))
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        ckpt.load(tmp_path)


def mapping_of(ptr: int) -> str:
    """The file behind the memory mapping that holds address `ptr` ("" for anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def test_mmap_is_an_explicit_zero_copy_opt_in(tmp_path):
    ref = reference()
    ckpt.save(tmp_path, ref)
    file = os.path.realpath(shard_path(tmp_path))
    mapped = ckpt.load(tmp_path, ["w"], mmap=True)["w"]
    owned = ckpt.load(tmp_path, ["w"])["w"]
    assert torch.equal(mapped, ref["w"]) and torch.equal(owned, ref["w"])
    # The opt-in views the file's pages; the default is memory of the process's own.
    assert mapping_of(mapped.data_ptr()) == file
    assert mapping_of(owned.data_ptr()) != file
    shard = ckpt.load_shard(shard_path(tmp_path), mmap=True)["w"][0]
    assert mapping_of(shard.data_ptr()) == file
    assert mapping_of(ckpt.load_shard(shard_path(tmp_path))["w"][0].data_ptr()) != file
    # Writes to a zero-copy tensor stay in this process (private mapping), never in the file.
    shard.add_(1)
    assert torch.equal(ckpt.load(tmp_path, ["w"])["w"], ref["w"])


def test_mmap_opt_in_carries_the_documented_sigbus_risk(tmp_path):
    # The opt-in really maps the file: truncating it and then touching the tensor kills the
    # process with SIGBUS, exactly the risk the docs state (run in a child process).
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT / "python")!r})
        import torch
        from fsdp_ema import checkpoint as ckpt
        d = {str(tmp_path)!r}
        ckpt.save(d, {{"w": torch.arange(1 << 20, dtype=torch.float32)}})
        owned = ckpt.load(d)["w"]
        mapped = ckpt.load(d, mmap=True)["w"]
        os.truncate(os.path.join(d, ckpt.shard_file_name(0, 1)), 0)
        assert float(owned.sum()) == float(torch.arange(1 << 20, dtype=torch.float64).sum())
        print("owned ok", flush=True)
        print(float(mapped.sum()), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
    assert "owned ok" in proc.stdout, proc.stderr
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr)


def raw_safetensors(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


def test_zero_element_shape_whose_strides_overflow_is_a_clear_error(tmp_path):
    path = tmp_path / "z.safetensors"
    path.write_bytes(raw_safetensors(
        {"z": {"dtype": "F32", "shape": [0, 2**62, 4], "data_offsets": [0, 0]}}, b""))
    with pytest.raises(RuntimeError, match=r'z\.safetensors: tensor "z".*overflows'):
        ckpt.load_shard(path)


def test_bool_bytes_other_than_zero_or_one_are_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(raw_safetensors(
        {"m": {"dtype": "BOOL", "shape": [4], "data_offsets": [0, 4]}}, b"\x00\x01\x07\x01"))
    with pytest.raises(RuntimeError, match=r'tensor "m": BOOL byte 7'):
        ckpt.load_shard(path)


def test_dcp_directory_missing_a_rank_file_is_refused(tmp_path):
    src = ROOT / "tests" / "format" / "data" / "dcp_hf_sharded"
    dst = tmp_path / "dcp"
    shutil.copytree(src, dst)
    assert ckpt.info(dst)["layout"] == "dcp-huggingface"
    (dst / "shard-00002-model-00001-of-00001.safetensors").unlink()
    with pytest.raises(RuntimeError, match=r"files of shard 2 \(rank 1\) are missing"):
        ckpt.load(dst)
    with pytest.raises(RuntimeError, match=r"files of shard 2 \(rank 1\) are missing"):
        ckpt.info(dst)


def data_range(path, name):
    """[begin, end) of tensor `name`'s bytes in a safetensors file."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def multi_chunk_state():
    """A tensor over several 8 MiB read chunks (with an odd tail) and two small ones."""
    g = torch.Generator().manual_seed(5)
    return {"big": torch.randn(5_000_003, generator=g), "b": torch.ones(3, dtype=torch.bfloat16),
            "m": torch.tensor([True, False])}


def test_a_tensor_over_several_read_chunks_loads_whole_on_every_path(tmp_path):
    state = multi_chunk_state()
    ckpt.save(tmp_path, state)
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        try:
            for got in (ckpt.load(tmp_path), ckpt.open_checkpoint(tmp_path).load(list(state)),
                        {k: v[0] for k, v in ckpt.load_shard(shard_path(tmp_path)).items()}):
                assert all(torch.equal(got[k], v) for k, v in state.items())
            half = ckpt.load(tmp_path, ["big"], rank=1, world_size=2)["big"]
            assert torch.equal(half, state["big"].chunk(2)[1])
        finally:
            torch.set_num_threads(2)


def test_a_flipped_byte_in_the_last_read_chunk_is_refused_naming_the_file(tmp_path):
    ckpt.save(tmp_path, multi_chunk_state())
    path = shard_path(tmp_path)
    _, end = data_range(path, "big")
    raw = bytearray(Path(path).read_bytes())
    raw[end - 2] ^= 0x04  # the last chunk of "big"
    Path(path).write_bytes(bytes(raw))
    for load in (lambda: ckpt.load(tmp_path), lambda: ckpt.load_shard(path),
                 lambda: ckpt.load(tmp_path, ["big"], rank=1, world_size=2)):
        with pytest.raises(RuntimeError, match="checksum mismatch") as e:
            load()
        assert path in str(e.value) and '"big"' in str(e.value)
    # The first half never touches the damaged block: it reads (and verifies) its own blocks only.
    state = multi_chunk_state()
    half = ckpt.load(tmp_path, ["big"], rank=0, world_size=2)["big"]
    assert torch.equal(half, state["big"].chunk(2)[0])
