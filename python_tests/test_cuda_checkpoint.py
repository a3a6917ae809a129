"""Checkpoints of CUDA tensors: save_shard stages device memory through pinned buffers, loads with
device=cuda put the tensors back on the GPU; every byte must survive (NaN payloads and -0.0
included), checked against the original tensors and against safetensors' own reader. Skips
without a CUDA device.
"""

import pytest
import torch
from cuda_utils import side_stream_behind_a_sleep

import fsdp_ema.checkpoint as ckpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def bits(t):
    return t.reshape(-1).contiguous().view(torch.uint8) if t.numel() else t


def assert_bit_exact(a, b, name):
    assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a.cpu()), bits(b.cpu())), f"{name}: bytes differ"


def device_tensors():
    g = torch.Generator(device="cuda").manual_seed(0)
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-40, 3.0],
                           device="cuda")
    words = [0x7FC01234, 0xFF800001, 0x80000000]  # a quiet NaN with payload, a signaling NaN, -0
    nan_payload = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                               dtype=torch.int32, device="cuda").view(torch.float32)
    base = torch.randn(1 << 21, generator=g, device="cuda").to(torch.bfloat16)
    grid = torch.randn(64, 96, generator=g, device="cuda")
    return {
        "big.bf16": torch.randn(3, 1 << 21, generator=g, device="cuda").to(torch.bfloat16),
        "fp32": torch.randn(1000, 17, generator=g, device="cuda"),
        "fp16.special": special.to(torch.float16),
        "fp32.nan_payload": nan_payload,
        "fp64": torch.randn(33, generator=g, device="cuda", dtype=torch.float64),
        "odd_offset.bf16": base[1:(1 << 20) + 2],           # starts 2 bytes into its storage
        "transposed": grid.t(),                             # not contiguous
        "empty": torch.empty(0, 5, device="cuda"),
        "scalar": torch.tensor(2.5, device="cuda"),
    }


def test_save_from_cuda_and_load_to_cuda_bit_exact(tmp_path):
    tensors = device_tensors()
    ckpt.save(tmp_path, tensors)
    loaded = ckpt.load(tmp_path, device="cuda")
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].is_cuda, name
        assert_bit_exact(loaded[name], t, name)
    shard = ckpt.load_shard(tmp_path / ckpt.shard_file_name(0, 1), device=torch.device("cuda"))
    for name, t in tensors.items():
        assert shard[name][0].is_cuda, name
        assert_bit_exact(shard[name][0], t, name)
    # An independent reader of the same file.
    from safetensors.torch import load_file

    independent = load_file(str(tmp_path / ckpt.shard_file_name(0, 1)))
    for name, t in tensors.items():
        assert_bit_exact(independent[name], t, name)


def test_rows_of_a_cuda_checkpoint_load_to_cuda(tmp_path):
    tensors = device_tensors()
    ckpt.save(tmp_path, tensors)
    names = ["big.bf16", "fp32", "odd_offset.bf16"]
    for rank in range(3):
        part = ckpt.load(tmp_path, names, rank=rank, world_size=3, device="cuda")
        for name in names:
            expected = torch.chunk(tensors[name], 3)[rank]
            assert part[name].is_cuda
            assert_bit_exact(part[name], expected, f"{name} rank {rank}")


def test_save_reads_what_the_current_side_stream_wrote(tmp_path):
    """Values written on a side stream behind a long sleep must be what save_shard stages when it
    is called on that stream (its device-to-host copies run on the current stream)."""
    t = torch.zeros(1 << 22, device="cuda")
    with side_stream_behind_a_sleep():
        t.fill_(1.75)
        ckpt.save(tmp_path, {"t": t})
    loaded = ckpt.load(tmp_path, device="cuda")["t"]
    assert torch.equal(loaded, torch.full_like(t, 1.75))


# Loads to CUDA go through two pinned staging buffers of 64 MiB (format/read/read_exec.cpp): the
# device copies one while the file is read into the other. These cases cycle the buffers several
# times.
def staged_tensors():
    g = torch.Generator().manual_seed(1)
    tensors = {"big": torch.randn(150 * 256 + 5, 1024, generator=g)}  # 150 MiB: three steps
    for i in range(40):  # small ones between large ones: several share one step
        tensors[f"small.{i:02d}"] = torch.randn(i + 1, 3, generator=g).to(torch.bfloat16)
    tensors["wide"] = torch.randn(2, 5 << 22, generator=g)  # a row of 80 MiB: a wider buffer
    tensors["scalar"] = torch.tensor(-0.0, dtype=torch.float64)
    return tensors


def test_staged_loads_to_cuda_cycle_the_buffers_bit_exact(tmp_path):
    tensors = staged_tensors()
    ckpt.save(tmp_path, tensors)
    for rank, world in [(0, 1), (1, 3)]:
        names = sorted(tensors)
        loaded = ckpt.load(tmp_path, names, rank=rank, world_size=world, device="cuda")
        dst = {n: torch.full_like(loaded[n], 7.0) for n in names}
        ckpt.load_into(tmp_path, dst, rank=rank, world_size=world)
        for n in names:
            t = tensors[n]
            cs = -(-t.shape[0] // world) if t.dim() else 0  # torch.chunk's rows, empty past the end
            expected = t if t.dim() == 0 else t[rank * cs:(rank + 1) * cs]
            assert loaded[n].is_cuda and dst[n].is_cuda, n
            assert_bit_exact(loaded[n], expected, f"{n} load rank {rank}/{world}")
            assert_bit_exact(dst[n], expected, f"{n} load_into rank {rank}/{world}")


def test_staged_load_into_follows_the_current_stream(tmp_path):
    """Work queued on the current stream before load_into (a fill behind a long sleep) runs
    before the staged copies; the loaded values are what the caller sees afterwards."""
    t = torch.randn(1 << 24)
    ckpt.save(tmp_path, {"t": t})
    dst = torch.zeros(1 << 24, device="cuda")
    with side_stream_behind_a_sleep():
        dst.fill_(3.0)
        ckpt.load_into(tmp_path, {"t": dst})
        dst.add_(1.0)
    assert torch.equal(dst.cpu(), t + 1.0)


def test_staged_load_into_refuses_a_corrupt_file_with_cuda_destinations_untouched(tmp_path):
    from test_load_in_place import flip_data_byte

    tensors = staged_tensors()
    ckpt.save(tmp_path, tensors)
    flip_data_byte(tmp_path / ckpt.shard_file_name(0, 1), "wide")
    dst = {n: torch.full_like(t, 5.0, device="cuda") for n, t in tensors.items()}
    with pytest.raises(RuntimeError, match="wide"):
        ckpt.load_into(tmp_path, dst)
    for n, t in dst.items():
        assert torch.equal(t.cpu(), torch.full_like(tensors[n], 5.0)), n
    with pytest.raises(RuntimeError, match="wide"):
        ckpt.load(tmp_path, device="cuda")
    with pytest.raises(RuntimeError, match="wide"):
        ckpt.load_shard(tmp_path / ckpt.shard_file_name(0, 1), device="cuda")
