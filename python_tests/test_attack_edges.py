"""Edges found by an attack (issue #11, items 2-6): each is a clear error naming what is wrong,
with nothing lost or half-changed.

- keep_last rotation never follows a link out of the root, and a failed rotation is a warning
  after the commit, never the save's error.
- load_training_state / ShardedEMA.load check everything on every rank and agree before the first
  write: a bad RNG state, a bad ``extra``, an integer tensor where a float one is expected leave
  model, optimizer, EMA and RNG as they were, and every rank raises (no rank left waiting).
- ``fsdp-ema export --overwrite`` that fails halfway leaves the earlier export byte for byte.
- ``fsdp_ema.checkpoint.save(..., overwrite=True)`` overwrites, and the old checkpoint loads until
  the new index lands.
- ``fsdp-ema inspect`` / ``verify`` / ``export`` escape control characters in names.
"""

from __future__ import annotations

import base64
import os
import subprocess
from pathlib import Path

import pytest
import torch
from dist_utils import PoolManager
from torch import nn

import fsdp_ema
from fsdp_ema import ShardedEMA
from fsdp_ema import checkpoint as ckpt
from fsdp_ema import training_state as ts

CLI = Path(__file__).resolve().parents[1] / "build" / "bin" / "fsdp-ema"
needs_cli = pytest.mark.skipif(not CLI.exists(), reason="fsdp-ema tool not built")


@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


def plain(seed):
    """A small model and an AdamW that has taken a step (so its state exists)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt, ShardedEMA(model, 0.9)


def snapshot(model, opt, ema):
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, entries in opt.state_dict()["state"].items():
        out.update({f"optim.{pid}.{k}": torch.as_tensor(v).clone() for k, v in entries.items()})
    out["lr"] = torch.tensor([g["lr"] for g in opt.param_groups])
    out.update({f"ema.{k}": v.detach().clone() for k, v in ema.state_dict().items()})
    out["rng"] = torch.get_rng_state()
    return out


def same(a, b):
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def save_tampered(directory, model, opt, ema, *, rng=None, extra=None):
    """save_training_state with this rank's RNG state or the encoded ``extra`` replaced (the
    checkpoint is otherwise valid, checksums included)."""
    real_rng, real_encode = ts._rng_state, ts._encode
    if rng is not None:
        ts._rng_state = lambda: {**real_rng(), **rng}
    if extra is not None:
        ts._encode = lambda v, where="extra": extra if where == "extra" else real_encode(v, where)
    try:
        fsdp_ema.save_training_state(directory, model=model, optimizer=opt, ema=ema,
                                     extra={"step": 1})
    finally:
        ts._rng_state, ts._encode = real_rng, real_encode


# --- item 3: loads check and agree before the first write -----------------------------------------

def run_load_tampered(rank, world, directory, what):
    model, opt, ema = plain(0)
    short_cpu_state = base64.b64encode(torch.get_rng_state().numpy().tobytes()[:100]).decode()
    if what == "rng":  # rank 1's RNG state only: rank 0 alone would load fine
        save_tampered(directory, model, opt, ema,
                      rng={"torch_cpu": short_cpu_state} if rank == 1 else {})
    else:
        save_tampered(directory, model, opt, ema, extra={"x": {"__float__": "bogus"}})
    model2, opt2, ema2 = plain(1)
    before = snapshot(model2, opt2, ema2)
    try:
        fsdp_ema.load_training_state(directory, model=model2, optimizer=opt2, ema=ema2)
        message = None
    except Exception as e:  # noqa: BLE001
        message = f"{type(e).__name__}: {e}"
    return {"message": message, "unchanged": same(before, snapshot(model2, opt2, ema2))}


@pytest.mark.parametrize("what", ["rng", "extra"])
def test_bad_rng_or_extra_on_load_raises_on_every_rank_and_writes_nothing(pools, tmp_path, what):
    results = pools.get(2).run(run_load_tampered, str(tmp_path / "ckpt"), what, timeout=120)
    failed = "[1]" if what == "rng" else "[0, 1]"
    for rank, res in enumerate(results):
        assert res["message"] is not None, f"rank {rank} loaded without an error"
        assert f"failed on rank(s) {failed}" in res["message"], res["message"]
        assert res["unchanged"], f"rank {rank}: model, optimizer, EMA or RNG changed"
    if what == "rng":
        assert "rng.1.torch_cpu: 100 bytes" in results[1]["message"]
    else:
        assert "extra['x']: __float__ 'bogus'" in results[0]["message"]


def run_ema_load_one_rank_missing(rank, world, directory):
    model, _, ema = plain(0)
    ema.save(directory)
    model2, _, ema2 = plain(1)
    before = {k: v.clone() for k, v in ema2.state_dict().items()}
    try:
        # Rank 1 alone is given a directory that does not exist: its info() fails.
        ema2.load(directory if rank == 0 else directory + "-missing")
        message = None
    except Exception as e:  # noqa: BLE001
        message = str(e)
    after = ema2.state_dict()
    return {"message": message, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def test_sharded_ema_load_agrees_before_writing_and_no_rank_hangs(pools, tmp_path):
    results = pools.get(2).run(run_ema_load_one_rank_missing, str(tmp_path / "ema"), timeout=120)
    for rank, res in enumerate(results):
        assert res["message"] is not None and "failed on rank(s) [1]" in res["message"], res
        assert res["unchanged"], f"rank {rank}'s EMA changed"
    assert "ema-missing" in results[1]["message"]


def test_integer_optimizer_state_into_a_float_one_is_refused(tmp_path):
    model, opt, ema = plain(0)
    for state in opt.state.values():
        state["step"] = torch.tensor(7)  # int64 where AdamW keeps a float32 step
    fsdp_ema.save_training_state(tmp_path / "c", model=model, optimizer=opt, ema=ema)
    model2, opt2, ema2 = plain(1)
    before = snapshot(model2, opt2, ema2)
    with pytest.raises(TypeError, match=r"optim\.state\.0\.weight\.step' is torch\.int64 in the "
                                        r"checkpoint but torch\.float32 here"):
        fsdp_ema.load_training_state(tmp_path / "c", model=model2, optimizer=opt2, ema=ema2)
    assert same(before, snapshot(model2, opt2, ema2))


def test_ema_load_refuses_an_integer_tensor(tmp_path):
    model, _, ema = plain(0)
    sd = {k: v for k, v in ema.state_dict().items() if k != ShardedEMA.STEP_KEY}
    sd["0.bias"] = torch.arange(3)  # int64
    ckpt.save(tmp_path / "c", sd)
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    with pytest.raises(TypeError, match=r"'0\.bias' is torch\.int64 in the checkpoint but "
                                        r"torch\.float32 here"):
        ema.load(tmp_path / "c")
    assert all(torch.equal(before[k], v) for k, v in ema.state_dict().items())


@pytest.mark.parametrize("bad, error", [
    ({"b": {"__bytes__": "@@@@"}}, r"extra\['b'\]: invalid base64"),
    ({"t": {"__tensor__": {"dtype": "float32", "shape": [2], "data": "AAAA"}}},
     r"extra\['t'\]: a float32 tensor of shape \[2\] needs 8 bytes, the data has 3"),
    ({"t": {"__tensor__": {"dtype": "nn", "shape": [], "data": ""}}},
     r"extra\['t'\]: unknown tensor dtype 'nn'"),
    ({"d": {"__dict__": [[1]]}}, r"extra\['d'\]: __dict__ must hold \[key, value\] pairs"),
])
def test_malformed_extra_is_an_error_not_silently_empty(tmp_path, bad, error):
    model, opt, ema = plain(0)
    save_tampered(tmp_path / "c", model, opt, ema, extra=bad)
    model2, opt2, ema2 = plain(1)
    before = snapshot(model2, opt2, ema2)
    with pytest.raises(ValueError, match=error):
        fsdp_ema.load_training_state(tmp_path / "c", model=model2, optimizer=opt2, ema=ema2)
    assert same(before, snapshot(model2, opt2, ema2))


def test_rng_state_of_another_python_is_refused_before_any_write(tmp_path):
    model, opt, ema = plain(0)
    save_tampered(tmp_path / "c", model, opt, ema, rng={"python": {"__tuple__": [3, [1, 2], None]}})
    model2, opt2, ema2 = plain(1)
    before = snapshot(model2, opt2, ema2)
    with pytest.raises(ValueError, match=r"rng\.0\.python: refused by random\.setstate"):
        fsdp_ema.load_training_state(tmp_path / "c", model=model2, optimizer=opt2, ema=ema2)
    assert same(before, snapshot(model2, opt2, ema2))


# --- item 2: rotation stays inside the root, and never fails a committed save ---------------------

def save_step(directory, keep_last=None):
    model, _, _ = plain(0)
    fsdp_ema.save_training_state(directory, model=model, rng=False, keep_last=keep_last)


def test_rotation_neither_follows_nor_removes_a_link(tmp_path):
    root, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    save_step(elsewhere / "precious")
    root.mkdir()
    # Sorts first among the root's entries, so it would be the first "old" checkpoint removed.
    (root / "a-link").symlink_to(elsewhere / "precious", target_is_directory=True)
    save_step(root / "step-1")
    save_step(root / "step-2")
    save_step(root / "step-3", keep_last=1)  # no error
    assert sorted(p.name for p in root.iterdir()) == ["a-link", "step-3"]
    assert (elsewhere / "precious" / ts.INDEX_NAME).is_file()
    assert fsdp_ema.checkpoint.info(elsewhere / "precious")["tensors"]


def test_rotation_failure_warns_and_the_save_stays_committed(tmp_path, monkeypatch):
    save_step(tmp_path / "step-1")

    def refuse(*args, **kwargs):
        raise PermissionError("injected: cannot remove")

    monkeypatch.setattr(torch.ops.fsdp_ema, "remove_checkpoint", refuse)
    with pytest.warns(RuntimeWarning, match="committed, but removing older checkpoints failed: "
                                            "injected: cannot remove"):
        save_step(tmp_path / "step-2", keep_last=1)
    assert fsdp_ema.latest_checkpoint(tmp_path) == tmp_path / "step-2"


# --- item 5: overwrite works, atomically ---------------------------------------------------------

def test_checkpoint_save_overwrites_and_the_old_one_loads_until_the_commit(tmp_path):
    d = tmp_path / "c"
    ckpt.save(d, {"w": torch.zeros(4), "old_only": torch.ones(2)})
    with pytest.raises(RuntimeError, match="already committed"):
        ckpt.save(d, {"w": torch.ones(4)})
    # The new file is written, the commit has not happened yet: the old checkpoint, whole.
    ckpt.save_shard(d, {"w": torch.full((4,), 2.0)}, overwrite=True)
    old = ckpt.load(d)
    assert sorted(old) == ["old_only", "w"] and torch.equal(old["w"], torch.zeros(4))
    ckpt.commit(d, 1, overwrite=True)
    assert list(ckpt.load(d)) == ["w"] and torch.equal(ckpt.load(d)["w"], torch.full((4,), 2.0))
    # And in one call, any number of times; only the committed files stay.
    for value in (3.0, 4.0, 5.0):
        ckpt.save(d, {"w": torch.full((4,), value)}, overwrite=True)
        assert torch.equal(ckpt.load(d)["w"], torch.full((4,), value))
        assert len([n for n in os.listdir(d) if n.endswith(".safetensors")]) == 1
    if CLI.exists():
        res = subprocess.run([str(CLI), "verify", str(d)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr


def test_training_state_overwrite_keeps_the_old_one_until_the_commit(tmp_path, monkeypatch):
    model, opt, ema = plain(0)
    fsdp_ema.save_training_state(tmp_path / "c", model=model, extra={"v": 1})
    # A save that dies after writing its shard file, before the commit.
    monkeypatch.setattr(ts._ckpt, "commit", lambda *a, **k: (_ for _ in ()).throw(
        OSError("injected: killed before the commit")))
    with pytest.raises(OSError, match="injected"):
        fsdp_ema.save_training_state(tmp_path / "c", model=model, extra={"v": 2}, overwrite=True)
    monkeypatch.undo()
    model2, _, _ = plain(1)
    assert fsdp_ema.load_training_state(tmp_path / "c", model=model2) == {"v": 1}
    fsdp_ema.save_training_state(tmp_path / "c", model=model, extra={"v": 3}, overwrite=True)
    assert fsdp_ema.load_training_state(tmp_path / "c", model=model2) == {"v": 3}
    assert len([n for n in os.listdir(tmp_path / "c") if n.endswith(".safetensors")]) == 1


# --- items 4 and 6: the command line -------------------------------------------------------------

def run_cli(*args):
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True)


def flip_last_byte(path):
    data = bytearray(Path(path).read_bytes())
    data[-1] ^= 1
    Path(path).write_bytes(bytes(data))


@needs_cli
def test_cli_export_overwrite_that_fails_halfway_keeps_the_earlier_export(tmp_path):
    # Ten float32 tensors of 64 bytes: with --max-file-size 130, two per file, five files.
    names = [f"t{i}" for i in range(10)]
    ckpt.save(tmp_path / "a", {n: torch.full((16,), float(i)) for i, n in enumerate(names)})
    ckpt.save(tmp_path / "b", {n: torch.full((16,), -float(i)) for i, n in enumerate(names)})
    out = tmp_path / "out"
    assert run_cli("export", tmp_path / "a", out, "--max-file-size", "130", "-q").returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(before) == 6
    # The last bytes of b's file are t9's, which goes to the last export file.
    flip_last_byte(tmp_path / "b" / ckpt.shard_file_name(0, 1))
    res = run_cli("export", tmp_path / "b", out, "--max-file-size", "130", "--overwrite", "-q")
    assert res.returncode == 1 and b"checksum mismatch" in res.stderr, res.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@needs_cli
def test_cli_escapes_control_characters_in_names(tmp_path):
    evil = {"red\x1b[31mtext": torch.zeros(2), "x\nOK: 1 tensors, fake": torch.ones(2),
            "bidi\u202eexe.txt": torch.ones(1)}
    ckpt.save(tmp_path / "c", evil)
    res = run_cli("inspect", tmp_path / "c")
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    assert "\x1b" not in out and "\u202e" not in out
    assert not any(line.startswith("OK:") for line in out.splitlines())
    assert "red\\e[31mtext" in out and "x\\nOK: 1 tensors, fake" in out
    assert "bidi\\u202eexe.txt" in out
    # A failure message quoting a name goes through the same escaping (verify, export).
    flip_last_byte(tmp_path / "c" / ckpt.shard_file_name(0, 1))
    for args in (["verify", tmp_path / "c"], ["export", tmp_path / "c", tmp_path / "out", "-q"]):
        res = run_cli(*args)
        text = (res.stdout + res.stderr).decode()
        assert res.returncode == 1 and "checksum mismatch" in text, text
        assert "\x1b" not in text and "\u202e" not in text
        assert not any(line.startswith("OK:") for line in text.splitlines()), text


def test_sharded_ema_export_that_fails_midway_leaves_the_earlier_export_whole(tmp_path,
                                                                              monkeypatch):
    # The export is staged by format::ExportWriter (the writer `fsdp-ema export` uses, whose
    # switch order format's export tests pin): a failure after some tensors are written leaves
    # the earlier export byte for byte, and no staging directory behind.
    from fsdp_ema.store import full_state as _full_state

    model, _, ema = plain(0)
    out = tmp_path / "out"
    ema.export(out, max_file_bytes=40)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "model.safetensors.index.json" in before and len(before) >= 3
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    real_buckets = _full_state.full_buckets

    def die_after_first_bucket(parts, bucket_bytes):
        buckets = real_buckets(parts, bucket_bytes)
        yield next(buckets)
        raise OSError("injected: killed while exporting")

    monkeypatch.setattr(_full_state, "full_buckets", die_after_first_bucket)
    with pytest.raises(OSError, match="injected"):
        ema.export(out, max_file_bytes=40, overwrite=True)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# --- #28: paths with an embedded NUL -----------------------------------------------------------

def _nul_calls(tmp_path: Path):
    """Every entry that takes a path, each given one with a NUL byte in it."""
    good = tmp_path / "good"
    ckpt.save(good, {"w": torch.ones(3)})
    shard = str(good / ckpt.shard_file_name(0, 1))
    new = str(tmp_path / "new") + "\0dir"
    return {
        "save": lambda: ckpt.save(new, {"w": torch.ones(3)}),
        "save_shard": lambda: ckpt.save_shard(new, {"w": torch.ones(3)}),
        "commit": lambda: ckpt.commit(new, 1),
        "load_shard": lambda: ckpt.load_shard(shard + "\0.bin"),
        "load": lambda: ckpt.load(str(good) + "\0x"),
        "load_into": lambda: ckpt.load_into(str(good) + "\0x", {"w": torch.zeros(3)}),
        "info": lambda: ckpt.info(str(good) + "\0x"),
        "open_checkpoint": lambda: ckpt.open_checkpoint(str(good) + "\0x"),
        "ShardedEMA.save": lambda: ShardedEMA(nn.Linear(2, 2)).save(new),
        "ShardedEMA.export": lambda: ShardedEMA(nn.Linear(2, 2)).export(new),
        "save_training_state": lambda: ts.save_training_state(new, model=nn.Linear(2, 2)),
    }


NUL_CALLS = ["save", "save_shard", "commit", "load_shard", "load", "load_into", "info",
             "open_checkpoint", "ShardedEMA.save", "ShardedEMA.export", "save_training_state"]


@pytest.mark.parametrize("call", NUL_CALLS)
def test_a_nul_byte_in_a_path_is_refused_whole_and_creates_nothing(tmp_path, call):
    """load_shard(path + "\\0.bin") read the file before the NUL, save(".../new\\0dir") created
    ".../new" before refusing, and messages stopped at the NUL. Now the whole path is named
    (the NUL as \\x00) and nothing is created or read."""
    calls = _nul_calls(tmp_path)
    assert sorted(calls) == sorted(NUL_CALLS)
    fn = calls[call]
    with pytest.raises(RuntimeError, match=r"holds a NUL byte at offset \d+") as info:
        fn()
    message = str(info.value)
    assert "\\x00" in message and ("dir'" in message or ".bin'" in message or "x'" in message)
    assert not (tmp_path / "new").exists()


def test_a_save_creates_its_directory_and_a_failed_one_leaves_none(tmp_path):
    """#28: save_shard creates the directory (with its parents) when it writes; a save refused
    for its input removes what it created, so nothing is left behind."""
    ops = torch.ops.fsdp_ema
    target = tmp_path / "a" / "b" / "ckpt"
    with pytest.raises(RuntimeError, match=r"shards\[0\] \('w'\): offset 5"):
        ops.save_shard(str(target), 0, 1, ["w"], [torch.zeros(2)], [5], [2])  # checked first
    assert not (tmp_path / "a").exists()
    with pytest.raises(RuntimeError, match="name is reserved by safetensors"):  # checked after
        ops.save_shard(str(target), 0, 1, ["__metadata__"], [torch.zeros(2)], [0], [2])
    assert not (tmp_path / "a").exists()
    nbytes = ops.save_shard(str(target), 0, 1, ["w"], [torch.zeros(2)], [0], [2])
    assert int(nbytes) == (target / ckpt.shard_file_name(0, 1)).stat().st_size
