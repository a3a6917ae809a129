"""A program that reaches the operators through ``torch.ops.load_library`` alone.

Run by test_library_only.py in a fresh interpreter (never importing the fsdp_ema package, whose
import would register Python-side marks): ``python library_only_program.py LIB CHECK WORKDIR``.
Each check raises on failure and prints ``ok <check>`` on success.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def compiled_save_commit_load(work: Path) -> None:
    """EMA update, save, commit, load and a value from the loaded tensors: one fullgraph graph."""
    from torch._dynamo.utils import counters

    directory = str(work / "ckpt")
    Path(directory).mkdir()
    gen = torch.Generator().manual_seed(0)
    model = [torch.randn(6, 3, generator=gen), torch.randn(5, generator=gen).to(torch.bfloat16)]
    start = [torch.randn(6, 3, generator=gen), torch.randn(5, generator=gen)]
    ema = [t.clone() for t in start]

    def step(decay):
        torch.ops.fsdp_ema.update_(ema, model, decay)
        nbytes = torch.ops.fsdp_ema.save_shard(directory, 0, 1, ["w", "b"], ema, [0, 0, 0],
                                               [6, 3, 5], overwrite=True)
        count = torch.ops.fsdp_ema.commit_checkpoint(directory, 1, [nbytes], overwrite=True)
        w, b = torch.ops.fsdp_ema.load_tensors(directory, ["w", "b"], [count])
        return w.sum(dim=0) + b.sum() + count, nbytes

    # The load's dtypes and shapes are read from the checkpoint when the graph is traced, so one
    # must exist: an eager step writes it (and is the reference for the first compiled step).
    step(torch.tensor(1.0))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    expect = [t.clone() for t in start]
    for decay in (0.9, 0.5, 0.99):  # a changing decay tensor must not recompile
        for e, m in zip(expect, model):
            e.copy_(torch.lerp(e, m.float(), 1 - decay))
        value, nbytes = compiled(torch.tensor(decay))
        want = expect[0].sum(dim=0) + expect[1].sum() + 2
        assert torch.allclose(value, want, rtol=1e-6, atol=1e-6), (decay, value, want)
        for e, t in zip(expect, ema):
            assert torch.allclose(t, e, rtol=1e-6, atol=1e-6), decay
        # What the compiled step committed is on disk: read it back eagerly.
        w, b = torch.ops.fsdp_ema.load_tensors(directory, ["w", "b"])
        assert torch.equal(w, ema[0]) and torch.equal(b, ema[1]), decay
        (file,) = Path(directory).glob("*.safetensors")  # an overwrite's commit removes the old
        assert nbytes.dtype == torch.int64 and int(nbytes) == file.stat().st_size
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def torchscript_keeps_unused_save(work: Path) -> None:
    """TorchScript's dead-code elimination keeps a save whose result is unused (C++ mark)."""
    directory = work / "scripted"
    directory.mkdir()

    @torch.jit.script
    def save(d: str, t: torch.Tensor):
        torch.ops.fsdp_ema.save_shard(d, 0, 1, ["t"], [t * 2], [0], [3])

    assert "fsdp_ema::save_shard" in str(save.graph)
    save(str(directory), torch.ones(3))
    torch.ops.fsdp_ema.commit_checkpoint(str(directory), 1)
    (t,) = torch.ops.fsdp_ema.load_tensors(str(directory), ["t"])
    assert torch.equal(t, torch.full((3,), 2.0))


def trace_reads_no_tensor_data(work: Path) -> None:
    """Under FakeTensorMode the loads read headers and the index only: a corrupted data byte
    (caught by the checksum on a real load) does not stop tracing, and the shapes are right."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    directory = work / "ckpt"
    directory.mkdir()
    w = torch.arange(12.0).reshape(6, 2)
    nbytes = torch.ops.fsdp_ema.save_shard(str(directory), 0, 1, ["w"], [w], [0, 0], [6, 2])
    torch.ops.fsdp_ema.commit_checkpoint(str(directory), 1)
    shard = directory / "shard-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40  # the last byte of w's data
    shard.write_bytes(bytes(data))
    try:
        torch.ops.fsdp_ema.load_tensors(str(directory), ["w"])
    except RuntimeError as e:
        assert "checksum" in str(e), e
    else:
        raise AssertionError("the corrupted byte was not caught by a real load")
    with FakeTensorMode() as mode:
        nbytes = mode.from_tensor(nbytes)
        (rows,) = torch.ops.fsdp_ema.load_tensors(str(directory), ["w"], 1, 4)
        names, shards, offsets, global_shapes = torch.ops.fsdp_ema.load_shard(str(shard))
        count = torch.ops.fsdp_ema.commit_checkpoint(str(directory), 1, [nbytes], overwrite=True)
    assert rows.shape == (2, 2) and rows.dtype == torch.float32 and rows.device.type == "cpu"
    assert names == ["w"] and shards[0].shape == (6, 2) and offsets == [0, 0]
    assert global_shapes == [6, 2] and count.shape == () and count.dtype == torch.int64
    # Real meta tensors: the shapes, no data; a save of meta tensors has nothing to write.
    (meta,) = torch.ops.fsdp_ema.load_tensors(str(directory), ["w"], device="meta")
    assert meta.is_meta and meta.shape == (6, 2)
    try:
        torch.ops.fsdp_ema.save_shard(str(work), 0, 1, ["m"], [meta], [0, 0], [6, 2])
    except RuntimeError as e:
        assert "shards[0] ('m') is a meta tensor, which has no data to save" in str(e), e
    else:
        raise AssertionError("a save of meta tensors was accepted")


def opcheck_every_op(work: Path) -> None:
    """torch.library.opcheck (schema, autograd registration, fake tensor, AOT dispatch)."""
    import torch.distributed as dist
    from torch.library import opcheck

    ops = torch.ops.fsdp_ema
    gen = torch.Generator().manual_seed(1)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    for overload, decay in ((ops.update_.default, 0.9), (ops.update_.Tensor, torch.tensor(0.9)),
                            (ops.ema_shard_update_.default, 0.5),
                            (ops.ema_shard_update_.Tensor, torch.tensor(0.5))):
        opcheck(overload, ([r(4, 3), r(7, dtype=torch.bfloat16)], [r(4, 3), r(7)], decay))

    dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD.group_name
        opcheck(ops.gather_shards.default, ([r(5, 2), r(3, dtype=torch.float64)], [5, 3], group))
    finally:
        dist.destroy_process_group()

    directory = work / "opcheck"
    directory.mkdir()
    d = str(directory)
    shards = [r(4, 3), r(2, dtype=torch.bfloat16)]
    save_args = (d, 0, 1, ["w", "b"], shards, [0, 0, 0], [4, 3, 2])
    opcheck(ops.save_shard.default, save_args, {"overwrite": True})
    nbytes = ops.save_shard(*save_args, overwrite=True)
    opcheck(ops.commit_checkpoint.after, (d, 1, [nbytes]), {"overwrite": True})
    for rank, world in ((0, 1), (1, 3)):
        opcheck(ops.load_tensors.default, (d, ["w", "b"], rank, world))
        opcheck(ops.load_tensors.after, (d, ["w", "b"], [nbytes], rank, world))
        opcheck(ops._load_tensors.default,
                (torch.empty(0), [nbytes], d, ["w", "b"], rank, world, True, False))
        rows = torch.chunk(torch.empty(4, 3), world)[rank].shape
        out = [torch.empty(rows), torch.empty(torch.chunk(torch.empty(2), world)[rank].shape,
                                              dtype=torch.bfloat16)]
        opcheck(ops.load_into_.default, (d, ["w", "b"], out, rank, world))
    shard = str(directory / "shard-00000-of-00001.safetensors")
    # load_shard's names and offsets are strings and ints: the fake-tensor and schema checks
    # apply, while AOT dispatch cannot return them from a graph.
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    opcheck(ops.load_shard.default, (shard,), test_utils=checks)
    opcheck(ops._load_shard.default, (torch.empty(0), shard, True, False), test_utils=checks)


def opcheck_cuda(work: Path) -> None:
    """The CUDA kernels under opcheck: results on the tensors' (or the requested) device."""
    from torch.library import opcheck

    ops = torch.ops.fsdp_ema
    gen = torch.Generator().manual_seed(2)
    ema = [torch.randn(4, 3, generator=gen).cuda(), torch.randn(7, generator=gen).cuda()]
    model = [torch.randn(4, 3, generator=gen).cuda().bfloat16(),
             torch.randn(7, generator=gen).cuda()]
    opcheck(ops.update_.Tensor, (ema, model, torch.tensor(0.9, device="cuda")))
    opcheck(ops.update_.default, (ema, model, 0.5))
    d = str(work)
    save_args = (d, 0, 1, ["w", "b"], ema, [0, 0, 0], [4, 3, 7])
    opcheck(ops.save_shard.default, save_args, {"overwrite": True})
    nbytes = ops.save_shard(*save_args, overwrite=True)
    assert nbytes.is_cuda
    opcheck(ops.commit_checkpoint.after, (d, 1, [nbytes]), {"overwrite": True})
    assert ops.commit_checkpoint(d, 1, [nbytes], overwrite=True).is_cuda
    cuda = torch.device("cuda")
    opcheck(ops.load_tensors.default, (d, ["w", "b"], 1, 3), {"device": cuda})
    opcheck(ops.load_tensors.after, (d, ["w", "b"], [nbytes], 0, 1), {"device": cuda})
    (w,) = ops.load_tensors(d, ["w"], device=cuda)
    assert w.is_cuda and torch.equal(w, ema[0])
    into = [torch.empty(4, 3, device=cuda), torch.empty(7, device=cuda)]
    opcheck(ops.load_into_.default, (d, ["w", "b"], into))
    assert torch.equal(into[0], ema[0]) and torch.equal(into[1], ema[1])
    shard = str(next(work.glob("*.safetensors")))
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    opcheck(ops.load_shard.default, (shard,), {"device": cuda}, test_utils=checks)


CHECKS = {f.__name__: f for f in (compiled_save_commit_load, torchscript_keeps_unused_save,
                                  trace_reads_no_tensor_data, opcheck_every_op, opcheck_cuda)}


def main() -> None:
    library, check, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.ops.load_library(library)
    torch.set_num_threads(1)
    CHECKS[check](work)
    assert not any(name == "fsdp_ema" or name.startswith("fsdp_ema.") for name in sys.modules)
    print(f"ok {check}")


if __name__ == "__main__":
    main()
