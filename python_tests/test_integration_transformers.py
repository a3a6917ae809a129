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
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
from dist_utils import PoolManager

import fsdp_ema

transformers = pytest.importorskip("transformers")  # pinned in requirements.txt (test-only)
pytest.importorskip("accelerate")

from fsdp_ema.integrations.transformers import ShardedEMACallback  # noqa: E402

TRAIN_ROWS, EVAL_ROWS = 64, 8
CLI = Path(__file__).resolve().parents[1] / "build" / "bin" / "fsdp-ema"


def verify_strict(directory) -> tuple[int, str]:
    """``fsdp-ema verify --strict`` (a file the index does not list fails it)."""
    done = subprocess.run([str(CLI), "verify", "--strict", str(directory)], capture_output=True,
                          text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


def hf_env(rank: int, world: int) -> None:
    """The ranks are the pool's (gloo already initialized): Accelerate reads them from these
    variables and reuses the process group. Its state is shared by every Trainer in a process,
    and FSDP2Trainer changes it: each run starts from a fresh one."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1"})
    # Accelerate sets it in the process once it is given an FSDP plugin: each run starts without.
    os.environ.pop("ACCELERATE_USE_FSDP", None)
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
                out["verify"] = [verify_strict(os.path.join(straight_dir, c, "ema"))
                                 for c in out["checkpoints"]]
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
    # Our own tool trusts our own output: no stray file, every checksum.
    for code, text in results[0]["verify"]:
        assert code == 0 and text.startswith("OK:") and "warning" not in text, text
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

class Observer(transformers.TrainerCallback):
    """After ShardedEMACallback in the list: the weights another callback sees at the events
    around an evaluation (collective under FSDP2: every rank records at the same events)."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.seen.append(("step_end", state.global_step, full_weights(model)))

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):
        self.seen.append(("log", state.global_step, full_weights(model)))

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.seen.append(("evaluate", state.global_step, full_weights(model)))


def run_evaluate(rank, world, kind, mode, root):
    hf_env(rank, world)
    if kind == "ddp_env_fsdp":  # what `accelerate launch` with an FSDP config file sets
        os.environ.update({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})
    decay = 0.75
    ref, observer = LerpReference(decay), Observer()
    export = os.path.join(root, "ema_model")
    cb = ShardedEMACallback(decay, eval_with_ema=mode, save_ema_model=export)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = make_trainer(kind, os.path.join(root, "out"), [ref, cb, observer],
                         eval_strategy="steps", eval_steps=3, logging_steps=3)
        t.train()
    os.environ.pop("FSDP_VERSION", None)
    history = t.state.log_history
    out = {"evals": {h["step"]: h for h in history if "eval_loss" in h},
           "train_logs": {h["step"]: h for h in history if "loss" in h},
           "steps": ref.steps, "before_step": ref.before_step, "seen": observer.seen,
           "ema": cb.ema.full_state_dict(rank0_only=False), "is_fsdp": any(
               hasattr(p, "full_tensor") for p in t.model.parameters()),
           "warnings": [(str(w.message), w.filename) for w in caught
                        if "ShardedEMACallback" in str(w.message)]}
    torch.distributed.barrier()
    if rank == 0:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(export)
        out["export"] = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
        out["export_files"] = sorted(os.listdir(export))
        ids = Tokens(EVAL_ROWS, 2).ids[:1, :4]
        out["generated"] = loaded.generate(ids, max_new_tokens=2, do_sample=False).shape
    return out


def replica_loss(weights) -> torch.Tensor:
    ids = Tokens(EVAL_ROWS, 2).ids
    replica = tiny_llama()
    replica.load_state_dict(weights)
    with torch.no_grad():
        return replica(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("kind,mode", [("fsdp2", True), ("ddp", True), ("ddp_from_fsdp", True),
                                       ("ddp_env_fsdp", True), ("fsdp2", "both")])
def test_eval_with_ema_gives_the_loss_of_a_lerp_replica_and_the_export_loads_with_from_pretrained(
        pools, tmp_path, kind, mode):
    results = pools.get(2).run(run_evaluate, kind, mode, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["is_fsdp"] == (kind == "fsdp2")
        fsdp_warning = [(w, f) for w, f in r["warnings"] if "FSDP was asked for" in w]
        # An FSDP request that became DDP (the Trainer's arguments on a CPU, or Accelerate's
        # environment) is reported, once, by rank 0, at the line that called train().
        if kind in ("ddp_from_fsdp", "ddp_env_fsdp") and rank == 0:
            assert len(fsdp_warning) == 1 and fsdp_warning[0][1] == __file__, r["warnings"]
            assert ("ACCELERATE_USE_FSDP=true" in fsdp_warning[0][0]) == (kind == "ddp_env_fsdp")
        else:
            assert fsdp_warning == [], r["warnings"]
        assert sorted(r["evals"]) == [3, 6]
        for step, logs in r["evals"].items():
            ema, weights = r["steps"][step]
            if mode is True:  # the evaluation ran with the EMA weights
                torch.testing.assert_close(torch.tensor(logs["eval_loss"]), replica_loss(ema),
                                           rtol=1e-5, atol=0)
                assert "eval_loss_ema" not in logs
            else:  # both: the training weights' loss, and the EMA's beside it
                torch.testing.assert_close(torch.tensor(logs["eval_loss"]),
                                           replica_loss(weights), rtol=1e-5, atol=0)
                torch.testing.assert_close(torch.tensor(logs["eval_loss_ema"]),
                                           replica_loss(ema), rtol=1e-5, atol=0)
            # The next step starts from the training weights, bit for bit.
            if step in r["before_step"]:
                for name, w in weights.items():
                    assert torch.equal(r["before_step"][step][name], w), (rank, step, name)
        # A callback after this one never sees the EMA weights: not at the step end that
        # schedules an evaluation, nor in the evaluation's logs, nor at its end.
        assert {e for e, _, _ in r["seen"]} == {"step_end", "log", "evaluate"}
        for event, step, seen in r["seen"]:
            for name, w in r["steps"][step][1].items():
                assert torch.equal(seen[name], w), (rank, event, step, name)
        # ema/decay and ema/step in the Trainer's training logs (log_history).
        assert sorted(r["train_logs"]) == [3, 6]
        for step, logs in r["train_logs"].items():
            assert logs["ema/step"] == step and logs["ema/decay"] == 0.75, logs
        ema = r["steps"][6][0]
        for name, t in ema.items():  # the op's lerp and torch.lerp agree at decay 0.75
            assert torch.equal(r["ema"][name], t), (rank, name)
    export = results[0]["export"]
    for name, t in results[0]["ema"].items():
        assert torch.equal(export[name], t), name
    assert results[0]["export_files"] == ["config.json", "generation_config.json",
                                          "model.safetensors"]
    assert results[0]["generated"] == (1, 6)


# --- resume: the EMA of the checkpoint the Trainer restored, or a refusal naming both -------------

class EMAProbe(transformers.TrainerCallback):
    """Listed after ShardedEMACallback: the EMA as it stands once a resume has loaded it, and
    after the update of each step."""

    def __init__(self, cb):
        self.cb, self.begin, self.at = cb, None, {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.begin = self.cb.ema.full_state_dict(rank0_only=False)

    def on_step_end(self, args, state, control, **kwargs):
        self.at[state.global_step] = self.cb.ema.full_state_dict(rank0_only=False)


def run_resume_refusals(rank, world, root):
    """Run A (6 steps, a checkpoint every 2), run B (other data, a checkpoint at step 4), then
    resumes from A's checkpoint-4 (and from copies of it holding B's ema/ or no ema/) in ways
    that must be taken, refused, or accepted when asked."""
    a, b, c = (os.path.join(root, n) for n in "abc")
    a4, b4 = os.path.join(a, "checkpoint-4"), os.path.join(b, "checkpoint-4")
    mixed, stripped = os.path.join(root, "mixed"), os.path.join(root, "stripped")
    out = {}

    def train(output_dir, cb, resume=None, data_seed=1, **kwargs):
        hf_env(rank, world)
        options = dict(save_strategy="steps", save_steps=2, gradient_accumulation_steps=1)
        options.update(kwargs)
        probe = EMAProbe(cb)
        t = make_trainer("plain", output_dir, [cb, probe], **options)
        t.train_dataset = Tokens(TRAIN_ROWS, data_seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                t.train(resume_from_checkpoint=resume)
            except (ValueError, RuntimeError) as e:
                return {"error": str(e)}
        return {"ema": cb.ema.full_state_dict(rank0_only=False), "step": int(cb.ema.step),
                "begin": probe.begin, "at": probe.at,
                "warnings": [str(w.message) for w in caught if "strict_resume" in str(w.message)]}

    def callback(decay=0.875, warmup=True, **kwargs):
        return ShardedEMACallback(decay, warmup=warmup, **kwargs)

    out["a"] = train(a, callback())
    out["b"] = train(b, callback(), data_seed=3, max_steps=4)
    # A's checkpoint-4 with B's ema/ (of the same step), and with none.
    torch.distributed.barrier()
    if rank == 0:
        shutil.copytree(a4, mixed, ignore=shutil.ignore_patterns("ema"))
        shutil.copytree(os.path.join(b4, "ema"), os.path.join(mixed, "ema"))
        shutil.copytree(a4, stripped, ignore=shutil.ignore_patterns("ema"))
    torch.distributed.barrier()
    # Finding 1: B's output_dir holds B's checkpoint-4; the Trainer restores A's, given as the
    # argument of train() alone: the callback finds it.
    out["other_run"] = train(b, callback(), resume=a4, save_strategy="no")
    out["mixed"] = train(c, callback(), resume=mixed, save_strategy="no")
    out["mixed_named"] = train(c, callback(resume_from=a4), resume=mixed, save_strategy="no")
    out["stripped"] = train(c, callback(), resume=stripped, save_strategy="no")
    no = dict(resume=a4, save_strategy="no")
    out["decay"] = train(a, callback(0.9), **no)
    out["decay_allowed"] = train(a, callback(0.9, allow_changes={"decay"}), **no)
    out["dtype"] = train(a, callback(dtype=torch.float64), **no)
    out["warmup"] = train(a, callback(warmup=fsdp_ema.Warmup(power=0.5)), **no)
    out["schedule"] = train(a, callback(warmup=None, schedule=fsdp_ema.PowerEMA(0.05)), **no)
    frozen = {"params": lambda name, p: "embed" not in name}
    out["params"] = train(a, callback(**frozen), **no)
    out["params_lax"] = train(a, callback(strict_resume=False, **frozen), **no)
    return out


def test_resume_takes_the_ema_of_the_restored_checkpoint_and_refuses_others_naming_both(
        pools, tmp_path):
    for rank, r in enumerate(pools.get(2).run(run_resume_refusals, str(tmp_path))):
        a4 = tmp_path / "a" / "checkpoint-4"
        mixed, stripped = tmp_path / "mixed", tmp_path / "stripped"
        # Finding 1: train(resume_from_checkpoint=A's checkpoint-4), no resume_from=, while
        # output_dir holds B's checkpoint-4: the EMA loaded is the one saved in A's, bit for bit
        # (not B's), and the resumed run equals A's uninterrupted one.
        assert "error" not in r["other_run"], r["other_run"]
        saved, other = r["a"]["at"][4], r["b"]["at"][4]
        assert sorted(r["other_run"]["begin"]) == sorted(saved)
        for name, t in saved.items():
            assert torch.equal(r["other_run"]["begin"][name], t), name
        assert any(not torch.equal(other[n], t) for n, t in saved.items())
        for name, t in r["a"]["ema"].items():
            assert torch.equal(r["other_run"]["ema"][name], t), name
        assert r["other_run"]["step"] == r["a"]["step"] == 6
        # The restored folder holds another run's ema/: refused, naming the folder the Trainer
        # restored and the ema/ compared, and saying what to pass.
        message = r["mixed"]["error"]
        assert f"{mixed}/ema was saved beside other model weights" in message, message
        assert f"than the model the Trainer restored from {mixed} (fingerprint" in message
        assert "pass ShardedEMACallback(resume_from=" in message, message
        # ... which, naming A's checkpoint, takes A's EMA (its fingerprint is the restored one).
        for name, t in r["a"]["ema"].items():
            assert torch.equal(r["mixed_named"]["ema"][name], t), name
        assert r["mixed_named"]["step"] == 6
        # No ema/ anywhere: refused, naming the restored folder, without claiming a stopped save.
        message = r["stripped"]["error"]
        assert f"resumed at step 4 from {stripped}, saved by a run that kept an EMA" in message
        assert f"{stripped} has no ema/" in message, message
        assert "copied or moved without its ema/" in message, message
        assert "while saving it" not in message, message
        assert "pass ShardedEMACallback(resume_from=" in message, message
        # Finding 5: a changed option is refused, naming it, unless allowed.
        message = r["decay"]["error"]
        assert f"the EMA's options changed since {a4}/ema was saved: decay: 0.875 when saved, " \
               f"0.9 now" in message and "allow_changes={'decay'}" in message, message
        assert r["decay_allowed"]["step"] == 6
        message = r["dtype"]["error"]
        assert "dtype: 'float32' when saved, 'float64' now" in message, message
        assert "allow_changes={'dtype'}" in message, message
        message = r["warmup"]["error"]
        assert "warmup: {'gamma': 1.0, " in message, message
        assert "'power': 0.6666666666666666} when saved, {'gamma': 1.0, 'power': 0.5," in message
        message = r["schedule"]["error"]
        assert "schedule: None when saved, 'fsdp_ema.power_ema.PowerEMA: " in message, message
        message = r["params"]["error"]
        assert "another set of tensors than the EMA of this model" in message, message
        assert "only in the checkpoint: ['model.embed_tokens.weight']" in message, message
        # strict_resume=False: resumed, with one warning (rank 0) naming what differs.
        assert r["params_lax"]["step"] == 6
        assert len(r["params_lax"]["warnings"]) == (1 if rank == 0 else 0), r["params_lax"]
        if rank == 0:
            assert "model.embed_tokens.weight" in r["params_lax"]["warnings"][0]
        assert "model.embed_tokens.weight" not in r["params_lax"]["ema"]


def run_best_async(rank, world, root):
    """async_save + load_best_model_at_end + save_total_limit=1: the Trainer deletes the last
    checkpoint at the end unless it is the best; the EMA's background save must not bring it
    back. Then train(resume_from_checkpoint=True) continues from what is left."""
    hf_env(rank, world)
    out_dir = os.path.join(root, "out")
    # The evaluation loss rises on these tokens: the first checkpoint stays the best, and the
    # Trainer deletes the last one at the end.
    options = dict(save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
                   save_total_limit=1, load_best_model_at_end=True,
                   metric_for_best_model="eval_loss", greater_is_better=False,
                   gradient_accumulation_steps=1)
    cb = ShardedEMACallback(0.875, async_save=True)
    t = make_trainer("plain", out_dir, [cb], **options)
    t.train()
    torch.distributed.barrier()
    result = {"best": t.state.best_model_checkpoint, "left": sorted(os.listdir(out_dir)),
              "limit": t.args.save_total_limit}
    result["contents"] = {d: sorted(os.listdir(os.path.join(out_dir, d))) for d in result["left"]}
    torch.distributed.barrier()
    hf_env(rank, world)
    cb = ShardedEMACallback(0.875)
    t = make_trainer("plain", out_dir, [cb], **dict(options, max_steps=8))
    t.train(resume_from_checkpoint=True)
    result["resumed_step"] = int(cb.ema.step)
    return result


def test_async_save_with_load_best_model_at_end_never_brings_a_deleted_checkpoint_back(
        pools, tmp_path):
    for r in pools.get(2).run(run_best_async, str(tmp_path)):
        best = os.path.basename(r["best"])
        # One checkpoint left (save_total_limit=1), the best, whole with its committed EMA.
        assert r["left"] == [best] and best != "checkpoint-6", r
        assert {"trainer_state.json", "model.safetensors", "ema"} <= set(r["contents"][best])
        assert r["limit"] == 1  # the callback put the Trainer's setting back
        assert r["resumed_step"] == 8, r  # resumed from the best checkpoint, with its EMA


class CheckpointCount(transformers.TrainerCallback):
    """After ShardedEMACallback: the checkpoint folders on disk (rank 0, which rotates) at the
    step end that schedules a save (the previous save has landed, its rotation done), at each
    on_save (the one being written is there) and at the end of training."""

    def __init__(self):
        self.seen = []

    def _count(self, args, event, step):
        if args.should_save:
            found = sorted(p for p in os.listdir(args.output_dir) if p.startswith("checkpoint-"))
            self.seen.append((event, step, found))

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._count(args, "step_end", state.global_step)

    def on_save(self, args, state, control, **kwargs):
        self._count(args, "save", state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._count(args, "end", state.global_step)


def run_limit_with_async(rank, world, root, async_save, limit):
    hf_env(rank, world)
    counter = CheckpointCount()
    t = make_trainer("plain", os.path.join(root, f"async-{async_save}"),
                     [ShardedEMACallback(0.875, async_save=async_save), counter],
                     save_strategy="steps", save_steps=1, save_total_limit=limit, max_steps=5,
                     gradient_accumulation_steps=1)
    t.train()
    return counter.seen


@pytest.mark.parametrize("limit", [1, 2])
def test_save_total_limit_holds_with_async_save_as_without(pools, tmp_path, limit):
    for async_save in (False, True):
        seen = pools.get(2).run(run_limit_with_async, str(tmp_path), async_save, limit)[0]
        assert [e for e, _, _ in seen] == ["step_end", "save"] * 5 + ["end"], seen
        for event, step, found in seen:
            # Before a save (the previous one landed and rotated) and at the end: the limit
            # exactly; while one is written: at most the limit plus that one.
            last = step - (event == "step_end")
            if event == "save":
                assert len(found) <= limit + 1 and f"checkpoint-{step}" in found, (
                    async_save, seen)
            else:
                assert len(found) == min(limit, last), (async_save, event, step, found)
            if last:
                assert found[-1] == f"checkpoint-{last}", (async_save, event, step, found)


# --- hyperparameter search: each trial's checkpoints in its own folder ----------------------------

class Trial:
    """What an optuna trial gives the Trainer (optuna is not installed here): its number and
    parameters. ``hyperparameter_search`` calls ``train(trial=trial)`` with it."""

    def __init__(self, number: int):
        self.number, self.params = number, {}


def tree_digest(root: str) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256 of its bytes)."""
    import hashlib

    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def committed_ema(ema_dir: str) -> dict[str, torch.Tensor]:
    """The EMA tensors of a committed ``ema/`` (the replicated EMA: rank 0's file holds all)."""
    from safetensors import safe_open

    assert fsdp_ema._ops.is_committed(ema_dir), ema_dir
    out = {}
    for path in sorted(glob.glob(os.path.join(ema_dir, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            out.update({k[len("ema."):]: f.get_tensor(k) for k in f.keys() if k.startswith("ema.")})
    return out


def run_trial_beside_an_earlier_run(rank, world, root):
    """An earlier run's checkpoints 4, 8 and 12 in output_dir, then one trial of a search into
    the same output_dir, driven as ``hyperparameter_search`` drives it (the optuna backend set,
    ``train(trial=...)``): the Trainer saves the trial's checkpoints in output_dir/run-0."""
    import transformers.integrations as integrations
    from transformers.trainer_utils import HPSearchBackend

    out = os.path.join(root, "out")
    hf_env(rank, world)
    steps = dict(save_strategy="steps", save_steps=4, gradient_accumulation_steps=1)
    make_trainer("plain", out, [ShardedEMACallback(0.875)], max_steps=12, **steps).train()
    torch.distributed.barrier()
    before = tree_digest(out)
    torch.distributed.barrier()
    hf_env(rank, world)
    cb = ShardedEMACallback(0.5)
    t = make_trainer("plain", out, [cb], max_steps=8, save_total_limit=1, **steps)
    t.train_dataset = Tokens(TRAIN_ROWS, 5)
    t.hp_search_backend, t.hp_space, t.hp_name = HPSearchBackend.OPTUNA, lambda trial: {}, None
    real_hp_params = integrations.hp_params  # it knows optuna's trial class only
    integrations.hp_params = lambda trial: dict(trial.params)
    result = {"before": before}
    try:
        t.train(trial=Trial(0))
    except Exception as e:  # noqa: BLE001 (the test reports it)
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        integrations.hp_params = real_hp_params
    torch.distributed.barrier()
    result["after"] = tree_digest(out)
    if "error" not in result:
        result["ema"] = cb.ema.full_state_dict(rank0_only=False)
        result["trial"] = sorted(os.listdir(os.path.join(out, "run-0")))
        result["saved"] = committed_ema(os.path.join(out, "run-0", "checkpoint-8", "ema"))
    torch.distributed.barrier()
    return result


def test_a_search_trial_saves_its_ema_in_its_own_folder_and_leaves_other_runs_alone(pools,
                                                                                  tmp_path):
    for r in pools.get(2).run(run_trial_beside_an_earlier_run, str(tmp_path)):
        assert "error" not in r, r["error"]
        # The earlier run's folders: not one file written or removed.
        old = {k: v for k, v in r["after"].items() if not k.startswith("run-0" + os.sep)}
        assert old == r["before"], sorted(set(old.items()) ^ set(r["before"].items()))
        # The trial's checkpoints hold its EMA, rotated in its folder (save_total_limit=1).
        assert r["trial"] == ["checkpoint-8"], r["trial"]
        assert sorted(r["saved"]) == sorted(r["ema"]), sorted(r["saved"])
        for name, t in r["saved"].items():
            assert torch.equal(r["ema"][name], t), name


def test_a_trial_whose_folder_cannot_be_read_is_refused_naming_the_trial_folders(tmp_path):
    from fsdp_ema.integrations.hf_checkpoints import run_folder

    args = types.SimpleNamespace(output_dir=str(tmp_path))
    # No Trainer on the stack (a subclass that replaces train and _inner_training_loop).
    assert run_folder(args, types.SimpleNamespace(is_hyper_param_search=False)) == str(tmp_path)
    with pytest.raises(RuntimeError, match=r"hyperparameter-search trial.*run-<trial id>"):
        run_folder(args, types.SimpleNamespace(is_hyper_param_search=True))


def run_save_on_each_node(rank, world, root):
    hf_env(rank, world)
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # two nodes of one rank each
    try:
        t = make_trainer("plain", os.path.join(root, "out"), [ShardedEMACallback(0.9)],
                         save_on_each_node=True)
        t.train()
    except ValueError as e:
        return str(e), t.state.global_step
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = str(world)
    return None, None


def test_save_on_each_node_over_several_nodes_is_refused_before_training(pools, tmp_path):
    for message, step in pools.get(2).run(run_save_on_each_node, str(tmp_path)):
        assert message is not None and "save_on_each_node=False" in message, message
        assert step == 0


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
        "files": sorted(os.listdir(state)),
        "verify": verify_strict(os.path.join(state, "ema")) if rank == 0 else None}


def test_accelerate_loop_saves_and_resumes_the_ema_with_save_state_and_load_state(pools,
                                                                                  tmp_path):
    for r in pools.get(2).run(run_accelerate_loop, str(tmp_path)):
        assert "ema" in r["files"]
        if r["verify"] is not None:
            code, text = r["verify"]
            assert code == 0 and text.startswith("OK:") and "warning" not in text, text
        (straight, s_step), (first, f_step), (resumed, r_step) = (
            r["straight"], r["first"], r["resumed"])
        assert (s_step, f_step, r_step) == (6, 3, 6)
        for name, t in straight.items():
            assert torch.equal(resumed[name], t), name
            assert not torch.equal(first[name], t), name


# --- the rotation: by step, never by mtime; the Trainer's state first, the EMA's index next -----

def make_checkpoint(out: Path, step: int, mtime: float, *, whole: bool = True) -> Path:
    """A ``checkpoint-<step>`` folder: whole (the Trainer's files and a committed-looking ema/),
    or what a removal killed halfway leaves (its trainer_state.json and ema/ gone first, one file
    left); ``mtime`` set."""
    folder = out / f"checkpoint-{step}"
    (folder / "ema").mkdir(parents=True)
    names = (["model.safetensors", "optimizer.pt", "trainer_state.json",
              "ema/fsdp_ema.index.json"] if whole else ["optimizer.pt"])
    for name in names:
        (folder / name).write_text("x")
    if not whole:
        (folder / "ema").rmdir()
    os.utime(folder, (mtime, mtime))
    return folder


def test_rotation_orders_by_step_so_a_half_deleted_folder_goes_first(tmp_path):
    from transformers.trainer_utils import rotate_checkpoints

    now = time.time()
    for name, rotate in (("ours", None), ("trainer", rotate_checkpoints)):
        out = tmp_path / name
        # Killed while the save of step 12 removed checkpoint-8: its rmtree touched the folder
        # after checkpoint-12 was written. Resumed from 12; step 16 is saved now.
        make_checkpoint(out, 12, now - 100)
        make_checkpoint(out, 8, now - 50, whole=False)
        newest = make_checkpoint(out, 16, now)
        if rotate is None:
            cb = ShardedEMACallback(0.9)
            cb.rotation.limit = 2
            args = types.SimpleNamespace(output_dir=str(out), should_save=True)
            state = types.SimpleNamespace(best_model_checkpoint=None, global_step=16)
            cb.rotation.after_commit(args, state, str(newest))
        else:  # what the Trainer's own rotation (use_mtime=True) would do
            rotate(output_dir=str(out), save_total_limit=2, use_mtime=True)
        left = sorted(os.listdir(out))
        if rotate is None:
            assert left == ["checkpoint-12", "checkpoint-16"], left
        else:  # mtime keeps the broken folder and removes a complete one
            assert left == ["checkpoint-16", "checkpoint-8"], left


def test_rotation_keeps_the_checkpoint_just_saved_below_steps_already_on_disk(tmp_path):
    from fsdp_ema.integrations.hf_checkpoints import rotate_by_step

    now = time.time()
    # Resumed from checkpoint-4 while checkpoint-8 of a longer run is there; checkpoint-6 saved.
    for step, age in ((4, 300), (8, 200), (6, 0)):
        make_checkpoint(tmp_path, step, now - age)
    best = tmp_path / "checkpoint-4"
    removed = rotate_by_step(str(tmp_path), 2, newest=str(tmp_path / "checkpoint-6"),
                             keep=(str(best),))
    assert [os.path.basename(p) for p in removed] == ["checkpoint-8"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-6"]
    removed = rotate_by_step(str(tmp_path), 1, newest=str(tmp_path / "checkpoint-6"))
    assert [os.path.basename(p) for p in removed] == ["checkpoint-4"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-6"]
    assert rotate_by_step(str(tmp_path), 1, newest=str(tmp_path / "checkpoint-6")) == []


def test_rotation_removes_an_abandoned_higher_step_before_this_runs_checkpoints(tmp_path):
    from fsdp_ema.integrations.hf_checkpoints import rotate_by_step

    # Resumed from checkpoint-4 while checkpoint-8 of an abandoned branch is there; limit 2.
    # This run's checkpoints are the ones kept (a resume would otherwise take the stale 8).
    for step in (4, 8):
        make_checkpoint(tmp_path, step, time.time())
    for saved, want in ((6, ["checkpoint-4", "checkpoint-6"]),
                        (7, ["checkpoint-6", "checkpoint-7"])):
        newest = make_checkpoint(tmp_path, saved, time.time())
        rotate_by_step(str(tmp_path), 2, newest=str(newest))
        assert sorted(os.listdir(tmp_path)) == want, (saved, sorted(os.listdir(tmp_path)))


def test_rotation_never_removes_the_step_being_saved(tmp_path):
    from fsdp_ema.integrations.transformers import ShardedEMACallback

    # async_save: the rotation of checkpoint-6 runs at the save of step 8, whose folder another
    # rank has already begun (its RNG file); that folder is kept, the older complete one goes.
    make_checkpoint(tmp_path, 4, time.time())
    newest = make_checkpoint(tmp_path, 6, time.time())
    (tmp_path / "checkpoint-8").mkdir()
    (tmp_path / "checkpoint-8" / "rng_state_1.pth").write_text("x")
    cb = ShardedEMACallback(0.9)
    cb.rotation.limit = 1
    args = types.SimpleNamespace(output_dir=str(tmp_path), should_save=True)
    cb.rotation.after_commit(args, types.SimpleNamespace(best_model_checkpoint=None,
                                                         global_step=8), str(newest))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-6", "checkpoint-8"]


def test_a_resumed_run_removes_the_checkpoints_above_its_step_highest_first(tmp_path):
    from fsdp_ema.integrations.hf_checkpoints import Rotation

    # Resumed at step 2 (or 4) while checkpoints of an abandoned branch are above it: with the
    # rotation on they go before the first step (resume_from_checkpoint=True takes the highest
    # step), highest first; the best and the restored folder stay; without it nothing goes.
    for step in (2, 4, 6, 8):
        make_checkpoint(tmp_path, step, time.time())
    args = types.SimpleNamespace(output_dir=str(tmp_path), should_save=True,
                                 save_total_limit=None)
    rotation = Rotation()
    rotation.take_over(args)
    assert rotation.remove_above(args, 4) == []
    args.save_total_limit = 3
    rotation.take_over(args)
    removed = rotation.remove_above(args, 4, keep=(str(tmp_path / "checkpoint-6"), None))
    assert [os.path.basename(p) for p in removed] == ["checkpoint-8"]
    removed = rotation.remove_above(args, 2)
    assert [os.path.basename(p) for p in removed] == ["checkpoint-6", "checkpoint-4"]
    assert os.listdir(tmp_path) == ["checkpoint-2"]


def test_a_removed_checkpoint_loses_its_trainer_state_then_its_ema_index_first(tmp_path):
    from fsdp_ema import _ops
    from fsdp_ema.integrations.hf_checkpoints import remove_checkpoint_folder

    # One format operation removes the folder: the Trainer's state with the folder's index
    # first, durably. A removal stopped right after that (here: a marker that cannot go, a
    # directory named as one) leaves a folder that is complete to nobody: no trainer_state.json,
    # the rest still there.
    folder = make_checkpoint(tmp_path, 4, time.time())
    (folder / "stuck").mkdir()
    with pytest.raises(RuntimeError, match="cannot remove the commit marker"):
        _ops.remove_checkpoint(str(folder), first=["trainer_state.json", "stuck"])
    assert not (folder / "trainer_state.json").exists()
    assert (folder / "optimizer.pt").exists() and _ops.is_committed(str(folder / "ema"))
    # The next removal finishes it, the EMA losing its index before its files.
    remove_checkpoint_folder(str(folder))
    assert os.listdir(tmp_path) == []
    # Killed after the Trainer's state went: the folder is complete to nobody, and the next
    # removal finishes it.
    half = make_checkpoint(tmp_path, 6, time.time())
    (half / "trainer_state.json").unlink()
    remove_checkpoint_folder(str(half))
    assert os.listdir(tmp_path) == []


def test_a_folder_the_rotation_cannot_remove_costs_no_other_checkpoint(tmp_path):
    from fsdp_ema.integrations.hf_checkpoints import rotate_by_step

    # save_total_limit=2 over a link (checkpoint-1) and checkpoints 2, 3, 4: the link stays (one
    # warning), checkpoint-2 goes, and 3 and 4, the two the Trainer keeps, both stay.
    elsewhere = make_checkpoint(tmp_path / "kept", 1, time.time())
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint-1").symlink_to(elsewhere)
    for step in (2, 3, 4):
        newest = make_checkpoint(out, step, time.time())
    with pytest.warns(RuntimeWarning, match="could not remove .*checkpoint-1"):
        removed = rotate_by_step(str(out), 2, newest=str(newest))
    assert [os.path.basename(p) for p in removed] == ["checkpoint-2"]
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]


def test_the_rotation_never_removes_through_a_link_and_says_so(tmp_path):
    from fsdp_ema.integrations.hf_checkpoints import rotate_by_step

    # checkpoint-2 is a link to a checkpoint kept elsewhere: its files stay whole (not even its
    # trainer_state.json goes), one warning names it, and the rotation removes the next oldest.
    elsewhere = make_checkpoint(tmp_path / "kept", 2, time.time())
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint-2").symlink_to(elsewhere)
    for step in (4, 6):
        newest = make_checkpoint(out, step, time.time())
    with pytest.warns(RuntimeWarning, match="could not remove .*checkpoint-2"):
        removed = rotate_by_step(str(out), 1, newest=str(newest))
    assert [os.path.basename(p) for p in removed] == ["checkpoint-4"]
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-6"]
    assert sorted(os.listdir(elsewhere)) == sorted(["ema", "model.safetensors", "optimizer.pt",
                                                    "trainer_state.json"])


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
