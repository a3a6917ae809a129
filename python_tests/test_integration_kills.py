"""Kills during the trainer integrations' saves (#34): every rank SIGKILLs itself at a named point
of one save (a kill point patched into the run, never a timed kill), and a fresh run resumes.
After every kill, some checkpoint holds model, optimizer and EMA together, and the resume either
continues with all three from one checkpoint, bit for bit the uninterrupted run's, or refuses with
a message that says what to do; doing it then resumes bit for bit too.

The ranks are fork servers (``dist_utils.ForkRanks``): a killed rank costs a fork, not an
interpreter. Hugging Face: DDP over 2 gloo ranks, a checkpoint every 2 steps, ``save_total_limit=1``
(the previous checkpoint is the one a rotation would remove), killed in the save of step 4; and
a run resumed below an abandoned branch's checkpoints, killed in its first save.
Lightning: ``ModelParallelStrategy`` (FSDP2) over 2 gloo ranks, killed in the save after epoch 1,
with the checkpoint overwritten in place (``filename="last"``) and with the recipe that keeps the
previous one (versioned names, ``save_last="link"``), also between removing ``last.ckpt`` and
linking it again.
"""

from __future__ import annotations

import os
import re
import shutil
import signal

import pytest
import torch
from dist_utils import ForkRanks

import fsdp_ema

transformers = pytest.importorskip("transformers")
pl = pytest.importorskip("lightning.pytorch")

from fsdp_ema.integrations.hf_checkpoints import Rotation  # noqa: E402
from fsdp_ema.integrations.lightning import ShardedEMA  # noqa: E402
from fsdp_ema.integrations.transformers import ShardedEMACallback  # noqa: E402


@pytest.fixture(scope="module")
def ranks():
    r = ForkRanks(2, preload=("transformers", "accelerate", "lightning.pytorch",
                              "test_integration_kills"))
    yield r
    r.close()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def local_state(optimizer) -> dict:
    """This rank's optimizer state tensors (DTensors: their local shards)."""
    out = {}
    for i, s in optimizer.state_dict()["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"{i}.{k}"] = (v._local_tensor if hasattr(v, "_local_tensor") else v).clone()
    return out


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got["step"] == want["step"] and got["global_step"] == want["global_step"], (what, got)
    for part in ("ema", "model", "optim"):
        assert sorted(got[part]) == sorted(want[part]), (what, part)
        for name, t in want[part].items():
            assert torch.equal(got[part][name], t), (what, part, name)


# --- Hugging Face Trainer -------------------------------------------------------------------------

HF_STEPS, HF_KILL_STEP = 6, 4


def hf_setup(rank, world, root, max_steps, cb, data=1, **options):
    from test_integration_transformers import Tokens, hf_env, tiny_llama

    hf_env(rank, world)
    options = dict(dict(save_steps=2, save_total_limit=1), **options)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(root, "out"), use_cpu=True, per_device_train_batch_size=2,
        max_steps=max_steps, learning_rate=1e-2, report_to=[], disable_tqdm=True,
        save_strategy="steps", logging_steps=100, seed=0, **options)
    return transformers.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(64, data),
                                callbacks=[cb])


def hf_callback(async_save=False):
    return ShardedEMACallback(0.875, warmup=fsdp_ema.Warmup(power=0.75), async_save=async_save)


def hf_result(trainer, cb) -> dict:
    from test_integration_transformers import full_weights

    return {"ema": cb.ema.full_state_dict(rank0_only=False), "step": int(cb.ema.step),
            "global_step": trainer.state.global_step, "model": full_weights(trainer.model),
            "optim": local_state(trainer.optimizer)}


def hf_killed_run(rank, world, root, point):
    """Trains to HF_STEPS, every rank killing itself at ``point`` of the save of step 4."""
    cb = hf_callback(async_save=point == "async_ema_files")
    trainer = hf_setup(rank, world, root, HF_STEPS, cb)
    at_kill = f"checkpoint-{HF_KILL_STEP}"
    if point == "trainer_files":  # the Trainer's model, optimizer and RNG files, no state yet
        real = transformers.Trainer._save_rng_state

        def save_rng(self, output_dir):
            real(self, output_dir)
            if at_kill in output_dir:
                die()
        transformers.Trainer._save_rng_state = save_rng
    elif point == "before_ema":  # the Trainer's checkpoint complete, no ema/ yet
        real_on_save = ShardedEMACallback.on_save

        def on_save(self, args, state, control, **kwargs):
            if state.global_step == HF_KILL_STEP:
                die()
            return real_on_save(self, args, state, control, **kwargs)
        ShardedEMACallback.on_save = on_save
    elif point in ("ema_files", "async_ema_files"):  # every rank's EMA file, not committed
        real_save_shard = fsdp_ema.checkpoint.save_shard

        def save_shard(directory, *args, **kwargs):
            out = real_save_shard(directory, *args, **kwargs)
            if at_kill in os.fspath(directory):
                die()
            return out
        fsdp_ema.checkpoint.save_shard = save_shard
    elif point == "before_rotation":  # the EMA committed, the previous checkpoint not removed
        real_rotate = Rotation.after_commit

        def rotate(self, args, state, *rest):
            if state.global_step == HF_KILL_STEP:
                die()
            return real_rotate(self, args, state, *rest)
        Rotation.after_commit = rotate
    elif point == "during_rotation":  # the previous checkpoint half removed by the rotation
        real_rotate, real_remove = Rotation.after_commit, fsdp_ema._ops.remove_checkpoint

        def remove(directory, first=()):
            # Killed inside the format's removal once it has taken the Trainer's state (its
            # first, durable step), the EMA (index first) and one file more.
            if os.path.basename(directory).startswith("checkpoint-"):
                for name in first:
                    os.remove(os.path.join(directory, name))
                real_remove(os.path.join(directory, "ema"))
                os.remove(os.path.join(directory, "model.safetensors"))
                die()
            real_remove(directory, first)

        def rotate(self, args, state, *rest):
            if state.global_step == HF_KILL_STEP:
                fsdp_ema._ops.remove_checkpoint = remove  # rank 0 dies in it; the others after
                real_rotate(self, args, state, *rest)     # their (no) rotation
                die()
            return real_rotate(self, args, state, *rest)
        Rotation.after_commit = rotate
    trainer.train()
    return hf_result(trainer, cb)


def complete_hf_checkpoints(out: str) -> list[str]:
    """The checkpoints that hold model, optimizer, trainer state and a committed EMA."""
    found = []
    for name in sorted(os.listdir(out)):
        d = os.path.join(out, name)
        if all(os.path.isfile(os.path.join(d, f)) for f in (
                "model.safetensors", "optimizer.pt", "trainer_state.json")) and (
                torch.ops.fsdp_ema.is_committed(os.path.join(d, "ema"))):
            found.append(name)
    return found


def hf_resume(rank, world, root):
    """``train(resume_from_checkpoint=True)``; on a refusal, what it says to do, then again."""
    refusal = None
    try:
        cb = hf_callback()
        trainer = hf_setup(rank, world, root, HF_STEPS, cb)
        trainer.train(resume_from_checkpoint=True)
        return {"refusal": None, **hf_result(trainer, cb)}
    except (RuntimeError, FileNotFoundError) as e:
        refusal = f"{type(e).__name__}: {e}"
    command = re.search(r"rm -r '([^']+)'", refusal)
    interrupted = (command.group(1) if command else
                   os.path.join(root, "out", f"checkpoint-{HF_KILL_STEP}"))
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(interrupted)
    torch.distributed.barrier()
    cb = hf_callback()
    trainer = hf_setup(rank, world, root, HF_STEPS, cb)
    trainer.train(resume_from_checkpoint=True)
    return {"refusal": refusal, "removed": interrupted, **hf_result(trainer, cb)}


def hf_straight(rank, world, root):
    cb = hf_callback()
    trainer = hf_setup(rank, world, root, HF_STEPS, cb)
    trainer.train()
    return hf_result(trainer, cb)


# point -> what the resume does: "resumes" (from checkpoint-4), "ours" (the callback refuses with
# the command), "trainer" (the Trainer itself refuses: its state file is missing)
HF_CASES = {"trainer_files": "trainer", "before_ema": "ours", "ema_files": "ours",
            "async_ema_files": "ours", "before_rotation": "resumes",
            "during_rotation": "resumes"}


def test_hf_kill_in_each_window_of_a_save_resumes_bit_for_bit_or_says_what_to_do(ranks,
                                                                                 tmp_path):
    reference = [r[1] for r in ranks.run(hf_straight, str(tmp_path / "straight"))]
    for point, expect in HF_CASES.items():
        root = str(tmp_path / point)
        killed = ranks.run(hf_killed_run, root, point)
        assert killed == [("killed", None)] * 2, (point, killed)
        out = os.path.join(root, "out")
        # The previous checkpoint is still there, whole, whatever the window (the rotation runs
        # only once the new one holds its EMA); past the commit the new one is whole too, and a
        # rotation killed halfway leaves only the new one whole (the resume takes it, and its
        # rotation, by step, removes the half-deleted one).
        complete = complete_hf_checkpoints(out)
        assert complete == (["checkpoint-4"] if point == "during_rotation" else
                            ["checkpoint-2", "checkpoint-4"] if expect == "resumes"
                            else ["checkpoint-2"]), (point, sorted(os.listdir(out)))
        if point == "during_rotation":
            # The removal took the Trainer's state first, then the EMA (its index first): what
            # is left of checkpoint-2 looks complete to neither the Trainer nor the callback.
            left = os.listdir(os.path.join(out, "checkpoint-2"))
            assert "optimizer.pt" in left and not {"trainer_state.json", "ema",
                                                   "model.safetensors"} & set(left), left
        results = ranks.run(hf_resume, root)
        for rank, (status, r) in enumerate(results):
            assert status == "ok", (point, r)
            if expect == "resumes":
                assert r["refusal"] is None, (point, r["refusal"])
            elif expect == "ours":
                # Killed before the EMA's save began: no ema/ at all; after its files: one with
                # no commit. Either way the message says which, and the command to go on.
                why = ("the run was stopped before saving it" if point == "before_ema"
                       else "the run was stopped while saving it")
                assert why in r["refusal"], (point, r["refusal"])
                assert f"from {os.path.join(out, f'checkpoint-{HF_KILL_STEP}')}," in (
                    r["refusal"]), r["refusal"]
                assert r["removed"] == os.path.join(out, f"checkpoint-{HF_KILL_STEP}"), r
            else:
                assert r["refusal"].startswith("FileNotFoundError") and (
                    "trainer_state.json" in r["refusal"]), r["refusal"]
            assert_same(r, reference[rank], point)
        # The resumed run rotated as the Trainer would have: the last checkpoint only.
        assert os.listdir(out) == [f"checkpoint-{HF_STEPS}"], (point, os.listdir(out))


# An abandoned branch: a run saved checkpoints 4, 6 and 8; a second run (other data) resumes from
# checkpoint-4 (a path) and is killed in its save of step 6, once its EMA is committed, before the
# rotation. resume_from_checkpoint=True must continue the second run, never the first's 8.
BRANCH = dict(data=3, save_total_limit=3)


class RestoredStep(transformers.TrainerCallback):
    def __init__(self):
        self.step = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


def hf_branch_run(rank, world, root, resume, kill_at=None):
    """The second run (resumed from ``resume``), killed before the rotation of ``kill_at``."""
    real_rotate = Rotation.after_commit

    def rotate(self, args, state, *rest):
        if state.global_step == kill_at:
            die()
        return real_rotate(self, args, state, *rest)
    Rotation.after_commit = rotate
    cb, restored = hf_callback(), RestoredStep()
    trainer = hf_setup(rank, world, root, 8, cb, **BRANCH)
    trainer.add_callback(restored)
    if resume is not True:
        resume = os.path.join(root, "out", resume)
    trainer.train(resume_from_checkpoint=resume)
    return {"restored": restored.step, **hf_result(trainer, cb)}


def hf_abandoned_run(rank, world, root):
    trainer = hf_setup(rank, world, root, 8, hf_callback(), save_total_limit=3)
    trainer.train()
    torch.distributed.barrier()
    if rank == 0:  # the second run's uninterrupted reference starts from the same checkpoint-4
        shutil.copytree(os.path.join(root, "out", "checkpoint-4"),
                        os.path.join(root + "-reference", "out", "checkpoint-4"))
    torch.distributed.barrier()
    return sorted(os.listdir(os.path.join(root, "out")))


def test_hf_kill_after_resuming_below_an_abandoned_branch_never_continues_that_branch(ranks,
                                                                                    tmp_path):
    root = str(tmp_path / "branch")
    first = ranks.run(hf_abandoned_run, root)
    assert first == [("ok", ["checkpoint-4", "checkpoint-6", "checkpoint-8"])] * 2, first
    reference = ranks.run(hf_branch_run, root + "-reference", "checkpoint-4")
    killed = ranks.run(hf_branch_run, root, "checkpoint-4", 6)
    assert killed == [("killed", None)] * 2, killed
    # The second run took the first run's checkpoints above its own step away before its first
    # step: what a kill leaves holds no checkpoint of the abandoned branch.
    out = os.path.join(root, "out")
    assert complete_hf_checkpoints(out) == ["checkpoint-4", "checkpoint-6"], os.listdir(out)
    assert sorted(os.listdir(out)) == ["checkpoint-4", "checkpoint-6"], os.listdir(out)
    resumed = ranks.run(hf_branch_run, root, True)
    for rank, (status, r) in enumerate(resumed):
        assert status == "ok", r
        assert r["restored"] == 6, r["restored"]  # the second run's latest, not the first's 8
        assert_same(r, reference[rank][1], "abandoned branch")


# --- Lightning ------------------------------------------------------------------------------------

PL_EPOCHS = 3


def pl_setup(rank, world, root, recipe, cb, *extra):
    from test_integration_lightning import lightning_env, trainer

    lightning_env(rank, world)
    if recipe == "overwrite":  # the checkpoint docs/INTEGRATIONS.md warns about
        save = pl.callbacks.ModelCheckpoint(dirpath=root, filename="last", every_n_epochs=1,
                                            enable_version_counter=False)
    else:
        save = pl.callbacks.ModelCheckpoint(dirpath=root, filename="{epoch}-{step}",
                                            monitor="step", mode="max", save_top_k=2,
                                            save_last="link")
    return trainer("fsdp2", world, root, [cb, *extra, save], max_epochs=PL_EPOCHS,
                   limit_val_batches=0, enable_checkpointing=True)


def pl_callback():
    return ShardedEMA(0.875, warmup=fsdp_ema.Warmup(power=0.75))


def pl_result(trainer, module, cb) -> dict:
    from test_integration_lightning import full_ema, full_weights

    return {"ema": full_ema(cb.ema), "step": int(cb.ema.step), "global_step": trainer.global_step,
            "model": full_weights(module), "optim": local_state(trainer.optimizers[0])}


def pl_killed_run(rank, world, root, recipe, point):
    """Fits PL_EPOCHS epochs, every rank killing itself at ``point`` of the second save."""
    import warnings

    import torch.distributed.checkpoint.filesystem as dcp_fs
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning.pytorch.strategies import model_parallel as mp
    from test_integration_lightning import Module, loader

    warnings.filterwarnings("ignore")
    saves = {"n": 0}
    real_dcp_save = mp._distributed_checkpoint_save
    real_save = ModelParallelStrategy.save_checkpoint
    real_write = dcp_fs._FileSystemWriter.write_data

    def dcp_save(state, path):
        saves["n"] += 1
        if saves["n"] == 2 and point == "before_data":
            die()
        real_dcp_save(state, path)
        if saves["n"] == 2 and point == "before_meta":  # data and .metadata, no meta.pt
            die()

    def write_data(self, plan, planner):
        fut = real_write(self, plan, planner)
        fut.wait()
        if saves["n"] == 2 and point == "before_metadata":  # every rank's data file written
            die()
        return fut

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        real_save(self, checkpoint, filepath, storage_options)
        if saves["n"] == 2 and point == "after_meta":
            die()

    real_link, real_symlink = ModelCheckpoint._link_checkpoint, os.symlink

    def link(trainer, filepath, linkpath):
        # "relink": rank 0 (the one that links) removes last.ckpt and is killed before it links
        # it again; the others die before they would wait for it.
        if saves["n"] == 2 and point == "relink" and not trainer.is_global_zero:
            die()
        real_link(trainer, filepath, linkpath)

    def symlink(src, dst, *args, **kwargs):
        if saves["n"] == 2 and point == "relink":
            die()
        real_symlink(src, dst, *args, **kwargs)

    ModelCheckpoint._link_checkpoint = staticmethod(link)
    os.symlink = symlink

    mp._distributed_checkpoint_save = dcp_save
    dcp_fs._FileSystemWriter.write_data = write_data
    ModelParallelStrategy.save_checkpoint = save_checkpoint
    cb, module = pl_callback(), Module("fsdp2")
    trainer = pl_setup(rank, world, root, recipe, cb)
    trainer.fit(module, loader())
    return pl_result(trainer, module, cb)


class StartStep(pl.Callback):
    def __init__(self):
        self.step = None

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def pl_resume(rank, world, root, recipe, ckpt="last.ckpt"):
    """``fit(ckpt_path=root/ckpt)`` (``ckpt="last"``: Lightning's own choice)."""
    import warnings

    from test_integration_lightning import Module, loader

    warnings.filterwarnings("ignore")
    cb, module, start = pl_callback(), Module("fsdp2"), StartStep()
    trainer = pl_setup(rank, world, root, recipe, cb, start)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, loader(), ckpt_path=ckpt if ckpt == "last" else
                        os.path.join(root, ckpt))
        except ValueError as e:
            return {"refusal": str(e)}
    return {"refusal": None, "start": start.step, **pl_result(trainer, module, cb),
            "no_last": any("no last checkpoint" in str(w.message) for w in caught)}


def pl_straight(rank, world, root):
    import warnings

    from test_integration_lightning import Module, loader

    warnings.filterwarnings("ignore")
    cb, module = pl_callback(), Module("fsdp2")
    trainer = pl_setup(rank, world, root, "overwrite", cb)
    trainer.fit(module, loader())
    return pl_result(trainer, module, cb)


# (recipe, point) -> "resumes" or "torn" (the callback refuses: the checkpoint mixes two saves),
# or "unlinked" (no last.ckpt: ckpt_path="last" starts from scratch; the newest versioned
# checkpoint, named, resumes)
PL_CASES = {("overwrite", "before_data"): "resumes", ("overwrite", "before_metadata"): "torn",
            ("overwrite", "before_meta"): "torn", ("overwrite", "after_meta"): "resumes",
            ("versioned", "before_data"): "resumes", ("versioned", "before_metadata"): "resumes",
            ("versioned", "before_meta"): "resumes", ("versioned", "after_meta"): "resumes",
            ("versioned", "relink"): "unlinked"}
NEWEST = "epoch=1-step=6.ckpt"  # the versioned checkpoint of the killed save
# The global step each case resumes at: epoch 0's checkpoint (3), or the killed save's (6).
PL_RESUMED_AT = {("overwrite", "after_meta"): 6, ("versioned", "relink"): 6}


def test_lightning_kill_in_each_window_of_a_save_resumes_bit_for_bit_or_refuses_a_torn_one(
        ranks, tmp_path):
    reference = [r[1] for r in ranks.run(pl_straight, str(tmp_path / "straight"))]
    for (recipe, point), expect in PL_CASES.items():
        root = str(tmp_path / f"{recipe}-{point}")
        killed = ranks.run(pl_killed_run, root, recipe, point)
        assert killed == [("killed", None)] * 2, (recipe, point, killed)
        if expect == "unlinked":
            # last.ckpt is gone while the checkpoint of the killed save is complete.
            assert not os.path.lexists(os.path.join(root, "last.ckpt")), os.listdir(root)
            assert NEWEST in os.listdir(root), os.listdir(root)
            shutil.copytree(root, root + "-last", symlinks=True)
            for rank, (status, r) in enumerate(ranks.run(pl_resume, root + "-last", recipe,
                                                         "last")):
                assert status == "ok" and r["refusal"] is None, r
                # ckpt_path="last" finds none: Lightning says so (rank 0) and starts over.
                assert r["start"] == 0 and r["no_last"] == (rank == 0), (r["start"], r["no_last"])
        results = ranks.run(pl_resume, root, recipe,
                            NEWEST if expect == "unlinked" else "last.ckpt")
        for rank, (status, r) in enumerate(results):
            assert status == "ok", (recipe, point, r)
            if expect == "torn":
                assert "is torn" in r["refusal"] and "save_last='link'" in r["refusal"], r
                assert "global step 6" in r["refusal"] and "step 3" in r["refusal"], r
            else:
                assert r["refusal"] is None, (recipe, point, r["refusal"])
                assert r["start"] == PL_RESUMED_AT.get((recipe, point), 3), (recipe, point, r)
                assert_same(r, reference[rank], f"{recipe}-{point}")
