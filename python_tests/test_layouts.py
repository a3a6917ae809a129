"""``fsdp_ema.model.layouts.Layout``: one tensor's layout on a rank. The pieces the ranks write
cover the full tensor exactly once for every kind (DTensors on 1-D and 2-D meshes, uneven and empty
shards, 0-dim tensors, ShardedTensors, FSDP1 member rows, replicated tensors), and what a rank
reads back through ``read()`` and ``assign()`` (or ``target()`` in a collective load) is its own
local tensor again, through a real checkpoint written by 4 gloo ranks."""

from __future__ import annotations

import random

import pytest
import torch
from dist_utils import PoolManager

WORLD = 4

# (name, global shape, mesh shape, placements as (kind, dim)); kinds: S Shard, R Replicate.
MESH_CASES = [
    ("fsdp_rows", (10, 3), (4,), [("S", 0)]),
    ("fsdp_uneven", (5, 2), (4,), [("S", 0)]),
    ("fewer_rows_than_ranks", (2, 3), (4,), [("S", 0)]),
    ("cols", (3, 7), (4,), [("S", 1)]),
    ("replicated", (6, 2), (4,), [("R", 0)]),
    ("hsdp", (9, 2), (2, 2), [("R", 0), ("S", 0)]),
    ("tp_2d", (7, 5), (2, 2), [("S", 0), ("S", 1)]),
    ("same_dim_twice", (11, 2), (2, 2), [("S", 0), ("S", 0)]),
    ("tp_replicated", (4, 6), (2, 2), [("S", 1), ("R", 0)]),
    ("scalar", (), (2, 2), [("R", 0), ("R", 0)]),
    ("empty", (0, 3), (4,), [("S", 0)]),
]


def full_value(name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g) if shape else torch.randn((), generator=g)


def placements_of(spec):
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(d) if kind == "S" else Replicate() for kind, d in spec]


def local_tensors(rank, world):
    """Every case's Layout on this rank over a fresh copy of its local tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from fsdp_ema.model import layouts as _layouts
    from fsdp_ema.model.fsdp1 import sharded_tensor

    group = torch.distributed.group.WORLD
    out = {}
    for name, shape, mesh_shape, spec in MESH_CASES:
        mesh = init_device_mesh("cpu", mesh_shape)
        d = distribute_tensor(full_value(name, shape), mesh, placements_of(spec),
                              src_data_rank=None)
        out[name] = _layouts.layout_of(name, d)
    for name, shape in (("st_rows", (10, 3)), ("st_uneven", (2, 5))):
        full = full_value(name, shape)
        begin, end = _layouts.chunk_rows(shape[0], rank, world)
        out[name] = _layouts.layout_of(
            name, sharded_tensor(full[begin:end].clone(), torch.Size(shape), rank, world, group))
    for name, shape in (("flat_member", (9, 2)), ("flat_scalar", ())):
        full = full_value(name, shape)
        rows = full
        if shape:
            begin, end = _layouts.chunk_rows(shape[0], rank, world)
            rows = full[begin:end].clone()
        out[name] = _layouts.rows(name, rows, torch.Size(shape), rank, world)
    out["plain"] = _layouts.layout_of("plain", full_value("plain", (7, 3)).clone())
    out["shared"] = _layouts.whole("shared", full_value("shared", (7, 3)).clone(),
                                   writers=world)
    return out


def run_pieces(rank, world):
    out = {}
    for layout in local_tensors(rank, world).values():
        out.update(layout.piece(rank))
    return out


def run_round_trip(rank, world, directory):
    """Save every case's pieces, then read each back: ``read()`` + ``take`` + ``assign`` into a
    zeroed local tensor, and ``target()`` through the collective load into another."""
    from fsdp_ema import checkpoint as ckpt
    from fsdp_ema.store.collective import load_collective, save_collective

    group = torch.distributed.group.WORLD
    layouts = local_tensors(rank, world)
    pieces = {}
    for layout in layouts.values():
        pieces.update(layout.piece(rank))
    save_collective(directory, lambda: pieces, group=group, device=torch.device("cpu"),
                    what="test", overwrite=False)
    mine = {name: layout.local.clone() for name, layout in layouts.items()
            if layout.local is not None}
    assigned = {}
    for name, layout in layouts.items():
        request = layout.read()
        if request is None:
            continue
        layout.local.zero_()
        k, n = request.request
        loaded = ckpt.load(directory, [name], rank=k, world_size=n)[name]
        layout.assign(request.take(loaded))
        assigned[name] = layout.local.clone()
        layout.local.zero_()
    load_collective(directory, lambda info: [layout.target() for layout in layouts.values()],
                    group=group, device=torch.device("cpu"), what="test")
    targeted = {name: layout.local.clone() for name, layout in layouts.items()
                if layout.local is not None}
    return mine, assigned, targeted


def run_full_parts(rank, world):
    """The full tensors the gather makes of every DTensor and whole layout's ``full_part``."""
    from fsdp_ema.store.full_state import full_buckets

    parts = [layout.full_part() for name, layout in local_tensors(rank, world).items()
             if not name.startswith(("st_", "flat_"))]
    kinds = {p.fqn: p.kind for p in parts}
    full = {}
    for bucket in full_buckets(parts, 1 << 20):
        full.update({fqn: t.clone() for fqn, t, _ in bucket})
    return kinds, full


@pytest.fixture(scope="module")
def pool():
    manager = PoolManager()
    yield manager.get(WORLD)
    manager.close()


def expected_full():
    out = {name: full_value(name, shape) for name, shape, _, _ in MESH_CASES}
    out.update({name: full_value(name, shape) for name, shape in
                (("st_rows", (10, 3)), ("st_uneven", (2, 5)), ("flat_member", (9, 2)),
                 ("flat_scalar", ()), ("plain", (7, 3)), ("shared", (7, 3)))})
    return out


def test_pieces_of_every_layout_cover_the_full_tensor_exactly_once(pool):
    results = pool.run(run_pieces)
    for name, full in expected_full().items():
        covered = torch.zeros(full.shape, dtype=torch.int64)
        rebuilt = torch.zeros_like(full)
        writers = []
        for rank, pieces in enumerate(results):
            if name not in pieces:
                continue
            writers.append(rank)
            piece = pieces[name]
            if isinstance(piece, torch.Tensor):  # written whole
                assert list(piece.shape) == list(full.shape), name
                covered += 1
                rebuilt.copy_(piece)
                continue
            local, offsets, shape = piece
            assert list(shape) == list(full.shape), name
            region = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
            covered[region] += 1
            rebuilt[region] = local
        assert writers, name
        assert bool((covered == 1).all()), (name, covered)
        assert torch.equal(rebuilt, full), name
    # Who writes: the first replica's boxes; rank 0 alone for what is written whole.
    assert sorted(r for r, p in enumerate(results) if "hsdp" in p) == [0, 1]
    assert sorted(r for r, p in enumerate(results) if "replicated" in p) == [0]
    assert sorted(r for r, p in enumerate(results) if "plain" in p) == [0]
    assert sorted(r for r, p in enumerate(results) if "shared" in p) == [0, 1, 2, 3]
    assert sorted(r for r, p in enumerate(results) if "fewer_rows_than_ranks" in p) == [0, 1]


def test_read_and_assign_give_back_each_ranks_local_tensor(pool, tmp_path):
    results = pool.run(run_round_trip, str(tmp_path / "ckpt"))
    for rank, (mine, assigned, targeted) in enumerate(results):
        assert set(targeted) == set(mine)
        for name, local in mine.items():
            assert torch.equal(targeted[name], local), (rank, name)
            if name in assigned:
                assert torch.equal(assigned[name], local), (rank, name)
        # Every rank holding elements of a tensor reads them (empty shards need no read).
        assert {n for n, t in mine.items() if t.numel() > 0} <= set(assigned), rank


def test_full_part_of_every_mesh_layout_gathers_the_full_tensor(pool):
    expected = expected_full()
    for kinds, full in pool.run(run_full_parts):
        assert set(full) == set(kinds)
        for name, t in full.items():
            assert torch.equal(t, expected[name]), name
        # Rows where the read is rows (one gather_shards call), full_tensor() for other boxes.
        assert kinds["fsdp_uneven"] == kinds["hsdp"] == "rows"
        assert kinds["cols"] == kinds["tp_2d"] == "dtensor"
        assert kinds["replicated"] == kinds["scalar"] == kinds["plain"] == "full"


def test_chunk_rows_is_torch_chunk():
    """The row rule the layouts use (the chunk_rows op, fsdp_ema/format/rows.h) is torch.chunk's,
    for thousands of (rows, world) pairs, every rank."""
    from fsdp_ema.model.layouts import chunk_rows

    rnd = random.Random(0)
    cases = [(rows, world) for rows in range(0, 40) for world in range(1, 12)]
    cases += [(rnd.randrange(0, 10**6), rnd.randrange(1, 300)) for _ in range(200)]
    for rows, world in cases:
        t = torch.empty(rows, 0)
        chunks = torch.chunk(t, world) if rows else ()
        begin = 0
        for rank in range(world):
            size = chunks[rank].shape[0] if rank < len(chunks) else 0
            assert chunk_rows(rows, rank, world) == (begin, begin + size), (rows, rank, world)
            begin += size
        assert begin == rows
