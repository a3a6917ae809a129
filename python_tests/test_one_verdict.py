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


def _block_digits(path: Path, name: str) -> str:
    _, h = header(path)
    return json.loads(h["__metadata__"]["fsdp_ema_block_checksums"])[name]


def test_data_and_block_checksums_edited_together_are_refused_everywhere(tmp_path):
    """#41: a shard file whose data and block checksums were edited together (its whole checksum
    and the index kept) loaded everywhere, by the blocks, while verify (and any reader of the
    whole checksum) refused it. Every load path, the export and verify now refuse it."""
    g = torch.Generator().manual_seed(41)
    w = torch.randn(8, 65536, generator=g)  # 2 MiB: one 256 KiB block per row
    edited = w.clone()
    edited[1] += 1.0
    a, b = tmp_path / "a", tmp_path / "b"
    ckpt.save(a, {"w": w}, fsync=False)
    ckpt.save(b, {"w": edited}, fsync=False)
    fa, fb = shard_files(a)[0], shard_files(b)[0]
    n, _ = header(fa)
    digits_a, digits_b = _block_digits(fa, "w"), _block_digits(fb, "w")
    assert digits_a[:16] == digits_b[:16] and digits_a[16:32] != digits_b[16:32]
    raw = bytearray(fa.read_bytes())
    head = bytes(raw[8:8 + n])
    assert head.count(digits_a[16:32].encode()) == 1
    raw[8:8 + n] = head.replace(digits_a[16:32].encode(), digits_b[16:32].encode())
    raw[8 + n:] = fb.read_bytes()[8 + n:]  # block 1's data, edited with its checksum
    fa.write_bytes(bytes(raw))

    def refused(call) -> bool:
        try:
            call()
        except RuntimeError:
            return True
        return False

    dst = {"w": torch.full((8, 65536), 7.0)}
    result = {
        "load": refused(lambda: ckpt.load(a)),
        "load 1->2, rank 0": refused(lambda: ckpt.load(a, rank=0, world_size=2)),
        "load 1->2, rank 1": refused(lambda: ckpt.load(a, rank=1, world_size=2)),
        "load_into": refused(lambda: ckpt.load_into(a, dst)),
        "load(mmap=True)": refused(lambda: ckpt.load(a, mmap=True)["w"].clone()),
        "load_shard": refused(lambda: ckpt.load_shard(fa)),
        "load_shard(mmap=True)": refused(lambda: ckpt.load_shard(fa, mmap=True)),
        "open_checkpoint().load_boxes": refused(
            lambda: ckpt.open_checkpoint(a).load_boxes({"w": ([1, 0], [1, 16])})),
        "export": subprocess.run([str(CLI), "export", str(a), str(tmp_path / "out"), "--quiet"],
                                 capture_output=True).returncode != 0,
        "verify": subprocess.run([str(CLI), "verify", str(a)], capture_output=True).returncode == 1,
    }
    assert all(result.values()), {k: v for k, v in result.items() if not v}
    assert torch.all(dst["w"] == 7.0)
