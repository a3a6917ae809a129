"""ShardedEMA in one process (plain modules): values, schedules, torch.compile, swap, state
dicts, names, checkpoint directories and errors. The distributed cases are in
test_sharded_ema.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import fsdp_ema
from fsdp_ema import ShardedEMA, Warmup


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 7)
        self.norm = nn.BatchNorm1d(7)
        self.head = nn.Linear(7, 2)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.inp(x))))


def make(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return Net().to(dtype)


def train(model, steps, ema=None, seed=1, on_step=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g)
        F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()
        if ema is not None:
            ema.update()
        if on_step is not None:
            on_step(i)


def weights(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def lerp_reference(ema, state, decay, buffers="average"):
    out = {}
    for n, t in state.items():
        if t.is_floating_point() and (buffers == "average" or n in ema["_params"]):
            out[n] = torch.lerp(ema[n], t.float(), 1 - decay)
        else:
            out[n] = t.clone()
    out["_params"] = ema["_params"]
    return out


def start_reference(model):
    ref = {n: t.float() if t.is_floating_point() else t.clone()
           for n, t in weights(model).items()}
    ref["_params"] = {n for n, _ in model.named_parameters()}
    return ref


# --- values -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("buffers", ["average", "copy"])
@pytest.mark.parametrize("decay", [0.7, 0.9999, 0.999999])
def test_plain_ema_equals_lerp_reference(dtype, buffers, decay):
    model = make(dtype)
    ema = ShardedEMA(model, decay, buffers=buffers)
    ref = start_reference(model)

    def step(_):
        nonlocal ref
        ref = lerp_reference(ref, weights(model), decay, buffers)

    train(model, 5, ema, on_step=step)
    state = ema.state_dict()
    assert int(state.pop(ShardedEMA.STEP_KEY)) == 5
    assert sorted(state) == sorted(n for n in ref if n != "_params")  # no non-persistent buffer
    for name, t in state.items():
        expected = ref[name]
        assert t.dtype == (torch.float32 if expected.is_floating_point() and
                           (buffers == "average" or name in ref["_params"]) else expected.dtype)
        # One float32 lerp per step with the weight 1 - decay formed in double: the same bits.
        assert torch.equal(t, expected.to(t.dtype)), name
    assert int(state["norm.num_batches_tracked"]) == 5  # integer buffers are copied


def test_ema_memory_is_the_model_numel_in_the_ema_dtype():
    model = make(torch.bfloat16)
    ema = ShardedEMA(model, 0.9)
    numel = sum(t.numel() for n, t in model.state_dict().items() if "num_batches" not in n)
    assert ema.nbytes == numel * 4 + 8  # float32 EMA, int64 num_batches_tracked
    assert ShardedEMA(model, 0.9, dtype=None).nbytes == numel * 2 + 8
    assert ShardedEMA(model, 0.9, include_buffers=False).nbytes == sum(
        p.numel() for p in model.parameters()) * 4


def test_decay_one_keeps_and_decay_zero_copies_exactly():
    model = make()
    keep = ShardedEMA(model, 1.0)
    copy = ShardedEMA(model, 0.0)
    start = weights(model)
    train(model, 3, None)
    keep.update()
    copy.update()
    now = weights(model)
    for name, t in keep.state_dict().items():
        if name != ShardedEMA.STEP_KEY and "num_batches" not in name:
            assert torch.equal(t, start[name]), name
    for name, t in copy.state_dict().items():
        if name != ShardedEMA.STEP_KEY:
            assert torch.equal(t, now[name]), name


# --- schedules ----------------------------------------------------------------------------------

def test_warmup_decay_equals_the_formula_every_step():
    model = make()
    warmup = Warmup(gamma=2.0, power=0.75, min_decay=0.1)
    ema = ShardedEMA(model, 0.85, warmup=warmup)
    decays = []
    train(model, 40, ema, on_step=lambda i: decays.append(float(ema.last_decay)))
    for s, d in enumerate(decays):
        expected = min(max(1 - (1 + s / 2.0) ** -0.75, 0.1), 0.85)
        assert d == pytest.approx(expected, rel=0, abs=1e-15), s
    assert decays[0] == 0.1 and decays[-1] == 0.85  # the clamps are hit at both ends
    assert ema.decay_at(7) == pytest.approx(decays[7], abs=1e-15)


def test_warmup_default_copies_on_the_first_update():
    model = make()
    ema = ShardedEMA(model, 0.999, warmup=True)
    train(model, 1, ema)
    assert float(ema.last_decay) == 0.0
    for name, t in ema.state_dict().items():
        if name != ShardedEMA.STEP_KEY:
            assert torch.equal(t, weights(model)[name].to(t.dtype)), name


def test_update_every_and_start_step_are_honoured():
    model = make()
    ema = ShardedEMA(model, 0.5, update_every=3, start_step=4, include_buffers=False)
    history = []

    def step(i):
        history.append(({n: t.clone() for n, t in ema.state_dict().items()},
                        weights(model), float(ema.last_decay)))

    prev = {n: t.clone() for n, t in ema.state_dict().items()}
    train(model, 12, ema, on_step=step)
    for k, (state, w, decay) in enumerate(history):
        if k < 4:
            assert decay == 0.0  # before start_step the EMA tracks the weights exactly
            for name, t in state.items():
                if name != ShardedEMA.STEP_KEY:
                    assert torch.equal(t, w[name]), (k, name)
        elif k % 3:
            assert decay == 1.0  # skipped: bit-identical to the previous step
            for name, t in state.items():
                if name != ShardedEMA.STEP_KEY:
                    assert torch.equal(t, prev[name]), (k, name)
        else:
            assert decay == 0.5
            for name, t in state.items():
                if name != ShardedEMA.STEP_KEY:
                    torch.testing.assert_close(t, torch.lerp(prev[name], w[name], 0.5))
        assert decay == ema.decay_at(k)
        prev = state


# The schedule, written out here rather than taken from ShardedEMA.decay_at (which would share a
# bug with the code under test). k counts update() calls from 0.
def expected_decay(k, decay, warmup, update_every, start_step):
    if k < start_step:
        return 0.0                    # before start_step the EMA copies the weights
    if k % update_every != 0:
        return 1.0                    # a skipped update keeps the EMA as it is
    if warmup is None:
        return decay
    s = k - start_step                # updates since start_step: 0 at the first one
    gamma, power, min_decay = warmup
    return min(max(1.0 - (1.0 + s / gamma) ** -power, min_decay), decay)


def timm_decay(step, decay, update_after_step, gamma, power, min_decay):
    """timm ModelEmaV3.get_decay, as timm writes it (``step`` counts optimizer steps from 1)."""
    step = max(0, step - update_after_step - 1)
    if step <= 0:
        return 0.0
    d = 1 - (1 + step / gamma) ** -power
    return max(min(d, decay), min_decay)


def test_the_written_out_schedule_for_one_case():
    """update_every=3, start_step=4, Warmup(gamma=1, power=1): the warmup is s / (1 + s)."""
    got = [expected_decay(k, 0.9, (1.0, 1.0, 0.0), 3, 4) for k in range(16)]
    assert got == pytest.approx([0.0, 0.0, 0.0, 0.0,  # k < start_step: copy
                                 1.0, 1.0,            # k = 4, 5: not multiples of 3
                                 2 / 3,               # k = 6: s = 2
                                 1.0, 1.0,
                                 5 / 6,               # k = 9: s = 5
                                 1.0, 1.0,
                                 8 / 9,               # k = 12: s = 8
                                 1.0, 1.0,
                                 0.9],                # k = 15: 11/12 clamped to the decay
                                rel=0, abs=1e-15)
    # timm's warmup where the two agree (update_every=1, min_decay=0): timm's step is ours + 1.
    for k in range(40):
        assert expected_decay(k, 0.99, (2.0, 0.75, 0.0), 1, 5) == pytest.approx(
            timm_decay(k + 1, 0.99, 5, 2.0, 0.75, 0.0), rel=0, abs=1e-15), k


SCHEDULES = [(1, 0), (1, 3), (2, 0), (3, 4), (4, 2), (2, 5)]


@pytest.mark.parametrize("update_every,start_step", SCHEDULES)
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_every_applied_decay_equals_the_written_out_schedule(mode, update_every, start_step):
    """The decay update() applies at every step (seen in the float64 EMA values, not only in
    last_decay) against the schedule written out above, for warmup and fixed decays."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    warmup = (2.0, 0.75, 0.05)
    emas = {
        "warmup": ShardedEMA(model, 0.95, warmup=Warmup(*warmup), update_every=update_every,
                             start_step=start_step, dtype=torch.float64),
        "fixed": ShardedEMA(model, 0.95, update_every=update_every, start_step=start_step,
                            dtype=torch.float64),
    }
    updates = {name: ema.update for name, ema in emas.items()}
    if mode == "compiled":
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        updates = {name: torch.compile(ema.update, backend=counter, fullgraph=True)
                   for name, ema in emas.items()}
    refs = {name: {n: p.detach().clone() for n, p in model.named_parameters()} for name in emas}
    g = torch.Generator().manual_seed(4)
    for k in range(3 * update_every + start_step + 8):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        for name, ema in emas.items():
            d = expected_decay(k, 0.95, warmup if name == "warmup" else None, update_every,
                               start_step)
            updates[name]()
            if mode == "compiled" and k == 0 and name == "fixed":
                frames = counter.frame_count  # both compiled by now
            assert float(ema.last_decay) == pytest.approx(d, rel=0, abs=1e-15), (name, k)
            assert ema.decay_at(k) == pytest.approx(d, rel=0, abs=1e-15), (name, k)
            state = ema.state_dict()
            for n, p in model.named_parameters():
                refs[name][n] = d * refs[name][n] + (1 - d) * p.detach()
                torch.testing.assert_close(state[n], refs[name][n], rtol=1e-13, atol=1e-13,
                                           msg=f"{name} EMA of {n} after update {k}")
    if mode == "compiled":
        assert counter.frame_count == frames  # never recompiled after the first update


def test_compiled_step_with_warmup_compiles_once_in_20_steps_and_matches_eager():
    """SGD step + ema.update() as one torch.compile(fullgraph=True) graph (inductor), as in
    examples/ema_compiled_loop.py (torch.optim's step() graph-breaks by design)."""
    eager_model, compiled_model = make(), make()
    kwargs = dict(warmup=Warmup(power=0.75), update_every=2, start_step=2)
    eager_ema = ShardedEMA(eager_model, 0.99, **kwargs)
    compiled_ema = ShardedEMA(compiled_model, 0.99, **kwargs)

    def step(params, ema):
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-0.1)
        ema.update()

    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    compiled_step = torch.compile(step, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    for k in range(20):
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g)
        for model in (eager_model, compiled_model):
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
        step(list(eager_model.parameters()), eager_ema)
        compiled_step(list(compiled_model.parameters()), compiled_ema)
        # Both against the schedule written out, not against each other: they run the same code.
        expected = expected_decay(k, 0.99, (1.0, 0.75, 0.0), 2, 2)
        assert float(eager_ema.last_decay) == pytest.approx(expected, rel=0, abs=1e-15), k
        assert float(compiled_ema.last_decay) == pytest.approx(expected, rel=0, abs=1e-15), k
    assert counter.frame_count == 1, "ema.update() in a compiled step recompiled"
    assert int(compiled_ema.step) == 20
    compiled_state, eager_state = compiled_ema.state_dict(), eager_ema.state_dict()
    for name, t in eager_state.items():
        # Inductor may fuse the SGD arithmetic differently (last-bit differences that the
        # training then carries along).
        torch.testing.assert_close(compiled_state[name], t, rtol=1e-5, atol=1e-6, msg=name)


# --- swap ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swap_round_trip_is_bit_exact_and_eval_uses_the_ema(dtype):
    model = make(dtype)
    ema = ShardedEMA(model, 0.8)
    train(model, 4, ema)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(5)).to(dtype)
    model.eval()
    before = weights(model)
    ema_model = make(dtype)
    ema_model.load_state_dict({n: t.to(before[n].dtype)
                               for n, t in ema.state_dict().items() if n != ShardedEMA.STEP_KEY})
    ema_model.eval()
    with torch.no_grad():
        raw = model(x)
        with ema.swap() as swapped:
            assert swapped is model
            inside = model(x)
        after = model(x)
        expected = ema_model(x)
    assert torch.equal(inside, expected)
    assert not torch.equal(inside, raw)
    assert torch.equal(after, raw)
    for name, t in weights(model).items():
        assert torch.equal(t.view(-1).view(torch.uint8), before[name].view(-1).view(torch.uint8))


def test_swap_restores_even_when_the_block_raises():
    model = make()
    ema = ShardedEMA(model, 0.5)
    train(model, 2, ema)
    before = weights(model)
    with pytest.raises(KeyError), ema.swap():
        raise KeyError("eval failed")
    for name, t in weights(model).items():
        assert torch.equal(t, before[name]), name


def test_swap_cannot_nest_and_update_inside_swap_is_an_error():
    model = make()
    ema = ShardedEMA(model, 0.5)
    with ema.swap():
        with pytest.raises(RuntimeError, match="already active"), ema.swap():
            pass
        with pytest.raises(RuntimeError, match="inside swap"):
            ema.update()
    ema.update()  # fine again afterwards


# --- names and state dicts ----------------------------------------------------------------------

def test_state_dict_keys_are_clean_fqns_under_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = sorted(ShardedEMA(make(), 0.9).state_dict())
    model = make()
    model.inp = checkpoint_wrapper(model.inp)
    compiled = torch.compile(model)
    assert sorted(ShardedEMA(compiled, 0.9).state_dict()) == plain
    assert "inp.weight" in plain and ShardedEMA.STEP_KEY in plain


def test_a_submodule_named_module_keeps_its_name():
    outer = nn.Module()
    outer.module = nn.Linear(2, 2)
    assert sorted(ShardedEMA(outer, 0.9).state_dict()) == sorted(
        ["module.weight", "module.bias", ShardedEMA.STEP_KEY])


def test_tied_parameters_are_averaged_once():
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    ema = ShardedEMA(model, 0.9)
    assert sorted(ema.state_dict()) == ["0.weight", ShardedEMA.STEP_KEY]
    assert ema.nbytes == 15 * 4


def test_load_state_dict_round_trip_and_step():
    model = make()
    ema = ShardedEMA(model, 0.8, warmup=True)
    train(model, 3, ema)
    other = ShardedEMA(make(seed=9), 0.8, warmup=True)
    other.load_state_dict(ema.state_dict())
    assert int(other.step) == 3
    for name, t in ema.state_dict().items():
        assert torch.equal(other.state_dict()[name], t), name


def test_load_state_dict_lists_missing_unexpected_and_misshaped_names():
    ema = ShardedEMA(make(), 0.8)
    state = {n: t.clone() for n, t in ema.state_dict().items()}
    del state["inp.bias"]
    state["extra.weight"] = torch.zeros(2)
    state["head.weight"] = torch.zeros(3, 7)
    with pytest.raises(ValueError) as err:
        ema.load_state_dict(state)
    message = str(err.value)
    assert "missing 1 name(s): 'inp.bias'" in message
    assert "unexpected 1 name(s): 'extra.weight'" in message
    assert "'head.weight' is [3, 7] there but [2, 7] here" in message
    del state["head.weight"]
    before = {n: t.clone() for n, t in ema.state_dict().items()}
    ema.load_state_dict(state, strict=False)  # loads what matches
    assert torch.equal(ema.state_dict()["inp.bias"], before["inp.bias"])


def test_strict_false_loads_the_names_present_and_keeps_the_others(tmp_path):
    """A state (and a checkpoint directory) with really different values: every name present
    is loaded, the missing one keeps its value, the unexpected one is ignored."""
    ema = ShardedEMA(make(), 0.8)
    other = ShardedEMA(make(seed=9), 0.8)
    train(other.model, 2, other)
    before = {n: t.clone() for n, t in ema.state_dict().items()}
    state = {n: t.clone() for n, t in other.state_dict().items() if n != "inp.bias"}
    state["extra.weight"] = torch.zeros(2)
    params = [n for n, _ in ema.model.named_parameters()]
    for n in params:
        if n != "inp.bias":
            assert not torch.equal(state[n], before[n]), n  # a load that does nothing fails
    for load in ("state_dict", "directory"):
        fresh = ShardedEMA(make(), 0.8)
        if load == "state_dict":
            fresh.load_state_dict(state, strict=False)
            assert int(fresh.step) == 2
        else:
            fsdp_ema.checkpoint.save(tmp_path / "part", {n: t for n, t in state.items()
                                                         if n != ShardedEMA.STEP_KEY},
                                     overwrite=True)
            fresh.load(tmp_path / "part", strict=False)
        got = fresh.state_dict()
        for n, t in got.items():
            if n == ShardedEMA.STEP_KEY:
                continue
            expected = before[n] if n == "inp.bias" else state[n]
            assert torch.equal(t, expected), (load, n)


# --- checkpoint directories ---------------------------------------------------------------------

def test_save_load_round_trip_and_seed_recipe_names(tmp_path):
    model = make()
    ema = ShardedEMA(model, 0.8)
    train(model, 3, ema)
    ema.save_ema_shard_weights(tmp_path / "ema")
    ema.save_shard_weights(tmp_path / "weights")
    assert fsdp_ema.checkpoint.info(tmp_path / "ema")["world_size"] == 1
    state = ema.state_dict()
    loaded = fsdp_ema.checkpoint.load(tmp_path / "ema")
    assert sorted(loaded) == sorted(n for n in state if n != ShardedEMA.STEP_KEY)
    for name, t in loaded.items():
        assert torch.equal(t, state[name]), name
    for name, t in fsdp_ema.checkpoint.load(tmp_path / "weights").items():
        assert torch.equal(t, model.state_dict()[name]), name
    fresh = ShardedEMA(make(seed=5), 0.8)
    fresh.load(tmp_path / "ema")
    for name, t in fresh.state_dict().items():
        if name != ShardedEMA.STEP_KEY:
            assert torch.equal(t, state[name]), name


def test_load_from_a_checkpoint_of_another_model_lists_the_differences(tmp_path):
    fsdp_ema.checkpoint.save(tmp_path, {"inp.weight": torch.zeros(7, 5), "other": torch.zeros(1)})
    ema = ShardedEMA(make(), 0.8)
    with pytest.raises(ValueError) as err:
        ema.load(tmp_path)
    message = str(err.value)
    assert message.startswith("ShardedEMA.load: missing 8 name(s): ")
    assert "'head.bias'" in message and "unexpected 1 name(s): 'other'" in message
    assert "'inp.weight' is [7, 5] there but [7, 6] here" in message


def test_save_refuses_a_committed_directory_unless_overwrite(tmp_path):
    model = make()
    ema = ShardedEMA(model, 0.8)
    ema.save(tmp_path)
    with pytest.raises(FileExistsError, match="already holds a committed checkpoint"):
        ema.save(tmp_path)
    train(model, 1, ema)
    ema.save(tmp_path, overwrite=True)
    assert torch.equal(fsdp_ema.checkpoint.load(tmp_path)["inp.weight"],
                       ema.state_dict()["inp.weight"])


# --- errors -------------------------------------------------------------------------------------

def test_model_without_floating_parameters_is_an_error():
    model = nn.Module()
    model.register_buffer("count", torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="Module has no floating-point parameters to average"):
        ShardedEMA(model)


def test_replaced_parameter_of_another_shape_is_a_sharding_change():
    model = make()
    ema = ShardedEMA(model, 0.9)
    model.inp.weight = nn.Parameter(torch.zeros(8, 6))
    with pytest.raises(RuntimeError, match=r"sharding changed.*'inp\.weight' has a local shard "
                                           r"of shape \[8, 6\] here, it had \[7, 6\]"):
        ema.update()


def test_replaced_parameter_of_the_same_shape_is_followed():
    model = make()
    ema = ShardedEMA(model, 0.0)
    model.inp.weight = nn.Parameter(torch.full((7, 6), 3.0))
    ema.update()
    assert torch.equal(ema.state_dict()["inp.weight"], torch.full((7, 6), 3.0))


@pytest.mark.parametrize("kwargs,message", [
    (dict(decay=1.5), "decay must be in"),
    (dict(update_every=0), "update_every must be an integer >= 1"),
    (dict(start_step=-1), "start_step must be an integer >= 0"),
    (dict(dtype=torch.int32), "dtype must be one of"),
    (dict(buffers="sum"), "buffers must be 'average' or 'copy'"),
    (dict(warmup=Warmup(min_decay=0.99999)), "min_decay <= decay"),
])
def test_bad_arguments_are_rejected(kwargs, message):
    kwargs = {"decay": 0.999, **kwargs}
    with pytest.raises(ValueError, match=message):
        ShardedEMA(make(), **kwargs)


def test_meta_parameters_are_rejected():
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device"):
        ShardedEMA(model)


def test_shapes_name_every_kept_tensor_in_state_dict_order_read_only():
    model = make()
    ema = ShardedEMA(model, decay=0.9, params=lambda fqn, p: fqn != "inp.bias")
    full = model.state_dict()
    kept = {n: t.shape for n, t in full.items() if n != "inp.bias"}
    assert list(ema.shapes) == [n for n in ema.state_dict() if n != ShardedEMA.STEP_KEY]
    assert dict(ema.shapes) == kept
    with pytest.raises(TypeError):
        ema.shapes["inp.bias"] = torch.Size([7])
    assert ema.process_group is None
