"""Asynchronous saves (#17): ShardedEMA.save, save_training_state and the checkpoint helpers with
``async_=True``.

What is checked: the files hold the values at the time of the call although training modifies the
tensors before the background thread writes (the write waits for an event set after the training
steps, so the overlap is certain); a failure on one rank (in the background write, or in the
caller's pieces) raises on every rank's handle and commits nothing; one save in flight per object
(a second waits, or with ``if_busy="raise"`` raises on every rank); the staging buffers are the
same memory from one save to the next. The training's own collectives (full state dicts) run while
the background thread agrees, on its own process group. Ranks: a dist_utils.WorkerPool of 2 gloo
ranks.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from dist_utils import PoolManager
from test_training_state import assert_bit_equal, build, full_state, train

import fsdp_ema
from fsdp_ema import ShardedEMA
from fsdp_ema import checkpoint as ckpt
from fsdp_ema.store import async_save as _async

INDEX = "fsdp_ema.index.json"


class slow_writes:
    """Delays every ``save_shard`` (the background write) by ``delay`` seconds, or makes it
    raise; optionally waits for ``gate`` first."""

    def __init__(self, delay=0.0, fail=False, gate=None):
        self.delay, self.fail, self.gate = delay, fail, gate
        self.calls = 0

    def __enter__(self):
        self.original = ckpt.save_shard

        def patched(*args, **kwargs):
            self.calls += 1
            if self.gate is not None:
                assert self.gate.wait(30)
            time.sleep(self.delay)
            if self.fail:
                raise OSError("injected: disk full")
            return self.original(*args, **kwargs)

        ckpt.save_shard = patched
        return self

    def __exit__(self, *exc):
        ckpt.save_shard = self.original


def state_keys(state):
    return {k: v for k, v in state.items() if k.split(".")[0] in ("model", "optim", "ema")
            or k == "ema_step"}


# --- functions the ranks run ----------------------------------------------------------------------

def run_training_state_async(rank, world, kind, directory):
    model, opt, sched, ema = build(kind)
    train(model, opt, sched, ema, rank, 0, 2)
    gate = threading.Event()  # the background write starts only once training has moved on
    with slow_writes(gate=gate):
        handle = fsdp_ema.save_training_state(directory, model=model, optimizer=opt, ema=ema,
                                              extra={"step": 2}, async_=True)
        assert isinstance(handle, fsdp_ema.SaveHandle)
        # Collectives of the training (all-gathers) while the background thread agrees.
        at_call = state_keys(full_state(model, opt, sched, ema))
        train(model, opt, sched, ema, rank, 2, 5)  # modifies every tensor in place
        after = state_keys(full_state(model, opt, sched, ema))
        assert not handle.done()
        gate.set()
        nbytes = handle.result(timeout=60)
    assert nbytes > 0 and handle.done()
    differ = [k for k in at_call if not torch.equal(at_call[k], after[k])]
    model2, opt2, sched2, ema2 = build(kind, seed=77)
    extra = fsdp_ema.load_training_state(directory, model=model2, optimizer=opt2, ema=ema2)
    return {"at_call": at_call, "loaded": state_keys(full_state(model2, opt2, sched2, ema2)),
            "extra": extra, "changed": differ}


def run_ema_async_reuse(rank, world, d1, d2, d3):
    """Three async EMA saves with updates in between: each directory holds the EMA at its call,
    and the staging buffers are the same memory each time."""
    model, opt, sched, ema = build("fsdp2_fp32")
    ptrs, expected = [], []
    for d in (d1, d2, d3):
        gate = threading.Event()
        with slow_writes(gate=gate):
            train(model, opt, sched, ema, rank, 0, 1)
            expected.append({k: v.clone() for k, v in ema.full_state_dict().items()})
            handle = ema.save(d, async_=True)
            ptrs.append({k: b.data_ptr() for k, b in ema.state.async_saver.staging.buffers.items()})
            train(model, opt, sched, ema, rank, 1, 3)  # before the write starts
            gate.set()
            handle.result(timeout=60)
    loaded = [ckpt.load(d) for d in (d1, d2, d3)] if rank == 0 else None
    return {"ptrs": ptrs, "expected": expected, "loaded": loaded}


def run_failure_in_background(rank, world, directory):
    model, opt, sched, ema = build("fsdp2_fp32")
    train(model, opt, sched, ema, rank, 0, 1)
    with slow_writes(fail=rank == 1):
        handle = fsdp_ema.save_training_state(directory, model=model, optimizer=opt, ema=ema,
                                              async_=True)
        try:
            handle.result(timeout=60)
            message = None
        except RuntimeError as e:
            message = str(e)
    # The pair stays usable: a sync save afterwards commits.
    ok = fsdp_ema.save_training_state(directory + "_after", model=model, optimizer=opt, ema=ema)
    return {"message": message, "index": os.path.exists(os.path.join(directory, INDEX)),
            "after": ok > 0}


def run_failure_in_pieces(rank, world, directory):
    """Rank 1's extra state cannot be encoded: the error is raised in the caller's pieces, and
    carried into the background agreement."""
    model, _opt, _sched, ema = build("fsdp2_fp32")
    extra = {"bad": object()} if rank == 1 else {}
    handle = fsdp_ema.save_training_state(directory, model=model, ema=ema, extra=extra,
                                          async_=True)
    try:
        handle.result(timeout=60)
        return {"message": None}
    except (RuntimeError, TypeError) as e:
        return {"message": str(e), "index": os.path.exists(os.path.join(directory, INDEX))}


def run_one_in_flight(rank, world, d1, d2):
    _model, _opt, _sched, ema = build("fsdp2_fp32")
    gate = threading.Event()
    with slow_writes(gate=gate):
        h1 = ema.save(d1, async_=True)
        try:
            ema.save(d2, async_=True, if_busy="raise")
            refused = None
        except RuntimeError as e:
            refused = str(e)
        assert not h1.done()
        # The default waits for h1: release its write a little later, from another thread.
        timer = threading.Timer(0.3, gate.set)
        timer.start()
        t0 = time.monotonic()
        h2 = ema.save(d2, async_=True)
        waited = time.monotonic() - t0
        first_done_at_return = h1.done()
        h2.result(timeout=60)
        timer.join()
    return {"refused": refused, "waited": waited, "first_done": first_done_at_return,
            "committed": [os.path.exists(os.path.join(d, INDEX)) for d in (d1, d2)]}


def run_destroy_during_save(rank, world, directory, after, init_file):
    """destroy_process_group() while a save is in flight: the handle raises a clear error on
    every rank and nothing is committed; after a new init_process_group, async saves work again
    (a new background group, not the destroyed one)."""
    import datetime

    import torch.distributed as dist

    _model, _opt, _sched, ema = build("fsdp2_fp32")
    gate = threading.Event()
    with slow_writes(gate=gate) as writes:
        handle = ema.save(directory, async_=True)
        # Both background threads past the first agreement, held before the write: no
        # collective of theirs is running when the groups go (destroying a group under a
        # running gloo collective can leave that thread blocked: what the docs warn of).
        deadline = time.monotonic() + 30
        while writes.calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        dist.barrier()
        dist.destroy_process_group()
        gate.set()
        try:
            handle.result(timeout=60)
            message = None
        except RuntimeError as e:
            message = str(e)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    _model, _opt, _sched, ema = build("fsdp2_fp32")
    nbytes = ema.save(after, async_=True).result(timeout=60)
    return {"message": message, "index": os.path.exists(os.path.join(directory, INDEX)),
            "after": nbytes > 0 and os.path.exists(os.path.join(after, INDEX))}


def run_subgroup_async(rank, world, directory, prepare):
    """An async save by ranks 0 and 1 over their subgroup, then a group made by all 3 ranks:
    with the background group made up front (init_async_groups) every rank names the new group
    alike, and its collective runs."""
    import torch.distributed as dist

    sub = dist.new_group([0, 1])  # every rank calls new_group, members or not
    if prepare:
        fsdp_ema.init_async_groups([[0, 1]])
    committed = None
    if rank < 2:
        torch.manual_seed(0)
        ema = ShardedEMA(torch.nn.Linear(4, 3), 0.9, process_group=sub)
        ema.save(directory, async_=True).result(timeout=60)
        committed = os.path.exists(os.path.join(directory, INDEX))
    everyone = dist.new_group([0, 1, 2])
    t = torch.ones(1)
    dist.all_reduce(t, group=everyone)
    return {"committed": committed, "sum": float(t)}


# --- tests ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool():
    manager = PoolManager()
    yield manager.get(2)
    manager.close()


@pytest.mark.parametrize("kind", ["fsdp2_fp32", "fsdp1"])
def test_training_state_async_holds_the_state_at_the_call(pool, tmp_path, kind):
    results = pool.run(run_training_state_async, kind, str(tmp_path / "ckpt"))
    for rank, res in enumerate(results):
        # Training changed the tensors while the save was being written...
        assert any(k.startswith("model.") for k in res["changed"]), rank
        assert any(k.startswith("optim.") for k in res["changed"]), rank
        assert any(k.startswith("ema.") for k in res["changed"]), rank
        # ...and the checkpoint holds them as they were at the call.
        assert_bit_equal(res["loaded"], res["at_call"], f"rank {rank}")
        assert res["extra"] == {"step": 2}


def test_ema_async_saves_reuse_their_buffers(pool, tmp_path):
    dirs = [str(tmp_path / f"e{i}") for i in range(3)]
    results = pool.run(run_ema_async_reuse, *dirs)
    for res in results:
        assert res["ptrs"][0] and res["ptrs"][0] == res["ptrs"][1] == res["ptrs"][2]
    expected, loaded = results[0]["expected"], results[0]["loaded"]
    assert not torch.equal(expected[0]["inp.weight"], expected[1]["inp.weight"])
    for exp, got in zip(expected, loaded):
        assert_bit_equal(got, exp, "ema save")


def test_failure_in_the_background_raises_on_every_rank(pool, tmp_path):
    results = pool.run(run_failure_in_background, str(tmp_path / "ckpt"))
    for res in results:
        assert res["message"] is not None and "failed on rank(s) [1]" in res["message"]
        assert not res["index"] and res["after"]
    assert "injected: disk full" in results[1]["message"]


def test_failure_in_the_callers_pieces_raises_on_every_rank(pool, tmp_path):
    results = pool.run(run_failure_in_pieces, str(tmp_path / "ckpt"))
    for res in results:
        assert res["message"] is not None and "failed on rank(s) [1]" in res["message"]
        assert not res["index"]


def test_one_save_in_flight_waits_or_raises(pool, tmp_path):
    results = pool.run(run_one_in_flight, str(tmp_path / "a"), str(tmp_path / "b"))
    for res in results:
        assert res["refused"] is not None and "still in flight" in res["refused"]
        assert res["first_done"] and res["waited"] >= 0.2
        assert res["committed"] == [True, True]


def test_destroying_the_group_during_a_save_fails_it_clearly(pool, tmp_path):
    results = pool.run(run_destroy_during_save, str(tmp_path / "ckpt"), str(tmp_path / "after"),
                       str(tmp_path / "reinit"))
    for res in results:
        assert res["message"] is not None
        assert "process group was destroyed" in res["message"]
        assert "nothing was committed" in res["message"]
        assert not res["index"]  # shard files may be there, uncommitted: no reader takes them
        assert res["after"]


def test_async_save_over_a_subgroup_with_groups_made_up_front(tmp_path):
    manager = PoolManager()
    try:
        results = manager.get(3).run(run_subgroup_async, str(tmp_path / "sub"), True,
                                     timeout=120)
    finally:
        manager.close()
    assert [r["committed"] for r in results] == [True, True, None]
    assert all(r["sum"] == 3.0 for r in results)


def test_init_async_groups_checks_its_ranks(pool):
    for res in pool.run(run_init_groups_bad):
        assert "is not a set of ranks of a world of 2" in res


def run_init_groups_bad(rank, world):
    try:
        fsdp_ema.init_async_groups([[0, 5]])
    except ValueError as e:
        return str(e)
    return None


# --- single process: the checkpoint helpers ------------------------------------------------------

def test_checkpoint_save_async_snapshots_and_reuses(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(1000, generator=g), "b": torch.randn(7, 9, generator=g).t(),
               "c": torch.arange(5, dtype=torch.int64)}
    ptrs = []
    for i in range(2):
        expected = {k: v.clone() for k, v in tensors.items()}
        gate = threading.Event()
        with slow_writes(gate=gate):
            handle = ckpt.save(tmp_path / f"c{i}", tensors, async_=True)
            ptrs.append({k: b.data_ptr()
                         for k, b in _async.default_saver("save").staging.buffers.items()})
            for v in tensors.values():
                v.add_(1)
            gate.set()
            assert handle.result(timeout=60) > 0
        assert_bit_equal(ckpt.load(tmp_path / f"c{i}"), expected, f"save {i}")
    assert ptrs[0] == ptrs[1] and len(ptrs[0]) == 3


def test_checkpoint_save_shard_async_then_commit(tmp_path):
    rows = torch.randn(6, 4)
    handles = [ckpt.save_shard(tmp_path, {"w": (rows[3 * r:3 * r + 3], [3 * r, 0], [6, 4])},
                               rank=r, world_size=2, async_=True) for r in range(2)]
    assert all(h.result(timeout=60) > 0 for h in handles)
    ckpt.commit(tmp_path, 2)
    assert torch.equal(ckpt.load(tmp_path)["w"], rows)


def test_async_save_errors_are_the_handles(tmp_path):
    ckpt.save(tmp_path / "x", {"a": torch.ones(3)})
    handle = ckpt.save(tmp_path / "x", {"a": torch.zeros(3)}, async_=True)
    with pytest.raises(RuntimeError, match="committed"):
        handle.result(timeout=60)
    assert torch.equal(ckpt.load(tmp_path / "x")["a"], torch.ones(3))
    with pytest.raises(ValueError, match="if_busy"):
        ckpt.save(tmp_path / "y", {"a": torch.ones(3)}, async_=True, if_busy="skip")


def test_single_process_ema_async_save(tmp_path):
    model = torch.nn.Linear(4, 3)
    ema = ShardedEMA(model, 0.5)
    with torch.no_grad():
        model.weight.add_(1)
    ema.update()
    expected = {k: v.clone() for k, v in ema.full_state_dict().items()}
    gate = threading.Event()
    with slow_writes(gate=gate):
        handle = ema.save(tmp_path / "e", async_=True)
        for _ in range(3):
            with torch.no_grad():
                model.weight.add_(1)
            ema.update()
        gate.set()
        handle.result(timeout=60)
    assert_bit_equal(ckpt.load(tmp_path / "e"), expected, "ema")


def test_background_write_leaves_the_collector_on(tmp_path):
    """gc.disable() is process-wide: the bulk calls pause the collector on the main thread only,
    so an async save's write does not stop it for the training's thread."""
    import gc

    assert gc.isenabled()
    t = torch.randn(32 << 20)  # 128 MiB: a write long enough to be seen in progress
    handle = ckpt.save(tmp_path / "big", {"t": t}, async_=True)
    disabled = 0
    while not handle.done():
        disabled += not gc.isenabled()
    handle.result(timeout=120)
    assert disabled == 0 and gc.isenabled()
