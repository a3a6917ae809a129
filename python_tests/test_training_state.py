"""save_training_state / load_training_state under real torch.distributed (gloo on the CPU).

Exact resume at the same world size (FSDP2 fp32 and bf16 params with an fp32 EMA, FSDP1 with
use_orig_params False and True):
run A trains 2N steps; run B trains N, saves, and fresh objects (other weights, other RNG
state) load and train N more; everything is compared bit for bit. The directories saved at 2
ranks are then loaded at 3 ranks and at 1 and compared with the full tensors at the save, and
training continues. Rotation, ``latest_checkpoint``, failure agreement and the JSON encoding run
in one process.

Ranks come from a dist_utils.WorkerPool kept for the module: 2 ranks, then 3, then 1.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_utils import PoolManager
from torch import nn

import fsdp_ema
from fsdp_ema import ShardedEMA, Warmup, training_state

CLI = Path(__file__).resolve().parents[1] / "build" / "bin" / "fsdp-ema"
N = 3  # steps before the save, and after it
KINDS = ["fsdp2_fp32", "fsdp2_bf16", "fsdp1", "fsdp1_orig"]


class Net(nn.Module):
    """7 and 5 rows divide by neither 2 nor 3 ranks; the head has 1 row, fewer than the ranks.
    Dropout makes the result depend on the RNG state."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 7)
        self.drop = nn.Dropout(0.3)
        self.hidden = nn.Linear(7, 5)
        self.head = nn.Linear(5, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(self.drop(torch.relu(self.inp(x))))))


def chunk_rows(rows, rank, world):
    size = -(-rows // world)
    begin = min(rank * size, rows)
    return begin, min(begin + size, rows)


def build(kind, seed=0):
    """Model (same initial weights on every rank), AdamW, a warmup LR schedule, an fp32 EMA."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if kind.endswith("bf16") else torch.float32
    model = Net().to(dtype)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if kind.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in (model.inp, model.hidden, model.head):
            fully_shard(m, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    elif kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                     use_orig_params=kind == "fsdp1_orig", device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    ema = ShardedEMA(model, 0.999, warmup=Warmup(power=0.75), dtype=torch.float32)
    return model, opt, sched, ema


def batch(step, rank, dtype):
    """The data of a step on a rank: a function of (step, rank), as a resumable loader gives."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g).to(dtype), torch.randn(8, 1, generator=g).to(dtype)


def train(model, opt, sched, ema, rank, first, last):
    dtype = next(model.parameters()).dtype
    model.train()
    for step in range(first, last):
        x, y = batch(step, rank, dtype)
        F.mse_loss(model(x).float(), y.float()).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ema.update()


def full_model_and_optimizer(model, opt):
    """The model's and the optimizer's values as full tensors (torch's state dicts, gathered)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    out = {f"model.{k}": v.clone() for k, v in get_model_state_dict(model, options=options).items()}
    optim = get_optimizer_state_dict(model, opt, options=options)
    for fqn, entries in optim["state"].items():
        out.update({f"optim.{fqn}.{k}": torch.as_tensor(v).clone() for k, v in entries.items()})
    return out


def full_state(model, opt, sched, ema):
    """Every value as full tensors (gathered; independent of fsdp_ema's checkpoint code)."""
    out = full_model_and_optimizer(model, opt)
    out.update({f"ema.{k}": v.clone() for k, v in ema.full_state_dict(rank0_only=False).items()})
    out["ema_step"] = ema.step.clone()
    out["lr"] = torch.tensor([g["lr"] for g in opt.param_groups], dtype=torch.float64)
    out["sched_epoch"] = torch.tensor(sched.last_epoch)
    return out


def bit_equal(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def assert_bit_equal(got, expected, what):
    assert sorted(got) == sorted(expected), what
    differ = [k for k in expected if not bit_equal(got[k], expected[k])]
    assert not differ, f"{what}: {differ} differ"


# --- functions the ranks run ----------------------------------------------------------------------

def run_straight(rank, world, kind):
    """Run A: 2N steps without stopping."""
    model, opt, sched, ema = build(kind)
    torch.manual_seed(1234 + rank)
    train(model, opt, sched, ema, rank, 0, 2 * N)
    return full_state(model, opt, sched, ema)


def run_save(rank, world, kind, directory):
    """Run B, first half: N steps, then a checkpoint."""
    model, opt, sched, ema = build(kind)
    torch.manual_seed(1234 + rank)
    train(model, opt, sched, ema, rank, 0, N)
    fsdp_ema.save_training_state(directory, model=model, optimizer=opt, ema=ema,
                                 extra={"step": N, "epoch": 0, "lr_scheduler": sched.state_dict(),
                                        "loader": {"position": N * 8}})
    state = full_state(model, opt, sched, ema)
    state["rng_after_save"] = torch.get_rng_state()
    return state


def run_resume(rank, world, kind, directory, steps):
    """Fresh objects with other weights and another RNG state load the checkpoint; their full
    state right after the load, then after ``steps`` more steps."""
    model, opt, sched, ema = build(kind, seed=77)
    if world == 1 and kind.startswith("fsdp1"):
        # FSDP1 at 1 rank is NO_SHARD, whose EMA state dict ShardedEMA refuses: a plain model.
        kind = "plain"
        model, opt, sched, ema = build(kind, seed=77)
    torch.manual_seed(999)
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append(1))
    extra = fsdp_ema.load_training_state(directory, model=model, optimizer=opt, ema=ema)
    load_steps, grads = len(calls), [p.grad is not None for p in model.parameters()]
    sched.load_state_dict(extra["lr_scheduler"])
    rng = torch.get_rng_state()
    loaded = full_state(model, opt, sched, ema)
    train(model, opt, sched, ema, rank, extra["step"], extra["step"] + steps)
    after = full_state(model, opt, sched, ema)
    local_ema_numel = (sum(v.to_local().numel() for k, v in ema.state_dict().items()
                           if k != ShardedEMA.STEP_KEY) if kind.startswith("fsdp2") else None)
    return {"extra": extra, "loaded": loaded, "after": after, "rng": rng,
            "local_ema_numel": local_ema_numel, "load_steps": load_steps, "load_grads": grads}


def build_layout(layout, seed):
    """Net under DDP, or under FSDP2 on a 2-D mesh (HSDP: Replicate over the 2 ranks, Shard(0)
    over 1), with AdamW."""
    torch.manual_seed(seed)
    model = Net()
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        for m in (model.inp, model.hidden, model.head):
            fully_shard(m, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def run_layout_resume(rank, world, layout, directory):
    """Saves after 2 steps and goes on 1; fresh objects (an optimizer without state) load and
    take the same step."""
    model, opt = build_layout(layout, 0)
    for step in range(2):
        optimizer_step(model, opt, step)
    fsdp_ema.save_training_state(directory, model=model, optimizer=opt)
    saved = full_model_and_optimizer(model, opt)
    optimizer_step(model, opt, 2)
    model2, opt2 = build_layout(layout, 9)
    calls = []
    opt2.register_step_pre_hook(lambda *args: calls.append(1))
    fsdp_ema.load_training_state(directory, model=model2, optimizer=opt2)
    load_steps, grads = len(calls), [p.grad is not None for p in model2.parameters()]
    loaded = full_model_and_optimizer(model2, opt2)
    optimizer_step(model2, opt2, 2)
    return {"saved": saved, "loaded": loaded, "straight": full_model_and_optimizer(model, opt),
            "after": full_model_and_optimizer(model2, opt2), "load_steps": load_steps,
            "load_grads": grads}


def run_save_failure(rank, world, directory):
    model, opt, sched, ema = build("fsdp2_fp32")
    train(model, opt, sched, ema, rank, 0, 1)
    original = fsdp_ema.checkpoint.save_shard

    def failing(*args, **kwargs):
        raise OSError("injected: disk full")

    if rank == 1:
        fsdp_ema.checkpoint.save_shard = failing
    message = None
    try:
        fsdp_ema.save_training_state(directory, model=model, optimizer=opt, ema=ema)
    except RuntimeError as e:
        message = str(e)
    finally:
        fsdp_ema.checkpoint.save_shard = original
    return {"message": message,
            "index": os.path.exists(os.path.join(directory, "fsdp_ema.index.json"))}


# --- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory):
    """At 2 ranks, per kind: run A, run B's save, run B's resume (N more steps)."""
    root = tmp_path_factory.mktemp("training_state")
    pool = pools.get(2)
    out = {}
    for kind in KINDS:
        directory = str(root / kind)
        out[kind] = {"dir": directory,
                     "straight": pool.run(run_straight, kind),
                     "saved": pool.run(run_save, kind, directory),
                     "resumed": pool.run(run_resume, kind, directory, N)}
    return out


# --- 2 ranks: exact resume ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_resume_at_same_world_size_is_bit_exact(runs, kind):
    run = runs[kind]
    for rank in range(2):
        straight, saved, resumed = (run["straight"][rank], run["saved"][rank],
                                    run["resumed"][rank])
        before = {k: v for k, v in saved.items() if k != "rng_after_save"}
        # Right after the load: exactly what was saved, RNG included.
        assert_bit_equal(resumed["loaded"], before, f"{kind} rank {rank} after load")
        assert torch.equal(resumed["rng"], saved["rng_after_save"])
        assert resumed["extra"]["step"] == N and resumed["extra"]["loader"] == {"position": N * 8}
        # N more steps: the same model, AdamW state, EMA, LR as 2N straight steps.
        assert_bit_equal(resumed["after"], straight, f"{kind} rank {rank} after resume")
        assert int(straight["ema_step"]) == 2 * N
        # The run moved: the EMA is not the weights, the optimizer state is not zero.
        assert not torch.equal(straight["ema.inp.weight"].float(),
                               straight["model.inp.weight"].float())
        assert straight["optim.inp.weight.exp_avg_sq"].abs().sum() > 0


def test_bf16_params_keep_an_fp32_ema_and_bf16_optimizer_state(runs):
    state = runs["fsdp2_bf16"]["straight"][0]
    assert state["model.inp.weight"].dtype == torch.bfloat16
    assert state["ema.inp.weight"].dtype == torch.float32
    assert state["optim.inp.weight.exp_avg"].dtype == torch.bfloat16


def test_directory_layout_names_and_json(runs):
    directory = runs["fsdp2_fp32"]["dir"]
    info = fsdp_ema.checkpoint.info(directory)
    assert info["world_size"] == 2
    names = set(info["tensors"])
    assert {"model.inp.weight", "model.head.bias", "ema.inp.weight", "ema.head.bias",
            "optim.state.inp.weight.exp_avg", "optim.state.inp.weight.exp_avg_sq",
            "optim.state.inp.weight.step", "meta.training_state", "rng.0", "rng.1"} <= names
    assert info["tensors"]["model.inp.weight"]["shape"] == [7, 6]
    # Sharded tensors have one piece per rank with rows; 0-dim and metadata: rank 0 only.
    shards = [fsdp_ema.checkpoint.load_shard(Path(directory) / f"shard-0000{r}-of-00002"
                                             ".safetensors") for r in range(2)]
    assert shards[0]["model.inp.weight"][1] == [0, 0] and shards[1]["model.inp.weight"][1] == [4, 0]
    step = "optim.state.inp.weight.step"
    assert step in shards[0] and step not in shards[1]
    assert "model.head.weight" in shards[0] and "model.head.weight" not in shards[1]  # 1 row
    assert "meta.training_state" not in shards[1] and "rng.1" in shards[1]
    # The JSON (checksummed in rank 0's file) and its readable copy agree.
    doc = training_state.read_training_state_json(directory)
    with open(os.path.join(directory, "training_state.json")) as f:
        assert json.load(f) == doc
    assert doc["format"] == "fsdp_ema.training_state" and doc["world_size"] == 2
    assert doc["ema"]["step"] == N and doc["extra"]["step"] == N
    groups = doc["optimizer"]["param_groups"]
    assert groups[0]["betas"] == {"__tuple__": [0.9, 0.999]} and groups[0]["weight_decay"] == 0.1
    # Loaded whole, the tensors equal the full state at the save.
    saved = runs["fsdp2_fp32"]["saved"][0]
    full = fsdp_ema.checkpoint.load(directory, ["model.hidden.weight", "ema.hidden.weight",
                                                "optim.state.hidden.weight.exp_avg"])
    assert bit_equal(full["model.hidden.weight"], saved["model.hidden.weight"])
    assert bit_equal(full["ema.hidden.weight"], saved["ema.hidden.weight"])
    assert bit_equal(full["optim.state.hidden.weight.exp_avg"],
                     saved["optim.hidden.weight.exp_avg"])


def test_failure_on_one_rank_raises_everywhere_and_leaves_no_index(pools, tmp_path):
    results = pools.get(2).run(run_save_failure, str(tmp_path / "ckpt"))
    for res in results:
        assert res["message"] is not None and "failed on rank(s) [1]" in res["message"]
        assert not res["index"]
    assert "injected: disk full" in results[1]["message"]
    assert fsdp_ema.latest_checkpoint(tmp_path) is None


@pytest.mark.skipif(not CLI.exists(), reason="fsdp-ema tool not built")
@pytest.mark.parametrize("what", ["ema", "model"])
def test_cli_exports_the_ema_or_the_model(runs, tmp_path, what):
    from safetensors.torch import load_file

    out = tmp_path / what
    done = subprocess.run([str(CLI), "export", "-q", "--what", what, runs["fsdp2_bf16"]["dir"],
                           str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    exported = load_file(str(out / "model.safetensors"))
    saved = runs["fsdp2_bf16"]["saved"][0]
    expected = {k.removeprefix(what + "."): v for k, v in saved.items()
                if k.startswith(what + ".")}
    assert sorted(exported) == sorted(expected)
    for name, t in expected.items():
        assert bit_equal(exported[name], t), name


# --- 2 -> 3 ranks ---------------------------------------------------------------------------------

def assert_loaded_equals_saved(res, saved, what):
    loaded = dict(res["loaded"])
    # The LR and the scheduler come back too; everything else is a tensor of the checkpoint.
    assert_bit_equal(loaded, {k: v for k, v in saved.items() if k != "rng_after_save"}, what)
    after = res["after"]
    assert int(after["ema_step"]) == N + 1
    assert all(torch.isfinite(v.float()).all() for v in after.values())
    assert not torch.equal(after["model.inp.weight"], loaded["model.inp.weight"])


@pytest.mark.parametrize("kind", KINDS)
def test_a_fresh_optimizer_is_loaded_without_an_initializing_step(runs, kind):
    """torch's get/set_optimizer_state_dict run a step at lr 0 (zero gradients for every
    parameter) to give an optimizer without state a template; the load makes FSDP2's and plain
    models' templates from the parameters instead (and still resumes bit for bit, above).
    FSDP1 units keep torch's way."""
    for rank, res in enumerate(runs[kind]["resumed"]):
        expected = 0 if kind.startswith("fsdp2") else 1
        assert res["load_steps"] == expected, (kind, rank)
        if kind.startswith("fsdp2"):
            assert not any(res["load_grads"]), (kind, rank)


@pytest.mark.parametrize("layout", ["ddp", "hsdp"])
def test_a_fresh_optimizer_resumes_under_ddp_and_a_2d_mesh(pools, tmp_path, layout):
    """DDP's plain parameters and HSDP's (Replicate, Shard(0)) DTensors: the template comes from
    the parameters (no step, no gradient) and the load restores the saved state bit for bit
    (torch's full state dicts), the next step included."""
    for rank, res in enumerate(pools.get(2).run(run_layout_resume, layout, str(tmp_path / "c"))):
        assert res["load_steps"] == 0 and not any(res["load_grads"]), (layout, rank)
        assert_bit_equal(res["loaded"], res["saved"], f"{layout} rank {rank} after load")
        assert_bit_equal(res["after"], res["straight"], f"{layout} rank {rank} after a step")
        assert any(k.endswith(".exp_avg_sq") for k in res["saved"])


@pytest.mark.parametrize("kind", KINDS)
def test_saved_at_2_ranks_resumes_at_3(pools, runs, kind):
    results = pools.get(3).run(run_resume, kind, runs[kind]["dir"], 1)
    saved = runs[kind]["saved"][0]
    for rank, res in enumerate(results):
        assert_loaded_equals_saved(res, saved, f"{kind} at 3 ranks, rank {rank}")
        assert res["extra"]["lr_scheduler"] == runs[kind]["resumed"][0]["extra"]["lr_scheduler"]
    # Ranks 0 and 1 restored their saved RNG states; rank 2 had none to restore.
    for rank in range(2):
        assert torch.equal(results[rank]["rng"], runs[kind]["saved"][rank]["rng_after_save"])
    if kind.startswith("fsdp2"):  # each rank keeps a third of the EMA rows
        numel = [r["local_ema_numel"] for r in results]
        rows = {"inp": (7, 6), "hidden": (5, 7), "head": (1, 5)}
        for rank in range(3):
            expected = sum((e - b) * (cols + 1) for b, e, cols in (
                (*chunk_rows(r, rank, 3), c) for r, c in rows.values()))
            assert numel[rank] == expected


# --- 2 -> 1 rank ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_saved_at_2_ranks_resumes_at_1(pools, runs, kind):
    """FSDP2 at 1 rank; the FSDP1 checkpoint is loaded into a plain model."""
    res = pools.get(1).run(run_resume, kind, runs[kind]["dir"], 1)[0]
    assert_loaded_equals_saved(res, runs[kind]["saved"][0], f"{kind} at 1 rank")
    assert torch.equal(res["rng"], runs[kind]["saved"][0]["rng_after_save"])


# --- one process: plain models, rotation, latest, JSON --------------------------------------------

def plain(seed=0):
    return build("plain", seed)


def save_plain(directory, step, **kwargs):
    model, opt, sched, ema = plain(step)
    train(model, opt, sched, ema, 0, 0, 1)
    fsdp_ema.save_training_state(directory, model=model, optimizer=opt, ema=ema,
                                 extra={"step": step}, **kwargs)
    return model


def committed(root):
    return sorted(p.name for p in root.iterdir() if (p / "fsdp_ema.index.json").exists())


def test_plain_model_round_trip_in_one_process(tmp_path):
    model, opt, sched, ema = plain()
    train(model, opt, sched, ema, 0, 0, 2)
    fsdp_ema.save_training_state(tmp_path / "c", model=model, optimizer=opt, ema=ema,
                                 extra={"step": 2, "lr_scheduler": sched.state_dict()})
    expected = full_state(model, opt, sched, ema)
    model2, opt2, sched2, ema2 = plain(seed=5)
    extra = fsdp_ema.load_training_state(tmp_path / "c", model=model2, optimizer=opt2, ema=ema2)
    sched2.load_state_dict(extra["lr_scheduler"])
    assert_bit_equal(full_state(model2, opt2, sched2, ema2), expected, "plain")
    # A committed directory is not overwritten unless asked.
    with pytest.raises(FileExistsError, match="already holds a committed checkpoint"):
        fsdp_ema.save_training_state(tmp_path / "c", model=model, extra={})
    fsdp_ema.save_training_state(tmp_path / "c", model=model, extra={"again": 1}, overwrite=True)
    assert fsdp_ema.load_training_state(tmp_path / "c", model=model2) == {"again": 1}
    with pytest.raises(ValueError, match="holds no optimizer state"):
        fsdp_ema.load_training_state(tmp_path / "c", model=model2, optimizer=opt2)


def optimizer_case(case, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    if case == "adamw_frozen":
        model[2].requires_grad_(False)
    if case == "tied":  # one parameter under two names
        model[4].tie = nn.Linear(6, 8, bias=False)  # a submodule its forward does not call
        model[4].tie.weight = model[0].weight
    if case == "compiled":  # FQNs under torch.compile's wrapper (_orig_mod. left out)
        model = torch.compile(model)
    if case == "sgd_stateless":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    elif case == "sgd_momentum":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif case == "adafactor":
        opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def optimizer_step(model, opt, step):
    x, y = batch(step, 0, torch.float32)
    module = getattr(model, "_orig_mod", model)  # compiling is not what is tested
    F.mse_loss(module(x), y).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("case", ["adamw_frozen", "compiled", "sgd_stateless", "adafactor",
                                  "tied"])
def test_an_optimizer_without_state_loads_the_saved_state(tmp_path, case):
    """Where the parameters say what the state is (AdamW: parameter-shaped tensors and a 0-dim
    step; frozen parameters have none; names under torch.compile's wrapper) the template is made
    without a step; elsewhere (no state
    saved, Adafactor's factored rows and columns, a parameter under two names) torch's step at
    lr 0 makes it. Either way the optimizer holds exactly the saved state and goes on alike."""
    model, opt = optimizer_case(case, 0)
    for step in range(3):
        optimizer_step(model, opt, step)
    fsdp_ema.save_training_state(tmp_path / "c", model=model, optimizer=opt)
    model2, opt2 = optimizer_case(case, 9)
    calls = []
    opt2.register_step_pre_hook(lambda *args: calls.append(1))
    fsdp_ema.load_training_state(tmp_path / "c", model=model2, optimizer=opt2)
    fresh = case in ("adamw_frozen", "compiled")
    assert (len(calls) == 0) == fresh, calls  # torch's way: 1 or 2 steps
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for i, entries in a["state"].items():
        assert sorted(entries) == sorted(b["state"][i])
        for key, v in entries.items():
            if isinstance(v, torch.Tensor):
                assert bit_equal(b["state"][i][key], v) and b["state"][i][key].device == v.device
            else:
                assert b["state"][i][key] == v
    if case == "adamw_frozen":
        assert len(b["state"]) == 4 and all(p.grad is None for p in model2.parameters())
    for m, o in ((model, opt), (model2, opt2)):
        optimizer_step(m, o, 3)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert bit_equal(p.detach(), q.detach())


@pytest.mark.parametrize("case", ["another_class", "integer_moment", "integer_step"])
def test_state_the_optimizer_would_not_make_is_refused_before_anything_is_written(tmp_path, case):
    """An AdamW without state and a checkpoint of SGD's momentum, or of an integer exp_avg or
    step: a template taken from the checkpoint would have SGD's state fail in load_state_dict
    (KeyError 'step') after the model was written, and the integers silently cast or kept. As
    torch's template (a step of AdamW) has it, the load is refused first, naming the problem."""
    model, opt = optimizer_case("sgd_momentum" if case == "another_class" else "adamw", 0)
    optimizer_step(model, opt, 0)
    for entries in opt.state.values():
        key = {"integer_moment": "exp_avg", "integer_step": "step"}.get(case)
        if key:
            entries[key] = entries[key].to(torch.int64)
    fsdp_ema.save_training_state(tmp_path / "c", model=model, optimizer=opt)
    model2, opt2 = optimizer_case("adamw", 9)
    before = [p.detach().clone() for p in model2.parameters()]
    groups = [sorted(g) for g in opt2.param_groups]
    match = (r"optimizer state 0\.weight\.\w+ is not in the checkpoint" if case == "another_class"
             else r"is torch\.int64 in the checkpoint but torch\.float32 here")
    with pytest.raises((KeyError, TypeError), match=match):
        fsdp_ema.load_training_state(tmp_path / "c", model=model2, optimizer=opt2)
    assert all(bit_equal(a, b.detach()) for a, b in zip(before, model2.parameters()))
    assert len(opt2.state) == 0 and [sorted(g) for g in opt2.param_groups] == groups


def test_rotation_keeps_the_last_k_committed(tmp_path):
    for step in range(1, 6):
        save_plain(tmp_path / f"step-{step:08d}", step, keep_last=3)
        assert committed(tmp_path) == [f"step-{s:08d}" for s in range(max(1, step - 2), step + 1)]
    assert fsdp_ema.latest_checkpoint(tmp_path).name == "step-00000005"
    # Unrelated directories and incomplete checkpoints are left alone.
    (tmp_path / "notes").mkdir()
    (tmp_path / "step-00000000").mkdir()
    save_plain(tmp_path / "step-00000006", 6, keep_last=1)
    assert committed(tmp_path) == ["step-00000006"]
    assert (tmp_path / "notes").is_dir() and (tmp_path / "step-00000000").is_dir()


def test_rotation_never_removes_the_only_complete_checkpoint(tmp_path):
    save_plain(tmp_path / "step-00000001", 1, keep_last=1)
    assert committed(tmp_path) == ["step-00000001"]
    # A save that fails before its commit removes nothing.
    original = fsdp_ema.checkpoint.commit

    def failing(*args, **kwargs):
        raise OSError("injected: commit failed")

    fsdp_ema.checkpoint.commit = failing
    try:
        with pytest.raises(OSError, match="injected"):
            save_plain(tmp_path / "step-00000002", 2, keep_last=1)
    finally:
        fsdp_ema.checkpoint.commit = original
    assert committed(tmp_path) == ["step-00000001"]
    assert fsdp_ema.latest_checkpoint(tmp_path).name == "step-00000001"
    # Re-saving an older step name does not remove the newer one it sorts before... nor itself.
    save_plain(tmp_path / "step-00000000", 0, keep_last=1)
    assert committed(tmp_path) == ["step-00000000", "step-00000001"]


def test_latest_skips_a_directory_whose_commit_is_missing(tmp_path):
    assert fsdp_ema.latest_checkpoint(tmp_path / "none") is None
    save_plain(tmp_path / "step-00000001", 1)
    save_plain(tmp_path / "step-00000002", 2)
    os.remove(tmp_path / "step-00000002" / "fsdp_ema.index.json")  # as if it died before commit
    latest = fsdp_ema.latest_checkpoint(tmp_path)
    assert latest.name == "step-00000001"
    model, *_ = plain(seed=9)
    assert fsdp_ema.load_training_state(latest, model=model) == {"step": 1}
    with pytest.raises(RuntimeError, match="incomplete checkpoint"):
        fsdp_ema.load_training_state(tmp_path / "step-00000002", model=model)
    # A plain checkpoint (not a training state) is not counted either.
    fsdp_ema.checkpoint.save(tmp_path / "step-00000003", {"w": torch.ones(2)})
    assert fsdp_ema.latest_checkpoint(tmp_path).name == "step-00000001"


def test_extra_json_round_trip_and_refusal(tmp_path):
    extra = {"step": 7, "lr": 1e-3, "betas": (0.9, 0.95), "inf": float("inf"),
             "nested": {"a": [1, 2, {"b": None}], "flag": True}, "raw": b"\x00\xff",
             "ids": {3: "three"}, "tag_like": {"__tuple__": 1},
             "tensor": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "empty": torch.zeros(0)}
    model, *_ = plain()
    fsdp_ema.save_training_state(tmp_path / "c", model=model, extra=extra)
    got = fsdp_ema.load_training_state(tmp_path / "c", model=model)
    assert got.keys() == extra.keys()
    for k, v in extra.items():
        if isinstance(v, torch.Tensor):
            assert bit_equal(got[k], v), k
        else:
            assert got[k] == v and type(got[k]) is type(v), k
    assert math.isinf(got["inf"])
    with pytest.raises(TypeError, match="stored neither as JSON"):
        fsdp_ema.save_training_state(tmp_path / "d", model=model, extra={"f": object()})
    assert not (tmp_path / "d" / "fsdp_ema.index.json").exists()
