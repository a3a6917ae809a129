"""fsdp_ema.posthoc and `fsdp-ema posthoc` (issue #18): the least-squares weights against an
independent numpy solve, reconstruction of a sigma_rel that was also tracked directly, agreement
with ema-pytorch's PostHocEMA on the same run, 2 gloo ranks equal to one process, the CLI equal
to Python bit for bit, and clear errors for bad inputs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_utils import PoolManager
from torch import nn

import fsdp_ema

ROOT = Path(__file__).resolve().parents[1]
CLI = Path(os.environ.get("FSDP_EMA_BUILD", ROOT / "build")) / "bin" / "fsdp-ema"
SIGMAS = (0.05, 0.10)
TARGET = 0.07  # tracked directly too, never snapshotted


def gram(t_a, g_a, t_b, g_b):
    """<p_a, p_b> for p(x) = (g + 1) x^g / t^(g + 1) on [0, t], by the integral written out
    (independent of format/posthoc/posthoc.cpp)."""
    m = np.minimum(t_a, t_b)
    return ((g_a + 1) * (g_b + 1) * m ** (g_a + g_b + 1)
            / ((g_a + g_b + 1) * t_a ** (g_a + 1) * t_b ** (g_b + 1)))


def numpy_weights(steps, gammas, step, gamma):
    t, g = np.asarray(steps, float), np.asarray(gammas, float)
    a = gram(t[:, None], g[:, None], t[None, :], g[None, :])
    b = gram(t, g, float(step), gamma)
    return np.linalg.solve(a, b)


def test_weights_equal_an_independent_numpy_solve():
    steps = [100, 200, 300, 400] * 2
    gammas = [fsdp_ema.PowerEMA(s).gamma for s in SIGMAS for _ in range(4)]
    for sigma, step in ((0.07, 400), (0.15, 400), (0.03, 250)):
        gamma = fsdp_ema.PowerEMA(sigma).gamma
        got = torch.ops.fsdp_ema.posthoc_weights(steps, gammas, step, gamma)
        np.testing.assert_allclose(got, numpy_weights(steps, gammas, step, gamma), rtol=1e-7,
                                   atol=1e-9)
    # A tracked profile at the last step is reproduced by itself alone.
    got = torch.ops.fsdp_ema.posthoc_weights(steps, gammas, 400, gammas[-1])
    np.testing.assert_allclose(got, [0] * 7 + [1], atol=1e-9)


def train(root, steps=300, every=25, ema_pytorch_dir=None):
    """One training run: SGD on a noisy regression; ShardedPowerEMA profiles 0.05 and 0.10 with
    snapshots every `every` steps, a ShardedEMA tracking TARGET directly, and optionally
    ema-pytorch's PostHocEMA with the same profiles and checkpoint steps."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    ours = fsdp_ema.ShardedPowerEMA(net, SIGMAS, snapshot_every=every, snapshot_root=root)
    direct = fsdp_ema.ShardedEMA(net, schedule=fsdp_ema.PowerEMA(TARGET))
    ref = None
    if ema_pytorch_dir is not None:
        from ema_pytorch import PostHocEMA

        ref = PostHocEMA(net, sigma_rels=SIGMAS, update_every=1,
                         checkpoint_every_num_steps=every, checkpoint_folder=ema_pytorch_dir,
                         checkpoint_dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    for n in range(1, steps + 1):
        x = torch.randn(32, 8, generator=g)
        y = x @ w + 0.5 * torch.randn(32, 1, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        ours.update()
        direct.update()
        if ref is not None:
            ref.update()
        ours.maybe_snapshot(n)
    final = {n: p.detach().clone() for n, p in net.named_parameters()}
    return net, ours, dict(zip(direct.state.shapes, direct.state.tensors)), final, ref


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("posthoc")
    _, ours, direct, final, ref = train(base / "snapshots", ema_pytorch_dir=base / "ema_pytorch")
    return {"base": base, "root": base / "snapshots", "ours": ours, "direct": direct,
            "final": final, "ref": ref}


def test_reconstruction_of_a_directly_tracked_sigma_rel(run, tmp_path):
    """Tolerance: per tensor, max |reconstructed - tracked| <= 5% of max |tracked - final
    weights| (the size of the EMA's own effect). The snapshot profiles 0.05 and 0.10 alone are
    both farther than that, so the bound tells a right combination from a wrong one."""
    plan = fsdp_ema.posthoc(run["root"], sigma_rel=TARGET, out=tmp_path / "out")
    assert len(plan["snapshots"]) == 24 and plan["step"] == 300
    assert sum(plan["weights"]) == pytest.approx(1.0, abs=0.02)
    rec = fsdp_ema.checkpoint.load(tmp_path / "out")
    assert sorted(rec) == sorted(run["direct"])
    last = {k: t for k, t in zip(run["ours"].state.shapes, run["ours"].profile_tensors(0))}
    last1 = {k: t for k, t in zip(run["ours"].state.shapes, run["ours"].profile_tensors(1))}
    for name, tracked in run["direct"].items():
        effect = (tracked - run["final"][name]).abs().max().item()
        err = (rec[name] - tracked).abs().max().item()
        assert err <= 0.05 * effect, (name, err, effect)
        for naive in (last[name], last1[name]):
            assert (naive - tracked).abs().max().item() > 0.05 * effect
    # Loads as a normal EMA checkpoint.
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ema = fsdp_ema.ShardedEMA(net)
    ema.load(tmp_path / "out")
    assert torch.equal(ema.state.tensors[0], rec["0.weight"])


def test_agrees_with_ema_pytorch_posthoc_on_the_same_run(run, tmp_path):
    """Same run, same profiles and checkpoint steps. ema-pytorch's KarrasEMA counts t from 2
    (beta = (1 - 1/(n+1))^(g+1) at update n, after copying the weights first) where EDM2 and we
    count from 1, so the two differ by O(gamma / t); tolerance: per tensor 2% of max |tracked -
    final weights|, against > 5% for either snapshot profile alone (previous test)."""
    fsdp_ema.posthoc(run["root"], sigma_rel=TARGET, out=tmp_path / "out")
    rec = fsdp_ema.checkpoint.load(tmp_path / "out")
    theirs = dict(run["ref"].synthesize_ema_model(sigma_rel=TARGET).ema_model.named_parameters())
    for name, tracked in run["direct"].items():
        effect = (tracked - run["final"][name]).abs().max().item()
        err = (rec[name] - theirs[name].detach()).abs().max().item()
        assert err <= 0.02 * effect, (name, err, effect)


def test_cli_equals_python_bit_for_bit(run, tmp_path):
    fsdp_ema.posthoc(run["root"], sigma_rel=0.08, out=tmp_path / "py")
    out = subprocess.run([str(CLI), "posthoc", str(run["root"]), str(tmp_path / "cli"),
                          "--sigma-rel", "0.08"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    # (Progress lines appear only for work past a second: tools/progress.h; cli_test.sh pins them.)
    assert "from 24 snapshots" in out.stdout
    a = fsdp_ema.checkpoint.load(tmp_path / "py")
    b = fsdp_ema.checkpoint.load(tmp_path / "cli")
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    verify = subprocess.run([str(CLI), "verify", str(tmp_path / "cli")], capture_output=True,
                            text=True, check=False)
    assert verify.returncode == 0, verify.stdout


# --- 2 gloo ranks ---------------------------------------------------------------------------------

class Net(nn.Module):
    """7 and 5 rows divide by neither rank count: uneven and empty shards."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 7)
        self.norm = nn.BatchNorm1d(7)
        self.head = nn.Linear(7, 1)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.inp(x))))


def sharded_snapshots(rank, world, root):
    """FSDP2 training on `world` gloo ranks with two profiles, snapshots every 10 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for m in (model.inp, model.head):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = fsdp_ema.ShardedPowerEMA(model, SIGMAS, snapshot_every=10, snapshot_root=root)
    g = torch.Generator().manual_seed(1)
    for n in range(1, 41):
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        ema.maybe_snapshot(n)
    return True


def sharded_posthoc(rank, world, root, out):
    fsdp_ema.posthoc(root, sigma_rel=TARGET, out=out)
    return fsdp_ema.checkpoint.info(out)["world_size"]


@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


def test_sharded_reconstruction_at_2_ranks_equals_single_process(pools, tmp_path):
    root = str(tmp_path / "snapshots")
    assert pools.get(2).run(sharded_snapshots, root) == [True, True]
    assert fsdp_ema.posthoc_plan(root, TARGET)["world_size"] == 2
    assert pools.get(2).run(sharded_posthoc, root, str(tmp_path / "two")) == [2, 2]
    fsdp_ema.posthoc(root, sigma_rel=TARGET, out=tmp_path / "one")
    a = fsdp_ema.checkpoint.load(tmp_path / "two")
    b = fsdp_ema.checkpoint.load(tmp_path / "one")
    assert sorted(a) == sorted(b) and "norm.num_batches_tracked" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # ... and the CLI (one process, torch-free) gives the same bits from the 2-rank snapshots.
    subprocess.run([str(CLI), "posthoc", root, str(tmp_path / "cli"), "--sigma-rel",
                    str(TARGET), "-q"], check=True)
    c = fsdp_ema.checkpoint.load(tmp_path / "cli")
    for name in a:
        assert torch.equal(a[name], c[name]), name


# --- bad inputs -----------------------------------------------------------------------------------

def small_snapshots(root, net=None, steps=6, every=3):
    torch.manual_seed(0)
    net = net or nn.Linear(3, 2)
    ema = fsdp_ema.ShardedPowerEMA(net, SIGMAS, snapshot_every=every, snapshot_root=root)
    for n in range(1, steps + 1):
        with torch.no_grad():
            net.weight.add_(0.1)
        ema.update()
        ema.maybe_snapshot(n)
    return root


def expect_error(root, message, sigma_rel=TARGET, **kw):
    with pytest.raises(RuntimeError, match=message):
        fsdp_ema.posthoc(root, sigma_rel=sigma_rel, out=Path(root).parent / "out", **kw)
    out = subprocess.run([str(CLI), "posthoc", str(root), str(Path(root).parent / "cli_out"),
                          "--sigma-rel", str(sigma_rel)]
                         + ([f"--step={kw['step']}"] if "step" in kw else []),
                         capture_output=True, text=True, check=False)
    assert out.returncode == 1 and "error:" in out.stderr
    import re
    assert re.search(message, out.stderr), out.stderr
    assert not (Path(root).parent / "out").exists() or not (
        Path(root).parent / "out" / "fsdp_ema.index.json").exists()


def test_no_snapshots(tmp_path):
    (tmp_path / "root").mkdir()
    expect_error(tmp_path / "root", "no snapshots")
    root = small_snapshots(tmp_path / "root")
    for d in os.listdir(root):
        os.remove(os.path.join(root, d, "fsdp_ema.index.json"))  # every save interrupted
    expect_error(root, r"no snapshots .*4 incomplete ones without an index")


def test_sigma_rel_out_of_range_and_step_past_the_last_snapshot(tmp_path):
    root = small_snapshots(tmp_path / "root")
    expect_error(root, r"sigma_rel must be in \(0, 0.2886", sigma_rel=0.5)
    expect_error(root, r"sigma_rel must be in \(0, 0.2886", sigma_rel=0.0)
    expect_error(root, r"step must be in \[1, 6\]", step=7)


def test_snapshots_of_different_models(tmp_path):
    root = small_snapshots(tmp_path / "root")
    other = small_snapshots(tmp_path / "other", net=nn.Linear(3, 4))
    shutil.copytree(os.path.join(other, "step-000000006.profile-0"),
                    os.path.join(root, "step-000000009.profile-0"))
    expect_error(root, r"snapshots of different models: tensor 'bias' is F32\[2\] in .* but "
                       r"F32\[4\] in")


def test_snapshots_of_different_world_sizes(tmp_path):
    root = small_snapshots(tmp_path / "root")
    src = os.path.join(root, "step-000000006.profile-1")
    values = fsdp_ema.checkpoint.load(src)
    dst = os.path.join(root, "step-000000009.profile-1")
    for r in range(2):  # the same tensors rewritten as a 2-rank checkpoint
        shards = {}
        for name, t in values.items():
            if t.dim() == 0:
                if r == 0:
                    shards[name] = t
                continue
            rows = -(-t.shape[0] // 2)
            part = t[r * rows:(r + 1) * rows]
            if part.shape[0]:
                shards[name] = (part, [r * rows] + [0] * (t.dim() - 1), list(t.shape))
        fsdp_ema.checkpoint.save_shard(dst, shards, rank=r, world_size=2)
    fsdp_ema.checkpoint.commit(dst, 2)
    expect_error(root, r"snapshots written at different world sizes: .* at 1, .* at 2")


def test_a_checkpoint_that_is_not_a_snapshot_and_duplicate_snapshots(tmp_path):
    root = small_snapshots(tmp_path / "root")
    fsdp_ema.checkpoint.save(os.path.join(root, "plain"), {"weight": torch.zeros(2, 3)})
    expect_error(root, r"plain is a checkpoint but not a power-EMA snapshot")
    shutil.rmtree(os.path.join(root, "plain"))
    shutil.copytree(os.path.join(root, "step-000000003.profile-0"), os.path.join(root, "copy"))
    expect_error(root, r"copy and .*step-000000003\.profile-0 have the same step and gamma")


def test_output_must_not_overwrite_a_checkpoint_unless_asked(tmp_path):
    root = small_snapshots(tmp_path / "root")
    fsdp_ema.posthoc(root, sigma_rel=TARGET, out=tmp_path / "out")
    with pytest.raises(FileExistsError, match="already holds a committed checkpoint"):
        fsdp_ema.posthoc(root, sigma_rel=TARGET, out=tmp_path / "out")
    fsdp_ema.posthoc(root, sigma_rel=0.09, out=tmp_path / "out", overwrite=True)
    with pytest.raises(RuntimeError, match="must not be a snapshot or inside one"):
        fsdp_ema.posthoc(root, sigma_rel=TARGET, out=os.path.join(root, "step-000000003.profile-0"),
                         overwrite=True)


def test_output_is_never_a_snapshot_by_any_path_and_a_refusal_creates_nothing(tmp_path,
                                                                              monkeypatch):
    """#28: the check compared path strings, so "<root>/s/", "./s", "s/." (the CLI) or a link
    (Python) with overwrite replaced a snapshot and made the root unusable. Now by device and
    inode, before anything is created; an output inside the root is refused too."""
    root = small_snapshots(tmp_path / "root")
    snap = "step-000000003.profile-0"
    os.symlink(os.path.join(root, snap), tmp_path / "link")
    monkeypatch.chdir(root)
    before = fsdp_ema.posthoc_plan(root, TARGET)
    for out in [os.path.join(root, snap) + "/", "./" + snap, snap + "/.", tmp_path / "link",
                tmp_path / "link" / "new"]:
        with pytest.raises(RuntimeError, match="must not be a snapshot or inside one"):
            fsdp_ema.posthoc(root, sigma_rel=TARGET, out=out, overwrite=True)
        cli = subprocess.run([str(CLI), "posthoc", str(root), str(out), "--sigma-rel",
                              str(TARGET), "--overwrite"], capture_output=True, text=True)
        assert cli.returncode == 1 and "must not be a snapshot or inside one" in cli.stderr, out
    for out in ["new", os.path.join(root, "deeper", "new")]:
        with pytest.raises(RuntimeError, match="must not be inside the snapshot root"):
            fsdp_ema.posthoc(root, sigma_rel=TARGET, out=out)
    with pytest.raises(RuntimeError, match="holds a NUL byte"):
        fsdp_ema.posthoc(root, sigma_rel=TARGET, out=str(tmp_path / "nul") + "\0x")
    assert not (tmp_path / "link" / "new").exists() and not os.path.exists("new")
    assert not os.path.exists(os.path.join(root, "deeper")) and not (tmp_path / "nul").exists()
    assert fsdp_ema.posthoc_plan(root, TARGET) == before  # every snapshot whole


def test_a_failed_posthoc_leaves_no_output_directory(tmp_path):
    root = small_snapshots(tmp_path / "root")
    snap = Path(root) / "step-000000006.profile-1"
    shard = snap / fsdp_ema.checkpoint.shard_file_name(0, 1)
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x40  # the last tensor's data: a checksum mismatch while combining
    shard.write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        fsdp_ema.posthoc(root, sigma_rel=TARGET, out=tmp_path / "out" / "deeper")
    assert not (tmp_path / "out").exists()
