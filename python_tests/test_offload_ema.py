"""EMA in host memory (#17): ``ShardedEMA(..., device="cpu")``.

Without a GPU the same path (staging snapshot, worker thread, synchronize) runs for CPU models
when forced (``fsdp_ema.ema.offload.forced_for_cpu_models()``, via ``offloaded`` below); it must
give bit for bit the EMA of the ordinary EMA (an independent reference, the on-device path, run
beside it), with warmup, update_every, start_step, copied and averaged buffers, bf16 weights under
an fp32 EMA, and FSDP2 local shards at 2 ranks. The device-specific parts (pinned memory, the
side stream) are in test_cuda_offload_ema.py.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import PoolManager
from torch import nn

from fsdp_ema import ShardedEMA, Warmup
from fsdp_ema import checkpoint as ckpt
from fsdp_ema.ema.offload import forced_for_cpu_models


def offloaded(model, *args, **kwargs):
    """``ShardedEMA(model, *args, device="cpu", **kwargs)`` on the host-memory path, forced for
    a model on the CPU."""
    with forced_for_cpu_models():
        return ShardedEMA(model, *args, device="cpu", **kwargs)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.bn = nn.BatchNorm1d(5)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.lin(x))))


def train_both(model, emas, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g).to(next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        for ema in emas:
            ema.update()


def assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        x = sa[k].to_local() if hasattr(sa[k], "to_local") else sa[k]
        y = sb[k].to_local() if hasattr(sb[k], "to_local") else sb[k]
        assert x.dtype == y.dtype and torch.equal(x, y), k


@pytest.mark.parametrize("kwargs", [
    {},
    {"warmup": Warmup(power=0.75), "update_every": 3, "start_step": 2},
    {"buffers": "copy", "update_every": 2},
    {"dtype": None, "decay": 0.9},
])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_offloaded_path_is_bit_exact(kwargs, param_dtype):
    torch.manual_seed(0)
    model = Net().to(param_dtype)
    kw = {"decay": 0.99, **kwargs}
    ref = ShardedEMA(model, **kw)
    off = offloaded(model, **kw)
    assert off.state.host is not None and ref.state.host is None
    train_both(model, [ref, off], 8)  # the last update (k=7) is skipped by update_every
    off.synchronize()
    assert_same(off, ref)
    assert int(off.step) == int(ref.step) == 8


def test_update_stages_a_snapshot_and_reads_wait():
    model = nn.Linear(300, 300)
    ema = offloaded(model, 0.5)
    ref = ShardedEMA(model, 0.5)
    with torch.no_grad():
        model.weight.add_(1)
    ema.update()
    ref.update()
    with torch.no_grad():  # the next step writes the weights while the worker may still run
        model.weight.mul_(-3)
    # state_dict waits for the update in flight: it saw the weights at update() time.
    assert torch.equal(ema.state_dict()["weight"], ref.state_dict()["weight"])
    ema.update()
    ref.update()
    with ema.swap():  # swap waits too
        assert torch.equal(model.weight, ref.state_dict()["weight"])
    assert_same(ema, ref)


def test_offloaded_save_waits_for_the_update(tmp_path):
    model = nn.Linear(64, 64)
    ema = offloaded(model, 0.9)
    ref = ShardedEMA(model, 0.9)
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(0.5)
        ema.update()
        ref.update()
    ema.save(tmp_path / "e")
    assert torch.equal(ckpt.load(tmp_path / "e")["weight"], ref.state_dict()["weight"])


def test_worker_errors_surface_on_synchronize(monkeypatch):
    model = nn.Linear(4, 4)
    ema = offloaded(model, 0.9)

    def boom(*args):
        raise RuntimeError("injected update failure")

    monkeypatch.setattr(torch.ops.fsdp_ema, "update_", boom)
    ema.update()
    with pytest.raises(RuntimeError, match="injected update failure"):
        ema.synchronize()


def test_device_argument_is_checked():
    with pytest.raises(ValueError, match="device must be None"):
        ShardedEMA(nn.Linear(2, 2), device="meta")
    # A CPU model with device="cpu" needs no offload: the ordinary path.
    assert ShardedEMA(nn.Linear(2, 2), device="cpu").state.host is None


# --- FSDP2 at 2 ranks -----------------------------------------------------------------------------

def run_fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    mesh = init_device_mesh("cpu", (world,))
    for m in (model[0], model[2]):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ref = ShardedEMA(model, 0.9, warmup=True, update_every=2)
    off = offloaded(model, 0.9, warmup=True, update_every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref.update()
        off.update()
    # The worker staged the local shards (plain tensors, not DTensors).
    assert all(type(t) is torch.Tensor for t in off.state.host.staging)
    # The view state_dict() builds for a host EMA on an accelerator mesh (there the devices
    # differ; here the same construction is checked on the CPU) is the DTensor from_local makes,
    # over the EMA tensor itself: uneven shards (7 rows over 2 ranks) keep their global shape.
    from torch.distributed.tensor import DTensor

    from fsdp_ema.model.slots import dtensor_view

    off.synchronize()  # the last update may still be running on the worker thread
    for slot, ema in zip(off.state.slots, off.state.tensors):
        want = DTensor.from_local(ema, slot.mesh, slot.placements, run_check=False,
                                  shape=slot.global_shape,
                                  stride=torch.empty(slot.global_shape, device="meta").stride())
        got = dtensor_view(ema, slot.mesh, slot.placements, slot.global_shape, want.stride())
        assert got._local_tensor is ema
        assert (got.shape, got.stride(), got.placements, got.dtype) == (
            want.shape, want.stride(), want.placements, want.dtype), slot.fqn
        assert torch.equal(got.full_tensor(), want.full_tensor()), slot.fqn
    return ({k: v.clone() for k, v in off.full_state_dict().items()},
            {k: v.clone() for k, v in ref.full_state_dict().items()})


def test_fsdp2_local_shards_are_offloaded():
    manager = PoolManager()
    try:
        results = manager.get(2).run(run_fsdp2)
    finally:
        manager.close()
    off, ref = results[0]
    assert sorted(off) == sorted(ref) and off
    for k in ref:
        assert torch.equal(off[k], ref[k]), k
