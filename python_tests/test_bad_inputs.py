"""Bad inputs to every fsdp_ema op (issue 8): a table of (op, argument, bad value) cases.

Each case must raise ``RuntimeError`` whose message names the bad argument, and must change
neither a tensor passed to the op (bit-compared with a snapshot) nor any file under the test's
directory (listing and bytes compared). CUDA cases run only where a CUDA device exists.
docs/RELIABILITY.md records the count.
"""

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_ema import checkpoint as ckpt

ops = torch.ops.fsdp_ema
HAS_CUDA = torch.cuda.is_available()

UPDATE_OPS = {
    "update_": ops.update_.default,
    "update_.Tensor": ops.update_.Tensor,
    "ema_shard_update_": ops.ema_shard_update_.default,
    "ema_shard_update_.Tensor": ops.ema_shard_update_.Tensor,
}


def decay_arg(overload, value):
    return torch.tensor(value, dtype=torch.float64) if overload.endswith(".Tensor") else value


def t(*shape, dtype=torch.float32):
    return torch.arange(int(torch.tensor(shape).prod()) if shape else 1,
                        dtype=torch.float32).reshape(shape).to(dtype)


# Each builder takes the environment (paths) and returns (callable, args, needs_cuda).
# The table: id -> (builder, substring the message must contain).
def update_cases():
    cases = {}
    for name, op in UPDATE_OPS.items():
        d = lambda v, name=name: decay_arg(name, v)  # noqa: E731

        def add(arg, what, ema, model, decay, expect, cuda=False, op=op):
            cases[f"{name}-{arg}-{what}"] = (lambda env, op=op, e=ema, m=model, dv=decay:
                                             (op, [e(), m(), dv()]), expect, cuda)

        add("ema", "dtype", lambda: [t(4, dtype=torch.int32)], lambda: [t(4)], lambda: d(0.9),
            "ema[0] has dtype Int")
        add("model", "dtype", lambda: [t(4)], lambda: [t(4, dtype=torch.int64)], lambda: d(0.9),
            "model[0] has dtype Long")
        add("ema", "dtype-second", lambda: [t(4), t(3, dtype=torch.bool)], lambda: [t(4), t(3)],
            lambda: d(0.9), "ema[1] has dtype Bool")
        add("model", "shape", lambda: [t(4)], lambda: [t(5)], lambda: d(0.9),
            "ema[0] has 4 elements but model[0] has 5")
        add("model", "shape-same-numel", lambda: [t(2, 3)], lambda: [t(3, 2)], lambda: d(0.9),
            "ema[0] has shape [2, 3] but model[0] has shape [3, 2]")
        add("model", "list-length", lambda: [t(4), t(4)], lambda: [t(4)], lambda: d(0.9),
            "ema has 2 tensors but model has 1")
        add("ema", "empty-list", lambda: [], lambda: [], lambda: d(0.9), "ema is empty")

        def shared():  # two EMA tensors on one storage
            base = t(8)
            return [base[:5], base[3:]]
        add("ema", "overlap-ema", shared, lambda: [t(5), t(5)], lambda: d(0.9),
            "ema[1] overlaps ema[0] in memory")

        def ema_model_overlap():
            base = t(8)
            cases_store["em"] = base
            return [base[:4]]
        add("ema", "overlap-model", ema_model_overlap, lambda: [cases_store["em"][2:6]],
            lambda: d(0.9), "ema[0] overlaps model[0] in memory")
        add("ema", "overlap-self", lambda: [t(1).expand(4)], lambda: [t(4)], lambda: d(0.9),
            "ema[0] has internally overlapping memory")
        add("decay", "above-1", lambda: [t(4)], lambda: [t(4)], lambda: d(1.5),
            "decay must be in [0, 1], got 1.5")
        add("decay", "negative", lambda: [t(4)], lambda: [t(4)], lambda: d(-0.1),
            "decay must be in [0, 1], got -0.1")
        add("decay", "nan", lambda: [t(4)], lambda: [t(4)], lambda: d(float("nan")),
            "decay must be in [0, 1], got nan")
        if name.endswith(".Tensor"):
            add("decay", "not-0-dim", lambda: [t(4)], lambda: [t(4)],
                lambda: torch.tensor([0.9]),
                "decay must be a 0-dim tensor, got shape [1]")
            add("decay", "int-dtype", lambda: [t(4)], lambda: [t(4)],
                lambda: torch.tensor(0),
                "decay must be a floating-point tensor, got dtype Long")
            add("decay", "cuda", lambda: [t(4)], lambda: [t(4)],
                lambda: torch.tensor(0.9, device="cuda"), ("decay", "cuda"), cuda=True)
        add("model", "device-meta", lambda: [t(4)], lambda: [t(4).to("meta")],
            lambda: d(0.9), "model[0] is on meta but ema[0] is on cpu")
        add("ema", "device-meta-second", lambda: [t(4).to("meta"), t(4)],
            lambda: [t(4).to("meta"), t(4)], lambda: d(0.9),
            "ema[1] is on cpu but ema[0] is on meta")
        add("model", "device-cuda", lambda: [t(4)], lambda: [t(4).cuda()], lambda: d(0.9),
            ("model[0] is on cuda", "ema[0] is on cpu"), cuda=True)
    return cases


cases_store = {}


def S(env, **kw):
    """save_shard args, with any of them replaced."""
    a = dict(directory=str(env["new"]), rank=0, world_size=1, names=["w"], shards=[t(2, 3)],
             offsets=[0, 0], global_shapes=[2, 3], fsync=False)
    a.update(kw)
    return ops.save_shard, [a["directory"], a["rank"], a["world_size"], a["names"],
                            a["shards"], a["offsets"], a["global_shapes"], a["fsync"]]


def L(env, **kw):
    a = dict(directory=str(env["ck"]), names=["w"], rank=0, world_size=1, verify=True,
             device=None)
    a.update(kw)
    return ops.load_tensors, list(a.values())


def G(env, **kw):
    a = dict(shards=[t(4, 2)], rows=[4], group_name=env["group"])
    a.update(kw)
    return ops.gather_shards, list(a.values())


CASES = dict(update_cases())
CASES.update({
    # save_shard(directory, rank, world_size, names, shards, offsets, global_shapes, fsync)
    "save_shard-rank-negative": (lambda e: S(e, rank=-1), "got rank -1 with world_size 1", False),
    "save_shard-rank-too-large": (lambda e: S(e, rank=1, world_size=1),
                                  "got rank 1 with world_size 1", False),
    "save_shard-world_size-zero": (lambda e: S(e, world_size=0), "world_size must be >= 1, got 0",
                                   False),
    "save_shard-world_size-negative": (lambda e: S(e, rank=0, world_size=-3),
                                       "world_size must be >= 1, got -3", False),
    "save_shard-names-list-length": (lambda e: S(e, names=["w", "v"]),
                                     "names has 2 entries but shards has 1", False),
    "save_shard-shards-empty-list": (lambda e: S(e, shards=[]),
                                     "names has 1 entries but shards has 0", False),
    "save_shard-names-empty-string": (lambda e: S(e, names=[""]), "names[0] is empty", False),
    "save_shard-names-duplicate": (lambda e: S(e, names=["w", "w"], shards=[t(2, 3), t(2, 3)],
                                               offsets=[0] * 4, global_shapes=[2, 3] * 2),
                                   "names[1] 'w' appears twice", False),
    "save_shard-shards-dtype": (lambda e: S(e, shards=[t(2, 3).to(torch.complex64)]),
                                "shards[0] ('w') has dtype ComplexFloat", False),
    "save_shard-shards-device-meta": (lambda e: S(e, shards=[t(2, 3).to("meta")]),
                                      "shards[0] ('w') is a meta tensor", False),
    "save_shard-offsets-list-length": (lambda e: S(e, offsets=[0]), "offsets has 1 entries",
                                       False),
    "save_shard-offsets-out-of-range": (lambda e: S(e, offsets=[1, 0]),
                                        "offset 1 + size 2 exceeds global size 2 in dim 0", False),
    "save_shard-offsets-negative": (lambda e: S(e, offsets=[-1, 0], global_shapes=[4, 3]),
                                    "shards[0] ('w'): offset -1", False),
    "save_shard-global_shapes-list-length": (lambda e: S(e, global_shapes=[2, 3, 1]),
                                             "global_shapes has 3 entries", False),
    "save_shard-global_shapes-too-small": (lambda e: S(e, global_shapes=[1, 3]),
                                           "exceeds global size 1 in dim 0", False),
    # A missing directory is created (and removed again if the save fails: test_attack_edges).
    "save_shard-directory-is-file": (lambda e: S(e, directory=str(e["file"])),
                                     "afile: not a directory", False),
    "save_shard-parent-is-file": (lambda e: S(e, directory=str(e["file"] / "sub")),
                                  "afile/sub: cannot create the directory: Not a directory",
                                  False),
    # commit_checkpoint(directory, world_size, overwrite, fsync)
    "commit-world_size-zero": (lambda e: (ops.commit_checkpoint,
                                          [str(e["part"]), 0, False, False]),
                               "world_size must be >= 1, got 0", False),
    "commit-world_size-missing-rank": (lambda e: (ops.commit_checkpoint,
                                                  [str(e["part"]), 3, False, False]),
                                       "missing shard file shard-00001-of-00003.safetensors",
                                       False),
    "commit-directory-missing": (lambda e: (ops.commit_checkpoint,
                                            [str(e["root"] / "nodir"), 1, False, False]),
                                 "nodir' cannot be opened", False),
    "commit-directory-empty": (lambda e: (ops.commit_checkpoint,
                                          [str(e["empty"]), 1, False, False]),
                               "empty: missing shard file shard-00000-of-00001", False),
    "commit-overwrite-false-committed": (lambda e: (ops.commit_checkpoint,
                                                    [str(e["ck"]), 1, False, False]),
                                         "checkpoint already committed", False),
    # load_shard(path, verify, device)
    "load_shard-path-missing": (lambda e: (ops.load_shard, [str(e["root"] / "nofile"), True,
                                                            None]), "nofile: cannot open", False),
    "load_shard-path-is-directory": (lambda e: (ops.load_shard, [str(e["ck"]), True, None]),
                                     "ck: not a regular file", False),
    "load_shard-path-not-safetensors": (lambda e: (ops.load_shard, [str(e["file"]), True,
                                                                    None]),
                                        ("afile: ", "safetensors"), False),
    "load_shard-device-cuda": (lambda e: (ops.load_shard, [str(e["ck_file"]), True,
                                                           torch.device("cuda:99")]),
                               "cuda", True),  # torch's own message
    # load_tensors(directory, names, rank, world_size, verify, device)
    "load_tensors-directory-missing": (lambda e: L(e, directory=str(e["root"] / "nodir")),
                                       "nodir: not a directory", False),
    "load_tensors-directory-uncommitted": (lambda e: L(e, directory=str(e["part"])),
                                           "part: incomplete checkpoint", False),
    "load_tensors-names-unknown": (lambda e: L(e, names=["w", "nosuchname"]),
                                   'no tensor "nosuchname" in this checkpoint', False),
    "load_tensors-rank-negative": (lambda e: L(e, rank=-1),
                                   "got rank -1 with world_size 1", False),
    "load_tensors-rank-too-large": (lambda e: L(e, rank=2, world_size=2),
                                    "got rank 2 with world_size 2", False),
    "load_tensors-world_size-zero": (lambda e: L(e, world_size=0),
                                     "world_size must be >= 1, got 0", False),
    "load_tensors-device-cuda": (lambda e: L(e, device=torch.device("cuda:99")), "cuda",
                                 True),  # torch's own message
    # checkpoint_info(directory)
    "checkpoint_info-directory-missing": (lambda e: (ops.checkpoint_info,
                                                     [str(e["root"] / "nodir")]),
                                          "nodir: not a directory", False),
    "checkpoint_info-directory-uncommitted": (lambda e: (ops.checkpoint_info, [str(e["part"])]),
                                              "part: incomplete checkpoint", False),
    "checkpoint_info-directory-is-file": (lambda e: (ops.checkpoint_info, [str(e["file"])]),
                                          "afile: not a directory", False),
    # gather_shards(shards, rows, group_name)
    "gather_shards-rows-list-length": (lambda e: G(e, rows=[4, 4]),
                                       "shards has 1 tensors but rows has 2 entries", False),
    "gather_shards-shards-empty-list": (lambda e: G(e, shards=[]),
                                        "shards has 0 tensors but rows has 1 entries", False),
    "gather_shards-shards-0-dim": (lambda e: G(e, shards=[torch.tensor(1.0)], rows=[1]),
                                   "shards[0] is 0-dim", False),
    "gather_shards-rows-negative": (lambda e: G(e, rows=[-4]), "rows[0] is negative: -4",
                                    False),
    "gather_shards-rows-mismatch": (lambda e: G(e, rows=[5]),
                                    "shards[0] has 4 rows but rank 0 of 1 holds 5 of rows[0] = 5",
                                    False),
    "gather_shards-shards-shape-second": (lambda e: G(e, shards=[t(4, 2), t(3)], rows=[4, 4]),
                                          "shards[1] has 3 rows but rank 0 of 1 holds 4", False),
    "gather_shards-shards-device-mixed": (lambda e: G(e, shards=[t(4, 2), t(4).to("meta")],
                                                      rows=[4, 4]),
                                          "shards[1] is on meta but shards[0] is on cpu", False),
    "gather_shards-shards-device-cuda": (lambda e: G(e, shards=[t(4, 2), t(4).cuda()],
                                                     rows=[4, 4]),
                                         ("shards[1] is on cuda", "shards[0] is on cpu"), True),
    "gather_shards-group_name-missing": (lambda e: G(e, group_name="no-such-group"),
                                         "group_name 'no-such-group' names no process group",
                                         False),
    "gather_shards-group_name-empty": (lambda e: G(e, group_name=""),
                                       "group_name '' names no process group", False),
    # cpu_capability() takes no argument
    "cpu_capability-extra-argument": (lambda e: (ops.cpu_capability, [1]),
                                      "cpu_capability() expected at most 0 argument(s)", False),
})


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo group for gather_shards; destroyed after this module."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.fixture
def env(tmp_path, group):
    ck = tmp_path / "ck"
    ckpt.save(ck, {"w": t(2, 3)})
    part = tmp_path / "part"
    ckpt.save_shard(part, {"w": (t(1, 3), [0, 0], [3, 3])}, rank=0, world_size=3)
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_bytes(b"not a checkpoint\n" * 4)
    return {"root": tmp_path, "ck": ck, "part": part, "empty": tmp_path / "empty",
            "file": tmp_path / "afile", "new": tmp_path / "new",
            "ck_file": ck / ckpt.shard_file_name(0, 1), "group": group}


def tensors_in(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from tensors_in(a)


def snapshot_tensors(args):
    out = []
    for x in tensors_in(args):
        if x.device.type == "meta":
            out.append((x, None))
        else:
            out.append((x, x.detach().clone()))
    return out


def snapshot_dir(root: Path):
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out


def bit_equal(a, b):
    raw = lambda x: x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(case, env):
    builder, expect, needs_cuda = CASES[case]
    if needs_cuda and not HAS_CUDA:
        pytest.skip("no CUDA device")
    op, args = builder(env)
    tensors = snapshot_tensors(args)
    files = snapshot_dir(env["root"])
    with pytest.raises(RuntimeError) as info:
        op(*args)
    msg = str(info.value)
    for part in (expect,) if isinstance(expect, str) else expect:
        assert part in msg, f"message does not say what is wrong ({part!r}): {msg}"
    for x, before in tensors:
        if before is not None:
            assert bit_equal(x, before), f"{case}: a tensor argument was changed"
    assert snapshot_dir(env["root"]) == files, f"{case}: files changed"


def test_valid_calls_of_the_same_table_succeed(env):
    """Controls: the unmodified arguments work, so each bad case fails for its one change."""
    for name, op in UPDATE_OPS.items():
        ema, model = [t(4)], [t(4) + 1]
        op(ema, model, decay_arg(name, 0.75))  # not 0.5, where decay and 1 - decay coincide
        assert torch.equal(ema[0], t(4) + 0.25)
    env["new"].mkdir()
    op, args = S(env)
    op(*args)
    assert ops.commit_checkpoint(str(env["new"]), 1, False, False) == 1
    op, args = L(env)
    assert torch.equal(op(*args)[0], t(2, 3))
    op, args = G(env)
    assert torch.equal(op(*args)[0], t(4, 2))
    assert ops.load_shard(str(env["ck_file"]), True, None)[0] == ["w"]
    assert '"w"' in ops.checkpoint_info(str(env["ck"]))
    assert ops.cpu_capability() in ("avx512", "avx2", "default")


def test_case_count():
    # A case that drops out of the table (a builder that raises, a renamed op) shows here.
    n_cuda = sum(1 for c in CASES.values() if c[2])
    print(f"RELIABILITY bad-input cases: {len(CASES)} ({n_cuda} need CUDA)")
    assert (len(CASES), n_cuda) == (117, 9)
    # Every expected message is specific: more than an argument's bare name (the two invalid
    # CUDA device ordinals fail inside torch, with torch's wording).
    for case, (_, expect, _) in CASES.items():
        parts = (expect,) if isinstance(expect, str) else expect
        if case not in ("load_shard-device-cuda", "load_tensors-device-cuda"):
            assert sum(len(p) for p in parts) >= 9, (case, expect)
