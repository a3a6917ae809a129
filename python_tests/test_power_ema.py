"""PowerEMA / ShardedPowerEMA (issue #18): gamma from sigma_rel against numpy's cubic roots, the
per-step power EMA against a direct float64 evaluation of its weights, profiles through
update_multi_, the compiled step, snapshots and state dicts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import fsdp_ema
from fsdp_ema import PowerEMA, ShardedEMA, ShardedPowerEMA
from fsdp_ema.power_ema import SNAPSHOT_GAMMA_KEY, SNAPSHOT_STEP_KEY


@pytest.mark.parametrize("sigma_rel", [0.01, 0.05, 0.08, 0.1, 0.2, 0.28, 1 / math.sqrt(12)])
def test_gamma_is_the_largest_real_root_of_the_papers_cubic(sigma_rel):
    s = sigma_rel ** -2
    want = np.roots([1, 7, 16 - s, 12 - s]).real.max()  # numpy: eigenvalues, independent
    got = PowerEMA(sigma_rel).gamma
    assert got == pytest.approx(want, rel=1e-10, abs=1e-9)
    assert PowerEMA(gamma=got).sigma_rel == pytest.approx(sigma_rel, rel=1e-12)
    # The definition: the std of (g + 1) x^g on [0, 1].
    g = got
    assert math.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3))) == pytest.approx(sigma_rel, rel=1e-12)


@pytest.mark.parametrize("bad", [0.0, -0.1, 0.29, 1.0, float("nan"), float("inf")])
def test_sigma_rel_out_of_range_is_a_clear_error(bad):
    with pytest.raises(RuntimeError, match=r"sigma_rel must be in \(0, 0.288675"):
        PowerEMA(bad)
    with pytest.raises(RuntimeError, match="gamma must be finite and >= 0"):
        PowerEMA(gamma=-1.0)


def weight_sequence(steps, shape=(5, 3), seed=0):
    """Weights of steps 1..T: a drifting random walk (what training does to weights)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    out = []
    for _ in range(steps):
        w = w + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64) + 0.01
        out.append(w.clone())
    return out


def direct_power_ema(thetas, gamma, update_every=1):
    """sum_tau w_tau theta_tau with w_tau = (1 - b_tau) prod_{s > tau} b_s, b_t = (1 - 1/t)^(g+1),
    over the averaged steps only, evaluated in float64 directly (no recurrence)."""
    averaged = [th for k, th in enumerate(thetas) if k % update_every == 0]
    n = len(averaged)
    betas = [(1.0 - 1.0 / t) ** (gamma + 1) for t in range(1, n + 1)]
    total = torch.zeros_like(thetas[0])
    for tau in range(1, n + 1):
        w = (1.0 - betas[tau - 1]) * math.prod(betas[tau:])
        total += w * averaged[tau - 1]
    return total


@pytest.mark.parametrize("ema_dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("update_every", [1, 3])
def test_per_step_power_ema_equals_direct_float64_evaluation(ema_dtype, tol, update_every):
    thetas = weight_sequence(60)
    net = nn.Linear(3, 5, bias=False).double()
    single = ShardedEMA(net, schedule=PowerEMA(0.1), dtype=ema_dtype, update_every=update_every)
    multi = ShardedPowerEMA(net, (0.05, 0.1, 0.2), dtype=ema_dtype, update_every=update_every)
    for th in thetas:
        with torch.no_grad():
            net.weight.copy_(th)
        single.update()
        multi.update()
    want = direct_power_ema(thetas, PowerEMA(0.1).gamma, update_every)
    scale = want.abs().max().item()
    torch.testing.assert_close(single.state_dict()["weight"].double(), want, rtol=0,
                               atol=tol * scale)
    for k, p in enumerate(multi.profiles):
        want_k = direct_power_ema(thetas, p.gamma, update_every)
        torch.testing.assert_close(multi.profile_tensors(k)[0].double(), want_k, rtol=0,
                                   atol=tol * scale)
    # The single-profile schedule and profile 1 of the multi-profile EMA are the same average.
    assert torch.equal(single.state_dict()["weight"], multi.profile_tensors(1)[0])
    assert multi.decay_at(0) == [0.0, 0.0, 0.0]
    assert single.decay_at(update_every) == pytest.approx((1 - 1 / 2) ** (PowerEMA(0.1).gamma + 1))


def test_profiles_share_one_update_multi_call_per_step(monkeypatch):
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ema = ShardedPowerEMA(net, (0.05, 0.1))
    calls = []
    real = torch.ops.fsdp_ema.update_multi_

    class Spy:
        def __call__(self, *args):
            calls.append(args)
            return real(*args)

    monkeypatch.setattr(torch.ops.fsdp_ema, "update_multi_", Spy())
    ema.update()
    assert len(calls) == 1
    flat, model, decays = calls[0]
    assert len(flat) == 2 * len(model) and len(decays) == 2


def test_compiled_step_with_two_profiles_compiles_once():
    torch._dynamo.reset()

    def make():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        params = list(net.parameters())
        ema = ShardedPowerEMA(net, (0.05, 0.1))

        def step():
            with torch.no_grad():
                torch._foreach_add_(params, [p.grad for p in params], alpha=-0.05)
            ema.update()

        return net, ema, step

    counter = CompileCounterWithBackend("inductor")
    net_c, ema_c, step_c = make()
    step_c = torch.compile(step_c, backend=counter, fullgraph=True)
    net_e, ema_e, step_e = make()
    g = torch.Generator().manual_seed(1)
    for _ in range(15):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        for net, step in ((net_c, step_c), (net_e, step_e)):
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            step()
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"
    for k in range(2):
        for a, b in zip(ema_c.profile_tensors(k), ema_e.profile_tensors(k)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(ema_c.profile_tensors(0)[0], ema_c.profile_tensors(1)[0])
    assert int(ema_c.step) == 15


def test_snapshots_record_step_and_gamma_and_load_as_checkpoints(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ema = ShardedPowerEMA(net, (0.05, 0.1), snapshot_every=4, snapshot_root=tmp_path,
                          update_every=2)
    written = []
    for n in range(1, 13):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.1)
        ema.update()
        written += ema.maybe_snapshot(n)
    # Update counts 4, 8, 12 -> averaging updates t = 2, 4, 6 (update_every=2).
    assert sorted(p.rsplit("/", 1)[1] for p in written) == [
        f"step-{t:09d}.profile-{k}" for t in (2, 4, 6) for k in (0, 1)]
    for d in written:
        k = int(d.rsplit("-", 1)[1])
        meta = fsdp_ema.checkpoint.load(d, [SNAPSHOT_STEP_KEY, SNAPSHOT_GAMMA_KEY])
        assert meta[SNAPSHOT_GAMMA_KEY].dtype == torch.float64
        assert meta[SNAPSHOT_GAMMA_KEY].item() == ema.profiles[k].gamma
        assert meta[SNAPSHOT_STEP_KEY].item() == int(d.split("step-")[1][:9])
    last = [d for d in written if "step-000000006" in d]
    for d in last:
        k = int(d.rsplit("-", 1)[1])
        values = fsdp_ema.checkpoint.load(d)
        shapes = [(n, s) for n, s in ema.state.shapes.items()]
        for (name, _), t in zip(shapes, ema.profile_tensors(k)):
            assert torch.equal(values[name], t)
        other = ShardedEMA(net)
        other.load(d, strict=False)  # the metadata tensors are extra names
        assert all(torch.equal(a, b) for a, b in zip(other.state.tensors, ema.profile_tensors(k)))


def test_state_dict_round_trip_keeps_every_profile():
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    a = ShardedPowerEMA(net, (0.05, 0.1, 0.15))
    for _ in range(5):
        with torch.no_grad():
            net.weight.add_(torch.randn_like(net.weight))
        a.update()
    sd = a.state_dict()
    assert f"{ShardedPowerEMA.PROFILE_KEY}2.weight" in sd
    b = ShardedPowerEMA(net, (0.05, 0.1, 0.15))
    b.load_state_dict(sd)
    assert int(b.step) == 5
    for k in range(3):
        assert all(torch.equal(x, y) for x, y in zip(a.profile_tensors(k), b.profile_tensors(k)))
    bad = dict(sd)
    bad[f"{ShardedPowerEMA.PROFILE_KEY}1.nope"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unexpected 1 name"):
        b.load_state_dict(bad)


def test_swap_and_save_pick_the_profile(tmp_path):
    torch.manual_seed(0)
    net = nn.Linear(2, 2)
    ema = ShardedPowerEMA(net, (0.05, 0.2))
    for _ in range(6):
        with torch.no_grad():
            net.weight.add_(1.0)
        ema.update()
    raw = net.weight.detach().clone()
    with ema.swap(profile=1) as m:
        assert torch.equal(m.weight, ema.profile_tensors(1)[0])
    assert torch.equal(net.weight, raw)
    ema.save(tmp_path / "p0", profile=0)
    assert torch.equal(fsdp_ema.checkpoint.load(tmp_path / "p0")["weight"],
                       ema.profile_tensors(0)[0])
    with pytest.raises(IndexError, match=r"profile must be in \[0, 2\)"):
        ema.save(tmp_path / "p2", profile=2)
    # load(profile=k) takes that profile's weights and leaves the others and the step (which
    # every profile shares) as they are; save records no step for one profile.
    ema.save(tmp_path / "p1", profile=1)
    assert "fsdp_ema.ema" not in fsdp_ema.checkpoint.info(tmp_path / "p1").get("metadata", {})
    fresh = ShardedPowerEMA(nn.Linear(2, 2), (0.05, 0.2))
    before0 = [t.clone() for t in fresh.profile_tensors(0)]
    fresh.load(tmp_path / "p1", profile=1)
    assert all(torch.equal(a, b) for a, b in zip(fresh.profile_tensors(1), ema.profile_tensors(1)))
    assert all(torch.equal(a, b) for a, b in zip(fresh.profile_tensors(0), before0))
    assert int(fresh.step) == 0


def test_bad_arguments():
    net = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="profiles must differ"):
        ShardedPowerEMA(net, (0.1, 0.1))
    with pytest.raises(ValueError, match="snapshot_every needs snapshot_root"):
        ShardedPowerEMA(net, (0.05, 0.1), snapshot_every=10)
    with pytest.raises(ValueError, match="no warmup or start_step"):
        ShardedEMA(net, schedule=PowerEMA(0.1), start_step=3)
    with pytest.raises(RuntimeError, match="no update yet"):
        ShardedPowerEMA(net, (0.05, 0.1)).snapshot("/tmp/unused")
    owner = nn.Module()  # a buffer whose FQN is the snapshot step's name
    owner.add_module("fsdp_ema", nn.Module())
    owner.fsdp_ema.add_module("snapshot", nn.Module())
    owner.fsdp_ema.snapshot.register_buffer("step", torch.zeros(()))
    with pytest.raises(ValueError, match="a name snapshots keep their metadata under"):
        ShardedPowerEMA(owner, (0.05, 0.1))
