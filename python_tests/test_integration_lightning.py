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
        self.log(f"{loop}_loss", loss, sync_dist=True)

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
        binding = state.pop("binding")
        assert state == {"layout": "state_dict", "prefix": "fsdp_ema/"}, state
        # What ties the EMA to the training state: the step and the model's fingerprint.
        assert binding["global_step"] == 3 and len(binding["fingerprint"]) == 16, binding
        assert binding["settings"]["decay"] == 0.875 and binding["settings"]["update_every"] == 2
        # In the distributed checkpoint, written rank by rank: rows 0-3 and 4-6 of inp.weight.
        chunks = results[0]["dcp"]
        assert chunks["state_dict.fsdp_ema/net.inp.weight"] == [[0, 0], [4, 0]], chunks
        assert "state_dict.fsdp_ema/fsdp_ema.step" in chunks
        assert "state_dict.fsdp_ema/fsdp_ema.binding" in chunks
        assert chunks["state_dict.ema/net.inp.weight"] == [[0, 0], [4, 0]], chunks
    else:
        # DDP: every rank holds the whole EMA, and it is the callback's state (rank 0 writes it).
        assert nbytes == [full, full]
        state = results[0]["callback_state"]
        assert state["layout"] == "callback" and state["ema"]["fsdp_ema.step"] == 3


# --- evaluation with the EMA ----------------------------------------------------------------------

def run_evaluate(rank, world, kind, mode, root):
    import warnings

    warnings.filterwarnings("ignore")
    lightning_env(rank, world)
    decay = 0.75
    cb = ShardedEMA(decay, export_dir=os.path.join(root, "export"), swap_for_validation=mode,
                    swap_for_test=mode)
    ref = LerpReference(decay)
    module = Module(kind)
    after = {}

    class Weights(pl.Callback):  # after ShardedEMA in the list: sees what it left
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            after["train"] = full_weights(pl_module)

        def on_validation_start(self, trainer, pl_module):
            after["val_start"] = full_weights(pl_module)

        def on_validation_epoch_start(self, trainer, pl_module):
            after["val_epoch_start"] = full_weights(pl_module)

        def on_validation_epoch_end(self, trainer, pl_module):
            after["val_epoch_end"] = full_weights(pl_module)

        def on_validation_end(self, trainer, pl_module):
            after["val"] = full_weights(pl_module)

    t = trainer(kind, world, root, [cb, ref, Weights()], max_epochs=1)
    t.fit(module, loader(), loader(seed=2))
    metrics = {k: float(v) for k, v in t.callback_metrics.items()}
    t.test(module, loader(seed=3), verbose=False)
    after["test"] = full_weights(module)
    metrics.update({k: float(v) for k, v in t.callback_metrics.items() if k.startswith("test")})
    out = {"seen": module.seen, "ref": ref.ref, "after": after, "ema": full_ema(cb.ema),
           "metrics": metrics, "global_step": t.global_step}
    if rank == 0:
        from safetensors.torch import load_file

        out["export"] = load_file(os.path.join(root, "export", "model.safetensors"))
    return out


@pytest.mark.parametrize("kind,mode", [("fsdp2", True), ("ddp", True), ("fsdp2", "both")])
def test_validation_and_test_run_with_the_ema_weights_and_give_the_loss_of_a_lerp_replica(
        pools, tmp_path, kind, mode):
    results = pools.get(2).run(run_evaluate, kind, mode, str(tmp_path))
    for rank, r in enumerate(results):
        ref = r["ref"]
        for name in ref:  # the op's lerp and torch.lerp agree bit for bit at decay 0.75
            assert torch.equal(r["ema"][name], ref[name]), (rank, name)
        ema_replica, raw_replica = UnevenMLP(), UnevenMLP()
        ema_replica.load_state_dict({k.removeprefix("net."): v for k, v in ref.items()})
        raw_replica.load_state_dict({k.removeprefix("net."): v
                                     for k, v in r["after"]["train"].items()})
        for loop in ("val", "test"):
            # True: one pass with the EMA; "both": the training weights', then the EMA's again.
            passes = [("ema", ema_replica)] if mode is True else [("raw", raw_replica),
                                                                  ("ema", ema_replica)]
            assert len(r["seen"][loop]) == len(passes)
            for (which, replica), (x, y, loss, weights) in zip(passes, r["seen"][loop]):
                for name in ref:  # what the model holds in the step
                    want = ref[name] if which == "ema" else r["after"]["train"][name]
                    assert torch.equal(weights[name], want), (loop, which, rank, name)
                with torch.no_grad():
                    expected = F.mse_loss(replica(x), y)
                torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
            # The logged metrics (the mean over the ranks, sync_dist): "<loop>_loss" of the
            # weights each pass ran with (both: the training weights' under the raw name, the
            # EMA's renamed "<loop>_loss_ema").
            logged = {"ema": f"{loop}_loss" if mode is True else f"{loop}_loss_ema",
                      "raw": f"{loop}_loss"}
            for i, (which, _) in enumerate(passes):
                mean = sum(float(q["seen"][loop][i][2]) for q in results) / len(results)
                assert r["metrics"][logged[which]] == pytest.approx(mean, rel=1e-6), (
                    loop, which, r["metrics"])
            if mode is True:
                assert f"{loop}_loss_ema" not in r["metrics"]
        # The training weights come back bit for bit after validation and test, and a callback
        # after this one sees them at every hook around the loop (the EMA is swapped in at the
        # first batch and out at the epoch end).
        for name, w in r["after"]["train"].items():
            for when in ("val_start", "val_epoch_start", "val_epoch_end", "val", "test"):
                assert torch.equal(r["after"][when][name], w), (rank, when, name)
            assert not torch.equal(w, ref[name])
        # ema/decay and ema/step logged after each update.
        assert r["metrics"]["ema/step"] == r["global_step"] == 3, r["metrics"]
        assert r["metrics"]["ema/decay"] == 0.75, r["metrics"]
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


def run_resume_past_the_end(rank, world, kind, root):
    """Two epochs with a checkpoint after each, then fit(ckpt_path=<the final checkpoint>) as a
    requeued job that had finished does: Lightning restores it and skips training (no
    on_train_start, no on_train_end). The callback's EMA, its swap and its teacher are the
    checkpoint's EMA all the same."""
    import warnings

    warnings.filterwarnings("ignore")
    lightning_env(rank, world)
    ckpt = os.path.join(root, "ckpt")
    cb = ShardedEMA(0.875, **OPTIONS)
    t = trainer(kind, world, os.path.join(root, "first"),
                [cb, pl.callbacks.ModelCheckpoint(dirpath=ckpt, every_n_epochs=1, save_top_k=-1)],
                max_epochs=2, limit_val_batches=0, enable_checkpointing=True)
    t.fit(Module(kind), loader())
    saved, saved_step = full_ema(cb.ema), int(cb.ema.step)
    again, module = ShardedEMA(0.875, **OPTIONS), Module(kind)
    t = trainer(kind, world, os.path.join(root, "again"), [again], max_epochs=2,
                limit_val_batches=0)
    t.fit(module, loader(), ckpt_path=os.path.join(ckpt, "epoch=1-step=6.ckpt"))
    x = next(iter(loader(seed=7)))[0]
    with torch.no_grad():
        with again.ema.swap():
            swapped, swapped_out = full_weights(module), module(x)
        teacher_out = again.ema.module(compile=False)(x)
        raw_out = module(x)
    return {"saved": saved, "saved_step": saved_step, "global_step": t.global_step,
            "ema": full_ema(again.ema), "step": int(again.ema.step), "swapped": swapped,
            "swapped_out": swapped_out, "teacher_out": teacher_out, "raw_out": raw_out}


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_fit_from_the_final_checkpoint_gives_the_checkpoints_ema_though_training_is_skipped(
        pools, tmp_path, kind):
    for rank, r in enumerate(pools.get(2).run(run_resume_past_the_end, kind, str(tmp_path))):
        assert r["global_step"] == 6 and r["saved_step"] == r["step"] == 6, (rank, r["step"])
        assert sorted(r["ema"]) == sorted(r["saved"])
        for name, t in r["saved"].items():
            assert torch.equal(r["ema"][name], t), (rank, name)
            if name in r["swapped"]:
                assert torch.equal(r["swapped"][name], t), (rank, name)
        assert torch.equal(r["teacher_out"], r["swapped_out"]), rank
        assert not torch.equal(r["raw_out"], r["swapped_out"]), rank


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


# --- exports of a submodule ------------------------------------------------------------------

class LlamaModule(pl.LightningModule):
    """A LightningModule holding a Hugging Face model under ``self.llm``, FSDP2 per layer."""

    def __init__(self):
        super().__init__()
        from test_integration_transformers import tiny_llama

        self.llm = tiny_llama()

    def configure_model(self):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.llm, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.llm.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.llm, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        return self.llm(input_ids=batch[0], labels=batch[0]).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.llm(input_ids=batch[0], labels=batch[0]).loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def token_loader(seed: int = 1):
    ids = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)


def run_export(rank, world, root):
    import warnings

    warnings.filterwarnings("ignore")
    lightning_env(rank, world)
    ckpt = os.path.join(root, "ckpt")
    cb = ShardedEMA(0.5, export_dir=os.path.join(root, "at_end"), export_module="llm")
    t = trainer("fsdp2", world, root, [cb, pl.callbacks.ModelCheckpoint(dirpath=ckpt)],
                max_epochs=1, limit_val_batches=0, enable_checkpointing=True)
    t.fit(LlamaModule(), token_loader())
    ema = full_ema(cb.ema)
    # From a saved checkpoint, in another trainer: validate() restores it, then export().
    again = ShardedEMA(0.5)
    t = trainer("fsdp2", world, os.path.join(root, "again"), [again], limit_val_batches=1)
    t.validate(LlamaModule(), token_loader(2), ckpt_path=os.path.join(ckpt, "epoch=0-step=2.ckpt"),
               verbose=False)
    files = again.export(os.path.join(root, "from_checkpoint"), module="llm")
    out = {"ema": ema, "files": files}
    torch.distributed.barrier()
    if rank == 0:
        import transformers

        for name in ("at_end", "from_checkpoint"):
            path = os.path.join(root, name)
            loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
            out[name] = ({k: v.detach().clone() for k, v in loaded.state_dict().items()},
                         sorted(os.listdir(path)))
    return out


def test_export_of_a_submodule_loads_with_from_pretrained_at_the_end_and_from_a_checkpoint(
        pools, tmp_path):
    pytest.importorskip("transformers")
    r = pools.get(2).run(run_export, str(tmp_path))[0]
    assert r["files"] == ["config.json", "generation_config.json"]
    for name in ("at_end", "from_checkpoint"):
        state, listing = r[name]
        assert listing == ["config.json", "generation_config.json", "model.safetensors"], listing
        # The submodule's own names (llm.model.norm.weight -> model.norm.weight), the EMA's values.
        assert sorted(k for k in state if "rotary" not in k) == sorted(
            k.removeprefix("llm.") for k in r["ema"]), name
        for k, t in r["ema"].items():
            assert torch.equal(state[k.removeprefix("llm.")], t), (name, k)


# --- refusals ------------------------------------------------------------------------------------

class CountBatches(pl.Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1


def run_setup_refusals(rank, world, root):
    import warnings

    from lightning.pytorch.strategies import ModelParallelStrategy

    warnings.filterwarnings("ignore")
    lightning_env(rank, world)
    out = {}

    def full_strategy():
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                     save_distributed_checkpoint=False)

    # Checkpoints that cannot hold a sharded EMA: refused when fit starts, before any batch.
    count = CountBatches()
    t = trainer("fsdp2", world, root, [ShardedEMA(0.9), count, pl.callbacks.ModelCheckpoint(
        dirpath=os.path.join(root, "full"))], max_epochs=1, limit_val_batches=0,
        enable_checkpointing=True, strategy=full_strategy())
    try:
        t.fit(Module("fsdp2"), loader())
    except ValueError as e:
        out["early"] = (str(e), count.batches)
    # Without a ModelCheckpoint the setting matters only to a save by hand: refused there.
    t = trainer("fsdp2", world, root, [ShardedEMA(0.9)], max_steps=1, limit_val_batches=0,
                strategy=full_strategy())
    t.fit(Module("fsdp2"), loader())
    try:
        t.save_checkpoint(os.path.join(root, "full.ckpt"))
    except RuntimeError as e:
        out["manual"] = str(e)
    # A sharding strategy over a model it did not shard (no fully_shard in configure_model).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer("fsdp2", world, root, [ShardedEMA(0.9)], max_steps=1,
                limit_val_batches=0).fit(Module("ddp"), loader())
    out["warnings"] = [(str(w.message), w.filename) for w in caught
                       if "FSDP was asked for" in str(w.message)]
    return out


def test_checkpoint_settings_that_cannot_hold_a_sharded_ema_are_refused_at_setup(pools,
                                                                                 tmp_path):
    for rank, r in enumerate(pools.get(2).run(run_setup_refusals, str(tmp_path))):
        message, batches = r["early"]
        assert "save_distributed_checkpoint=True" in message and batches == 0, r["early"]
        assert "save_distributed_checkpoint=True" in r["manual"], r["manual"]
        # One warning, from rank 0, at the line that called fit().
        if rank == 0:
            assert len(r["warnings"]) == 1 and r["warnings"][0][1] == __file__, r["warnings"]
            assert "ModelParallelStrategy" in r["warnings"][0][0]
        else:
            assert r["warnings"] == []


def run_resume_refusals(rank, world, root):
    """Checkpoints after epochs 0 and 1, then resumes that must be refused (or accepted when
    asked): changed options, another parameter set, a model that is not the EMA's."""
    import shutil
    import warnings

    warnings.filterwarnings("ignore")
    lightning_env(rank, world)
    out = {}

    def fit(kind, cb, ckpt_path=None, save=None, epochs=2):
        callbacks = [cb] + ([pl.callbacks.ModelCheckpoint(dirpath=save, every_n_epochs=1,
                                                          save_top_k=-1)] if save else [])
        t = trainer(kind, world, os.path.join(root, "run"), callbacks, max_epochs=epochs,
                    limit_val_batches=0, enable_checkpointing=bool(save))
        try:
            t.fit(Module(kind), loader(), ckpt_path=ckpt_path)
        except ValueError as e:
            return str(e)
        return int(cb.ema.step)

    for kind in ("fsdp2", "ddp"):
        ckpt = os.path.join(root, kind)
        fit(kind, ShardedEMA(0.875, **OPTIONS), save=ckpt)
        first = os.path.join(ckpt, "epoch=0-step=3.ckpt")
        out[kind] = {
            "decay": fit(kind, ShardedEMA(0.9, **OPTIONS), first),
            "decay_allowed": fit(kind, ShardedEMA(0.9, allow_changes={"decay"}, **OPTIONS),
                                 first),
            "dtype": fit(kind, ShardedEMA(0.875, **OPTIONS, dtype=torch.float64), first),
            "warmup": fit(kind, ShardedEMA(0.875, **{**OPTIONS, "warmup": None}), first),
            "params": fit(kind, ShardedEMA(0.875, params=lambda n, p: "head" not in n,
                                           **OPTIONS), first)}
    # A schedule instead of decay and warmup (and no start_step).
    out["schedule"] = fit("ddp", ShardedEMA(schedule=fsdp_ema.PowerEMA(0.05), update_every=2),
                          os.path.join(root, "ddp", "epoch=0-step=3.ckpt"))
    # A DDP checkpoint whose model is not the one its EMA was saved beside.
    replaced = os.path.join(root, "replaced.ckpt")
    torch.distributed.barrier()
    if rank == 0:
        checkpoint = torch.load(os.path.join(root, "ddp", "epoch=0-step=3.ckpt"),
                                weights_only=False)
        checkpoint["state_dict"]["net.inp.weight"] += 1e-3
        torch.save(checkpoint, replaced)
    # An FSDP2 checkpoint whose rank-1 file comes from the next save.
    mixed = os.path.join(root, "mixed.ckpt")
    if rank == 0:
        shutil.copytree(os.path.join(root, "fsdp2", "epoch=0-step=3.ckpt"), mixed)
        shutil.copy(os.path.join(root, "fsdp2", "epoch=1-step=6.ckpt", "__1_0.distcp"),
                    os.path.join(mixed, "__1_0.distcp"))
    torch.distributed.barrier()
    out["replaced"] = fit("ddp", ShardedEMA(0.875, **OPTIONS), replaced)
    out["mixed"] = fit("fsdp2", ShardedEMA(0.875, **OPTIONS), mixed)
    return out


def test_resume_refuses_changed_options_another_parameter_set_and_a_model_not_the_emas(
        pools, tmp_path):
    for r in pools.get(2).run(run_resume_refusals, str(tmp_path)):
        for kind in ("fsdp2", "ddp"):
            c = r[kind]
            assert "the EMA's options changed since the checkpoint" in c["decay"], c["decay"]
            assert "decay: 0.875 when saved, 0.9 now" in c["decay"], c["decay"]
            assert c["decay_allowed"] == 6  # 3 restored updates + 3 more
            assert "dtype: 'float32' when saved, 'float64' now" in c["dtype"], c["dtype"]
            assert "allow_changes={'dtype'}" in c["dtype"], c["dtype"]
            message = c["warmup"]
            assert "warmup: {'gamma': 1.0, " in message and "} when saved, None now" in message
            assert "'power': 0.75" in message and "allow_changes={'warmup'}" in message, message
            # The parameter set: one clear error naming the tensors (not DCP's missing key).
            assert "another set of tensors than the EMA of this model" in c["params"], c
            assert "only in the checkpoint: ['net.head.bias', 'net.head.weight']" in c["params"]
        message = r["schedule"]
        assert "schedule: None when saved, 'fsdp_ema.power_ema.PowerEMA: PowerEMA(sigma_rel=0.05" \
            in message and "start_step: 1 when saved, 0 now" in message, message
        assert "was saved beside other model weights" in r["replaced"], r["replaced"]
        # Rank 1's file of the next save: the checkpoint mixes two saves, whichever of its
        # files holds the binding.
        assert ("is torn" in r["mixed"] or "was saved beside other model weights"
                in r["mixed"]), r["mixed"]


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
