"""torch.ops.fsdp_ema.gather_shards: dim-0 shards -> full tensors with one collective (gloo)."""

import pytest
import torch
from dist_utils import PoolManager


def _chunk(t, rank, world):
    cs = -(-t.shape[0] // world)
    begin = min(rank * cs, t.shape[0])
    return t[begin:begin + cs]


def _tensors(count=0):
    g = torch.Generator().manual_seed(0)
    out = [
        torch.randn(5, 3, generator=g),                      # uneven over 2 and 3 ranks
        torch.arange(2, dtype=torch.int64),                  # fewer rows than 3 ranks: empty chunk
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randn(0, 4, generator=g),                      # empty tensor
        torch.randn(4, 2, 3, generator=g).to(torch.float16),
        torch.rand(9, generator=g) > 0.5,
        torch.randn(3, generator=g).to(torch.float64),
    ]
    out += [torch.randn(1 + i % 17, 8, generator=g) for i in range(count)]
    return out


def _gather_all(rank, world, count):
    import torch.distributed as dist

    full = _tensors(count)
    shards = [_chunk(t, rank, world) for t in full]
    out = torch.ops.fsdp_ema.gather_shards(shards, [t.shape[0] for t in full],
                                           dist.group.WORLD.group_name)
    return all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(out, full)), len(out)


def _gather_in_subgroup(rank, world):
    import torch.distributed as dist

    group = dist.new_group([0, 1])  # every rank creates it; only members use it
    if rank not in (0, 1):
        return None
    sub_rank = dist.get_rank(group)
    full = _tensors()
    shards = [_chunk(t, sub_rank, 2) for t in full]
    out = torch.ops.fsdp_ema.gather_shards(shards, [t.shape[0] for t in full], group.group_name)
    return all(torch.equal(a, b) for a, b in zip(out, full))


def _gather_compiled(rank, world):
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend

    name = dist.group.WORLD.group_name
    counter = CompileCounterWithBackend("aot_eager")

    def fn(a, b):
        x, y = torch.ops.fsdp_ema.gather_shards([a * 2, b], [5, 7], name)
        return x.sum() + y.sum()

    torch.manual_seed(0)  # the same full tensors on every rank
    full = [torch.randn(5, 3), torch.randn(7)]
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    got = compiled(_chunk(full[0], rank, world), _chunk(full[1], rank, world))
    expected = (full[0] * 2).sum() + full[1].sum()
    return bool(torch.allclose(got, expected)), counter.frame_count


def _expect_error(rank, world, case):
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    good = torch.ones(3 if rank == 0 else 2, 4)  # 5 rows over 2 ranks: 3 + 2
    bad = {
        "lengths": lambda: torch.ops.fsdp_ema.gather_shards([good], [5, 5], name),
        "rows": lambda: torch.ops.fsdp_ema.gather_shards([torch.ones(1, 4)], [5], name),
        "zero_dim": lambda: torch.ops.fsdp_ema.gather_shards([torch.tensor(1.0)], [1], name),
        "group": lambda: torch.ops.fsdp_ema.gather_shards([good], [5], "no-such-group"),
    }[case]
    try:
        bad()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


@pytest.mark.parametrize("world", [2, 3])
def test_gather_equals_unsharded_tensors(pools, world):
    results = pools.get(world).run(_gather_all, 200)
    assert all(ok for ok, _ in results), results
    assert all(n == len(_tensors(200)) for _, n in results)


def test_subgroup_gathers_among_its_members_only(pools):
    results = pools.get(3).run(_gather_in_subgroup)
    assert results == [True, True, None]


def test_gather_inside_torch_compile_fullgraph(pools):
    results = pools.get(2).run(_gather_compiled)
    assert results == [(True, 1), (True, 1)]


ERRORS = {
    "lengths": "shards has 1 tensors but rows has 2 entries",
    "rows": "shards[0] has 1 rows but rank",
    "zero_dim": "shards[0] is 0-dim",
    "group": "group_name 'no-such-group' names no process group",
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_an_error_not_a_hang(pools, case):
    messages = pools.get(2).run(_expect_error, case, timeout=60)
    for m in messages:
        assert m is not None and "fsdp_ema::gather_shards: " in m and ERRORS[case] in m, m
