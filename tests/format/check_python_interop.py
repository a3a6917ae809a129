"""Interop check: Python readers accept what the C++ format code writes.

    check_python_interop.py MAKE_FIXTURE FSDP_EMA_CLI WORK_DIR

For world sizes 1..4 it writes the fixture checkpoint (tests/format/fixture_model.h), then checks
that (1) safetensors.safe_open reads every shard file and each local shard equals the reference
slice at its DCP_SHARDING_INFO offsets, (2) torch.distributed.checkpoint loads the directory
through HuggingFaceStorageReader (resharding every world size to one process) into tensors equal
to the reference, and (3) safe_open reads `fsdp-ema export` output. Exits non-zero on mismatch.
"""

import json
import os
import shutil
import subprocess
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader


def same_bits(a, b):
    """Bit-exact equality (torch.equal is False for NaN, and random bytes make some)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def same_values(a, b):
    """Equal values with NaN where the other has NaN (payloads may differ after a cast)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def check_shards(ckpt_dir, ref):
    for name in sorted(os.listdir(ckpt_dir)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(ckpt_dir, name), framework="pt") as f:
            meta = f.metadata()
            assert meta["format"] == "pt" and meta["DCP_VERSION"] == "1.0", meta
            info = json.loads(meta["DCP_SHARDING_INFO"])
            assert set(info) == set(f.keys()), (name, info.keys(), f.keys())
            for key in f.keys():
                local = f.get_tensor(key)
                offsets = info[key]["saved_offsets"]
                index = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
                expect = ref[key][index] if index else ref[key]
                assert same_bits(local, expect), (name, key)


def check_dcp_load(ckpt_dir, ref):
    state = {k: torch.empty_like(v) for k, v in ref.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": single process
        dcp.load(state, storage_reader=HuggingFaceStorageReader(ckpt_dir))
    for k, v in ref.items():
        assert same_bits(state[k], v), k


def main():
    make_fixture, cli, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    ref_path = os.path.join(work, "reference.safetensors")
    for world in (1, 2, 3, 4):
        ckpt = os.path.join(work, f"w{world}")
        subprocess.run([make_fixture, ckpt, str(world), ref_path], check=True)
        ref = load_file(ref_path)
        check_shards(ckpt, ref)
        check_dcp_load(ckpt, ref)
        out = os.path.join(work, f"export{world}")
        subprocess.run([cli, "export", ckpt, out, "--quiet"], check=True)
        exported = load_file(os.path.join(out, "model.safetensors"))
        assert exported.keys() == ref.keys()
        for k, v in ref.items():
            assert same_bits(exported[k], v), k
        print(f"world {world}: safe_open, DCP HuggingFaceStorageReader and export OK")
    # A split, cast export: bf16 and several files, with the HF index.
    out = os.path.join(work, "export_bf16")
    subprocess.run([cli, "export", os.path.join(work, "w3"), out, "--dtype", "bf16",
                    "--max-file-size", "200", "--quiet"], check=True)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        hf_index = json.load(f)
    for k, v in ref.items():
        with safe_open(os.path.join(out, hf_index["weight_map"][k]), framework="pt") as f:
            got = f.get_tensor(k)
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert same_values(got, want), k
    print("bf16 split export OK")


if __name__ == "__main__":
    main()
