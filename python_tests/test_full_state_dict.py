"""ShardedEMA.full_state_dict and ShardedEMA.export under torch.distributed (gloo on the CPU, 2 and
3 ranks): full tensors equal the unsharded EMA for FSDP2, FSDP1 (use_orig_params True and False)
and plain models; rank0_only and cpu_offload; every gather_shards call (and FSDP1 all_to_all) of
a small-bucket run stays within bucket_bytes; exports read back by safetensors and by our reader.

One rank function per (world, kind) does all of it, so that the model is trained once per case.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from dist_utils import PoolManager
from test_sharded_ema import DECAY, REPLAY, _train_with_ema, assemble, local_entries, reference_ema

import fsdp_ema

STEPS = 3
KINDS = ["fsdp2", "fsdp1_orig", "fsdp1_flat", "plain"]
# Gathering inp.weight (7 x 6 float32) takes 552 bytes at 2 ranks and 560 at 3 (inputs, outputs,
# the op's workspace): over the bucket, so it must come alone; the biases share buckets.
BUCKET = 500
ALIGN = 16  # gather_shards' packed piece alignment
CLI = Path(__file__).resolve().parents[1] / "build" / "bin" / "fsdp-ema"


def _chunk_rows(rows, rank, world):
    size = -(-rows // world)
    begin = min(rank * size, rows)
    return begin, min(begin + size, rows)


def _nbytes(t):
    return t.numel() * t.element_size()


def _workspace(shards, rows, world):
    """gather_shards' packed send buffer and receive buffer, as the op sizes them."""
    packed = ALIGN
    for r in range(world):
        pos = 0
        for t, n in zip(shards, rows):
            b, e = _chunk_rows(n, r, world)
            row = t.element_size() * math.prod(t.shape[1:])
            pos = -(-(pos + (e - b) * row) // ALIGN) * ALIGN
        packed = max(packed, pos)
    return packed + world * packed


class _Recorder:
    """Records every gather_shards and all_to_all_single call's bytes, in order."""

    def __init__(self):
        self.events = []

    def __enter__(self):
        import torch.distributed as dist

        self._gather, self._a2a = torch.ops.fsdp_ema.gather_shards, dist.all_to_all_single

        def gather(shards, rows, group_name):
            out = self._gather(shards, rows, group_name)
            world = dist.get_world_size()
            self.events.append(("gather", len(shards), sum(map(_nbytes, shards)),
                                sum(map(_nbytes, out)), _workspace(shards, rows, world)))
            return out

        def a2a(output, input, *args, **kwargs):
            self.events.append(("a2a", _nbytes(input), _nbytes(output)))
            return self._a2a(output, input, *args, **kwargs)

        torch.ops.fsdp_ema.gather_shards, dist.all_to_all_single = gather, a2a
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        torch.ops.fsdp_ema.gather_shards, dist.all_to_all_single = self._gather, self._a2a


def run_full_and_export(rank, world, kind, directory):
    model, ema, states = _train_with_ema(rank, world, kind, torch.float32, {}, steps=STEPS)
    entries = local_entries(ema.state_dict())
    default = ema.full_state_dict()
    on_device = ema.full_state_dict(rank0_only=False, cpu_offload=False)
    with _Recorder() as rec:
        small = ema.full_state_dict(rank0_only=False, bucket_bytes=BUCKET)
    ema_ptrs = {t.untyped_storage().data_ptr() for t in ema.state.tensors}
    shares = lambda sd: sorted(n for n, t in sd.items()  # noqa: E731
                               if t.untyped_storage().data_ptr() in ema_ptrs)
    totals = {
        "one": ema.export(os.path.join(directory, "one")),
        "bf16": ema.export(os.path.join(directory, "bf16"), dtype=torch.bfloat16),
        "many": ema.export(os.path.join(directory, "many"), max_file_bytes=100,
                           bucket_bytes=BUCKET),
    }
    try:
        ema.export(os.path.join(directory, "one"))
        refused = None
    except RuntimeError as e:
        refused = str(e)
    ema.export(os.path.join(directory, "one"), overwrite=True, max_file_bytes=100)
    ema.save(os.path.join(directory, "ckpt"))  # the same EMA, for the CLI's export
    return {"states": states, "entries": entries, "default": default, "on_device": on_device,
            "small": small, "events": rec.events, "shares_default": shares(default),
            "shares_on_device": shares(on_device), "totals": totals, "refused": refused}


@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


def _assert_same(got, expected, what):
    assert list(got) == list(expected), what
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"{what}: {name}"


def _read_safetensors(directory):
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    out, where = {}, {}
    for f in files:
        with safe_open(os.path.join(directory, f), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            for name in handle.keys():
                assert name not in out, name
                out[name], where[name] = handle.get_tensor(name), f
    return files, out, where


def _check_export(directory, expected, several):
    files, tensors, where = _read_safetensors(directory)
    _assert_same({n: tensors[n] for n in expected}, expected, f"safetensors {directory}")
    assert sorted(tensors) == sorted(expected)
    ours = fsdp_ema.checkpoint.load(directory)  # the reader behind the C++ API
    _assert_same({n: ours[n] for n in expected}, expected, f"checkpoint.load {directory}")
    if several:
        assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        with open(os.path.join(directory, "model.safetensors.index.json")) as f:
            index = json.load(f)
        assert index["weight_map"] == where
        assert index["metadata"]["total_size"] == sum(map(_nbytes, expected.values()))
    else:
        assert files == ["model.safetensors"]
        assert not os.path.exists(os.path.join(directory, "model.safetensors.index.json"))
    assert not [f for f in os.listdir(directory) if f.startswith(".")]  # no temporaries left


# World outermost: the pool is respawned when the world size changes, so once per world size.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [2, 3])
def test_full_state_dict_and_export_equal_the_unsharded_ema(pools, tmp_path, world, kind):
    results = pools.get(world).run(run_full_and_export, kind, str(tmp_path))
    full = assemble([r["entries"] for r in results])
    names = list(results[0]["entries"])[:-1]  # state_dict() order, STEP_KEY last
    full = {n: full[n] for n in names}
    replay = reference_ema(results[0]["states"], [DECAY] * STEPS)
    for name, t in full.items():
        torch.testing.assert_close(t, replay[name].to(t.dtype), **REPLAY)

    for rank, res in enumerate(results):
        # rank0_only (the default): rank 0 gets everything on the CPU, the others nothing.
        if rank == 0:
            _assert_same(res["default"], full, "full_state_dict()")
        else:
            assert res["default"] == {}
        assert res["shares_default"] == []  # cpu_offload: never the EMA's own memory
        _assert_same(res["on_device"], full, f"rank {rank}, rank0_only=False")
        _assert_same(res["small"], full, f"rank {rank}, bucket_bytes={BUCKET}")
        # Without offload, only tensors already full here are the EMA's own.
        if kind == "plain":
            assert res["shares_on_device"] == sorted(names)
        else:
            assert all("running" in n or "num_batches" in n for n in res["shares_on_device"])

        # The bucket bound: each gather's inputs, outputs and workspace within BUCKET unless it
        # gathers one tensor; FSDP1's exchange buffers too.
        events = res["events"]
        gathers = [e for e in events if e[0] == "gather"]
        if kind == "plain":
            assert gathers == []
            continue
        assert len(gathers) >= 3, gathers
        assert any(n == 1 and i + o + w > BUCKET for _, n, i, o, w in gathers), gathers
        assert any(n > 1 for _, n, *_ in gathers), gathers
        for pos, event in enumerate(events):
            if event[0] == "gather":
                _, n, i, o, w = event
                assert n == 1 or i + o + w <= BUCKET, (rank, event)
            else:
                after = next(e for e in events[pos:] if e[0] == "gather")
                assert after[1] == 1 or event[1] + event[2] <= BUCKET, (rank, event, after)
        if kind.startswith("fsdp1"):
            assert len([e for e in events if e[0] == "a2a"]) >= len(gathers)

    total = sum(map(_nbytes, full.values()))
    assert all(r["totals"]["one"] == total for r in results)
    _check_export(tmp_path / "one", full, several=True)  # overwritten with max_file_bytes=100
    _check_export(tmp_path / "many", full, several=True)
    bf16 = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in full.items()}
    _check_export(tmp_path / "bf16", bf16, several=False)
    for res in results:
        assert res["refused"] is not None and "failed on rank(s) [0]" in res["refused"]
    assert "pass overwrite=True" in results[0]["refused"]


def _files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir())}


def _cli_export(src, out, *args):
    res = subprocess.run([str(CLI), "export", str(src), str(out), "-q", *map(str, args)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(not CLI.exists(), reason="fsdp-ema not built")
@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1_flat"])
def test_python_export_and_cli_export_of_the_same_ema_are_byte_identical(pools, tmp_path, kind):
    # ShardedEMA.export (gathered from 2 ranks while training runs) and `fsdp-ema export` of the
    # same EMA saved as a checkpoint go through one writer (format::ExportWriter and
    # export_consolidated share the plan, headers, index and cast): the same bytes, file by file.
    pools.get(2).run(run_full_and_export, kind, str(tmp_path))
    ckpt = tmp_path / "ckpt"
    _cli_export(ckpt, tmp_path / "cli_many", "--max-file-size", "100B")
    _cli_export(ckpt, tmp_path / "cli_bf16", "--dtype", "bf16")
    for python, cli in (("many", "cli_many"), ("one", "cli_many"), ("bf16", "cli_bf16")):
        got, want = _files(tmp_path / python), _files(tmp_path / cli)
        assert list(got) == list(want), (python, list(got), list(want))
        assert len(got) > (1 if python != "bf16" else 0)
        for name in want:
            assert got[name] == want[name], f"{python}/{name} differs from {cli}/{name}"


def test_single_process_export_matches_the_cli_byte_for_byte(tmp_path):
    # Mixed dtypes (an int64 buffer, a float16 EMA cast to bfloat16), one file and split.
    if not CLI.exists():
        pytest.skip("fsdp-ema not built")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7),
                                torch.nn.Linear(7, 3))
    ema = fsdp_ema.ShardedEMA(model, 0.5, dtype=torch.float16)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    model(torch.randn(4, 5)).sum().backward()
    ema.update()
    ema.save(tmp_path / "ckpt")
    cases = ((["--dtype", "bf16"], {"dtype": torch.bfloat16}),
             (["--max-file-size", "64B"], {"max_file_bytes": 64}),
             ([], {}))
    for k, (args, kwargs) in enumerate(cases):
        out_py, out_cli = tmp_path / f"py{k}", tmp_path / f"cli{k}"
        ema.export(out_py, **kwargs)
        _cli_export(tmp_path / "ckpt", out_cli, *args)
        assert _files(out_py) == _files(out_cli), args
    assert len(_files(tmp_path / "py1")) > 2  # the split case really split
