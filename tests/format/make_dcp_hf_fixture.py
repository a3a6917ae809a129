"""Writes tests/format/data/dcp_hf_sharded/: a checkpoint saved by torch.distributed.checkpoint's
HuggingFaceStorageWriter (save_distributed=True: every rank writes its own shards) from 4
processes (gloo, CPU) on a 2x2 device mesh, plus dcp_hf_sharded_reference.safetensors with the
full tensors. The C++ reader test (checkpoint_dir_test.cpp) reads the first and compares it
with the second. Run with the venv python from anywhere:

    /opt/fsdp_ema/venv/bin/python tests/format/make_dcp_hf_fixture.py

What DCP (torch 2.14) writes in this mode: one file per rank that has data,
"shard-<rank+1, 5 digits>-model-00001-of-00001.safetensors", with "__metadata__" =
{"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": "<json fqn -> {saved_offsets}>"};
local shard shapes in the entries; replicated tensors written by one rank only. No .metadata
file and no index: HuggingFaceStorageWriter.finish() writes nothing when save_distributed is set
without consolidation, so there is no commit marker.
"""

import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "dcp_hf_sharded")
REFERENCE = os.path.join(HERE, "data", "dcp_hf_sharded_reference.safetensors")


def reference():
    def ar(n, dtype):
        return (torch.arange(n, dtype=torch.float64) * 0.25 - 3).to(dtype)

    return {
        "layer.weight": ar(35, torch.float32).reshape(7, 5),  # 2-d boxes, uneven
        "layer.bias": ar(5, torch.bfloat16),  # replicated: stored once
        "embed": ar(12, torch.float16).reshape(3, 4),  # 3 rows over 4 ranks: an empty shard
        "proj": ar(24, torch.float64).reshape(2, 3, 4),  # split along inner dims only
        "counts": torch.arange(10, dtype=torch.int32) * 7 - 20,
        "mask": torch.tensor([True, False, True, True, False, True]),
        "step": torch.tensor(1234, dtype=torch.int64),  # 0-dim
        "codes": torch.arange(16, dtype=torch.uint8).reshape(4, 4),
    }


PLACEMENTS = {
    "layer.weight": [Shard(0), Shard(1)],
    "layer.bias": [Replicate(), Replicate()],
    "embed": [Shard(0), Shard(0)],
    "proj": [Shard(2), Shard(1)],
    "counts": [Replicate(), Shard(0)],
    "mask": [Shard(0), Replicate()],
    "codes": [Shard(1), Shard(0)],
}


def run(rank, world, out, init_file):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (2, 2))
    state = {}
    for name, value in reference().items():
        if name in PLACEMENTS:
            state[name] = distribute_tensor(value, mesh, PLACEMENTS[name])
        else:
            state[name] = value
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
    dist.destroy_process_group()


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(4, OUT, os.path.join(tmp, "init")), nprocs=4)
    save_file(reference(), REFERENCE)
    for name in sorted(os.listdir(OUT)):
        print(name, os.path.getsize(os.path.join(OUT, name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
