"""One verdict (#28): ``fsdp-ema verify``, a full load (``checkpoint.load``, owned and mapped) and
``fsdp-ema export`` say the same of every directory, on every layout we read: ours, DCP's
HuggingFace writer's, a plain Hugging Face file and a split Hugging Face export. Each layout gets
the same corpus of breakages; verify exits 0 exactly when the loads and the export succeed.

Before, ``verify`` said OK for a DCP or plain directory with a BOOL byte of 2, which load and
export refuse (DCP files carry no checksums, and verify only hashed pieces that had one).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fsdp_ema import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "build" / "bin" / "fsdp-ema"
DCP_FIXTURE = ROOT / "tests" / "format" / "data" / "dcp_hf_sharded"
pytestmark = pytest.mark.skipif(not CLI.exists(), reason="fsdp-ema tool not built")


def tensors() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12.0).reshape(3, 4), "mask": torch.tensor([True, False, True]),
            "ids": torch.arange(5, dtype=torch.int64)}


def make_layout(kind: str, d: Path) -> None:
    if kind == "fsdp_ema":
        for rank in range(2):  # two ranks' files: w's rows split between them
            rows = torch.chunk(tensors()["w"], 2)[rank]
            shards = {"w": (rows, [rank * 2, 0], [3, 4])}
            if rank == 0:
                shards.update({k: v for k, v in tensors().items() if k != "w"})
            ckpt.save_shard(d, shards, rank=rank, world_size=2, fsync=False)
        ckpt.commit(d, 2, fsync=False)
    elif kind == "dcp-huggingface":
        shutil.copytree(DCP_FIXTURE, d)
    elif kind == "hf-single":
        d.mkdir()
        save_file(tensors(), str(d / "model.safetensors"), metadata={"format": "pt"})
    elif kind == "hf-split":
        d.mkdir()
        t = tensors()
        files = {"model-00001-of-00002.safetensors": ["w"],
                 "model-00002-of-00002.safetensors": ["mask", "ids"]}
        for name, keys in files.items():
            save_file({k: t[k] for k in keys}, str(d / name), metadata={"format": "pt"})
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: f for f, ks in files.items() for k in ks}}))
    else:
        raise AssertionError(kind)


def shard_files(d: Path) -> list[Path]:
    return sorted(p for p in d.glob("*.safetensors"))


def header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def poke(path: Path, offset: int, value: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(value)] = value
    path.write_bytes(bytes(raw))


def first_tensor(d: Path, dtypes: tuple[str, ...]) -> tuple[Path, int, int]:
    """(file, absolute data offset, bytes) of the first tensor of one of `dtypes`."""
    for f in shard_files(d):
        n, h = header(f)
        for name, e in h.items():
            if name != "__metadata__" and e["dtype"] in dtypes and e["data_offsets"][1] > \
                    e["data_offsets"][0]:
                begin, end = e["data_offsets"]
                return f, 8 + n + begin, end - begin
    raise AssertionError(f"no {dtypes} tensor in {d}")


def bool_byte_2(d: Path):
    f, off, _ = first_tensor(d, ("BOOL",))
    poke(f, off, b"\x02")


def float_bit_flip(d: Path):
    f, off, _ = first_tensor(d, ("F32", "F64", "F16", "BF16"))
    raw = f.read_bytes()
    poke(f, off, bytes([raw[off] ^ 0x10]))


def truncate(d: Path):
    f = shard_files(d)[-1]
    f.write_bytes(f.read_bytes()[:-3])


def trailing_bytes(d: Path):
    f = shard_files(d)[0]
    f.write_bytes(f.read_bytes() + b"\0" * 8)


def huge_header_length(d: Path):
    poke(shard_files(d)[0], 0, struct.pack("<Q", 1 << 40))


def header_not_an_object(d: Path):
    f = shard_files(d)[0]
    raw = f.read_bytes()
    poke(f, 8, b"[")
    assert f.read_bytes() != raw


def unknown_dtype(d: Path):
    f, _, _ = first_tensor(d, ("BOOL",))
    raw = f.read_bytes()
    i = raw.index(b'"BOOL"')
    poke(f, i, b'"BOOX"')


def data_offsets_swapped(d: Path):
    f = shard_files(d)[0]
    n, h = header(f)
    names = [k for k in h if k != "__metadata__"]
    a, b = h[names[0]]["data_offsets"], h[names[-1]]["data_offsets"]
    h[names[0]]["data_offsets"], h[names[-1]]["data_offsets"] = b, a
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    if len(text) != n:
        pytest.skip("the rewritten header does not fit")
    poke(f, 8, text)


def a_file_removed(d: Path):
    shard_files(d)[-1].unlink()


def a_stray_copy(d: Path):
    files = shard_files(d)
    shutil.copy(files[0], d / "zz-stray.safetensors")


def index_removed(d: Path):
    for name in ("fsdp_ema.index.json", "model.safetensors.index.json"):
        if (d / name).exists():
            (d / name).unlink()


def empty(d: Path):
    for f in d.iterdir():
        f.unlink()


BREAKAGES = {f.__name__: f for f in [
    lambda d: None, bool_byte_2, float_bit_flip, truncate, trailing_bytes, huge_header_length,
    header_not_an_object, unknown_dtype, data_offsets_swapped, a_file_removed, a_stray_copy,
    index_removed, empty]}
BREAKAGES["intact"] = BREAKAGES.pop("<lambda>")
LAYOUTS = ["fsdp_ema", "dcp-huggingface", "hf-single", "hf-split"]


def verdicts(d: Path, out: Path) -> dict[str, bool]:
    verify = subprocess.run([str(CLI), "verify", str(d)], capture_output=True, text=True)
    export = subprocess.run([str(CLI), "export", str(d), str(out), "--quiet"],
                            capture_output=True, text=True)
    result = {"verify": verify.returncode == 0, "export": export.returncode == 0}
    for mmap in (False, True):
        try:
            loaded = ckpt.load(d, mmap=mmap)
            for t in loaded.values():  # a mapped load is done once its bytes are read
                t.clone()
            result[f"load(mmap={mmap})"] = True
        except RuntimeError:
            result[f"load(mmap={mmap})"] = False
    return result


@pytest.mark.parametrize("breakage", list(BREAKAGES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_load_and_export_agree(tmp_path, layout, breakage):
    d = tmp_path / "ckpt"
    make_layout(layout, d)
    if breakage == "a_file_removed" and len(shard_files(d)) < 2:
        pytest.skip("one file: removing it is the empty directory")
    BREAKAGES[breakage](d)
    result = verdicts(d, tmp_path / "export")
    assert len(set(result.values())) == 1, f"{layout} / {breakage}: {result}"
    if breakage == "intact" or (breakage == "a_stray_copy" and layout == "fsdp_ema"):
        assert all(result.values()), result  # a file our index does not list: a warning
    if breakage in ("bool_byte_2", "truncate", "huge_header_length", "header_not_an_object",
                    "unknown_dtype", "empty"):
        assert not any(result.values()), result


def test_verify_names_a_bool_byte_of_2_in_a_dcp_directory(tmp_path):
    d = tmp_path / "dcp"
    make_layout("dcp-huggingface", d)
    bool_byte_2(d)
    out = subprocess.run([str(CLI), "verify", str(d)], capture_output=True, text=True)
    assert out.returncode == 1
    assert 'tensor "mask": BOOL byte 2 is neither 0 nor 1' in out.stdout
    assert os.listdir(d)  # nothing removed or changed by verify
