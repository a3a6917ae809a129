"""The device-specific parts of #17: an EMA in pinned host memory for CUDA weights
(``device="cpu"``), and async saves of CUDA tensors staged into pinned buffers. Skips without a
CUDA device.

The offloaded EMA is compared bit for bit with the on-device EMA of the same weights (plain model
and FSDP2 on one GPU); the EMA holds no device memory; the bf16 weights are staged as bf16; the
optimizer's in-place write right after update() (no synchronize) does not leak into the EMA.
"""

import pytest
import torch
from cuda_utils import nccl_group

from fsdp_ema import ShardedEMA
from fsdp_ema import checkpoint as ckpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 257), torch.nn.Tanh(),
                                torch.nn.Linear(257, 9))
    model.register_buffer("scale", torch.linspace(0.5, 1.5, 9))
    return model.cuda().to(dtype)


def train(model, emas, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(steps):
        x = torch.randn(16, 64, device="cuda", generator=g).to(next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        for ema in emas:
            ema.update()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("update_every", [1, 3])
def test_offloaded_ema_matches_the_device_ema(dtype, update_every):
    model = make_model(dtype)
    ref = ShardedEMA(model, 0.9, warmup=True, update_every=update_every)
    off = ShardedEMA(model, 0.9, warmup=True, update_every=update_every, device="cpu")
    assert off.state.host is not None
    assert all(t.device.type == "cpu" and t.is_pinned() for t in off.state.tensors)
    assert all(s.is_pinned() and s.dtype == dtype for s in off.state.host.staging[:2])
    train(model, [ref, off], 7)
    off.synchronize()
    sr, so = ref.state_dict(), off.state_dict()
    for k in sr:
        if k == ShardedEMA.STEP_KEY:
            assert int(sr[k]) == int(so[k])
            continue
        assert so[k].device.type == "cpu"
        assert torch.equal(so[k], sr[k].cpu()), k


def test_offloaded_ema_under_fsdp2_local_shards():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with nccl_group():
        model = make_model()
        mesh = init_device_mesh("cuda", (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        ref = ShardedEMA(model, 0.9)
        off = ShardedEMA(model, 0.9, device="cpu")
        train(model, [ref, off], 5)
        got = off.full_state_dict(rank0_only=False)
        want = ref.full_state_dict(rank0_only=False)
        for k in want:
            assert torch.equal(got[k].cpu(), want[k].cpu()), k
        # state_dict() is a view of the host EMA (no device copy), so dcp.load into it
        # reaches the EMA.
        before = torch.cuda.memory_allocated()
        sd = off.state_dict()
        assert torch.cuda.memory_allocated() == before
        views = {k: v for k, v in sd.items() if k != ShardedEMA.STEP_KEY}
        assert views and all(v._local_tensor.device.type == "cpu" for v in views.values())
        assert {v._local_tensor.data_ptr() for v in views.values()} <= {
            t.data_ptr() for t in off.state.tensors}


def test_optimizer_step_right_after_update_waits_for_the_copy():
    """The copy runs on a side stream, overlapping the next forward; the optimizer's write of
    the weights must still come after it (the step pre-hook's device-side wait). A sleep on the
    training's stream before update() holds the copy back, so an optimizer kernel that did not
    wait would run beside it and the EMA would see the new weights."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(1 << 26, device="cuda"))  # 256 MiB
    off = ShardedEMA(model, 0.5, device="cpu")
    before = model.w.detach().cpu()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model.w.grad = torch.ones_like(model.w)
    for _ in range(2):
        torch.cuda._sleep(200_000_000)  # the copy waits behind this (on the device)
        off.update()
        assert off.state.host._device_waits  # no wait yet: the copy may overlap what comes next
        opt.step()  # w -= 1, on the training's stream
        assert not off.state.host._device_waits
        off.synchronize()
        # ema = lerp(ema, w at update(), 0.5): the weights from before this step's write.
        assert torch.equal(off.state.tensors[0], before), "the optimizer's write reached the copy"
        before = model.w.detach().cpu()
        off.state.tensors[0].copy_(before)  # restart from the current weights for the second round


def test_async_save_of_cuda_tensors_uses_pinned_staging(tmp_path):
    from fsdp_ema.store import async_save as _async

    t = torch.randn(1 << 20, device="cuda")
    expected = t.cpu()
    handle = ckpt.save(tmp_path / "c", {"t": t}, async_=True)
    t.add_(1)  # on the same stream: after the staging copy
    handle.result(timeout=60)
    assert torch.equal(ckpt.load(tmp_path / "c")["t"], expected)
    buf = _async.default_saver("save").staging.buffers["t"]
    assert buf.is_pinned()
    ptr = buf.data_ptr()
    ckpt.save(tmp_path / "d", {"t": t}, async_=True).result(timeout=60)
    assert _async.default_saver("save").staging.buffers["t"].data_ptr() == ptr
