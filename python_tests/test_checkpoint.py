"""Checkpoint ops: round trips, resharding, interop with safetensors and DCP, corruption, DCE."""

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

import fsdp_ema  # noqa: F401  (loads the operator library)
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
    assert meta["tensors"]["layers.5.w"] == {"dtype": "F32", "torch_dtype": "float32",
                                           "shape": [6, 3]}
    loaded = ckpt.load(tmp_path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_commit_records_metadata_in_the_index_and_refuses_odd_pairs(tmp_path):
    t = {"w": torch.arange(6.0).reshape(2, 3)}
    ckpt.save_shard(tmp_path, t)
    with pytest.raises(RuntimeError, match="metadata must hold key, value pairs"):
        torch.ops.fsdp_ema.commit_checkpoint.with_metadata(str(tmp_path), 1, ["only-a-key"])
    with pytest.raises(RuntimeError, match='the key "k" is given twice'):
        torch.ops.fsdp_ema.commit_checkpoint.with_metadata(str(tmp_path), 1, ["k", "1", "k", "2"])
    assert not (tmp_path / "fsdp_ema.index.json").exists()  # refused before any file
    ckpt.commit(tmp_path, 1, metadata={"step": "1000", "note": "{\"a\": 1}"})
    assert ckpt.info(tmp_path)["metadata"] == {"step": "1000", "note": '{"a": 1}'}
    index = json.loads((tmp_path / "fsdp_ema.index.json").read_text())
    assert index["metadata"] == {"note": '{"a": 1}', "step": "1000"}
    assert torch.equal(ckpt.load(tmp_path)["w"], t["w"])


def test_load_shard_maps_the_file_and_is_aligned(tmp_path):
    tensors = {"f64": make_tensor((3,), torch.float64, 0),
               "f32": make_tensor((5,), torch.float32, 1),
               "bf16": make_tensor((3,), torch.bfloat16, 2),
               "u8": make_tensor((3,), torch.uint8, 3)}
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
    # The message names the file and says it is cut short (not only that something failed).
    with pytest.raises(RuntimeError, match=r"shard-00000-of-00002\.safetensors: .*"
                                           r"(truncated|shorter than|past the end)"):
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


def test_commit_refuses_a_world_size_the_files_cannot_match_before_any_per_rank_work(tmp_path):
    """#33: a million ranks were a million names and stats (6.5 s, +137 MiB) before the first
    missing file was found; the listing alone now says which rank's file is missing."""
    ckpt.save_shard(tmp_path, {"w": torch.ones(2)}, rank=0, world_size=10**6)
    with pytest.raises(RuntimeError, match=r"fsdp_ema::commit_checkpoint: .*missing shard file "
                                           r"shard-00001-of-1000000\.safetensors \(rank 1 of "
                                           r"1000000 did not finish writing\); files of 1 of the "
                                           r"1000000 ranks are present"):
        ckpt.commit(tmp_path, 10**6)
    assert not (tmp_path / "fsdp_ema.index.json").exists()


def test_load_boxes_reads_boxes_of_every_layout(tmp_path):
    ref = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    write_sharded(tmp_path, {"w": ref}, 3)
    opened = ckpt.open_checkpoint(tmp_path)
    got = opened.load_boxes({"w": ([2, 1], [4, 3])})["w"]
    assert torch.equal(got, ref[2:6, 1:4])
    assert opened.load_boxes({"w": ([7, 6], [0, 0])})["w"].shape == (0, 0)
    # Boxes are checked before anything is sized from them: no allocation, no torch error.
    for offsets, shape in (([5, 0], [3, 6]), ([0, 0], [2**62, 1]), ([0, 0], [2**36, 6]),
                           ([0, 0], [1, -1]), ([-1, 0], [1, 1])):
        with pytest.raises(RuntimeError, match=r"load_boxes: .*tensor \"w\": slice at offsets "
                                               r".* is outside global shape \[7, 6\]"):
            opened.load_boxes({"w": (offsets, shape)})


def test_commit_refuses_a_missing_rank(tmp_path):
    ckpt.save_shard(tmp_path, {"w": (torch.ones(2), [0], [4])}, rank=0, world_size=2)
    with pytest.raises(RuntimeError, match=r"missing shard file shard-00001-of-00002\.safetensors "
                                           r"\(rank 1 of 2 did not finish writing\)"):
        ckpt.commit(tmp_path, 2)
    assert not (tmp_path / "fsdp_ema.index.json").exists()
    with pytest.raises(RuntimeError, match="incomplete checkpoint"):
        ckpt.load(tmp_path)
    # Once the late rank's file is there, the same commit goes through and lists both files.
    ckpt.save_shard(tmp_path, {"w": (torch.full((2,), 2.0), [2], [4])}, rank=1, world_size=2)
    assert ckpt.commit(tmp_path, 2) == 1
    index = json.loads((tmp_path / "fsdp_ema.index.json").read_text())
    assert sorted(p["file"] for p in index["tensors"]["w"]["pieces"]) == [
        ckpt.shard_file_name(0, 2), ckpt.shard_file_name(1, 2)]
    assert torch.equal(ckpt.load(tmp_path)["w"], torch.tensor([1.0, 1.0, 2.0, 2.0]))


def test_commit_refuses_a_missing_rank_whose_file_holds_nothing(tmp_path):
    """Rank 0's file alone covers every tensor (rank 1 holds no rows, as for a 1-row tensor
    on 2 ranks): the commit must still wait for rank 1's file, not index what is there."""
    ckpt.save_shard(tmp_path, {"s": torch.tensor(1.0), "row": (torch.ones(1, 4), [0, 0], [1, 4])},
                    rank=0, world_size=2)
    with pytest.raises(RuntimeError, match=r"missing shard file shard-00001-of-00002\.safetensors "
                                           r"\(rank 1 of 2 did not finish writing\)"):
        ckpt.commit(tmp_path, 2)
    assert not (tmp_path / "fsdp_ema.index.json").exists()
    ckpt.save_shard(tmp_path, {}, rank=1, world_size=2)
    assert ckpt.commit(tmp_path, 2) == 2  # tensors indexed
    assert ckpt.info(tmp_path)["world_size"] == 2
    # Rank 1's file held no tensor: the commit removed it, as every file the index does not name.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fsdp_ema.index.json",
                                                          ckpt.shard_file_name(0, 2)]


@pytest.mark.parametrize("second", [(2, 3), (2, 4)], ids=["overlap-and-gap", "overlap"])
def test_commit_refuses_pieces_that_overlap_by_one_row(tmp_path, second):
    """Rows [0, 3) and [2, 5) of 6: one row twice and one row missing, so the element counts
    add up and only the overlap check can tell; and rows [0, 3) and [2, 6)."""
    begin, rows = second
    t = torch.arange(12.0).reshape(6, 2)
    ckpt.save_shard(tmp_path, {"w": (t[:3], [0, 0], [6, 2])}, rank=0, world_size=2)
    ckpt.save_shard(tmp_path, {"w": (t[begin:begin + rows], [begin, 0], [6, 2])}, rank=1,
                    world_size=2)
    with pytest.raises(RuntimeError, match=r'tensor "w": pieces overlap.*offsets \[0, 0\].*'
                                           r'offsets \[2, 0\]'):
        ckpt.commit(tmp_path, 2)
    assert not (tmp_path / "fsdp_ema.index.json").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_partial_read_of_a_corrupted_piece_fails_the_checksum(committed, rank):
    """Rows of a piece read on their own (load at another world size) are verified against
    the whole piece's checksum: a flip in row 30 fails the reads of rows [0, 16) and
    [16, 32) of piece 0 alike, and leaves the rows of the intact piece 1 readable."""
    data = bytearray(_shard0(committed).read_bytes())
    row_bytes = 8 * 4
    data[len(data) - 2 * row_bytes + 4] ^= 0x10  # row 30 of the 32 rows in shard 0
    _shard0(committed).write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=r"shard-00000-of-00002\.safetensors.*checksum"):
        ckpt.load(committed, rank=rank, world_size=4)
    rows = ckpt.load(committed, rank=rank, world_size=4, verify=False)["w"]
    assert rows.shape == (16, 8)
    expected = make_tensor((64, 8), torch.float32, 0)
    assert torch.equal(ckpt.load(committed, rank=2, world_size=4)["w"], expected[32:48])


def _grid_checkpoint(directory, full):
    """A TP x FSDP-style grid of four writers: rows split 33 / 31, columns 4 / 4. Reads of rows
    cut these pieces in two dimensions (the sliced read path, not the dim-0 rows one)."""
    pieces = [(r0, r1, c0, c1) for r0, r1 in [(0, 33), (33, 64)] for c0, c1 in [(0, 4), (4, 8)]]
    for rank, (r0, r1, c0, c1) in enumerate(pieces):
        ckpt.save_shard(directory, {"w": (full[r0:r1, c0:c1], [r0, c0], list(full.shape))},
                        rank=rank, world_size=len(pieces))
    ckpt.commit(directory, len(pieces))


def test_resharding_a_grid_layout_reads_one_row_intersections(tmp_path):
    """Rank 2 of 4 holds rows [32, 48): row 32 is the last of the first row of pieces, an
    intersection one row high with pieces and a request both taller than one row."""
    full = make_tensor((64, 8), torch.float32, 5)
    _grid_checkpoint(tmp_path, full)
    for rank in range(4):
        got = ckpt.load(tmp_path, rank=rank, world_size=4)["w"]
        assert torch.equal(got, full[16 * rank:16 * (rank + 1)]), rank


def test_a_partial_read_of_a_corrupted_grid_piece_fails_the_checksum(tmp_path):
    """Rows [0, 16) read from the grid cut piece (rows [0, 33), columns [0, 4)) in two
    dimensions; a flip in its row 30, outside what is read, still fails the read: the whole
    piece is verified first."""
    full = make_tensor((64, 8), torch.float32, 6)
    _grid_checkpoint(tmp_path, full)
    path = tmp_path / ckpt.shard_file_name(0, 4)
    data = bytearray(path.read_bytes())
    data[len(data) - 33 * 16 + 30 * 16 + 4] ^= 0x10  # the piece is the file's only tensor
    path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=r"shard-00000-of-00004\.safetensors.*checksum"):
        ckpt.load(tmp_path, rank=0, world_size=4)
    assert torch.equal(ckpt.load(tmp_path, rank=0, world_size=4, verify=False)["w"], full[:16])


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


# --- dtype casts against torch's ------------------------------------------------------------------

CLI = Path(__file__).resolve().parents[1] / "build" / "bin" / "fsdp-ema"


def _cast_sources():
    g = torch.Generator().manual_seed(11)
    # Round-to-nearest-even ties and edges for both targets: 1 + 2^-8 and 1 + 3 * 2^-8 are bf16
    # ties (down and up to even), 1 + 2^-11 and 1 + 3 * 2^-11 are f16 ties, 65520 rounds to
    # f16 infinity, 2^-25 and 3 * 2^-25 are f16 subnormal ties, 3e38 overflows f16 only.
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1 + 2**-8, 1 + 3 * 2**-8,
                          -(1 + 2**-8), 1 + 2**-8 + 2**-20, 1 + 2**-11, 1 + 3 * 2**-11,
                          65504.0, 65519.0, 65520.0, 2**-24, 2**-25, 3 * 2**-25, 1e-30, 3e38,
                          -1e-40, 2**-126, 2**-133], dtype=torch.float32)
    return {
        "f32": torch.cat([torch.randn(3000, generator=g) * 1000, edges,
                          torch.randn(999, generator=g) * 1e-6]),
        "f64": torch.randn(2000, generator=g, dtype=torch.float64) * 50,
        "f16": (torch.randn(1000, generator=g) * 100).half(),
        "bf16": (torch.randn(1000, generator=g) * 100).bfloat16(),
        "ids": torch.randint(-1000, 1000, (17,), generator=g),
        "mask": torch.rand(9, generator=g) > 0.5,
    }


@pytest.mark.parametrize("flag,dtype", [("bf16", torch.bfloat16), ("f16", torch.float16),
                                        ("f32", torch.float32), ("f64", torch.float64)])
def test_cli_export_casts_as_torch_does(tmp_path, flag, dtype):
    """The expected bytes come from torch's own casts (an independent implementation), not
    from the cast code under test."""
    import subprocess

    from safetensors.torch import load_file

    assert CLI.exists(), f"{CLI} is missing: scripts/build.sh builds it with the library"
    tensors = _cast_sources()
    ckpt.save(tmp_path / "ck", tensors)
    done = subprocess.run([str(CLI), "export", "-q", "--dtype", flag, str(tmp_path / "ck"),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        expected = t.to(dtype) if t.is_floating_point() else t
        assert bit_equal(got[name], expected), (name, flag)


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
