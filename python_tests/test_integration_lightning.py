"""The Lightning callback ``fsdp_ema.integrations.lightning.ShardedEMA`` (#25) in real ``fit``
runs: 2 gloo ranks on the CPU with ``ModelParallelStrategy`` (FSDP2 through ``fully_shard`` in
``configure_model``) and DDP, the two strategies Lightning runs on a CPU; ``FSDPStrategy`` (FSDP1)
needs a GPU (the ``cuda`` test at the end).

References: an EMA recomputed in the test from the full weights after every optimizer step with
``torch.lerp`` (the weight ``1 - decay`` formed in double), and Lightning's own
``EMAWeightAveraging`` in the same fit (DDP).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from dist_utils import PoolManager
from models import UnevenMLP

import fsdp_ema

pl = pytest.importorskip("lightning.pytorch")  # pinned in requirements.txt (test-only)

from fsdp_ema.integrations.lightning import ShardedEMA  # noqa: E402

ROWS, BATCH = 48, 4        # 6 batches per rank and epoch at 2 ranks
ACCUMULATE = 2             # 3 optimizer steps per epoch


def lightning_env(rank: int, world: int) -> None:
    """The ranks are the pool's (gloo already initialized): Lightning's default environment
    takes processes launched outside it from these variables and reuses the process group."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "NODE_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})


class Module(pl.LightningModule):
    def __init__(self, kind: str, lr: float = 0.1):
        super().__init__()
        self.kind, self.lr = kind, lr
        torch.manual_seed(0)  # the same weights on every rank and in every run
        self.net = UnevenMLP()
        self.seen: dict[str, list] = {"val": [], "test": []}

    def configure_model(self):
        if self.kind != "fsdp2" or hasattr(self, "_sharded"):
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net.inp, self.net.hidden, self.net.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)
        self._sharded = True

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def _eval(self, batch, loop):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.seen[loop].append((x, y, loss.detach().clone(), full_weights(self)))

    def validation_step(self, batch, batch_idx):
        self._eval(batch, "val")

    def test_step(self, batch, batch_idx):
        self._eval(batch, "test")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def full_weights(module) -> dict[str, torch.Tensor]:
    """The module's full parameters (collective under FSDP2: the test's view, not the EMA's)."""
    out = {}
    for name, p in module.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def full_ema(ema: fsdp_ema.ShardedEMA) -> dict[str, torch.Tensor]:
    return {k: v for k, v in ema.full_state_dict(rank0_only=False).items()}


def loader(seed: int = 1, rows: int = ROWS):
    g = torch.Generator().manual_seed(seed)
    ds = torch.utils.data.TensorDataset(torch.randn(rows, 6, generator=g),
                                        torch.randn(rows, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=BATCH)


class LerpReference(pl.Callback):
    """An independent EMA of the full weights: ``torch.lerp(ref, w, 1 - decay)`` after every
    optimizer step, from the weights when fit starts."""

    def __init__(self, decay: float):
        self.decay, self.ref, self.step = decay, None, 0

    def on_fit_start(self, trainer, pl_module):
        self.ref = full_weights(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > self.step:
            self.step = trainer.global_step
            for name, w in full_weights(pl_module).items():
                self.ref[name] = torch.lerp(self.ref[name], w, 1.0 - self.decay)


def trainer(kind: str, world: int, root: str, callbacks, **kwargs):
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    strategy = (ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
                if kind == "fsdp2" else DDPStrategy(process_group_backend="gloo"))
    options = dict(accelerator="cpu", devices=world, strategy=strategy, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                   accumulate_grad_batches=ACCUMULATE, num_sanity_val_steps=0,
                   limit_val_batches=1, limit_test_batches=1, enable_checkpointing=False)
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


# --- resume -----------------------------------------------------------------------------------

OPTIONS = dict(warmup=fsdp_ema.Warmup(power=0.75), update_every=2, start_step=1)


def run_resume(rank, world, kind, root):
    """Two epochs straight, and the same two epochs resumed from the checkpoint after the first:
    the EMA (and its step) must come back exactly."""
    import warnings

    from torch.distributed.tensor import DTensor

    warnings.filterwarnings("ignore")
    lightning_env(rank, world)
    calls = {"full_tensor": 0, "full_state_dict": 0}
    real_full_tensor = DTensor.full_tensor
    real_full_state_dict = fsdp_ema.ShardedEMA.full_state_dict

    def counting(name, real):
        def fn(self, *args, **kwargs):
            calls[name] += 1
            return real(self, *args, **kwargs)
        return fn

    ckpt_dir = os.path.join(root, "ckpt")
    out = {}
    # DDP: the update compiled (fullgraph; aot_eager keeps the test quick).
    compiled = {"compile": {"backend": "aot_eager"}} if kind == "ddp" else {}
    for run in ("straight", "resumed"):
        cb = ShardedEMA(0.875, copy_to_model_at_end=True, **OPTIONS, **compiled)
        # A second EMA in the same checkpoints, under its own key.
        second = ShardedEMA(0.5, key="ema", swap_for_validation=False)
        module = Module(kind)
        callbacks = [cb, second]
        if run == "straight":
            callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1,
                                                          save_top_k=-1))
        t = trainer(kind, world, os.path.join(root, run), callbacks, max_epochs=2,
                    limit_val_batches=0, enable_checkpointing=True)
        # Counts every gather of a full tensor on this rank during fit (the test gathers after).
        DTensor.full_tensor = counting("full_tensor", real_full_tensor)
        fsdp_ema.ShardedEMA.full_state_dict = counting("full_state_dict", real_full_state_dict)
        try:
            if run == "straight":
                t.fit(module, loader())
            else:
                t.fit(module, loader(), ckpt_path=os.path.join(ckpt_dir, "epoch=0-step=3.ckpt"))
        finally:
            DTensor.full_tensor, fsdp_ema.ShardedEMA.full_state_dict = (real_full_tensor,
                                                                          real_full_state_dict)
        ema = cb.ema
        out[run] = {"ema": full_ema(ema), "step": int(ema.step), "global_step": t.global_step,
                    "second": full_ema(second.ema),
                    "model": full_weights(module), "nbytes": ema.nbytes, "gathers": dict(calls),
                    "full_bytes": sum(p.numel() * 4 for p in UnevenMLP().parameters())}
    if rank == 0:
        meta = os.path.join(ckpt_dir, "epoch=0-step=3.ckpt")
        if kind == "fsdp2":
            import torch.distributed.checkpoint as dcp

            md = dcp.FileSystemReader(meta).read_metadata().state_dict_metadata
            out["dcp"] = {k: [list(c.offsets) for c in v.chunks] for k, v in md.items()
                          if "/" in k and hasattr(v, "chunks")}
            pickled = torch.load(os.path.join(meta, "meta.pt"), weights_only=False)
        else:
            pickled = torch.load(meta, weights_only=False)
        out["callback_state"] = pickled["callbacks"][cb.state_key]
    return out


@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_fit_resumed_from_a_mid_run_checkpoint_equals_the_uninterrupted_fit_bit_for_bit(
        pools, tmp_path, kind):
    results = pools.get(2).run(run_resume, kind, str(tmp_path))
    for rank, r in enumerate(results):
        straight, resumed = r["straight"], r["resumed"]
        assert straight["global_step"] == resumed["global_step"] == 6
        # One update per optimizer step (gradient accumulation counts once), the step restored.
        assert straight["step"] == resumed["step"] == 6
        for name in straight["ema"]:
            assert torch.equal(straight["ema"][name], resumed["ema"][name]), (rank, name)
            assert torch.equal(straight["second"][name], resumed["second"][name]), (rank, name)
            assert not torch.equal(straight["second"][name], straight["ema"][name]), (rank, name)
            # copy_to_model_at_end: the model holds the EMA, bit for bit.
            assert torch.equal(straight["model"][name], straight["ema"][name]), (rank, name)
            assert torch.equal(resumed["model"][name], resumed["ema"][name]), (rank, name)
        assert straight["gathers"] == resumed["gathers"] == {"full_tensor": 0,
                                                               "full_state_dict": 0}
    full = results[0]["straight"]["full_bytes"]
    nbytes = [r["straight"]["nbytes"] for r in results]
    if kind == "fsdp2":
        # Each rank holds its rows only (7 + 5 + 1 rows of 6, 7, 5 columns and the biases).
        assert sum(nbytes) == full and max(nbytes) < full, nbytes
        state = results[0]["callback_state"]
        assert state == {"layout": "state_dict", "prefix": "fsdp_ema/"}, state
        # In the distributed checkpoint, written rank by rank: rows 0-3 and 4-6 of inp.weight.
        chunks = results[0]["dcp"]
        assert chunks["state_dict.fsdp_ema/net.inp.weight"] == [[0, 0], [4, 0]], chunks
        assert "state_dict.fsdp_ema/fsdp_ema.step" in chunks
        assert chunks["state_dict.ema/net.inp.weight"] == [[0, 0], [4, 0]], chunks
    else:
        # DDP: every rank holds the whole EMA, and it is the callback's state (rank 0 writes it).
        assert nbytes == [full, full]
        state = results[0]["callback_state"]
        assert state["layout"] == "callback" and state["ema"]["fsdp_ema.step"] == 3


# --- evaluation with the EMA ----------------------------------------------------------------------

def run_evaluate(rank, world, kind, root):
    import warnings

    warnings.filterwarnings("ignore")
    lightning_env(rank, world)
    decay = 0.75
    cb = ShardedEMA(decay, export_dir=os.path.join(root, "export"))
    ref = LerpReference(decay)
    module = Module(kind)
    after = {}

    class Weights(pl.Callback):  # after ShardedEMA in the list: sees what it left
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            after["train"] = full_weights(pl_module)

        def on_validation_end(self, trainer, pl_module):
            after["val"] = full_weights(pl_module)

    t = trainer(kind, world, root, [cb, ref, Weights()], max_epochs=1)
    t.fit(module, loader(), loader(seed=2))
    t.test(module, loader(seed=3), verbose=False)
    after["test"] = full_weights(module)
    out = {"seen": module.seen, "ref": ref.ref, "after": after, "ema": full_ema(cb.ema)}
    if rank == 0:
        from safetensors.torch import load_file

        out["export"] = load_file(os.path.join(root, "export", "model.safetensors"))
    return out


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_validation_and_test_run_with_the_ema_weights_and_give_the_loss_of_a_lerp_replica(
        pools, tmp_path, kind):
    results = pools.get(2).run(run_evaluate, kind, str(tmp_path))
    for rank, r in enumerate(results):
        ref = r["ref"]
        for name in ref:  # the op's lerp and torch.lerp agree bit for bit at decay 0.75
            assert torch.equal(r["ema"][name], ref[name]), (rank, name)
        replica = UnevenMLP()
        replica.load_state_dict({k.removeprefix("net."): v for k, v in ref.items()})
        for loop in ("val", "test"):
            assert len(r["seen"][loop]) == 1
            x, y, loss, weights = r["seen"][loop][0]
            for name in ref:  # inside the loop the model holds the EMA
                assert torch.equal(weights[name], ref[name]), (loop, rank, name)
            with torch.no_grad():
                expected = F.mse_loss(replica(x), y)
            torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        # The training weights come back bit for bit after validation and test.
        for name, w in r["after"]["train"].items():
            assert torch.equal(r["after"]["val"][name], w), (rank, name)
            assert torch.equal(r["after"]["test"][name], w), (rank, name)
            assert not torch.equal(w, ref[name])
    export = results[0]["export"]
    assert sorted(export) == sorted(results[0]["ema"])
    for name, t in export.items():
        assert torch.equal(t, results[0]["ema"][name]), name


# --- another world size ---------------------------------------------------------------------------

class EMAProbe(pl.Callback):
    """After ShardedEMA in the list: the EMA as the resumed fit starts."""

    def __init__(self, cb):
        self.cb, self.seen = cb, None

    def on_train_start(self, trainer, pl_module):
        self.seen = (full_ema(self.cb.ema), int(self.cb.ema.step), self.cb.ema.nbytes)


def run_checkpoint(rank, world, root):
    import warnings

    warnings.filterwarnings("ignore")
    lightning_env(rank, world)
    cb = ShardedEMA(0.875, **OPTIONS)
    t = trainer("fsdp2", world, root, [cb, pl.callbacks.ModelCheckpoint(dirpath=root)],
                max_epochs=1, limit_val_batches=0, enable_checkpointing=True)
    t.fit(Module("fsdp2"), loader())
    return full_ema(cb.ema), int(cb.ema.step)


def run_resume_at(rank, world, root):
    import warnings

    warnings.filterwarnings("ignore")
    lightning_env(rank, world)
    cb = ShardedEMA(0.875, **OPTIONS)
    probe = EMAProbe(cb)
    t = trainer("fsdp2", world, os.path.join(root, "resumed"), [cb, probe], max_epochs=2,
                limit_val_batches=0)
    t.fit(Module("fsdp2"), loader(), ckpt_path=os.path.join(root, "epoch=0-step=3.ckpt"))
    return probe.seen


def test_fsdp2_checkpoint_of_2_ranks_resumes_at_1_rank_with_the_ema_resharded(pools, tmp_path):
    (saved, step), _ = pools.get(2).run(run_checkpoint, str(tmp_path))
    ((restored, restored_step, nbytes),) = pools.get(1).run(run_resume_at, str(tmp_path))
    assert step == restored_step == 3
    assert sorted(restored) == sorted(saved)
    for name, t in saved.items():
        assert torch.equal(restored[name], t), name
    assert nbytes == sum(t.numel() * 4 for name, t in saved.items() if name != "fsdp_ema.step")


# --- parity with Lightning's EMAWeightAveraging ---------------------------------------------------

def run_parity(rank, world, root):
    import warnings

    from lightning.pytorch.callbacks import EMAWeightAveraging

    warnings.filterwarnings("ignore")
    if world > 1:
        lightning_env(rank, world)
    decay = 0.9
    # EMAWeightAveraging's average starts as a copy of the weights after the first step:
    # start_step=1 makes ShardedEMA's first update a copy too.
    ours = ShardedEMA(decay, start_step=1, swap_for_validation=False)
    theirs = EMAWeightAveraging(decay=decay)
    module = Module("ddp")
    kwargs = {} if world > 1 else {"strategy": "auto", "devices": 1}
    t = trainer("ddp", world, root, [ours, theirs], max_epochs=2, limit_val_batches=0, **kwargs)
    t.fit(module, loader())
    # EMAWeightAveraging copies its average into the module at the end of fit.
    return {"ours": full_ema(ours.ema), "theirs": full_weights(module), "step": int(ours.ema.step),
            "global_step": t.global_step}


@pytest.mark.parametrize("world", [1, 2], ids=["single_device", "ddp"])
def test_ema_equals_lightning_ema_weight_averaging_with_the_same_decay(pools, tmp_path, world):
    results = pools.get(world).run(run_parity, str(tmp_path))
    for r in results:
        assert r["step"] == r["global_step"] == (6 if world == 2 else 12)
        assert sorted(r["ours"]) == sorted(r["theirs"])
        for name, t in r["theirs"].items():
            torch.testing.assert_close(r["ours"][name], t, rtol=0, atol=1e-6)


# --- refusals ------------------------------------------------------------------------------------

def run_full_checkpoint(rank, world, root):
    import warnings

    from lightning.pytorch.strategies import ModelParallelStrategy

    warnings.filterwarnings("ignore")
    lightning_env(rank, world)
    cb = ShardedEMA(0.9)
    t = trainer("fsdp2", world, root, [cb], max_steps=1, limit_val_batches=0,
                strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                               save_distributed_checkpoint=False))
    t.fit(Module("fsdp2"), loader())
    try:
        t.save_checkpoint(os.path.join(root, "full.ckpt"))
    except RuntimeError as e:
        return str(e)
    return None


def test_a_sharded_ema_refuses_a_full_checkpoint_naming_the_setting(pools, tmp_path):
    for message in pools.get(2).run(run_full_checkpoint, str(tmp_path)):
        assert message is not None and "save_distributed_checkpoint=True" in message


def test_unknown_option_is_refused_when_the_callback_is_made():
    with pytest.raises(TypeError, match="warmupp"):
        ShardedEMA(0.9, warmupp=True)


def test_import_without_lightning_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.delitem(sys.modules, "fsdp_ema.integrations.lightning")
    with pytest.raises(ImportError, match=r'pip install "fsdp-ema\[lightning\]"'):
        import fsdp_ema.integrations.lightning  # noqa: F401


# --- FSDP1 (FSDPStrategy): GPUs only -------------------------------------------------------------

def run_fsdp1_cuda(rank, world, root):
    """FSDPStrategy (FSDP1) on the GPU, sharded checkpoints: a fit resumed from the checkpoint
    after the first epoch equals the uninterrupted one."""
    import warnings

    from lightning.pytorch.strategies import FSDPStrategy

    warnings.filterwarnings("ignore")
    lightning_env(rank, world)
    ckpt_dir = os.path.join(root, "ckpt")
    out = {}
    for run in ("straight", "resumed"):
        cb = ShardedEMA(0.875, **OPTIONS)
        callbacks = [cb]
        if run == "straight":
            callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1,
                                                          save_top_k=-1))
        strategy = FSDPStrategy(state_dict_type="sharded", auto_wrap_policy={torch.nn.Linear})
        t = trainer("ddp", world, os.path.join(root, run), callbacks, max_epochs=2,
                    limit_val_batches=0, enable_checkpointing=True, accelerator="cuda",
                    strategy=strategy)
        t.fit(Module("fsdp1"), loader(),
              ckpt_path=None if run == "straight" else os.path.join(ckpt_dir,
                                                                    "epoch=0-step=3.ckpt"))
        out[run] = (full_ema(cb.ema), int(cb.ema.step))
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDPStrategy (FSDP1) needs a GPU")
def test_cuda_fsdp1_strategy_fit_resumed_from_a_sharded_checkpoint_equals_the_uninterrupted_fit(
        pools, tmp_path):
    # One GPU: one rank (Lightning's FSDP1 refuses the CPU, and NCCL one GPU per rank).
    (r,) = pools.get(1).run(run_fsdp1_cuda, str(tmp_path))
    (straight, s_step), (resumed, r_step) = r["straight"], r["resumed"]
    assert s_step == r_step == 6
    for name, t in straight.items():
        assert torch.equal(resumed[name], t), name


def test_held_swap_enters_once_and_a_failed_swap_holds_nothing():
    """The swap both adapters hold across an evaluation (integrations.HeldSwap): a second enter
    does not swap again, exit restores, and a swap that raises on entry leaves nothing held (so
    the next evaluation can swap and no later exit restores weights that were never swapped)."""
    import contextlib

    from fsdp_ema.integrations import HeldSwap

    events = []

    class Ema:
        fail = False

        @contextlib.contextmanager
        def swap(self):
            if self.fail:
                raise RuntimeError("swap failed")
            events.append("in")
            yield
            events.append("out")

    ema, held = Ema(), HeldSwap()
    held.enter(ema)
    held.enter(ema)
    assert held.active and events == ["in"]
    held.exit()
    held.exit()
    assert not held.active and events == ["in", "out"]
    ema.fail = True
    with pytest.raises(RuntimeError, match="swap failed"):
        held.enter(ema)
    assert not held.active
    ema.fail = False
    held.enter(ema)
    held.exit()
    assert events == ["in", "out", "in", "out"]
