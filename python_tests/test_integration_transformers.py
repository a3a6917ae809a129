"""The Hugging Face callback ``fsdp_ema.integrations.transformers.ShardedEMACallback`` (#25) in real
``Trainer.train`` runs of a tiny Llama (made from a config: nothing is downloaded): 2 gloo ranks on
the CPU with DDP and with Accelerate's FSDP2. On a CPU the Trainer's FSDP config silently becomes
DDP (Accelerate drops the plugin), so FSDP2 runs through ``FSDP2Trainer``, a test-only subclass
that forces the plugin; FSDP1 refuses the CPU (the ``cuda`` test at the end). Also an Accelerate
loop of our own (``accelerator.save_state`` / ``load_state``).

References: an EMA recomputed in the test from the full weights after every optimizer step with
``torch.lerp`` (the weight ``1 - decay`` formed in double), and the eval loss of an unsharded
replica holding that EMA.
"""

from __future__ import annotations

import glob
import math
import os
import shutil
import sys
import time
import warnings

import pytest
import torch
from dist_utils import PoolManager

import fsdp_ema

transformers = pytest.importorskip("transformers")  # pinned in requirements.txt (test-only)
pytest.importorskip("accelerate")

from fsdp_ema.integrations.transformers import ShardedEMACallback  # noqa: E402

TRAIN_ROWS, EVAL_ROWS = 64, 8


def hf_env(rank: int, world: int) -> None:
    """The ranks are the pool's (gloo already initialized): Accelerate reads them from these
    variables and reuses the process group. Its state is shared by every Trainer in a process,
    and FSDP2Trainer changes it: each run starts from a fresh one."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1"})
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, rows: int, seed: int):
        self.ids = torch.randint(0, 32, (rows, 8), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class FSDP2Trainer(transformers.Trainer):
    """Test fixture only: Accelerate's FSDP plugin forced (FSDP2 on the CPU, where the Trainer's
    own setup drops it and trains DDP; FSDP1 on one GPU)."""

    def create_accelerator_and_postprocess(self):
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        super().create_accelerator_and_postprocess()
        self.accelerator.state.distributed_type = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            **self.args.fsdp_plugin_args)
        self.is_fsdp_enabled = True


class SlowRank0Trainer(transformers.Trainer):
    """Rank 0 (the only one that writes the trainer's files) reaches on_save late: the other
    rank's on_save, which has no barrier before it, starts the EMA's save first."""

    def _save_checkpoint(self, model, trial):
        if self.args.process_index == 0:
            time.sleep(0.3)
        super()._save_checkpoint(model, trial)


FSDP_CONFIG = {"version": 2, "state_dict_type": "SHARDED_STATE_DICT",
               "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
               "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}


def make_trainer(kind: str, output_dir: str, callbacks, **kwargs):
    fsdp = dict(fsdp=True, fsdp_config=dict(FSDP_CONFIG)) if kind in ("fsdp2", "ddp_from_fsdp"
                                                                        ) else {}
    options = dict(output_dir=output_dir, use_cpu=True, per_device_train_batch_size=2,
                   per_device_eval_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
                   learning_rate=1e-2, report_to=[], disable_tqdm=True, save_strategy="no",
                   logging_steps=100, seed=0)
    options.update(kwargs)
    args = transformers.TrainingArguments(**options, **fsdp)
    cls = {"fsdp2": FSDP2Trainer, "ddp": SlowRank0Trainer}.get(kind, transformers.Trainer)
    return cls(model=tiny_llama(), args=args, train_dataset=Tokens(TRAIN_ROWS, 1),
               eval_dataset=Tokens(EVAL_ROWS, 2), callbacks=callbacks)


def full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def full_weights(model) -> dict[str, torch.Tensor]:
    return {name: full(p) for name, p in model.named_parameters()}


class LerpReference(transformers.TrainerCallback):
    """An independent EMA of the full weights: ``torch.lerp(ref, w, 1 - decay)`` after every
    optimizer step. Listed before ShardedEMACallback, so it reads the training weights."""

    def __init__(self, decay: float):
        self.decay, self.ref, self.steps, self.before_step = decay, None, {}, {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.ref = full_weights(model)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.before_step[state.global_step] = full_weights(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        weights = full_weights(model)
        for name, w in weights.items():
            self.ref[name] = torch.lerp(self.ref[name], w, 1.0 - self.decay)
        self.steps[state.global_step] = ({k: v.clone() for k, v in self.ref.items()}, weights)


@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


# --- resume ---------------------------------------------------------------------------------------

def run_resume(rank, world, kind, root):
    """Six optimizer steps straight (a checkpoint every 2, at most 2 kept), and the same six
    resumed from checkpoint-4."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    calls = {"full_tensor": 0, "full_state_dict": 0}
    real = {"full_tensor": DTensor.full_tensor,
            "full_state_dict": fsdp_ema.ShardedEMA.full_state_dict}

    def counting(name):
        def fn(self, *args, **kwargs):
            calls[name] += 1
            return real[name](self, *args, **kwargs)
        return fn

    options = dict(warmup=fsdp_ema.Warmup(power=0.75), update_every=2,
                   async_save=(kind == "fsdp2"))
    straight_dir, resumed_dir = os.path.join(root, "straight"), os.path.join(root, "resumed")
    out = {}
    for run in ("straight", "resumed"):
        hf_env(rank, world)
        cb = ShardedEMACallback(0.875, **options)
        if run == "straight":
            t = make_trainer(kind, straight_dir, [cb], save_strategy="steps", save_steps=2,
                             save_total_limit=2)
        else:
            t = make_trainer(kind, resumed_dir, [cb], save_strategy="no")
        DTensor.full_tensor = counting("full_tensor")
        fsdp_ema.ShardedEMA.full_state_dict = counting("full_state_dict")
        try:
            if run == "straight":
                t.train()
            elif kind == "fsdp2":
                t.train(resume_from_checkpoint=True)  # the latest: resumed_dir/checkpoint-4
            else:
                t.train(resume_from_checkpoint=os.path.join(resumed_dir, "checkpoint-4"))
        finally:
            DTensor.full_tensor = real["full_tensor"]
            fsdp_ema.ShardedEMA.full_state_dict = real["full_state_dict"]
        ema = cb.ema
        out[run] = {"ema": ema.full_state_dict(rank0_only=False), "step": int(ema.step),
                    "global_step": t.state.global_step, "nbytes": ema.nbytes,
                    "gathers": dict(calls), "model": full_weights(t.model),
                    "full_bytes": sum(p.numel() * 4 for p in tiny_llama().parameters())}
        if run == "straight":
            dist.barrier()
            if rank == 0:
                out["checkpoints"] = sorted(os.listdir(straight_dir))
                out["ema_files"] = {}
                from safetensors import safe_open

                for path in sorted(glob.glob(os.path.join(straight_dir, "checkpoint-4", "ema",
                                                          "*.safetensors"))):
                    with safe_open(path, "pt") as f:  # EMA tensors are "ema.<fqn>" there
                        out["ema_files"][os.path.basename(path)] = sum(
                            math.prod(f.get_slice(k).get_shape())
                            for k in f.keys() if k.startswith("ema."))
                # The resumed run starts from a copy of checkpoint-4 alone.
                shutil.copytree(os.path.join(straight_dir, "checkpoint-4"),
                                os.path.join(resumed_dir, "checkpoint-4"))
            dist.barrier()
    return out


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_train_resumed_from_a_mid_run_checkpoint_equals_the_uninterrupted_run_bit_for_bit(
        pools, tmp_path, kind):
    results = pools.get(2).run(run_resume, kind, str(tmp_path))
    for rank, r in enumerate(results):
        straight, resumed = r["straight"], r["resumed"]
        assert straight["global_step"] == resumed["global_step"] == 6
        # One update per optimizer step (gradient accumulation counts once), the step restored.
        assert straight["step"] == resumed["step"] == 6
        assert sorted(straight["ema"]) == sorted(resumed["ema"])
        for name, t in straight["ema"].items():
            assert torch.equal(t, resumed["ema"][name]), (rank, name)
        for name, t in straight["model"].items():
            assert torch.equal(t, resumed["model"][name]), (rank, name)
        # No rank gathered a full tensor during training, saves and the resume included.
        assert straight["gathers"] == resumed["gathers"] == {"full_tensor": 0,
                                                               "full_state_dict": 0}
    # save_total_limit=2 removed checkpoint-2, its EMA with it.
    assert results[0]["checkpoints"] == ["checkpoint-4", "checkpoint-6"]
    full_bytes = results[0]["straight"]["full_bytes"]
    nbytes = [r["straight"]["nbytes"] for r in results]
    elements = list(results[0]["ema_files"].values())
    # FSDP2: one file per rank in checkpoint-4/ema; DDP: rank 0 writes the replicated EMA and
    # rank 1's file, which holds no tensor, goes at the commit.
    assert len(elements) == (2 if kind == "fsdp2" else 1), elements
    assert sum(elements) * 4 == full_bytes, elements
    if kind == "fsdp2":
        # Each rank holds its rows only, and writes them.
        assert sum(nbytes) == full_bytes and max(nbytes) < full_bytes, nbytes
        assert max(elements) * 4 < full_bytes, elements
    else:
        assert nbytes == [full_bytes, full_bytes]  # DDP: the whole EMA on every rank


# --- evaluation with the EMA and the export -------------------------------------------------------

def run_evaluate(rank, world, kind, root):
    hf_env(rank, world)
    decay = 0.75
    ref = LerpReference(decay)
    export = os.path.join(root, "ema_model")
    cb = ShardedEMACallback(decay, eval_with_ema=True, save_ema_model=export)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = make_trainer(kind, os.path.join(root, "out"), [ref, cb], eval_strategy="steps",
                         eval_steps=3)
        t.train()
    evals = {h["step"]: h["eval_loss"] for h in t.state.log_history if "eval_loss" in h}
    out = {"evals": evals, "steps": ref.steps, "before_step": ref.before_step,
           "ema": cb.ema.full_state_dict(rank0_only=False), "is_fsdp": any(
               hasattr(p, "full_tensor") for p in t.model.parameters()),
           "warnings": [str(w.message) for w in caught
                        if "ShardedEMACallback" in str(w.message)]}
    torch.distributed.barrier()
    if rank == 0:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(export)
        out["export"] = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
    return out


@pytest.mark.parametrize("kind", ["fsdp2", "ddp", "ddp_from_fsdp"])
def test_eval_with_ema_gives_the_loss_of_a_lerp_replica_and_the_export_loads_with_from_pretrained(
        pools, tmp_path, kind):
    results = pools.get(2).run(run_evaluate, kind, str(tmp_path))
    ids = Tokens(EVAL_ROWS, 2).ids
    for rank, r in enumerate(results):
        assert r["is_fsdp"] == (kind == "fsdp2")
        fsdp_warning = [w for w in r["warnings"] if "ask for FSDP" in w]
        # An FSDP config that the Trainer turned into DDP (the CPU) is reported.
        assert len(fsdp_warning) == (1 if kind == "ddp_from_fsdp" else 0), r["warnings"]
        assert sorted(r["evals"]) == [3, 6]
        for step, loss in r["evals"].items():
            ref, weights = r["steps"][step]
            replica = tiny_llama()
            replica.load_state_dict(ref)
            with torch.no_grad():
                expected = replica(input_ids=ids, labels=ids).loss
            torch.testing.assert_close(torch.tensor(loss), expected, rtol=1e-5, atol=0)
            # The next step starts from the training weights, bit for bit.
            if step in r["before_step"]:
                for name, w in weights.items():
                    assert torch.equal(r["before_step"][step][name], w), (rank, step, name)
        ref = r["steps"][6][0]
        for name, t in ref.items():  # the op's lerp and torch.lerp agree at decay 0.75
            assert torch.equal(r["ema"][name], t), (rank, name)
    export = results[0]["export"]
    for name, t in results[0]["ema"].items():
        assert torch.equal(export[name], t), name


# --- peft: the EMA adapter ------------------------------------------------------------------------

def run_peft(rank, world, root):
    import peft

    hf_env(rank, world)
    adapter = os.path.join(root, "ema_adapter")
    cb = ShardedEMACallback(0.5, params="trainable", save_ema_model=adapter)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(root, "out"), use_cpu=True, per_device_train_batch_size=2,
        max_steps=3, learning_rate=1e-2, report_to=[], disable_tqdm=True, save_strategy="no",
        fsdp=True, fsdp_config=dict(FSDP_CONFIG))
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, lora_alpha=4,
                                                              target_modules=["q_proj", "v_proj"]))
    t = FSDP2Trainer(model=model, args=args, train_dataset=Tokens(TRAIN_ROWS, 1), callbacks=[cb])
    t.train()
    ema = cb.ema.full_state_dict(rank0_only=False)
    torch.distributed.barrier()
    out = {"ema": ema, "nbytes": cb.ema.nbytes}
    if rank == 0:
        loaded = peft.PeftModel.from_pretrained(tiny_llama(), adapter)
        out["loaded"] = {k: v.detach().clone() for k, v in loaded.named_parameters()
                         if "lora_" in k}
    return out


def test_peft_model_ema_is_the_adapters_only_and_loads_with_peft_from_pretrained(pools, tmp_path):
    pytest.importorskip("peft")
    results = pools.get(2).run(run_peft, str(tmp_path))
    ema, loaded = results[0]["ema"], results[0]["loaded"]
    assert ema and all("lora_" in k for k in ema)  # params="trainable": the adapters only
    assert sorted(ema) == sorted(loaded)
    for name, t in ema.items():
        assert torch.equal(loaded[name], t), name


# --- an Accelerate loop of our own ----------------------------------------------------------------

def run_accelerate_loop(rank, world, root):
    """6 steps straight, and 3 steps + save_state + a new process state + load_state + 3 steps."""
    from accelerate import Accelerator

    def train(cb, steps, load=None, save=None):
        hf_env(rank, world)
        accelerator = Accelerator(cpu=True)
        model = tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.utils.data.DataLoader(Tokens(TRAIN_ROWS, 1), batch_size=2)
        model, opt, data = accelerator.prepare(model, opt, data)
        cb.attach(model, accelerator)
        if load is not None:
            accelerator.load_state(load)
        batches = iter(data)
        for _ in range(steps[0]):
            next(batches)
        for _ in range(steps[1] - steps[0]):
            batch = next(batches)
            accelerator.backward(model(**batch).loss)
            opt.step()
            opt.zero_grad()
            cb.update()
        if save is not None:
            accelerator.save_state(save)
        return cb

    straight = train(ShardedEMACallback(0.875, warmup=True), (0, 6))
    state = os.path.join(root, "state")
    first = train(ShardedEMACallback(0.875, warmup=True), (0, 3), save=state)
    resumed = train(ShardedEMACallback(0.875, warmup=True), (3, 6), load=state)
    return {name: (cb.ema.full_state_dict(rank0_only=False), int(cb.ema.step))
            for name, cb in (("straight", straight), ("first", first), ("resumed", resumed))} | {
        "files": sorted(os.listdir(state))}


def test_accelerate_loop_saves_and_resumes_the_ema_with_save_state_and_load_state(pools,
                                                                                  tmp_path):
    for r in pools.get(2).run(run_accelerate_loop, str(tmp_path)):
        assert "ema" in r["files"]
        (straight, s_step), (first, f_step), (resumed, r_step) = (
            r["straight"], r["first"], r["resumed"])
        assert (s_step, f_step, r_step) == (6, 3, 6)
        for name, t in straight.items():
            assert torch.equal(resumed[name], t), name
            assert not torch.equal(first[name], t), name


# --- refusals -------------------------------------------------------------------------------------

def test_unknown_option_and_a_bad_subdir_are_refused_when_the_callback_is_made():
    with pytest.raises(TypeError, match="warmupp"):
        ShardedEMACallback(0.9, warmupp=True)
    with pytest.raises(ValueError, match="subdir"):
        ShardedEMACallback(0.9, subdir="a/b")


def test_import_without_transformers_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "fsdp_ema.integrations.transformers")
    with pytest.raises(ImportError, match=r'pip install "fsdp-ema\[transformers\]"'):
        import fsdp_ema.integrations.transformers  # noqa: F401


# --- FSDP1: GPUs only ---------------------------------------------------------------------------

def run_fsdp1_cuda(rank, world, root):
    """Accelerate's FSDP1 plugin on the GPU (forced, as FSDP2 on the CPU: one process), sharded
    checkpoints: resumed from checkpoint-4 equals the uninterrupted run."""
    hf_env(rank, world)
    config = dict(FSDP_CONFIG, version=1, use_orig_params="false")
    out = {}
    for run in ("straight", "resumed"):
        hf_env(rank, world)
        cb = ShardedEMACallback(0.875, warmup=True)
        output_dir = os.path.join(root, "out")
        args = transformers.TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=6, learning_rate=1e-2, report_to=[], disable_tqdm=True,
            save_strategy="steps", save_steps=2, seed=0, fsdp=True, fsdp_config=config)
        t = FSDP2Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(TRAIN_ROWS, 1),
                         callbacks=[cb])
        t.train(resume_from_checkpoint=None if run == "straight" else
                os.path.join(output_dir, "checkpoint-4"))
        out[run] = (cb.ema.full_state_dict(rank0_only=False), int(cb.ema.step))
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP1 through Accelerate needs a GPU")
def test_cuda_fsdp1_train_resumed_from_a_mid_run_checkpoint_equals_the_uninterrupted_run(
        pools, tmp_path):
    (r,) = pools.get(1).run(run_fsdp1_cuda, str(tmp_path))
    (straight, s_step), (resumed, r_step) = r["straight"], r["resumed"]
    assert s_step == r_step == 6
    for name, t in straight.items():
        assert torch.equal(resumed[name], t), name
