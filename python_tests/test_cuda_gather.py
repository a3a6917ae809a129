"""gather_shards on CUDA over a one-rank NCCL group: the batched pack/unpack kernels and the
all-gather, against plain torch tensors (bit-exact). Skips without a CUDA device.

With one rank every chunk is the whole tensor, so the unpack writes to fresh (aligned) outputs;
misaligned destinations are covered by tests/test_cuda_batched_copy.cpp, which drives the copy
kernel with every source and destination alignment.
"""

import pytest
import torch
from cuda_utils import nccl_group, side_stream_behind_a_sleep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def group():
    with nccl_group() as g:
        yield g


def bits(t):
    """The tensor's bytes, so that NaN payloads and -0.0 compare too."""
    return t.reshape(-1).contiguous().view(torch.uint8) if t.numel() else t


def assert_same(out, full):
    assert len(out) == len(full)
    for i, (a, b) in enumerate(zip(out, full)):
        assert a.device == b.device and a.dtype == b.dtype and a.shape == b.shape, (i, a, b)
        assert a.is_contiguous(), i
        assert torch.equal(bits(a), bits(b)), f"tensor {i} differs"


def mixed_tensors():
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    special = torch.tensor([float("nan"), -0.0, float("inf"), -1.5, 65504.0], device="cuda")
    return [
        r(5, 3),
        torch.arange(7, device="cuda", dtype=torch.int64),
        r(7, dtype=torch.bfloat16),
        r(0, 4),                                            # no rows
        r(6, 0),                                            # rows of zero bytes
        r(4, 2, 3, dtype=torch.float16),
        torch.rand(9, generator=g, device="cuda") > 0.5,    # bool
        r(3, dtype=torch.float64),
        torch.randint(0, 255, (13, 3), generator=g, device="cuda", dtype=torch.uint8),
        special.to(torch.float16),
        r(70001),                                           # more than one copy block
        r(33, 1000, dtype=torch.bfloat16),
    ]


def gather(tensors, group):
    return torch.ops.fsdp_ema.gather_shards(tensors, [t.shape[0] for t in tensors],
                                            group.group_name)


def test_mixed_dtypes_and_empty_tensors(group):
    full = mixed_tensors()
    assert_same(gather(full, group), full)


def test_misaligned_and_non_contiguous_inputs(group):
    """Inputs that start at every byte offset 0..15 (the pack reads them with the widest common
    alignment) and strided ones (copied contiguous first)."""
    base = torch.randint(0, 255, (1 << 20,), device="cuda", dtype=torch.uint8)
    half = torch.randn(1 << 18, device="cuda").to(torch.bfloat16)
    grid = torch.randn(300, 40, device="cuda")
    shards = [base[off:off + 70000 + off] for off in range(16)]
    shards += [half[off:off + 4097] for off in range(8)]
    shards += [grid[:, ::3], grid.t()[5:30]]
    full = [s.clone() for s in shards]
    assert_same(gather(shards, group), full)


def test_many_small_tensors_in_one_call(group):
    g = torch.Generator(device="cuda").manual_seed(1)
    full = [torch.randn(1 + i % 17, 1 + i % 5, generator=g, device="cuda") for i in range(1500)]
    assert_same(gather(full, group), full)


def test_runs_on_the_current_side_stream(group):
    """The shard is rewritten on a side stream behind a long sleep; a gather issued on that
    stream must pack the new values."""
    shard = torch.zeros(1 << 20, device="cuda")
    with side_stream_behind_a_sleep():
        shard.fill_(3.25)
        (out,) = gather([shard], group)
        total = out.sum()
    assert float(total) == 3.25 * (1 << 20)
    assert torch.equal(out, torch.full_like(out, 3.25))


def test_large_gather_matches_torch_copies(group):
    g = torch.Generator(device="cuda").manual_seed(2)
    full = [torch.randn(4099, 1031, generator=g, device="cuda"),
            torch.randn(8191, 513, generator=g, device="cuda").to(torch.float16),
            torch.randn(3, generator=g, device="cuda").to(torch.float64)]
    assert_same(gather(full, group), full)
