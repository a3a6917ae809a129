"""fsdp_ema.update_ / torch.ops.fsdp_ema.update_: numerics, validation, opcheck, compile, script."""

import itertools
import os
from typing import List

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fsdp_ema

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
OPS = [torch.ops.fsdp_ema.update_, torch.ops.fsdp_ema.ema_shard_update_]


def opmath(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference(ema, model, decay):
    """Independent reference: torch.lerp in the EMA's math precision."""
    om = opmath(ema.dtype)
    return torch.lerp(ema.to(om), model.to(om), 1.0 - decay).to(ema.dtype)


def assert_ema_close(actual, expected):
    # One rounding step of the EMA dtype: torch.lerp and our kernel may fuse multiply-adds
    # differently, which can flip the last bit after rounding to the EMA dtype.
    eps = torch.finfo(actual.dtype).eps
    torch.testing.assert_close(actual, expected, rtol=eps, atol=eps, equal_nan=True)


def make_case(sizes, ema_dtype, model_dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ema = [torch.randn(s, generator=g).to(device=device, dtype=ema_dtype) for s in sizes]
    model = [torch.randn(s, generator=g).to(device=device, dtype=model_dtype) for s in sizes]
    return ema, model


SIZES = [(), (0,), (1,), (7,), (3, 5), (1023,), (4097,), (70001,)]


# The decays users run: 1 - 10^-k for k = 1..7 (0.9 ... 0.9999999). Diffusion models run
# 0.9999-0.99999; friendly values such as 0.5 or 0.75 hide a weight formed in float32.
USER_DECAYS = [1.0 - 10.0 ** -k for k in range(1, 8)]


@pytest.mark.parametrize("ema_dtype,model_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_update_matches_lerp_for_every_dtype_pair(device, ema_dtype, model_dtype):
    for decay in [0.9, 0.25, 0.9999, 0.999999]:
        ema, model = make_case(SIZES, ema_dtype, model_dtype, device)
        expected = [reference(e, m, decay) for e, m in zip(ema, model)]
        torch.ops.fsdp_ema.update_(ema, model, decay)
        for a, b in zip(ema, expected):
            assert torch.equal(a, b), (decay, a.dtype, (a != b).sum())


# --- exactness: the weight 1 - decay is formed in double ----------------------------------------

def _decay_args(decay, device):
    """decay as a float, a float64 0-dim CPU tensor and a float64 0-dim tensor on the device."""
    return [decay, torch.tensor(decay, dtype=torch.float64),
            torch.tensor(decay, dtype=torch.float64, device=device)]


@pytest.mark.parametrize("decay", USER_DECAYS, ids=[f"1-1e-{k}" for k in range(1, 8)])
def test_weight_is_one_minus_decay_formed_in_double(device, decay):
    """ema = 0, model = 1: lerp(0, 1, w) is w exactly, so the result is the weight the kernel
    applied. It must be float(1 - decay) computed in double (rounded once), as torch.lerp, timm
    and ema-pytorch form it; 1.0f - float(decay) is off by 1.7e-4 at 0.9999, 1.3e-2 at
    0.999999."""
    expected32 = torch.tensor(1.0 - decay, dtype=torch.float64).to(torch.float32)
    assert expected32.item() != (1.0 - torch.tensor(decay, dtype=torch.float32).item()) or \
        decay < 0.99  # the old rounding differs at every decay users run
    expected64 = torch.tensor(1.0 - decay, dtype=torch.float64)
    for arg in _decay_args(decay, device):
        for ema_dtype, expected in [(torch.float32, expected32), (torch.float64, expected64)]:
            for model_dtype in DTYPES:
                ema = [torch.zeros(37, dtype=ema_dtype, device=device)]
                model = [torch.ones(37, dtype=model_dtype, device=device)]
                torch.ops.fsdp_ema.update_(ema, model, arg)
                assert torch.equal(ema[0].cpu(), expected.expand(37)), (arg, ema_dtype, model_dtype)
        # update_multi_: every profile forms its own weight the same way.
        emas = [[torch.zeros(37, device=device)] for _ in range(3)]
        fsdp_ema.update_multi_(emas, [torch.ones(37, device=device)], [arg, 0.5, arg])
        assert torch.equal(emas[0][0].cpu(), expected32.expand(37))
        assert torch.equal(emas[2][0].cpu(), expected32.expand(37))


@pytest.mark.parametrize("decay", USER_DECAYS, ids=[f"1-1e-{k}" for k in range(1, 8)])
def test_bit_exact_against_lerp_with_the_weight_in_double(device, decay):
    """Random data, every dtype pair, every decay argument kind, update_ and update_multi_: the
    result is torch.lerp(ema, model, 1 - decay) bit for bit (math in float32, float64 for a
    float64 EMA)."""
    for ema_dtype, model_dtype in itertools.product(DTYPES, DTYPES):
        for arg in _decay_args(decay, device):
            ema, model = make_case([(1,), (33,), (4097,)], ema_dtype, model_dtype, device, seed=7)
            expected = [reference(e, m, decay) for e, m in zip(ema, model)]
            multi = [[e.clone() for e in ema], [e.clone() for e in ema]]
            torch.ops.fsdp_ema.update_(ema, model, arg)
            fsdp_ema.update_multi_(multi, model, [arg, arg])
            for a, b, c, d in zip(ema, expected, multi[0], multi[1]):
                assert torch.equal(a, b), (ema_dtype, model_dtype, arg, (a != b).sum())
                assert torch.equal(c, b) and torch.equal(d, b)


@pytest.mark.parametrize("k", [4, 5, 6, 7])
def test_ten_thousand_steps_stay_within_float32_rounding_of_a_float64_reference(device, k):
    """A cold-started fp32 EMA (zeros) of noisy weights around 1, 10,000 updates at decay
    1 - 10^-k, against the same recursion in float64 with the exact weight. The bound is the
    forward error of the float32 recursion, accumulated step by step from the values:
    |err'| <= decay |err| + w |m - e| (2u + u^2) + u |e'|, u = 2^-24 (the weight's rounding, the
    subtraction's and the fused multiply-add's). A weight formed from a float32 decay breaks it
    at k >= 5. The fp32 trajectory also equals 10,000 torch.lerp calls bit for bit."""
    decay = 1.0 - 10.0 ** -k
    w = 1.0 - decay
    u = 2.0 ** -24
    g = torch.Generator().manual_seed(k)
    n = 512
    ema = torch.zeros(n, device=device)
    lerp = torch.zeros(n, device=device)
    ref = torch.zeros(n, dtype=torch.float64, device=device)
    bound = torch.zeros(n, dtype=torch.float64, device=device)
    decay_t = torch.tensor(decay, dtype=torch.float64, device=device)
    noise = torch.randn(10_000, n, generator=g).mul_(0.1).add_(1.0).to(device)
    for step in range(10_000):
        m = noise[step]
        diff = (m.double() - ema.double()).abs_()
        torch.ops.fsdp_ema.update_([ema], [m], decay_t)
        lerp = torch.lerp(lerp, m, w)
        ref.lerp_(m.double(), w)
        bound.mul_(decay).add_(diff, alpha=w * (2 * u + u * u)).add_(ema.double().abs(), alpha=u)
    assert torch.equal(ema, lerp)
    err = (ema.double() - ref).abs()
    slack = 1e-12 * ref.abs() + 1e-300
    worst = ((err - bound - slack) / bound).max().item()
    assert torch.all(err <= bound + slack), f"exceeds the rounding bound by {worst:.3g} of it"
    assert ema.mean().item() == pytest.approx(1 - decay ** 10_000, rel=0.05)


@pytest.mark.parametrize("op", OPS, ids=["update_", "ema_shard_update_"])
def test_decay_tensor_equals_decay_float(device, op):
    ema_a, model = make_case(SIZES, torch.float32, torch.bfloat16, device)
    ema_b = [e.clone() for e in ema_a]
    op(ema_a, model, 0.75)
    op(ema_b, model, torch.tensor(0.75, device=device))
    for a, b in zip(ema_a, ema_b):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("decay_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_decay_tensor_dtypes_and_cpu_decay_for_device_tensors(device, decay_dtype):
    # 0.75 is exact in every decay dtype, and unlike 0.5 it tells decay from 1 - decay.
    ema, model = make_case([(257,)], torch.float32, torch.float32, device)
    expected = reference(ema[0], model[0], 0.75)
    swapped = reference(ema[0], model[0], 0.25)
    assert not torch.allclose(expected, swapped)
    torch.ops.fsdp_ema.update_(ema, model, torch.tensor(0.75, dtype=decay_dtype))  # on the CPU
    assert_ema_close(ema[0], expected)
    ema2, _ = make_case([(257,)], torch.float32, torch.float32, device)
    torch.ops.fsdp_ema.update_(ema2, model, torch.tensor(0.75, dtype=decay_dtype, device=device))
    assert_ema_close(ema2[0], expected)
    ema3, _ = make_case([(257,)], torch.float32, torch.float32, device)
    torch.ops.fsdp_ema.ema_shard_update_(ema3, model,
                                         torch.tensor(0.75, dtype=decay_dtype, device=device))
    assert_ema_close(ema3[0], expected)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_update_splits_the_work_across_1_2_and_3_threads(threads):
    """The CPU kernel splits the flat element range of all pairs between threads (each thread
    starting mid-tensor); every split must give torch.lerp's values on any machine."""
    sizes = [(70001,), (3,), (131077,), (1,), (0,), (99999,), (65536,), (5, 7)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.get_num_threads() == threads
        for ema_dtype, model_dtype in [(torch.float32, torch.bfloat16),
                                       (torch.bfloat16, torch.float32),
                                       (torch.float64, torch.float16)]:
            ema, model = make_case(sizes, ema_dtype, model_dtype, "cpu", seed=threads)
            expected = [reference(e, m, 0.9) for e, m in zip(ema, model)]
            torch.ops.fsdp_ema.update_(ema, model, 0.9)
            # Every element updated exactly once: a skipped or repeated range is far outside
            # one rounding of the EMA dtype.
            for a, b in zip(ema, expected):
                assert_ema_close(a, b)
    finally:
        torch.set_num_threads(before)


def test_decay_zero_copies_and_decay_one_keeps_exactly(device):
    ema, model = make_case([(1000,), (33,)], torch.float32, torch.float32, device)
    before = [e.clone() for e in ema]
    torch.ops.fsdp_ema.update_(ema, model, 1.0)
    for a, b in zip(ema, before):
        assert torch.equal(a, b)
    torch.ops.fsdp_ema.update_(ema, model, 0.0)
    for a, b in zip(ema, model):
        assert torch.equal(a, b)


def test_misaligned_and_noncontiguous_tensors(device):
    g = torch.Generator().manual_seed(1)
    base_e = torch.randn(4099, generator=g).to(device)
    base_m = torch.randn(4099, generator=g).to(device, torch.bfloat16)
    grid_e = torch.randn(64, 48, generator=g).to(device)
    grid_m = torch.randn(48, 64, generator=g).to(device, torch.float16)
    other_e = torch.randn(48, 64, generator=g).to(device)
    # Odd storage offsets (no vector alignment), an empty pair, and strided views on both sides.
    ema = [base_e[1:4098], base_e.new_empty(0), grid_e[:, ::3], other_e.t()[5:9]]
    model = [base_m[2:4099], base_m[:0], grid_m.t()[:, :16], grid_m.t()[5:9]]
    expected = [reference(e, m, 0.8) for e, m in zip(ema, model)]
    untouched = grid_e.clone()
    torch.ops.fsdp_ema.update_(ema, model, 0.8)
    for a, b in zip(ema, expected):
        assert_ema_close(a, b)
    # Columns of grid_e outside the strided view keep their values.
    mask = torch.ones(64, 48, dtype=torch.bool, device=device)
    mask[:, ::3] = False
    assert torch.equal(grid_e[mask], untouched[mask])


def test_hundreds_of_tensors_in_one_call(device):
    g = torch.Generator().manual_seed(2)
    sizes = [(int(torch.randint(0, 5000, (1,), generator=g)),) for _ in range(500)]
    ema, model = make_case(sizes, torch.float32, torch.bfloat16, device, seed=3)
    expected = [reference(e, m, 0.99) for e, m in zip(ema, model)]
    fsdp_ema.update_(ema, model, 0.99)
    for a, b in zip(ema, expected):
        assert_ema_close(a, b)


def test_repeated_updates_match_repeated_lerp(device):
    ema, model = make_case([(999,), (2, 3, 4)], torch.float32, torch.float32, device)
    ref = [e.clone() for e in ema]
    for step in range(10):
        d = 0.5 + 0.04 * step
        fsdp_ema.update_(ema, model, torch.tensor(d, device=device))
        ref = [reference(r, m, d) for r, m in zip(ref, model)]
    for a, b in zip(ema, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# --- validation: the error names the argument and nothing is written ---------------------------

def _bad_cases(device):
    f32 = dict(device=device, dtype=torch.float32)
    shared = torch.zeros(10, **f32)
    cases = {
        "list lengths": ([torch.zeros(3, **f32)], [], 0.5, "ema has 1 tensors but model has 0"),
        "empty lists": ([], [], torch.tensor(0.5, device=device), "ema is empty"),
        "numel": ([torch.zeros(4096, **f32)], [torch.zeros(4095, **f32)], 0.5,
                  "ema[0] has 4096 elements but model[0] has 4095"),
        "shape": ([torch.zeros(2, 6, **f32)], [torch.zeros(3, 4, **f32)], 0.5,
                  "ema[0] has shape [2, 6] but model[0] has shape [3, 4]"),
        "ema dtype": ([torch.zeros(3, **f32), torch.zeros(3, device=device, dtype=torch.int64)],
                      [torch.zeros(3, **f32)] * 2, 0.5, "ema[1] has dtype Long"),
        "model dtype": ([torch.zeros(3, **f32)], [torch.zeros(3, device=device, dtype=torch.int32)],
                        0.5, "model[0] has dtype Int"),
        "decay high": ([torch.zeros(3, **f32)], [torch.ones(3, **f32)], 1.5,
                       "decay must be in [0, 1], got 1.5"),
        "decay negative": ([torch.zeros(3, **f32)], [torch.ones(3, **f32)], -0.1,
                           "decay must be in [0, 1], got -0.1"),
        "decay nan": ([torch.zeros(3, **f32)], [torch.ones(3, **f32)], float("nan"),
                      "decay must be in [0, 1], got nan"),
        "decay cpu tensor out of range": ([torch.zeros(3, **f32)], [torch.ones(3, **f32)],
                                          torch.tensor(2.0), "decay must be in [0, 1], got 2"),
        "decay shape": ([torch.zeros(3, **f32)], [torch.ones(3, **f32)], torch.tensor([0.5]),
                        "decay must be a 0-dim tensor, got shape [1]"),
        "decay dtype": ([torch.zeros(3, **f32)], [torch.ones(3, **f32)], torch.tensor(1),
                        "decay must be a floating-point tensor, got dtype Long"),
        "ema overlaps model": ([shared[:6]], [shared[4:]], 0.5,
                               "ema[0] overlaps model[0] in memory"),
        "ema overlaps ema": ([torch.zeros(3, **f32), shared[2:5], shared[4:7]],
                             [torch.ones(3, **f32)] * 3, 0.5, "overlaps ema[1] in memory"),
        "ema is model": ([shared], [shared], 0.5, "ema[0] overlaps model[0]"),
        "expanded ema": ([torch.zeros(1, **f32).expand(5)], [torch.ones(5, **f32)], 0.5,
                         "ema[0] has internally overlapping memory"),
    }
    if device == "cpu":
        # Built only when it can run; listed always, so that CPU hosts report it as a skip.
        cases["mixed devices"] = (lambda: ([torch.zeros(3)], [torch.ones(3, device="cuda")], 0.5,
                                           "model[0] is on cuda:0 but ema[0] is on cpu"))
    return cases


@pytest.mark.parametrize("case", list(_bad_cases("cpu").keys()))
def test_bad_input_names_argument_and_changes_nothing(device, case):
    cases = _bad_cases(device)
    if case not in cases:
        pytest.skip("case only applies to CPU tensors")
    if case == "mixed devices" and not torch.cuda.is_available():
        pytest.skip("mixed devices need a CUDA device")
    ema, model, decay, message = cases[case]() if callable(cases[case]) else cases[case]
    before = [e.clone() for e in ema]
    # The first pairs are valid: validation must finish before any write.
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        torch.ops.fsdp_ema.update_(ema, model, decay)
    for a, b in zip(ema, before):
        assert torch.equal(a, b)


def test_strided_views_that_interleave_do_not_count_as_overlap(device):
    grid = torch.zeros(8, 8, device=device)
    model = torch.ones(8, 4, device=device)
    torch.ops.fsdp_ema.update_([grid[:, 0::2], grid[:, 1::2]], [model, model * 2], 0.5)
    assert torch.equal(grid[:, 0::2], torch.full((8, 4), 0.5, device=device))
    assert torch.equal(grid[:, 1::2], torch.full((8, 4), 1.0, device=device))


# --- torch.library.opcheck, torch.compile, TorchScript ------------------------------------------

@pytest.mark.parametrize("decay_kind", ["float", "tensor"])
def test_opcheck(device, decay_kind):
    ema, model = make_case([(5,), (2, 3), ()], torch.float32, torch.bfloat16, device)
    model = [m.requires_grad_() for m in model]
    decay = 0.9 if decay_kind == "float" else torch.tensor(0.9, device=device)
    for packet in OPS:
        op = packet.default if decay_kind == "float" else packet.Tensor
        args = ([e.clone() for e in ema], model, decay)
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, result


def _make_net(device):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return net.to(device)


def test_compiled_training_step_no_graph_break_no_recompile(device):
    """A compiled optimizer-step + EMA-update with a decay tensor that changes every step."""
    torch._dynamo.reset()

    def make_run():
        net = _make_net(device)
        params = list(net.parameters())
        ema = [p.detach().clone() for p in params]

        def step_and_update(decay):
            with torch.no_grad():
                torch._foreach_add_(params, [p.grad for p in params], alpha=-0.1)  # SGD
                torch.ops.fsdp_ema.update_(ema, params, decay)

        return net, ema, step_and_update

    counter = CompileCounterWithBackend("inductor")
    net_c, ema_c, step_c = make_run()
    step_c = torch.compile(step_c, backend=counter, fullgraph=True)
    net_e, ema_e, step_e = make_run()

    decay = torch.tensor(0.0, device=device)
    g = torch.Generator().manual_seed(1)
    for i in range(20):
        x = torch.randn(8, 16, generator=g).to(device)
        y = torch.randn(8, 4, generator=g).to(device)
        decay.fill_(min(0.99, (1 + i) / (10 + i)))  # a warmup schedule: new value every step
        for net, step in ((net_c, step_c), (net_e, step_e)):
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            step(decay)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"
    for a, b in zip(ema_c, ema_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The EMA really moved away from its start and differs from the final weights.
    assert not torch.equal(ema_c[0], net_c[0].weight.detach())


def test_torchscript_function_calls_the_op(device):
    @torch.jit.script
    def scripted(ema: List[torch.Tensor], model: List[torch.Tensor], decay: torch.Tensor,
                 decay_f: float):
        torch.ops.fsdp_ema.update_(ema, model, decay)
        torch.ops.fsdp_ema.ema_shard_update_(ema, model, decay_f)

    assert "fsdp_ema::update_" in str(scripted.graph)
    ema, model = make_case([(100,), (3, 3)], torch.float32, torch.float16, device)
    expected = [reference(reference(e, m, 0.9), m, 0.8) for e, m in zip(ema, model)]
    scripted(ema, model, torch.tensor(0.9, device=device), 0.8)
    for a, b in zip(ema, expected):
        assert_ema_close(a, b)


# --- CUDA-only behaviour -------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda_only
def test_cuda_graph_capture_replays_with_new_decay():
    ema, model = make_case([(10000,), (77,)], torch.float32, torch.bfloat16, "cuda")
    decay = torch.tensor(0.5, device="cuda")
    ref = [e.clone() for e in ema]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside capture
        torch.ops.fsdp_ema.update_([e.clone() for e in ema], model, decay)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.fsdp_ema.update_(ema, model, decay)
    for d in (0.5, 0.9, 0.1):
        decay.fill_(d)
        graph.replay()
        ref = [reference(r, m, d) for r, m in zip(ref, model)]
    torch.cuda.synchronize()
    for a, b in zip(ema, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@cuda_only
def test_cuda_few_launches_for_hundreds_of_tensors():
    ema, model = make_case([(1000 + i,) for i in range(500)], torch.float32, torch.bfloat16, "cuda")
    decay = torch.tensor(0.9, device="cuda")
    torch.ops.fsdp_ema.update_(ema, model, decay)  # warm up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.ops.fsdp_ema.update_(ema, model, decay)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    assert 1 <= len(kernels) <= 4, [e.name for e in kernels]


def test_torchscript_keeps_update_on_an_inline_list():
    """A list literal argument must not let TorchScript dead-code-eliminate the update."""

    class EmaModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
            self.register_buffer("ema", torch.zeros(2, 3))

        def forward(self, decay: float) -> torch.Tensor:
            torch.ops.fsdp_ema.update_([self.ema], [self.weight.detach()], decay)
            return self.weight

    scripted = torch.jit.script(EmaModule())
    assert "fsdp_ema::update_" in str(scripted.forward.graph)
    scripted(0.75)  # not 0.5: decay and 1 - decay must differ
    assert torch.equal(scripted.ema, torch.arange(6.0).reshape(2, 3) * 0.25)


@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_every_isa_kernel_matches_lerp(isa):
    """ATEN_CPU_CAPABILITY caps the kernel's instruction set; every build must agree with lerp."""
    import subprocess
    import sys
    from pathlib import Path

    script = """
import torch, fsdp_ema
print(torch.ops.fsdp_ema.cpu_capability())
g = torch.Generator().manual_seed(0)
for et in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    for mt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        ema = [torch.randn(n, generator=g).to(et) for n in (1, 33, 70001)]
        model = [torch.randn(n, generator=g).to(mt) for n in (1, 33, 70001)]
        om = torch.float64 if et == torch.float64 else torch.float32
        for decay in (0.75, 0.9999, 0.999999):
            ref = [torch.lerp(e.to(om), m.to(om), 1 - decay).to(et) for e, m in zip(ema, model)]
            fsdp_ema.update_(ema, model, decay)
            for a, b in zip(ema, ref):
                assert torch.equal(a, b), (et, mt, decay)
print("ok")
"""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, ATEN_CPU_CAPABILITY=isa, PYTHONPATH=str(root / "python"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    used, result = out.stdout.split()
    assert result == "ok"
    if isa == "default" or torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert used == isa  # the requested kernel really ran


# --- memory the EMA owns (#28) ------------------------------------------------------------------

def test_update_refuses_tensors_whose_storage_was_shrunk():
    ema, model = [torch.zeros(1000), torch.zeros(10)], [torch.ones(1000), torch.ones(10)]
    ema[0].untyped_storage().resize_(16)
    with pytest.raises(RuntimeError, match=r"ema\[0\] reaches 4000 bytes into its storage, "
                                           r"which holds 16"):
        torch.ops.fsdp_ema.update_(ema, model, 0.5)
    assert torch.equal(ema[1], torch.zeros(10))
    ema, model = [torch.zeros(1000)], [torch.ones(1000)]
    model[0].untyped_storage().resize_(16)  # a read past the end is refused too
    with pytest.raises(RuntimeError, match=r"model\[0\] reaches 4000 bytes"):
        fsdp_ema.update_multi_([ema], model, [0.5])


def test_update_bumps_the_version_counter_of_every_ema_tensor():
    ema, model = make_case([(5,), (3,)], torch.float32, torch.float32, "cpu")
    versions = [e._version for e in ema]
    torch.ops.fsdp_ema.update_(ema, model, 0.5)
    fsdp_ema.update_multi_([ema], model, [torch.tensor(0.5, dtype=torch.float64)])
    assert [e._version for e in ema] == [v + 2 for v in versions]
    assert all(m._version == 0 for m in model)


def test_a_sparse_ema_is_named_as_sparse():
    with pytest.raises(RuntimeError, match=r"ema\[0\] is a Sparse tensor; pass a dense"):
        torch.ops.fsdp_ema.update_([torch.zeros(3, 3).to_sparse()], [torch.ones(3, 3)], 0.5)


def test_thousands_of_interleaved_column_views_are_checked_exactly():
    """3,000 column views of one matrix: every pair's extents meet, so pairwise checks would be
    quadratic; the byte map of their memory decides exactly, and names a real overlap."""
    grid = torch.zeros(16, 3000)
    ema = [grid[:, i] for i in range(3000)]
    model = [torch.full((16,), float(i)) for i in range(3000)]
    torch.ops.fsdp_ema.update_(ema, model, 0.0)
    assert torch.equal(grid, torch.arange(3000.0).expand(16, 3000))
    ema[2999] = grid[:, 5]
    with pytest.raises(RuntimeError, match=r"ema\[2999\] overlaps ema\[5\] in memory"):
        torch.ops.fsdp_ema.update_(ema, model, 0.0)
    ema[2999] = grid[:, 2999]
    model[7] = grid[:, 8]  # a model column that is an EMA column
    with pytest.raises(RuntimeError, match=r"ema\[8\] overlaps model\[7\] in memory"):
        torch.ops.fsdp_ema.update_(ema, model, 0.0)
