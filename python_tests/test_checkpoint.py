"""Checkpoint ops: round trips, resharding, interop with safetensors and DCP, corruption, DCE."""

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import List

import pytest
import torch

import fsdp_ema
from fsdp_ema import checkpoint as ckpt

ALL_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
              torch.float8_e4m3fn, torch.float8_e5m2]


def make_tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def bit_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.cpu().view(torch.uint8) if a.dim() else a.cpu().reshape(1).view(torch.uint8),
        b.cpu().view(torch.uint8) if b.dim() else b.cpu().reshape(1).view(torch.uint8))


def chunk_rows(rows, rank, world):
    cs = -(-rows // world)
    begin = min(rank * cs, rows)
    return begin, min(begin + cs, rows)


def write_sharded(directory, tensors, world):
    """Every rank writes its torch.chunk dim-0 rows; 0-dim tensors are written by rank 0 only."""
    for rank in range(world):
        shards = {}
        for name, t in tensors.items():
            if t.dim() == 0:
                if rank == 0:
                    shards[name] = t
                continue
            b, e = chunk_rows(t.shape[0], rank, world)
            shards[name] = (t[b:e], [b] + [0] * (t.dim() - 1), list(t.shape))
        ckpt.save_shard(directory, shards, rank=rank, world_size=world)
    ckpt.commit(directory, world)


def reference_tensors():
    return {
        "emb.weight": make_tensor((13, 6), torch.float32, 1),
        "layer.0.bias": make_tensor((7,), torch.bfloat16, 2),
        "tiny": make_tensor((2, 3), torch.float16, 3),  # fewer rows than most world sizes
        "step": torch.tensor(42, dtype=torch.int64),   # 0-dim
        "empty": torch.empty(0, 4),
        "mask": make_tensor((5,), torch.bool, 4),
        "ema.fp64": make_tensor((9, 2, 2), torch.float64, 5),
    }


# --- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_round_trip_is_bit_exact_for_every_dtype(tmp_path, dtype):
    tensors = {"a": make_tensor((17, 3), dtype, 0), "scalar": make_tensor((), dtype, 1),
               "empty": make_tensor((0,), dtype, 2)}
    ckpt.save(tmp_path, tensors)
    loaded = ckpt.load(tmp_path)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert bit_equal(loaded[name], t), name
    shard = ckpt.load_shard(tmp_path / ckpt.shard_file_name(0, 1))
    for name, t in tensors.items():
        assert bit_equal(shard[name][0], t), name
        assert shard[name][2] == list(t.shape)


def test_round_trip_many_tensors_and_info(tmp_path):
    tensors = {f"layers.{i}.w": make_tensor((i % 7 + 1, 3), torch.float32, i) for i in range(300)}
    nbytes = ckpt.save(tmp_path, tensors)
    assert nbytes == os.path.getsize(tmp_path / "shard-00000-of-00001.safetensors")
    meta = ckpt.info(tmp_path)
    assert meta["layout"] == "fsdp_ema" and meta["world_size"] == 1
    assert meta["tensors"]["layers.5.w"] == {"dtype": "F32", "shape": [6, 3]}
    loaded = ckpt.load(tmp_path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_load_shard_maps_the_file_and_is_aligned(tmp_path):
    tensors = {"f64": make_tensor((3,), torch.float64, 0), "f32": make_tensor((5,), torch.float32, 1),
               "bf16": make_tensor((3,), torch.bfloat16, 2), "u8": make_tensor((3,), torch.uint8, 3)}
    ckpt.save(tmp_path, tensors)
    shard = ckpt.load_shard(tmp_path / ckpt.shard_file_name(0, 1))
    for name, (t, _, _) in shard.items():
        assert t.data_ptr() % t.element_size() == 0, name  # naturally aligned in the file
        assert torch.equal(t, tensors[name])


# --- resharding -------------------------------------------------------------------------------

@pytest.mark.parametrize("writers", [1, 2, 3, 4])
def test_resharding_matrix(tmp_path, writers):
    tensors = reference_tensors()
    write_sharded(tmp_path, tensors, writers)
    assert ckpt.info(tmp_path)["world_size"] == writers
    for readers in [1, 2, 3, 4, 5]:
        for rank in range(readers):
            got = ckpt.load(tmp_path, rank=rank, world_size=readers)
            for name, t in tensors.items():
                if t.dim() == 0:
                    expected = t
                else:
                    b, e = chunk_rows(t.shape[0], rank, readers)
                    expected = t[b:e]
                assert bit_equal(got[name], expected), (writers, readers, rank, name)


# --- interop ----------------------------------------------------------------------------------

def test_safetensors_reads_every_shard_file(tmp_path):
    from safetensors import safe_open

    tensors = reference_tensors()
    write_sharded(tmp_path, tensors, 3)
    for rank in range(3):
        path = tmp_path / ckpt.shard_file_name(rank, 3)
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            assert meta["format"] == "pt" and meta["DCP_VERSION"] == "1.0"
            sharding = json.loads(meta["DCP_SHARDING_INFO"])
            for name in f.keys():
                t = f.get_tensor(name)
                off = sharding[name]["saved_offsets"]
                full = tensors[name]
                expected = full if full.dim() == 0 else full[off[0]:off[0] + t.shape[0]]
                assert bit_equal(t, expected), (rank, name)


def test_dcp_huggingface_reader_loads_our_directory(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    tensors = {k: v for k, v in reference_tensors().items()
               if v.dim() > 0 and v.numel() > 0 and v.dtype != torch.bool}
    write_sharded(tmp_path, tensors, 3)
    target = {k: torch.zeros_like(v) for k, v in tensors.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=HuggingFaceStorageReader(str(tmp_path)))
    for name, t in tensors.items():
        assert bit_equal(target[name], t), name


def _dcp_hf_writer(rank, world, directory, init_file):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        state = {name: distribute_tensor(t, mesh, [Shard(0)])
                 for name, t in reference_tensors().items() if t.dim() > 0 and t.numel() > 0
                 and t.dtype != torch.bool}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=HuggingFaceStorageWriter(directory,
                                                                   save_distributed=True))
    finally:
        dist.destroy_process_group()


def test_our_reader_loads_a_directory_dcp_wrote_sharded(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "dcp"
    mp.spawn(_dcp_hf_writer, args=(2, str(out), str(tmp_path / "init")), nprocs=2, join=True)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) >= 2, files  # really sharded: one file per rank
    meta = ckpt.info(out)
    assert meta["layout"] == "dcp-huggingface"
    expected = {k: v for k, v in reference_tensors().items()
                if v.dim() > 0 and v.numel() > 0 and v.dtype != torch.bool}
    got = ckpt.load(out, list(expected))
    for name, t in expected.items():
        assert bit_equal(got[name], t), name
    for rank in range(3):
        rows = ckpt.load(out, ["emb.weight"], rank=rank, world_size=3)["emb.weight"]
        b, e = chunk_rows(13, rank, 3)
        assert torch.equal(rows, expected["emb.weight"][b:e])


# --- errors -----------------------------------------------------------------------------------

@pytest.fixture
def committed(tmp_path):
    write_sharded(tmp_path, {"w": make_tensor((64, 8), torch.float32, 0)}, 2)
    return tmp_path


def _shard0(d):
    return d / ckpt.shard_file_name(0, 2)


def test_missing_index_is_an_incomplete_checkpoint(committed):
    (committed / "fsdp_ema.index.json").unlink()
    with pytest.raises(RuntimeError, match="incomplete checkpoint: fsdp_ema.index.json missing"):
        ckpt.load(committed)


@pytest.mark.parametrize("keep", [0, 7, 100, -1])
def test_truncated_file_is_refused(committed, keep):
    data = _shard0(committed).read_bytes()
    _shard0(committed).write_bytes(data[:keep] if keep >= 0 else data[:-1])
    with pytest.raises(RuntimeError, match="shard-00000-of-00002.safetensors"):
        ckpt.load(committed)


def test_flipped_data_byte_fails_the_checksum(committed):
    data = bytearray(_shard0(committed).read_bytes())
    data[-5] ^= 0x10
    _shard0(committed).write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="checksum"):
        ckpt.load(committed)
    with pytest.raises(RuntimeError, match="checksum"):
        ckpt.load_shard(_shard0(committed))
    # Without verification the (corrupt) bytes load: the check is what catches it.
    assert ckpt.load(committed, verify=False)["w"].shape == (64, 8)


def test_header_garbage_is_refused(committed):
    data = bytearray(_shard0(committed).read_bytes())
    data[8:20] = b"{garbage!!!!"
    _shard0(committed).write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="shard-00000-of-00002.safetensors"):
        ckpt.load_shard(_shard0(committed))


def test_index_naming_a_file_outside_the_directory_is_refused(committed):
    index_path = committed / "fsdp_ema.index.json"
    index = json.loads(index_path.read_text())
    index["tensors"]["w"]["pieces"][0]["file"] = "../x.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(RuntimeError, match=r"\.\./x\.safetensors"):
        ckpt.load(committed)


def test_commit_refuses_a_committed_directory_unless_asked(committed):
    with pytest.raises(RuntimeError, match="already committed"):
        ckpt.commit(committed, 2)
    assert ckpt.commit(committed, 2, overwrite=True) == 1


def test_commit_refuses_a_missing_rank(tmp_path):
    ckpt.save_shard(tmp_path, {"w": (torch.ones(2), [0], [4])}, rank=0, world_size=2)
    with pytest.raises(RuntimeError, match="shard-00001-of-00002.safetensors"):
        ckpt.commit(tmp_path, 2)
    assert not (tmp_path / "fsdp_ema.index.json").exists()


SAVE_ERRORS = {
    "names vs shards": (["a"], [torch.ones(2), torch.ones(2)], [0, 0], [2, 2],
                        "names has 1 entries but shards has 2"),
    "offsets length": (["a"], [torch.ones(2, 2)], [0], [2, 2], "offsets has 1 entries"),
    "global shapes length": (["a"], [torch.ones(2)], [0], [], "global_shapes has 0 entries"),
    "offset past global": (["a"], [torch.ones(3)], [2], [4],
                           "offset 2 \\+ size 3 exceeds global size 4 in dim 0"),
    "duplicate name": (["a", "a"], [torch.ones(1), torch.ones(1)], [0, 0], [1, 1],
                       "names\\[1\\] 'a' appears twice"),
    "empty name": ([""], [torch.ones(1)], [0], [1], "names\\[0\\] is empty"),
    "complex dtype": (["c"], [torch.ones(2, dtype=torch.complex64)], [0], [2],
                      "shards\\[0\\] \\('c'\\) has dtype ComplexFloat"),
}


@pytest.mark.parametrize("case", list(SAVE_ERRORS))
def test_save_shard_rejects_bad_input_and_writes_nothing(tmp_path, case):
    names, shards, offsets, global_shapes, message = SAVE_ERRORS[case]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fsdp_ema.save_shard(str(tmp_path), 0, 1, names, shards, offsets, global_shapes)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rank,world", [(1, 1), (-1, 2), (0, 0)])
def test_save_shard_rejects_bad_rank(tmp_path, rank, world):
    with pytest.raises(RuntimeError, match="world_size|rank"):
        torch.ops.fsdp_ema.save_shard(str(tmp_path), rank, world, ["a"], [torch.ones(1)], [0], [1])
    assert list(tmp_path.iterdir()) == []


# --- save_shard is never dead-code-eliminated ---------------------------------------------------

def test_torchscript_keeps_save_shard_whose_result_is_unused(tmp_path):
    @torch.jit.script
    def save(directory: str, t: torch.Tensor):
        torch.ops.fsdp_ema.save_shard(directory, 0, 1, ["t"], [t * 2], [0], [3])

    assert "fsdp_ema::save_shard" in str(save.graph)
    save(str(tmp_path), torch.ones(3))
    assert torch.equal(ckpt.load_shard(tmp_path / ckpt.shard_file_name(0, 1))["t"][0],
                       torch.full((3,), 2.0))


def test_torch_compile_keeps_save_shard_whose_result_is_unused(tmp_path):
    directory = str(tmp_path)

    def step(x):
        torch.ops.fsdp_ema.save_shard(directory, 0, 1, ["y"], [x * 2], [0], [3])
        return x + 1

    torch._dynamo.reset()
    out = torch.compile(step, fullgraph=True)(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
    assert torch.equal(ckpt.load_shard(tmp_path / ckpt.shard_file_name(0, 1))["y"][0],
                       torch.full((3,), 2.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_shards_are_staged_and_load_back_to_the_device(tmp_path):
    tensors = {"big": make_tensor((3, 1 << 20), torch.bfloat16, 0).cuda(),  # > one staging chunk
               "small": make_tensor((5,), torch.float32, 1).cuda()}
    ckpt.save(tmp_path, tensors)
    loaded = ckpt.load(tmp_path, device="cuda")
    for name, t in tensors.items():
        assert loaded[name].is_cuda and torch.equal(loaded[name], t)
    shard = ckpt.load_shard(tmp_path / ckpt.shard_file_name(0, 1), device=torch.device("cuda"))
    assert shard["big"][0].is_cuda and torch.equal(shard["big"][0], tensors["big"])
