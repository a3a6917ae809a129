"""checkpoint.load_into / fsdp_ema::load_into_: a checkpoint read into existing tensors.

The reference is the owned load (checkpoint.load) of the same checkpoint, itself checked against
the saved tensors; every refusal must leave every destination as it was.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from load_state import mixed_state

from fsdp_ema import checkpoint as ckpt


def reference():
    return mixed_state(11, 301, empty=True)


def sentinels(like: dict) -> dict:
    """Destinations filled with a value no saved tensor holds, to see what a call wrote."""
    out = {}
    for k, v in like.items():
        t = torch.empty_like(v)
        t.fill_(True if v.dtype == torch.bool else 7)
        out[k] = t
    return out


def test_load_into_equals_the_owned_load(tmp_path):
    ref = reference()
    ckpt.save(tmp_path, ref)
    dst = sentinels(ref)
    ptrs = {k: v.data_ptr() for k, v in dst.items()}
    ckpt.load_into(tmp_path, dst)
    owned = ckpt.load(tmp_path)
    for k, t in ref.items():
        assert torch.equal(dst[k], t), k
        assert torch.equal(owned[k], t), k
        assert dst[k].data_ptr() == ptrs[k], f"{k}: the destination itself must be written"


def test_load_into_reshards_rows_for_any_world_size(tmp_path):
    ref = reference()
    # Written by 2 ranks (torch.chunk rows of w), read by 3.
    for rank in range(2):
        rows = torch.chunk(ref["w"], 2)[rank]
        ckpt.save_shard(tmp_path, {"w": (rows, [rank * 151, 0], [301, 70])}, rank=rank,
                        world_size=2)
    ckpt.commit(tmp_path, 2)
    for rank in range(3):
        want = torch.chunk(ref["w"], 3)[rank]
        dst = {"w": torch.full_like(want, 7.0)}
        ckpt.load_into(tmp_path, dst, rank=rank, world_size=3)
        assert torch.equal(dst["w"], want)
        assert torch.equal(dst["w"], ckpt.load(tmp_path, ["w"], rank=rank, world_size=3)["w"])


def test_load_into_non_contiguous_destination(tmp_path):
    ref = reference()
    ckpt.save(tmp_path, {"w": ref["w"]})
    base = torch.full((70, 301), 7.0)
    dst = base.t()  # a transposed view: the reader goes through a buffer of its own
    ckpt.load_into(tmp_path, {"w": dst})
    assert torch.equal(dst, ref["w"])
    assert torch.equal(base, ref["w"].t())


@pytest.mark.parametrize("bad,match", [
    (lambda d: d.update(w=torch.zeros(301, 71)), r"out\[0\] \('w'\) has shape"),
    (lambda d: d.update(b=torch.zeros(70)), r"out\[1\] \('b'\) has dtype Float"),
    (lambda d: d.update(nope=torch.zeros(1)), r"names\[5\] 'nope' is not in checkpoint"),
    (lambda d: d.update(b=torch.zeros(1, dtype=torch.bfloat16).expand(70)),
     r"out\[1\] \('b'\) has internally overlapping memory"),
    (lambda d: d.update(w=torch.zeros(301, 70, device="meta")),
     r"out\[0\] \('w'\) is a meta tensor"),
])
def test_load_into_refuses_bad_destinations_and_writes_nothing(tmp_path, bad, match):
    ref = reference()
    ckpt.save(tmp_path, ref)
    dst = sentinels(ref)
    bad(dst)
    before = {k: v.clone() for k, v in dst.items() if v.device.type != "meta"}
    with pytest.raises(RuntimeError, match=match):
        ckpt.load_into(tmp_path, dst)
    for k, v in before.items():
        assert torch.equal(dst[k], v), f"{k} was written by a refused call"


def test_load_into_refuses_destinations_that_share_memory(tmp_path):
    ref = reference()
    ckpt.save(tmp_path, {"a": ref["w"][:10], "c": ref["w"][10:20]})
    storage = torch.full((15, 70), 7.0)
    with pytest.raises(RuntimeError,
                       match=r"out\[1\] \('c'\) overlaps out\[0\] \('a'\) in memory"):
        ckpt.load_into(tmp_path, {"a": storage[:10], "c": storage[5:15]})
    assert torch.equal(storage, torch.full((15, 70), 7.0))


def test_load_into_refuses_a_corrupted_file_before_writing_any_destination(tmp_path):
    ref = reference()
    ckpt.save(tmp_path, ref)
    path = Path(tmp_path) / ckpt.shard_file_name(0, 1)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x10  # inside the bfloat16 "b" (the file ends with "b" then the 50 bools "m")
    path.write_bytes(bytes(raw))
    dst = sentinels(ref)
    before = {k: v.clone() for k, v in dst.items()}
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        ckpt.load_into(tmp_path, dst)
    for k, v in before.items():
        assert torch.equal(dst[k], v), f"{k} was written before the corruption was found"


def test_load_into_from_the_raw_op(tmp_path):
    ref = reference()
    ckpt.save(tmp_path, ref)
    dst = sentinels(ref)
    torch.ops.fsdp_ema.load_into_(os.fspath(tmp_path), list(dst), list(dst.values()))
    for k, t in ref.items():
        assert torch.equal(dst[k], t), k


# --- memory the destinations own (#28) ----------------------------------------------------------

def test_load_into_refuses_a_destination_whose_storage_was_shrunk(tmp_path):
    """A tensor whose storage was resized under it would have the whole tensor's bytes written
    into 16 bytes (heap corruption: "double free or corruption"); it is refused, nothing is
    written."""
    ref = reference()
    ckpt.save(tmp_path, ref)
    dst = sentinels(ref)
    before = {k: v.clone() for k, v in dst.items()}
    dst["w"].untyped_storage().resize_(16)
    with pytest.raises(RuntimeError, match=r"out\[0\] \('w'\) reaches 84280 bytes into its "
                                           r"storage, which holds 16"):
        ckpt.load_into(tmp_path, dst)
    for k, v in before.items():
        if k != "w":
            assert torch.equal(dst[k], v), f"{k} was written by a refused call"


def test_load_into_bumps_the_version_counter_so_backward_raises(tmp_path):
    """As torch's in-place ops: a tensor saved for backward and then loaded into makes backward
    raise, instead of computing the gradient from the loaded values."""
    ckpt.save(tmp_path, {"w": torch.full((4,), 2.0)})
    w = torch.ones(4)
    x = torch.ones(4, requires_grad=True)
    y = (x * w).sum()  # saves w for backward
    version = w._version
    ckpt.load_into(tmp_path, {"w": w})
    assert w._version > version
    assert torch.equal(w, torch.full((4,), 2.0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_interleaved_disjoint_views_are_destinations_of_one_call(tmp_path):
    """x[0::2] and x[1::2] share no element: torch's exact overlap rule, not their extents."""
    ckpt.save(tmp_path, {"even": torch.arange(0.0, 8.0, 2), "odd": torch.arange(1.0, 8.0, 2)})
    x = torch.zeros(8)
    ckpt.load_into(tmp_path, {"even": x[0::2], "odd": x[1::2]})
    assert torch.equal(x, torch.arange(8.0))
    x = torch.zeros(10)
    grid = torch.zeros(3, 4)
    ckpt.save(tmp_path / "cols", {"a": torch.ones(3, 2), "b": torch.full((3, 2), 2.0)})
    ckpt.load_into(tmp_path / "cols", {"a": grid[:, 0::2], "b": grid[:, 1::2]})
    assert torch.equal(grid, torch.tensor([[1.0, 2.0] * 2] * 3))
    # Views that do share an element are still refused, naming both.
    with pytest.raises(RuntimeError, match=r"out\[1\] \('odd'\) overlaps out\[0\] \('even'\)"):
        ckpt.load_into(tmp_path, {"even": x[0:8:2], "odd": x[2:10:2]})


def test_a_sparse_destination_is_named_as_sparse(tmp_path):
    ckpt.save(tmp_path, {"w": torch.zeros(4, 4)})
    with pytest.raises(RuntimeError, match=r"out\[0\] \('w'\) is a Sparse tensor; pass a dense"):
        ckpt.load_into(tmp_path, {"w": torch.zeros(4, 4).to_sparse()})


def _rewrite_in_place_keeping_size_and_mtime(path: Path) -> None:
    """Flips one data byte in place (same size) and sets the mtime back, as a user could."""
    st = os.stat(path)
    time.sleep(0.05)  # past the file system clock's tick: the ctime must be able to move
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x10
    with open(path, "r+b") as f:
        f.write(raw)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_a_same_size_rewrite_with_mtime_restored_is_refused(tmp_path):
    """#28: between check_into (which hashes every piece) and load_into (which does not hash them
    again), a file rewritten in place with its size and mtime kept loaded wrong data with no
    error. The fstat check of size, mtime and ctime (which no user can set back) refuses it."""
    ref = reference()
    ckpt.save(tmp_path, ref)
    dst = sentinels(ref)
    before = {k: v.clone() for k, v in dst.items()}
    opened = ckpt.open_checkpoint(tmp_path)
    opened.check_into(dst)
    _rewrite_in_place_keeping_size_and_mtime(Path(tmp_path) / ckpt.shard_file_name(0, 1))
    for call in (lambda: opened.load_into(dst), lambda: opened.load(list(ref)),
                 opened.check_unchanged):
        with pytest.raises(RuntimeError, match="changed since it was opened"):
            call()
    for k, v in before.items():
        assert torch.equal(dst[k], v), f"{k} was written"


def test_a_collective_load_refuses_a_file_rewritten_after_its_check(tmp_path, monkeypatch):
    """ShardedEMA.load checks and hashes on every rank, agrees, then writes: a file rewritten in
    place after the check is refused by the agreed fstat step, with the EMA untouched."""
    import fsdp_ema

    model = torch.nn.Linear(30, 20)
    ema = fsdp_ema.ShardedEMA(model)
    ema.save(tmp_path)
    with torch.no_grad():
        for t in ema.state.tensors:
            t.fill_(7.0)
    real_check = ckpt.OpenCheckpoint.check_into

    def check_then_rewrite(self, *args, **kwargs):
        real_check(self, *args, **kwargs)
        _rewrite_in_place_keeping_size_and_mtime(Path(tmp_path) / ckpt.shard_file_name(0, 1))

    monkeypatch.setattr(ckpt.OpenCheckpoint, "check_into", check_then_rewrite)
    with pytest.raises(RuntimeError, match="changed since it was opened"):
        ema.load(tmp_path)
    assert all(torch.all(t == 7.0) for t in ema.state.tensors)


def test_a_corrupted_last_read_chunk_is_refused_before_writing_any_destination(tmp_path):
    """A tensor over several 8 MiB read chunks, damaged in its last: refused, nothing written."""
    g = torch.Generator().manual_seed(9)
    ref = {"a": torch.arange(7, dtype=torch.int32), "big": torch.randn(5_000_003, generator=g)}
    ckpt.save(tmp_path, ref)
    path = Path(tmp_path) / ckpt.shard_file_name(0, 1)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x10  # "big" is the file's last tensor: its last byte
    path.write_bytes(bytes(raw))
    dst = sentinels(ref)
    before = {k: v.clone() for k, v in dst.items()}
    with pytest.raises(RuntimeError, match="checksum mismatch") as e:
        ckpt.load_into(tmp_path, dst)
    assert str(path) in str(e.value)
    for k, v in before.items():
        assert torch.equal(dst[k], v), f"{k} was written before the corruption was found"
    ckpt.save(tmp_path, ref, overwrite=True)
    ckpt.load_into(tmp_path, dst)
    assert all(torch.equal(dst[k], v) for k, v in ref.items())


# --- destinations whose own elements share memory (#41) -------------------------------------------

def _self_overlapping(base: torch.Tensor) -> torch.Tensor:
    """800 elements over 107 floats: torch calls its overlap "too hard" to decide, not "no"."""
    return base.as_strided((100, 8), (1, 1))


@pytest.mark.parametrize("how", ["load_into", "OpenCheckpoint.load_into",
                                 "OpenCheckpoint.check_into"])
def test_a_destination_whose_elements_share_memory_is_refused(tmp_path, how):
    """#41: as_strided((100, 8), (1, 1)) was accepted (693 of 800 elements then differed from the
    checkpoint, no error). It is refused naming it, with nothing written."""
    ref = {"s": torch.randn(100, 8), "t": torch.randn(3)}
    ckpt.save(tmp_path, ref)
    base = torch.full((107,), 7.0)
    other = torch.full((3,), 7.0)
    dst = {"s": _self_overlapping(base), "t": other}
    calls = {"load_into": lambda: ckpt.load_into(tmp_path, dst),
             "OpenCheckpoint.load_into": lambda: ckpt.open_checkpoint(tmp_path).load_into(dst),
             "OpenCheckpoint.check_into": lambda: ckpt.open_checkpoint(tmp_path).check_into(dst)}
    with pytest.raises(RuntimeError, match=r"out\[0\] \('s'\) has internally overlapping memory"):
        calls[how]()
    assert torch.all(base == 7.0) and torch.all(other == 7.0)


def test_a_collective_load_refuses_a_destination_whose_elements_share_memory(tmp_path):
    """The collective load (load_model_weights here) into a parameter that overlaps itself, read
    in place or through a cast: refused on the check, naming the parameter, nothing written."""
    import fsdp_ema

    for stored_dtype in (torch.float32, torch.float64):  # in place; a cast (a fresh read, copied)
        d = tmp_path / str(stored_dtype)
        ckpt.save(d, {"weight": torch.randn(100, 8, dtype=stored_dtype),
                      "bias": torch.randn(100, dtype=stored_dtype)})
        model = torch.nn.Linear(8, 100)
        base = torch.full((107,), 7.0)
        with torch.no_grad():
            model.weight = torch.nn.Parameter(_self_overlapping(base))
            model.bias.fill_(7.0)
        with pytest.raises(RuntimeError, match="'weight'.* internally overlapping memory"):
            fsdp_ema.load_model_weights(model, d)
        assert torch.all(base == 7.0) and torch.all(model.bias == 7.0), stored_dtype
