"""torch.ops.fsdp_ema.update_multi_ (K EMA lists, one read of the model): numerics against
update_ and torch.lerp, validation, opcheck, torch.compile and TorchScript."""

from typing import List  # TorchScript annotations, as in test_update.py

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fsdp_ema

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SIZES = [(), (0,), (1,), (7,), (3, 5), (1023,), (4097,), (70001,)]


def make_lists(sizes, ema_dtypes, model_dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    model = [torch.randn(s, generator=g).to(device=device, dtype=model_dtype) for s in sizes]
    emas = [[torch.randn(s, generator=g).to(device=device, dtype=d) for s in sizes]
            for d in ema_dtypes]
    return emas, model


def flat(emas):
    return [t for e in emas for t in e]


def lerp_reference(ema, model, decay):
    om = torch.float64 if ema.dtype == torch.float64 else torch.float32
    return torch.lerp(ema.to(om), model.to(om), 1.0 - decay).to(ema.dtype)


@pytest.mark.parametrize("model_dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_multi_equals_k_separate_updates_bit_for_bit(device, model_dtype, k):
    # Each profile its own EMA dtype (cycling), so mixed dtypes within one call are covered; K=5
    # exceeds the CUDA kernel's profiles per entry.
    ema_dtypes = [DTYPES[j % len(DTYPES)] for j in range(k)]
    emas, model = make_lists(SIZES, ema_dtypes, model_dtype, device)
    expected = [[t.clone() for t in e] for e in emas]
    decays = [0.9, 0.25, 0.999, 0.0, 1.0][:k]
    for e, d in zip(expected, decays):
        torch.ops.fsdp_ema.update_(e, model, d)
    torch.ops.fsdp_ema.update_multi_(flat(emas), model, decays)
    for e, x in zip(flat(emas), flat(expected)):
        assert torch.equal(e, x)
    # And independently of update_: torch.lerp with the weight formed in double, bit for bit.
    emas2, _ = make_lists(SIZES, ema_dtypes, model_dtype, device)
    ref = [[lerp_reference(t, m, d) for t, m in zip(e, model)] for e, d in zip(emas2, decays)]
    fsdp_ema.update_multi_(emas2, model, decays)
    for a, b in zip(flat(emas2), flat(ref)):
        assert torch.equal(a, b)


def test_tensor_decays_equal_float_decays_and_may_be_mixed(device):
    emas_a, model = make_lists(SIZES, [torch.float32, torch.float32], torch.bfloat16, device)
    emas_b = [[t.clone() for t in e] for e in emas_a]
    emas_c = [[t.clone() for t in e] for e in emas_a]
    torch.ops.fsdp_ema.update_multi_(flat(emas_a), model, [0.75, 0.5])
    torch.ops.fsdp_ema.update_multi_(flat(emas_b), model,
                                     [torch.tensor(0.75, device=device),
                                      torch.tensor(0.5, dtype=torch.float64)])  # device and CPU
    fsdp_ema.update_multi_(emas_c, model, [torch.tensor(0.75, device=device), 0.5])
    for a, b, c in zip(flat(emas_a), flat(emas_b), flat(emas_c)):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_non_contiguous_ema_and_model(device):
    base = torch.randn(8, 6, device=device)
    model = [base[:, ::2]]                              # strided model, 8 x 3
    e0 = torch.randn(3, 8, device=device).t()           # transposed EMA, 8 x 3
    e1 = torch.randn(8, 3, device=device)
    want0 = lerp_reference(e0, model[0], 0.9)
    want1 = lerp_reference(e1, model[0], 0.5)
    torch.ops.fsdp_ema.update_multi_([e0, e1], model, [0.9, 0.5])
    torch.testing.assert_close(e0, want0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(e1, want1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case,message", [
    ("k_mismatch", r"ema has 3 tensors but model has 1 and decays has 2"),
    ("no_decays", r"decays is empty"),
    ("empty_model", r"model is empty"),
    ("shape", r"ema\[1\] has 4 elements but model\[0\] has 3"),
    ("dtype", r"ema\[1\] has dtype Int; expected Double, Float, Half or BFloat16"),
    ("decay_range", r"decays\[1\] must be in \[0, 1\], got 1.5"),
    ("decay_shape", r"decays\[0\] must be a 0-dim tensor"),
    ("overlap_profiles", r"ema\[1\] overlaps ema\[0\]|ema\[0\] overlaps ema\[1\]"),
    ("overlap_model", r"overlaps model\[0\]"),
])
def test_bad_inputs_name_the_argument_and_write_nothing(case, message):
    m = [torch.randn(3)]
    e0, e1 = torch.zeros(3), torch.zeros(3)
    ema, model, decays = [e0, e1], m, [0.5, 0.5]
    if case == "k_mismatch":
        ema = [e0, e1, torch.zeros(3)]
    elif case == "no_decays":
        decays = []
    elif case == "empty_model":
        ema, model = [], []
    elif case == "shape":
        ema = [e0, torch.zeros(4)]
    elif case == "dtype":
        ema = [e0, torch.zeros(3, dtype=torch.int32)]
    elif case == "decay_range":
        decays = [0.5, 1.5]
    elif case == "decay_shape":
        decays = [torch.tensor([0.5]), torch.tensor(0.5)]
    elif case == "overlap_profiles":
        ema = [e0, e0]
    elif case == "overlap_model":
        ema = [e0, m[0]]
    before = [t.clone() for t in ema]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fsdp_ema.update_multi_(ema, model, decays)
    for t, b in zip(ema, before):
        if t.dtype.is_floating_point:
            assert torch.equal(t, b)


@pytest.mark.parametrize("decay_kind", ["float", "tensor"])
def test_opcheck(device, decay_kind):
    emas, model = make_lists([(5,), (2, 3), ()], [torch.float32, torch.bfloat16],
                             torch.bfloat16, device)
    model = [m.requires_grad_() for m in model]
    if decay_kind == "float":
        op, decays = torch.ops.fsdp_ema.update_multi_.default, [0.9, 0.7]
    else:
        op = torch.ops.fsdp_ema.update_multi_.Tensor
        decays = [torch.tensor(0.9, device=device), torch.tensor(0.7, device=device)]
    result = torch.library.opcheck(op, ([t.clone() for t in flat(emas)], model, decays))
    assert set(result.values()) == {"SUCCESS"}, result


def test_compiled_step_no_graph_break_no_recompile(device):
    """A compiled SGD step + two-profile update with decays that change every step."""
    torch._dynamo.reset()

    def make_run():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                  torch.nn.Linear(32, 4)).to(device)
        params = list(net.parameters())
        ema = [p.detach().clone() for p in params] + [p.detach().clone() for p in params]

        def step(d0, d1):
            with torch.no_grad():
                torch._foreach_add_(params, [p.grad for p in params], alpha=-0.1)
                torch.ops.fsdp_ema.update_multi_(ema, params, [d0, d1])

        return net, ema, step

    counter = CompileCounterWithBackend("inductor")
    net_c, ema_c, step_c = make_run()
    step_c = torch.compile(step_c, backend=counter, fullgraph=True)
    net_e, ema_e, step_e = make_run()
    d0, d1 = torch.tensor(0.0, device=device), torch.tensor(0.0, device=device)
    g = torch.Generator().manual_seed(1)
    for i in range(12):
        x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
        d0.fill_(1 - 1 / (i + 2))
        d1.fill_((1 - 1 / (i + 2)) ** 3)
        for net, step in ((net_c, step_c), (net_e, step_e)):
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            step(d0, d1)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"
    for a, b in zip(ema_c, ema_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    n = len(ema_c) // 2
    assert not torch.equal(ema_c[0], ema_c[n])  # the two profiles really differ


def test_torchscript_keeps_update_multi_on_an_inline_list():
    class TwoEmas(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
            self.register_buffer("fast", torch.zeros(2, 3))
            self.register_buffer("slow", torch.zeros(2, 3))

        def forward(self, d: List[float]) -> torch.Tensor:
            torch.ops.fsdp_ema.update_multi_([self.fast, self.slow], [self.weight.detach()], d)
            return self.weight

    scripted = torch.jit.script(TwoEmas())
    assert "fsdp_ema::update_multi_" in str(scripted.forward.graph)
    scripted([0.75, 0.25])
    w = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(scripted.fast, w * 0.25)
    assert torch.equal(scripted.slow, w * 0.75)


def test_torchscript_function_with_tensor_decays(device):
    @torch.jit.script
    def scripted(ema: List[torch.Tensor], model: List[torch.Tensor], d: List[torch.Tensor]):
        torch.ops.fsdp_ema.update_multi_(ema, model, d)

    emas, model = make_lists([(100,), (3, 3)], [torch.float32] * 2, torch.float16, device)
    want = [[lerp_reference(t, m, d) for t, m in zip(e, model)] for e, d in zip(emas, (0.9, 0.6))]
    scripted(flat(emas), model, [torch.tensor(0.9, device=device), torch.tensor(0.6)])
    for a, b in zip(flat(emas), flat(want)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_every_isa_kernel_equals_update(isa):
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = """
import torch, fsdp_ema
g = torch.Generator().manual_seed(0)
for mt in (torch.float32, torch.bfloat16, torch.float64):
    model = [torch.randn(n, generator=g).to(mt) for n in (1, 33, 70001)]
    emas = [[torch.randn(n, generator=g) for n in (1, 33, 70001)] for _ in range(3)]
    want = [[t.clone() for t in e] for e in emas]
    for e, d in zip(want, (0.9, 0.3, 0.99)):
        fsdp_ema.update_(e, model, d)
    fsdp_ema.update_multi_(emas, model, (0.9, 0.3, 0.99))
    assert all(torch.equal(a, b) for x, y in zip(emas, want) for a, b in zip(x, y))
print(torch.ops.fsdp_ema.cpu_capability(), "ok")
"""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, ATEN_CPU_CAPABILITY=isa, PYTHONPATH=str(root / "python"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    used, result = out.stdout.split()
    assert result == "ok"
    if isa == "default" or torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert used == isa
