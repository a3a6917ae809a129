"""Concurrent saves into one directory, and ranks that die inside a collective (issue 8).

docs/RELIABILITY.md records what these tests guarantee and the counts of the last run (each test
prints a ``RELIABILITY ...`` line; run pytest with ``-s``).
"""

import datetime
import multiprocessing as mp
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from fsdp_ema import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "build" / "bin" / "fsdp-ema"
FORK = mp.get_context("fork")  # torch is already imported here: forking costs no import


def tensors(value, names):
    return {n: torch.full((200_000,), float(value)) for n in names}


# --------------------------------------------------------------------------------------------
# 2. Two saves into one directory at once
# --------------------------------------------------------------------------------------------

def _saver(directory, value, names, mode, go, results):
    torch.set_num_threads(1)
    go.wait()
    try:
        if mode == "commit-only":
            ckpt.commit(directory, 1, fsync=False)
        else:
            ckpt.save(directory, tensors(value, names))
        results.put((value, "ok", ""))
    except RuntimeError as e:
        results.put((value, "error", str(e)))
    except BaseException as e:  # noqa: BLE001 -- anything else is a failure of the test
        results.put((value, "other", f"{type(e).__name__}: {e}"))


def _race(directory, mode, names_a, names_b):
    go = FORK.Event()
    results = FORK.Queue()
    procs = [FORK.Process(target=_saver, args=(str(directory), v, n, mode, go, results))
             for v, n in ((1, names_a), (2, names_b))]
    for p in procs:
        p.start()
    time.sleep(0.05)
    go.set()
    out = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return sorted(out)


MODES = [("save-same-names", ["a", "b", "c"], ["a", "b", "c"]),
         ("save-different-names", ["a", "b", "c"], ["x", "y"]),
         ("commit-only", None, None)]


def test_two_saves_into_one_directory(tmp_path):
    stats = {}
    for mode, names_a, names_b in MODES:
        for round_ in range(8):
            d = tmp_path / f"{mode}-{round_}"
            if mode == "commit-only":
                ckpt.save_shard(d, tensors(3, ["w"]), fsync=False)
            out = _race(d, mode, names_a, names_b)
            kinds = [k for _, k, _ in out]
            assert "other" not in kinds, out
            # Every failure is a clean RuntimeError saying why (the index is already there).
            for _, kind, msg in out:
                if kind == "error":
                    assert "already committed" in msg, msg
            assert kinds.count("ok") >= 1, out
            # One writer wins: the directory loads exactly one writer's tensors and verifies.
            # (save_shard holds the directory lock shared and refuses a committed directory,
            # commit holds it exclusively, so no shard file can replace one the index describes.)
            res = subprocess.run([str(CLI), "verify", str(d)], capture_output=True, text=True,
                                 timeout=60)
            loaded = ckpt.load(d)
            assert res.returncode == 0, res.stdout + res.stderr
            if mode == "commit-only":
                assert list(loaded) == ["w"] and bool((loaded["w"] == 3).all())
            else:
                values = {float(x[0]) for x in loaded.values()}
                assert len(values) == 1, f"mixed checkpoint: {values}"
                winner = int(values.pop())
                assert sorted(loaded) == sorted(names_a if winner == 1 else names_b)
                assert all(bool((x == winner).all()) for x in loaded.values())
            kinds.append("valid")
            key = (mode, "+".join(sorted(kinds)))
            stats[key] = stats.get(key, 0) + 1
    print("RELIABILITY concurrent saves:", {f"{m} {k}": n for (m, k), n in sorted(stats.items())})


# --------------------------------------------------------------------------------------------
# 3. A rank that dies inside a collective
# --------------------------------------------------------------------------------------------

TIMEOUT_S = 5


def _rank(rank, init, what, directory, results):
    import faulthandler

    import torch.distributed as dist
    faulthandler.dump_traceback_later(12, exit=True)  # a hang shows where, then ends the rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    if rank == 1:
        dist.barrier()   # both ranks are up
        os._exit(1)      # dies instead of joining the collective
    dist.barrier()
    time.sleep(0.2)
    t0 = time.monotonic()
    try:
        if what == "gather_shards":
            torch.ops.fsdp_ema.gather_shards([torch.randn(4, 8)], [8],
                                             dist.group.WORLD.group_name)
        else:  # a multi-rank save: every rank writes its file, barrier, rank 0 commits
            from fsdp_ema import save_training_state
            save_training_state(directory, model=torch.nn.Linear(4, 4), extra={"step": 1})
        results.put(("returned", time.monotonic() - t0, ""))
    except Exception as e:  # noqa: BLE001
        results.put(("raised", time.monotonic() - t0, f"{type(e).__name__}: {e}"[:300]))
    results.close()
    results.join_thread()  # flush the queue before os._exit
    os._exit(0)


@pytest.mark.parametrize("what", ["gather_shards", "save"])
def test_dead_rank_gives_an_error_not_a_hang(tmp_path, what):
    results = FORK.Queue()
    directory = tmp_path / "ckpt"
    procs = [FORK.Process(target=_rank, args=(r, tmp_path / "init", what, str(directory),
                                              results)) for r in range(2)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    try:
        kind, elapsed, msg = results.get(timeout=45)
    finally:
        for p in procs:
            p.join(30 if p is procs[0] else 5)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
    wall = time.monotonic() - t0
    assert not alive, "a rank hung"
    assert kind == "raised", f"rank 0 did not raise: {kind} {msg}"
    assert elapsed < 30, elapsed
    print(f"RELIABILITY dead rank during {what}: rank 0 raised after {elapsed:.2f} s "
          f"(wall {wall:.1f} s): {msg[:160]}")
    if what == "save":
        # No commit: the directory is refused, never loaded partially.
        if directory.exists():
            with pytest.raises(RuntimeError, match="incomplete checkpoint|not a checkpoint"):
                ckpt.load(directory)
