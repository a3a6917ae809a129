"""update_ on CUDA: every path of the kernel (vector packs with a peeled head, the scalar fallback,
64-bit indexing), streams, devices, CUDA graphs and torch.compile(mode="reduce-overhead").

References are torch.lerp in the EMA's math precision (fp32, fp64 for an fp64 EMA), compared
within one rounding step of the EMA dtype, as in test_update.py. The whole module skips without a
CUDA device.
"""

import itertools

import pytest
import torch
from cuda_utils import side_stream_behind_a_sleep

import fsdp_ema

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CHUNK = 16384  # kernels/update_cuda.h kCudaChunk: elements per thread block
HALF = [torch.bfloat16, torch.float16]
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def opmath(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference(ema, model, decay):
    om = opmath(ema.dtype)
    return torch.lerp(ema.to(om), model.to(om), 1.0 - decay).to(ema.dtype)


def assert_ema_close(actual, expected, msg=None):
    eps = torch.finfo(actual.dtype).eps
    torch.testing.assert_close(actual, expected, rtol=eps, atol=eps, equal_nan=True, msg=msg)


def randn(n, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, generator=g, device="cuda").to(dtype)


def free():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def need_free_bytes(nbytes):
    free_bytes, _ = torch.cuda.mem_get_info()
    if free_bytes < nbytes:
        pytest.skip(f"needs {nbytes / 2**30:.1f} GiB of free device memory, "
                    f"{free_bytes / 2**30:.1f} GiB free")


def check_in_slices(ema, before, model, decay, step=1 << 28):
    """Compares a huge result with the reference slice by slice (bounded extra memory)."""
    for s in range(0, ema.numel(), step):
        assert_ema_close(ema[s:s + step], reference(before[s:s + step], model[s:s + step], decay),
                         msg=f"elements [{s}, {s + step})")


# --- 64-bit indexing ----------------------------------------------------------------------------

def test_one_tensor_of_more_than_2_31_elements():
    n = (1 << 31) + 4099  # past 2^31, an odd tail after the last whole pack
    need_free_bytes(n * (4 + 4 + 2) + (1 << 30))
    ema, model = randn(n, torch.float32, 0), randn(n, torch.bfloat16, 1)
    before = ema.clone()
    fsdp_ema.update_([ema], [model], 0.75)
    check_in_slices(ema, before, model, 0.75)
    # The last elements, which a 32-bit index would have wrapped onto the first ones.
    assert_ema_close(ema[-5000:], reference(before[-5000:], model[-5000:], 0.75))
    del ema, model, before
    free()


def test_more_than_2_32_elements_in_one_call():
    sizes = [(3 << 29) + 1, 3 << 29, (3 << 29) + 77, 5]  # 4.83e9 elements: over 2^32
    assert sum(sizes) > 1 << 32
    need_free_bytes(sum(sizes) * 2 * 3 + (1 << 30))
    ema = [randn(n, torch.bfloat16, i) for i, n in enumerate(sizes)]
    model = [randn(n, torch.bfloat16, 10 + i) for i, n in enumerate(sizes)]
    before = [e.clone() for e in ema]
    fsdp_ema.update_(ema, model, 0.9)
    for e, b, m in zip(ema, before, model):
        check_in_slices(e, b, m, 0.9)
    del ema, model, before
    free()


# --- alignment: vector packs with a peeled head, and the element-by-element fallback -------------

@pytest.mark.parametrize("ema_dtype,model_dtype",
                         list(itertools.product(FLOATS, FLOATS)),
                         ids=lambda d: str(d).replace("torch.", ""))
def test_every_storage_offset_pair_updates_exactly_its_view(ema_dtype, model_dtype):
    """Every (ema offset, model offset) in elements 0..8: offsets that agree modulo the pack take
    the vector path after a head, the others the scalar path. Lengths cross chunk boundaries, so
    each chunk's own head and tail run; elements around each view must stay as they were."""
    n = 2 * CHUNK + 13
    ema_views, model_views, ema_bases, untouched = [], [], [], []
    offsets = list(itertools.product(range(9), range(9)))
    for k, (oe, om) in enumerate(offsets):
        length = n if k % 3 else 5  # some shorter than a pack (head larger than the view)
        eb = randn(oe + length + 16, ema_dtype, 2 * k)
        mb = randn(om + length + 16, model_dtype, 2 * k + 1)
        ema_bases.append((eb, oe, length))
        untouched.append(eb.clone())
        ema_views.append(eb[oe:oe + length])
        model_views.append(mb[om:om + length])
    expected = [reference(e, m, 0.3) for e, m in zip(ema_views, model_views)]
    fsdp_ema.update_(ema_views, model_views, 0.3)
    for (eb, oe, length), before, e, exp, (o1, o2) in zip(ema_bases, untouched, ema_views,
                                                           expected, offsets):
        assert_ema_close(e, exp, msg=f"ema offset {o1}, model offset {o2}")
        assert torch.equal(eb[:oe], before[:oe]), f"wrote before the view (offsets {o1}, {o2})"
        assert torch.equal(eb[oe + length:], before[oe + length:]), \
            f"wrote past the view (offsets {o1}, {o2})"


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_half_types_at_odd_storage_offsets_with_a_decay_tensor(dtype):
    base_e, base_m = randn(3 * CHUNK + 11, dtype, 3), randn(3 * CHUNK + 11, dtype, 4)
    other_e = randn(16, dtype, 5)
    ema = [base_e[1:], base_e.new_empty(0), other_e[3:10]]
    model = [base_m[1:], base_m.new_empty(0), base_m[5:12]]
    # ema[0] and model[0] start one element in (a head of 7, then packs of 8); ema[2] starts at
    # element 3 and model[2] at element 5: they disagree modulo 8 (element by element).
    expected = [reference(e, m, 0.6) for e, m in zip(ema, model)]
    fsdp_ema.update_(ema, model, torch.tensor(0.6, device="cuda"))
    for a, b in zip(ema, expected):
        assert_ema_close(a, b)


def test_non_contiguous_views_are_updated_in_place():
    g = randn(96 * 80, torch.float32, 5).view(96, 80)
    h = randn(80 * 96, torch.bfloat16, 6).view(80, 96)
    # Three disjoint strided views of one buffer (rows < 48; rows >= 48 columns 7..39; rows 60..63
    # odd columns from 41), against strided and transposed model views.
    ema = [g[:48, ::3], g.t()[7:40, 48:], g[60:64, 41::2]]
    model = [h.t()[:48, ::3], h[7:40, 48:].to(torch.float16), h.t()[60:64, 41::2]]
    expected = [reference(e, m, 0.8) for e, m in zip(ema, model)]
    outside = torch.ones_like(g, dtype=torch.bool)
    outside[:48, ::3] = False
    outside[48:, 7:40] = False
    outside[60:64, 41::2] = False
    before = g.clone()
    fsdp_ema.update_(ema, model, 0.8)
    for a, b in zip(ema, expected):
        assert_ema_close(a, b)
    assert torch.equal(g[outside], before[outside])


def test_decay_zero_and_one_are_exact_on_the_vector_and_scalar_paths():
    e = randn(CHUNK + 9, torch.float32, 7)
    m = randn(CHUNK + 9, torch.bfloat16, 8)
    # Both aligned (vector path); ema one element off and model aligned (scalar path).
    ema, model = [e[:-1], e[1:].clone()[1:]], [m[:-1], m[1:].clone()[:-1]]
    before = [x.clone() for x in ema]
    fsdp_ema.update_(ema, model, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(ema, before))
    fsdp_ema.update_(ema, model, 0.0)
    assert all(torch.equal(a, b.float()) for a, b in zip(ema, model))


# --- devices and streams ------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensors_on_cuda0_while_cuda1_is_current():
    ema, model = randn(5 * CHUNK + 3, torch.float32, 9), randn(5 * CHUNK + 3, torch.bfloat16, 10)
    expected = reference(ema, model, 0.7)
    with torch.cuda.device(1):
        decay = torch.tensor(0.7, device="cuda:0")
        fsdp_ema.update_([ema], [model], decay)
        torch.cuda.synchronize(0)
    assert_ema_close(ema, expected)
    assert ema.device == torch.device("cuda:0")


def test_runs_on_the_current_side_stream():
    """The model is rewritten on a side stream behind a long sleep; an update issued on that same
    stream must see the new values (a launch on any other stream would read the old ones)."""
    ema, model = randn(4 * CHUNK + 5, torch.float32, 11), randn(4 * CHUNK + 5, torch.float32, 12)
    new_model = randn(4 * CHUNK + 5, torch.float32, 13)
    expected = reference(ema, new_model, 0.5)
    decay = torch.tensor(0.9, device="cuda")
    with side_stream_behind_a_sleep():  # ~0.1 s of GPU time before the writes
        model.copy_(new_model)
        decay.fill_(0.5)
        fsdp_ema.update_([ema], [model], decay)
    assert_ema_close(ema, expected)


@pytest.mark.parametrize("count,launches", [(800, 2), (1600, 3)])
def test_kernel_launches_per_call(count, launches):
    """One table-fill launch per ~800 pairs plus the update itself (docs/OPERATORS.md, update_)."""
    ema = [randn(100 + i % 50, torch.float32, i) for i in range(count)]
    model = [randn(100 + i % 50, torch.bfloat16, 9000 + i) for i in range(count)]
    decay = torch.tensor(0.9, device="cuda")
    fsdp_ema.update_(ema, model, decay)  # warm-up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fsdp_ema.update_(ema, model, decay)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    assert len(kernels) == launches, kernels
    assert sum("update_kernel" in k for k in kernels) == 1, kernels


# --- CUDA graphs and torch.compile ---------------------------------------------------------------

def test_graph_replays_read_the_current_device_decay():
    """Captured once, replayed with a new device decay before each replay: mixed dtypes,
    misaligned views and 900 pairs (two table-fill launches) in the one captured call."""
    sizes = [1 + (i * 37) % 3000 for i in range(900)] + [3 * CHUNK + 5]
    ema = [randn(n + 1, FLOATS[i % 4], i)[1:] for i, n in enumerate(sizes)]
    model = [randn(n, FLOATS[(i + 1) % 4], 5000 + i) for i, n in enumerate(sizes)]
    decay = torch.tensor(0.5, dtype=torch.float64, device="cuda")
    ref = [e.clone() for e in ema]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, on copies
        fsdp_ema.update_([e.clone() for e in ema], model, decay)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fsdp_ema.update_(ema, model, decay)
    for d in (0.25, 0.9, 0.999):
        decay.fill_(d)
        graph.replay()
        ref = [reference(r, m, d) for r, m in zip(ref, model)]
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(ema, ref)):
        # Three steps, each within one rounding of the EMA dtype.
        eps = torch.finfo(a.dtype).eps
        torch.testing.assert_close(a, b, rtol=3 * eps, atol=3 * eps, msg=f"pair {i}")


class _EmaModule(torch.nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(randn(n, torch.bfloat16, 100 + i)) for i, n in enumerate(sizes)])
        for i, w in enumerate(self.weights):
            self.register_buffer(f"ema{i}", w.detach().float() + 1.0)
        self.register_buffer("decay", torch.tensor(0.5, device="cuda"))

    def forward(self, x):
        emas = [getattr(self, f"ema{i}") for i in range(len(self.weights))]
        torch.ops.fsdp_ema.update_(emas, [w.detach() for w in self.weights], self.decay)
        return x * 2


def test_torch_compile_reduce_overhead_replays_with_a_changing_decay():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    module = _EmaModule([CHUNK + 3, 1000, 7])
    ref = [getattr(module, f"ema{i}").clone() for i in range(3)]
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    x = torch.ones(4, device="cuda")
    for step, d in enumerate((0.5, 0.9, 0.1, 0.99, 0.75)):
        module.decay.fill_(d)
        out = compiled(x)
        torch.testing.assert_close(out, x * 2)
        ref = [reference(r, w.detach(), d) for r, w in zip(ref, module.weights)]
        for i, r in enumerate(ref):
            torch.testing.assert_close(getattr(module, f"ema{i}"), r, rtol=1e-6, atol=1e-6,
                                       msg=f"step {step}, ema{i}")
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["inductor"].get("cudagraph_skips"), \
        f"cudagraphs skipped: {dict(counters['inductor'])}"
