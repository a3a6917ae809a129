"""examples/diffusers_ema.py (#42): diffusers' ``--use_ema`` flow with
``fsdp_ema.integrations.diffusers.EMAModel`` under Accelerate, FSDP2 on 2 gloo ranks on the CPU.

One run of the example as its docstring documents it (a subprocess that spawns its 2 ranks: 4
steps, ``save_state`` every 2) is the reference. Against it:

- a run whose ranks are all SIGKILLed in the step after its ``save_state`` of step 2, then resumed
  from that checkpoint, saves at step 4 the reference's model, optimizer and EMA, bit for bit
  (read back with torch.distributed.checkpoint and safetensors), and the EMA's
  ``optimization_step``;
- one rank loads the reference's 2-rank checkpoint: the same weights, optimizer state, EMA and
  ``optimization_step``, and the same validation losses;
- the exported ``unet_ema/`` loads with ``UNet2DModel.from_pretrained`` and holds the EMA.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import ForkRanks

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "diffusers_ema.py"
STEPS, SAVE_EVERY = 4, 2
LOSSES = re.compile(r"validation loss: EMA (\S+)  raw weights (\S+)")


def example():
    spec = importlib.util.spec_from_file_location("diffusers_ema_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_env(rank: int, world: int) -> None:
    """Accelerate reads the ranks from these and reuses the fork's process group."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"})


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def state_of(run: dict) -> dict:
    """The run's model, optimizer state and EMA as full tensors, FQN-keyed as Accelerate saves
    them, and the EMA's step."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    unet, ema = run["unet"], run["ema"].state_dict()
    optim = get_optimizer_state_dict(unet, run["optimizer"])["state"]
    return {"model": {n: full(t).clone() for n, t in unet.state_dict().items()},
            "optimizer": {f"{n}.{k}": full(v).clone() for n, s in optim.items()
                          for k, v in s.items()},
            "ema": {n: full(t).clone() for n, t in zip(ema["shadow_names"],
                                                       ema["shadow_params"])},
            "optimization_step": run["ema"].optimization_step,
            "losses": (run["ema_loss"], run["raw"])}


def killed_after_save(rank, world, out):
    """Steps 1-2, save_state, then every rank SIGKILLed in step 3 (after its optimizer step)."""
    import accelerate

    from fsdp_ema.integrations.diffusers import EMAModel

    rank_env(rank, world)
    saved = []
    save_state, step = accelerate.Accelerator.save_state, EMAModel.step

    def save_then_arm(self, *args, **kwargs):
        result = save_state(self, *args, **kwargs)
        saved.append(True)
        return result

    def die_when_armed(self, parameters):
        if saved:
            torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        step(self, parameters)

    accelerate.Accelerator.save_state = save_then_arm
    EMAModel.step = die_when_armed
    module = example()
    module.train(module.parse(["--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
                               "--out", out]))


def resumed(rank, world, out, checkpoint, steps):
    rank_env(rank, world)
    module = example()
    return state_of(module.train(module.parse(
        ["--steps", str(steps), "--save-every", str(SAVE_EVERY), "--out", out,
         "--resume-from", checkpoint])))


def read_checkpoint(folder: str, tmp: str) -> dict:
    """A checkpoint-N folder read back with torch.distributed.checkpoint (model, optimizer)
    and the EMA's step from its custom state (Accelerate's pickle)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = {}
    for name, sub in (("model", "pytorch_model_fsdp_0"), ("optimizer", "optimizer_0")):
        target = os.path.join(tmp, f"{name}.pt")
        dcp_to_torch_save(os.path.join(folder, sub), target)
        out[name] = torch.load(target, weights_only=False)
    model = out["model"]
    model = model.get("model", model)
    optim = out["optimizer"]["optimizer"]["state"]
    custom = torch.load(os.path.join(folder, "custom_checkpoint_0.pkl"), weights_only=False)
    return {"model": model,
            "optimizer": {f"{n}.{k}": v for n, s in optim.items() for k, v in s.items()},
            "optimization_step": custom["optimization_step"]}


def exported(folder: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))


def assert_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), (
            what, name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffusers_accelerate")
    documented = subprocess.Popen(  # the docstring's command, shortened
        [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
         "--out", str(root / "straight")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    two, one = ForkRanks(2, preload=("diffusers", "accelerate")), ForkRanks(1, preload=(
        "diffusers", "accelerate"))
    try:
        out = {"killed": two.run(killed_after_save, str(root / "killed")),
               "killed_files": sorted(os.listdir(root / "killed")),
               "resumed": two.run(resumed, str(root / "killed"),
                                  str(root / "killed" / "checkpoint-2"), STEPS)}
        text, _ = documented.communicate(timeout=300)
        assert documented.returncode == 0, text
        out.update(text=text, one=one.run(resumed, str(root / "one"),
                                          str(root / "straight" / "checkpoint-4"), STEPS))
    finally:
        documented.kill()
        two.close()
        one.close()
    out["root"] = root
    return out


def test_killed_run_resumes_from_save_state_bit_for_bit(runs, tmp_path):
    assert runs["killed"] == [("killed", None)] * 2, runs["killed"]
    assert runs["killed_files"] == ["checkpoint-2"], runs["killed_files"]
    root = runs["root"]
    want = read_checkpoint(str(root / "straight" / "checkpoint-4"), str(tmp_path))
    got = read_checkpoint(str(root / "killed" / "checkpoint-4"), str(tmp_path))
    assert want["optimization_step"] == got["optimization_step"] == STEPS
    assert_equal(got["model"], want["model"], "model")
    assert_equal(got["optimizer"], want["optimizer"], "optimizer")
    assert_equal(exported(str(root / "killed" / "unet_ema")),
                 exported(str(root / "straight" / "unet_ema")), "EMA")
    # The resumed ranks' memory holds what the uninterrupted run saved.
    for status, state in runs["resumed"]:
        assert status == "ok", state
        assert state["optimization_step"] == STEPS
        assert_equal(state["model"], want["model"], "model in memory")
        assert_equal(state["optimizer"], want["optimizer"], "optimizer in memory")
        assert_equal(state["ema"], exported(str(root / "straight" / "unet_ema")), "EMA in memory")


def test_a_two_rank_state_loads_at_one_rank(runs, tmp_path):
    [(status, state)] = runs["one"]
    assert status == "ok", state
    root = runs["root"]
    want = read_checkpoint(str(root / "straight" / "checkpoint-4"), str(tmp_path))
    assert state["optimization_step"] == STEPS
    assert_equal(state["model"], want["model"], "model")
    assert_equal(state["optimizer"], want["optimizer"], "optimizer")
    assert_equal(state["ema"], exported(str(root / "straight" / "unet_ema")), "EMA")
    ema_loss, raw = map(float, LOSSES.search(runs["text"]).groups())
    assert (round(state["losses"][0], 6), round(state["losses"][1], 6)) == (ema_loss, raw)


def test_the_example_runs_as_documented_and_its_export_loads_as_the_ema(runs):
    text, root = runs["text"], runs["root"]
    assert f"step {STEPS:4d}  loss " in text, text
    ema_loss, raw = map(float, LOSSES.search(text).groups())
    assert ema_loss != raw  # two sets of weights were evaluated
    folder = root / "straight" / "unet_ema"
    assert f"exported: {folder}" in text, text
    assert sorted(os.listdir(root / "straight")) == ["checkpoint-2", "checkpoint-4", "unet_ema"]
    model = diffusers.UNet2DModel.from_pretrained(folder)
    loaded = model.state_dict()
    # The EMA: what the 1-rank resume of checkpoint-4 holds, and what a resumed run exported.
    [(_, one)] = runs["one"]
    assert_equal({n: loaded[n] for n in one["ema"]}, one["ema"], "export vs EMA")
    config = json.loads((folder / "config.json").read_text())
    assert config["optimization_step"] == STEPS and config["_class_name"] == "UNet2DModel"
