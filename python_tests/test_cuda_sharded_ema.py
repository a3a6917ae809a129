"""ShardedEMA on CUDA parameters: FSDP2 on one GPU (world size 1, NCCL) with the SGD step and
ema.update() in one torch.compile'd function, then full_state_dict (gather_shards over NCCL with
the CUDA pack/unpack kernels), export (read back by safetensors) and save/load, all against an
EMA computed independently with torch.lerp. Skips without a CUDA device.
"""

import pytest
import torch
import torch.nn.functional as F
from cuda_utils import nccl_group

from fsdp_ema import ShardedEMA

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

DECAY = 0.9
STEPS = 6
LR = 0.1


def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    model.register_buffer("scale", torch.linspace(0.5, 1.5, 5))
    return model.cuda()


@pytest.fixture(scope="module")
def trained():
    """FSDP2 model, its EMA after STEPS compiled steps, and the torch.lerp reference EMA."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    with nccl_group() as group:
        model = make_model()
        mesh = DeviceMesh.from_group(group, "cuda")
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ema = ShardedEMA(model, DECAY, process_group=group)
        # World size 1: each local shard is the whole parameter.
        reference = {name: t.detach().full_tensor().clone() if hasattr(t, "full_tensor")
                     else t.detach().clone() for name, t in model.state_dict().items()}

        def step(params, grads, ema):
            with torch.no_grad():
                torch._foreach_add_(params, grads, alpha=-LR)
            ema.update()

        torch._dynamo.reset()
        from torch._dynamo.testing import CompileCounterWithBackend

        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(STEPS):
            x = torch.randn(16, 6, generator=g, device="cuda")
            y = torch.randn(16, 5, generator=g, device="cuda")
            model.zero_grad()
            F.mse_loss(model(x) * model.scale, y).backward()
            # The very local tensors ShardedEMA reads (to_local() would hand the compiled step
            # autograd views aliasing them).
            params = [p._local_tensor for p in model.parameters()]
            grads = [p.grad._local_tensor for p in model.parameters()]
            compiled(params, grads, ema)
            for name, t in model.state_dict().items():
                full = t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach()
                reference[name] = torch.lerp(reference[name], full.float(), 1.0 - DECAY)
        torch.cuda.synchronize()
        yield {"model": model, "ema": ema, "reference": reference, "frames": counter.frame_count}


def test_compiled_fsdp2_step_matches_lerp_reference(trained):
    ema, reference = trained["ema"], trained["reference"]
    assert trained["frames"] == 1, "the compiled step recompiled"
    assert int(ema.step) == STEPS
    state = ema.state_dict()
    for name, ref in reference.items():
        value = state[name]
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert value.is_cuda, name
        torch.testing.assert_close(value, ref, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("cpu_offload", [False, True], ids=["on_gpu", "cpu_offload"])
def test_full_state_dict_gathers_cuda_shards(trained, cpu_offload):
    full = trained["ema"].full_state_dict(rank0_only=True, cpu_offload=cpu_offload)
    reference = trained["reference"]
    assert sorted(full) == sorted(reference)
    for name, ref in reference.items():
        assert full[name].device.type == ("cpu" if cpu_offload else "cuda"), name
        torch.testing.assert_close(full[name].cpu(), ref.cpu(), rtol=1e-6, atol=1e-6, msg=name)
    # Small buckets: many gather_shards calls, same values.
    small = trained["ema"].full_state_dict(cpu_offload=cpu_offload, bucket_bytes=256)
    for name in reference:
        assert torch.equal(small[name], full[name]), name


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_export_of_cuda_ema_reads_back_with_safetensors(trained, tmp_path, dtype):
    from safetensors.torch import load_file

    trained["ema"].export(tmp_path / "export", dtype=dtype)
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    full = trained["ema"].full_state_dict(cpu_offload=True)
    assert sorted(exported) == sorted(trained["reference"])
    for name, ref in trained["reference"].items():
        torch.testing.assert_close(exported[name].float(), ref.cpu(),
                                   rtol=1e-2 if dtype else 1e-6, atol=1e-2 if dtype else 1e-6,
                                   msg=name)
        # The cast is torch's own rounding of the gathered value, bit for bit.
        expected = full[name].to(dtype) if dtype is not None else full[name]
        assert torch.equal(exported[name], expected), name


def test_save_and_load_of_cuda_ema(trained, tmp_path):
    ema = trained["ema"]
    ema.save(tmp_path / "ck")
    before = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
              for k, v in ema.state_dict().items() if k != ShardedEMA.STEP_KEY}
    for t in ema.state.tensors:
        t.zero_()
    ema.load(tmp_path / "ck")
    after = ema.state_dict()
    for name, value in before.items():
        got = after[name].full_tensor() if hasattr(after[name], "full_tensor") else after[name]
        assert got.is_cuda and torch.equal(got, value), name
