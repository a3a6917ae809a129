"""Reliability: crashes during save, exhaustive corruption of a small file, no pickle on load.

docs/RELIABILITY.md says what these tests guarantee and records the counts of the last run
(each test prints a ``RELIABILITY ...`` line; run pytest with ``-s`` to see them).
"""

import contextlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fsdp_ema import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "build" / "bin" / "fsdp-ema"
INDEX = "fsdp_ema.index.json"
REFUSED = re.compile(r"incomplete checkpoint|not a checkpoint|not a directory")


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def bit_equal(a, b):
    def raw(t):
        return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def verify_cli(directory):
    return subprocess.run([str(CLI), "verify", str(directory)], capture_output=True, text=True,
                          timeout=60)


# --------------------------------------------------------------------------------------------
# 1. Crash during save
# --------------------------------------------------------------------------------------------

# Executed both in the test and in the child so that both build the same tensors:
# 3 ranks x 12 float32 tensors, ~20 MB in all.
TENSORS_CODE = textwrap.dedent("""
    def make_shards(seed):
        import torch
        g = torch.Generator().manual_seed(seed)
        return [{f"r{r}.t{i:02d}": torch.randn(70000 * (1 + i % 3), generator=g)
                 for i in range(12)} for r in range(3)]
""")
WORLD = 3

# The loop of a fork server: the server imports torch once (a fresh interpreter costs seconds
# here) and builds its tensors, then serve(child) prints "ready" and for each request line
# ("save <args>...") forks a child that runs child(<args>...) and exits; the server prints
# "pid <pid>", then "exit <wait status>".
FORK_SERVER_CODE = textwrap.dedent("""
    import os, sys

    def serve(child):
        print("ready", flush=True)
        for line in sys.stdin:
            pid = os.fork()
            if pid == 0:
                try:
                    child(*line.split()[1:])
                finally:
                    os._exit(0)
            print("pid", pid, flush=True)
            _, status = os.waitpid(pid, 0)
            print("exit", status, flush=True)
""")

# For each "save <dir> <stop>" the child saves the three ranks' files in sequence and commits.
# stop >= 0 makes the child SIGKILL itself after that many steps (0: before anything, 1..3: after
# shard 0..2 was written, 4: after the commit); stop < 0 runs to the end (the test kills it from
# outside).
SERVER = TENSORS_CODE + FORK_SERVER_CODE + textwrap.dedent("""
    import signal
    import torch
    torch.set_num_threads(1)
    from fsdp_ema import checkpoint as ckpt
    shards = make_shards(1)

    def save(directory, stop):
        stop = int(stop)

        def step(k):
            if k == stop:
                os.kill(os.getpid(), signal.SIGKILL)
        step(0)
        for r in range(3):
            ckpt.save_shard(directory, shards[r], rank=r, world_size=3)
            step(r + 1)
        ckpt.commit(directory, 3)
        step(4)

    serve(save)
""")


def kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # the save finished first
        pass


def read_line(proc, timeout=30.0):
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "fork server did not answer"
    line = proc.stdout.readline()
    assert line, "fork server died"
    return line.split()


@contextlib.contextmanager
def fork_server(code):
    """A fork server (SERVER, ASYNC_SERVER) that has said "ready"; stopped on the way out."""
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
    try:
        assert read_line(server, 120) == ["ready"]
        yield server
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def save_and_kill(server, request, directory, delay=None, tmp_prefix=None, exit_timeout=30.0):
    """One save by the fork server's child, SIGKILLed from here `delay` seconds after it started,
    or once a file named `tmp_prefix`... appears in `directory` (a temporary being written; 10 s
    at the most), or not at all (neither given). Returns (killed, seconds from the start to the
    kill, seconds from the start to the child's exit)."""
    server.stdin.write(request + "\n")
    server.stdin.flush()
    pid = int(read_line(server)[1])
    t0 = time.monotonic()
    if delay is not None:
        time.sleep(delay)
        kill(pid)
    elif tmp_prefix is not None:
        while time.monotonic() - t0 < 10:
            try:
                if any(n.startswith(tmp_prefix) for n in os.listdir(directory)):
                    break
            except FileNotFoundError:
                pass
        kill(pid)
    elapsed = time.monotonic() - t0
    _, status = read_line(server, exit_timeout)
    return os.WIFSIGNALED(int(status)), elapsed, time.monotonic() - t0


def check_crashed_dir(directory, expected):
    """The new directory is complete and equal, or refused; never a silent partial load."""
    names = sorted(os.listdir(directory)) if directory.exists() else []
    finals = [n for n in names if n.endswith(".safetensors") and not n.startswith(".")]
    hidden = [n for n in names if n.startswith(".")]
    # A file under its final name is complete: it was renamed only after being written in full.
    for f in finals:
        got = ckpt.load_shard(directory / f)
        for name, (t, _, _) in got.items():
            assert bit_equal(t, expected[name]), (f, name)
    if INDEX in names:
        loaded = ckpt.load(directory)
        assert sorted(loaded) == sorted(expected)
        for name, t in loaded.items():
            assert bit_equal(t, expected[name]), name
        res = verify_cli(directory)
        assert res.returncode == 0, res.stdout + res.stderr
        return "complete", len(finals), len(hidden)
    with pytest.raises(RuntimeError, match=REFUSED):
        ckpt.load(directory)
    if directory.exists():
        assert verify_cli(directory).returncode != 0
    return "refused", len(finals), len(hidden)


def test_sigkill_during_multi_file_save(tmp_path):
    ns = {}
    exec(TENSORS_CODE, ns)
    new_expected = {k: v for d in ns["make_shards"](1) for k, v in d.items()}
    prev_expected = {k: v for d in ns["make_shards"](7) for k, v in d.items()}
    total_bytes = sum(t.numel() * t.element_size() for t in new_expected.values())
    assert 15e6 < total_bytes < 25e6 and len(new_expected) == 36

    # The previous, committed checkpoint, in another directory.
    prev = tmp_path / "prev"
    for r, shard in enumerate(ns["make_shards"](7)):
        ckpt.save_shard(prev, shard, rank=r, world_size=WORLD)
    ckpt.commit(prev, WORLD)
    prev_files = {n: (prev / n).read_bytes() for n in os.listdir(prev)}

    outcomes = []
    with fork_server(SERVER) as server:

        def run(mode, arg):
            d = tmp_path / f"new{len(outcomes):02d}"
            stop = arg if mode == "step" else -1
            killed, elapsed, total = save_and_kill(
                server, f"save {d} {stop}", d, delay=arg if mode == "delay" else None,
                # Kill while rank `arg`'s temporary file is being written.
                tmp_prefix="." + ckpt.shard_file_name(arg, WORLD) if mode == "tmp" else None)
            state = check_crashed_dir(d, new_expected)
            # The previous checkpoint is untouched and loads bit-exact.
            loaded = ckpt.load(prev)
            assert sorted(loaded) == sorted(prev_expected)
            for name, t in loaded.items():
                assert bit_equal(t, prev_expected[name]), name
            outcomes.append((mode, round(arg, 4), killed, round(elapsed, 4)) + state)
            return total

        # Calibrate: a full save, not killed (stop step 5 never comes).
        full = run("step", 5)
        assert outcomes[-1][4] == "complete" and not outcomes[-1][2]
        for k in range(5):                  # deterministic step boundaries
            run("step", k)
        for r in range(WORLD):              # during each rank's data write
            run("tmp", r)
        rng = random.Random(1234)
        deadline = time.monotonic() + 20
        # Random points over the whole save: 16 of them (fewer once 20 s have passed), and more,
        # up to 64, until 15 kills have landed. A delay past the save's end kills nothing, and
        # how many do depends on the machine's load, so the count of runs cannot be fixed.
        for random_runs in range(64):
            enough = sum(o[2] for o in outcomes) >= 15
            if enough and (random_runs >= 16 or time.monotonic() > deadline):
                break
            run("delay", rng.uniform(0, full))

    crashes = [o for o in outcomes if o[2]]
    # Every step-mode and tmp-mode run was killed; delays past the end may let the save finish.
    assert len(crashes) >= 15, outcomes
    assert {o[4] for o in crashes} == {"complete", "refused"}, outcomes
    assert any(o[4] == "refused" and o[5] > 0 for o in crashes), outcomes  # partial files
    assert {n: (prev / n).read_bytes() for n in os.listdir(prev)} == prev_files

    # After a crash: a new save into a fresh directory works.
    fresh = tmp_path / "fresh"
    for r, shard in enumerate(ns["make_shards"](1)):
        ckpt.save_shard(fresh, shard, rank=r, world_size=WORLD)
    ckpt.commit(fresh, WORLD)
    assert check_crashed_dir(fresh, new_expected)[0] == "complete"

    # Saving again into a crashed, uncommitted directory also works: the rename replaces any
    # complete file of the crashed save, and the next save of a file removes the temporaries its
    # crashed writers left (their pid is gone); a live writer's temporary (pid 1 here) is kept,
    # and readers ignore it.
    crashed = [o for o in outcomes if o[4] == "refused" and o[5] > 0]
    redo = tmp_path / f"new{outcomes.index(crashed[0]):02d}"
    live = ".shard-00000-of-00003.safetensors.tmp-1-0000000000000000"
    (redo / live).write_bytes(b"junk")
    for r, shard in enumerate(ns["make_shards"](1)):
        ckpt.save_shard(redo, shard, rank=r, world_size=WORLD)
    ckpt.commit(redo, WORLD)
    assert check_crashed_dir(redo, new_expected)[0] == "complete"
    assert sorted(p.name for p in redo.iterdir() if p.name.startswith(".")) == [live]
    # A crashed directory whose commit finished refuses a second commit.
    done = [o for o in outcomes if o[4] == "complete"][0]
    with pytest.raises(RuntimeError, match="already committed"):
        ckpt.commit(tmp_path / f"new{outcomes.index(done):02d}", WORLD)

    n_refused = sum(o[4] == "refused" for o in crashes)
    n_hidden = sum(o[6] > 0 for o in crashes)
    print(f"\nRELIABILITY crash: runs={len(outcomes)} sigkills={len(crashes)} "
          f"complete={len(crashes) - n_refused} refused={n_refused} "
          f"with_leftover_tmp={n_hidden} full_save_s={full:.3f} lost=0")
    for o in outcomes:
        print("  ", o)


# The same crash, during an asynchronous save: the child stages the tensors, keeps modifying
# them (as training does) while the background thread writes the file and the index, and is
# killed from outside at random points or while the temporary file is being written.
ASYNC_SERVER = TENSORS_CODE + FORK_SERVER_CODE + textwrap.dedent("""
    import torch
    torch.set_num_threads(1)
    from fsdp_ema import checkpoint as ckpt
    tensors = {k: v for d in make_shards(1) for k, v in d.items()}

    def save(directory):
        handle = ckpt.save(directory, tensors, async_=True)
        while not handle.done():
            for t in tensors.values():
                t.add_(1.0)
        handle.result()

    serve(save)
""")


def test_sigkill_during_async_save(tmp_path):
    ns = {}
    exec(TENSORS_CODE, ns)
    expected = {k: v for d in ns["make_shards"](1) for k, v in d.items()}
    outcomes = []
    with fork_server(ASYNC_SERVER) as server:

        def run(mode, arg):
            d = tmp_path / f"a{len(outcomes):02d}"
            killed, _, total = save_and_kill(
                server, f"save {d}", d, delay=arg if mode == "delay" else None,
                # While the background thread writes the temporary file.
                tmp_prefix="." + ckpt.shard_file_name(0, 1) if mode == "tmp" else None,
                # A generous wait: a SIGKILL lands only once an fsync in flight returns, which on
                # a disk shared with other jobs can take seconds.
                exit_timeout=120)
            # Complete and equal to the tensors at the call (not the ones modified after), or
            # refused: never a partial checkpoint that loads.
            state = check_crashed_dir(d, expected)
            outcomes.append((mode, round(arg, 4), killed) + state)
            return total

        full = run("none", 0)
        assert outcomes[-1][3] == "complete" and not outcomes[-1][2]
        for _ in range(3):
            run("tmp", 0)
        rng = random.Random(4321)
        for _ in range(8):
            run("delay", rng.uniform(0, full))
    crashes = [o for o in outcomes if o[2]]
    assert len(crashes) >= 3, outcomes
    assert any(o[0] == "tmp" and o[3] == "refused" for o in crashes), outcomes
    print(f"\nRELIABILITY async crash: runs={len(outcomes)} sigkills={len(crashes)} "
          f"refused={sum(o[3] == 'refused' for o in crashes)} full_save_s={full:.3f} lost=0")


# --------------------------------------------------------------------------------------------
# 2. Exhaustive single-byte flips and truncations of a small checkpoint
# --------------------------------------------------------------------------------------------

def small_tensors():
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
            "b": torch.tensor([1, -2, 3], dtype=torch.int64),
            "h": torch.tensor([0.5, -1.25], dtype=torch.bfloat16),
            "m": torch.tensor([True, False, True])}


def try_load(directory, expected):
    """"rejected" (RuntimeError naming the file), "equal", or fails the test."""
    try:
        got = ckpt.load(directory)
        got = {k: v.clone() for k, v in got.items()}   # not a view of the mapped file
    except RuntimeError as e:
        return "rejected", str(e)
    assert sorted(got) == sorted(expected)
    for name, t in got.items():
        assert bit_equal(t, expected[name]), f"silently wrong value for {name}"
    return "equal", None


@pytest.mark.parametrize("target", ["shard", "index"])
def test_every_byte_flip_and_truncation(tmp_path, target):
    expected = small_tensors()
    good = tmp_path / "good"
    ckpt.save(good, expected)
    fname = ckpt.shard_file_name(0, 1) if target == "shard" else INDEX
    original = (good / fname).read_bytes()
    assert len(original) < 2048
    work = tmp_path / "work"
    shutil.copytree(good, work)
    path = work / fname

    def put(data):
        path.unlink()                  # a new inode: no earlier mapping sees the change
        path.write_bytes(data)

    counts = {"flips": 0, "flips_rejected": 0, "flips_equal": 0, "truncations": 0,
              "truncations_rejected": 0}
    corrupt_samples = []
    for pos in range(len(original)):
        for mask in (0xFF, 0x01):
            data = bytearray(original)
            data[pos] ^= mask
            put(bytes(data))
            outcome, msg = try_load(work, expected)
            counts["flips"] += 1
            counts["flips_" + outcome] += 1
            if outcome == "rejected":
                # A flipped index may be caught by the cross-check against the file it names
                # (possibly a flipped name): the message names that file in the directory.
                assert (fname if target == "shard" else str(work)) in msg, msg
                if (pos * 7 + mask) % 97 == 0:
                    corrupt_samples.append(bytes(data))
    for length in range(len(original)):
        put(original[:length])
        outcome, msg = try_load(work, expected)
        counts["truncations"] += 1
        if outcome == "equal":
            # Only the index's trailing newline may go (the JSON is still complete).
            assert target == "index" and not original[length:].strip(), length
            counts["truncations_equal"] = counts.get("truncations_equal", 0) + 1
            continue
        assert (fname if target == "shard" else str(work)) in msg, msg
        counts["truncations_rejected"] += 1
        if length % 173 == 0:
            corrupt_samples.append(original[:length])
    put(original)
    assert try_load(work, expected) == ("equal", None)

    # The CLI on a sample (a subprocess each): non-zero on every corrupt file, 0 on the original.
    assert verify_cli(work).returncode == 0
    for data in corrupt_samples:
        put(data)
        res = verify_cli(work)
        assert res.returncode != 0, res.stdout
    counts["cli_rejected"] = len(corrupt_samples)
    counts["bytes"] = len(original)
    print(f"\nRELIABILITY flips[{target}]: " + " ".join(f"{k}={v}" for k, v in counts.items()))


# --------------------------------------------------------------------------------------------
# 3. No pickle on the load path; unknown format versions
# --------------------------------------------------------------------------------------------

NO_PICKLE = textwrap.dedent("""
    import pickle, sys
    calls = []
    def trap(name):
        def f(*a, **k):
            calls.append(name)
            raise AssertionError("pickle." + name + " called on the load path")
        return f
    class Trap:
        def __init__(self, *a, **k):
            calls.append("Unpickler")
            raise AssertionError("pickle.Unpickler used on the load path")
    pickle.load, pickle.loads, pickle.Unpickler = trap("load"), trap("loads"), Trap
    import torch
    from fsdp_ema import checkpoint as ckpt
    d = sys.argv[1]
    got = ckpt.load(d)
    assert got["w"].tolist() == [[0.0, 1.0], [2.0, 3.0]], got
    one = ckpt.load_shard(d + "/" + ckpt.shard_file_name(0, 1))
    assert one["b"][0].tolist() == [5, 6], one
    ckpt.info(d)
    assert not calls, calls
    print("NO_PICKLE_OK")
""")


def test_load_path_uses_no_pickle(tmp_path):
    ckpt.save(tmp_path / "c", {"w": torch.arange(4.0).reshape(2, 2), "b": torch.tensor([5, 6])})
    res = subprocess.run([sys.executable, "-c", NO_PICKLE, str(tmp_path / "c")],
                         capture_output=True, text=True, env=child_env(), timeout=120)
    assert res.returncode == 0 and "NO_PICKLE_OK" in res.stdout, res.stdout + res.stderr


def test_unknown_format_versions_are_refused(tmp_path):
    good = tmp_path / "good"
    ckpt.save(good, {"w": torch.arange(4.0)})
    shard = ckpt.shard_file_name(0, 1)

    bad_index = tmp_path / "bad_index"
    shutil.copytree(good, bad_index)
    index = json.loads((bad_index / INDEX).read_text())
    index["format_version"] = 2
    (bad_index / INDEX).write_text(json.dumps(index))
    with pytest.raises(RuntimeError, match=r"unsupported format_version 2"):
        ckpt.load(bad_index)
    assert verify_cli(bad_index).returncode != 0

    bad_header = tmp_path / "bad_header"
    shutil.copytree(good, bad_header)
    data = (bad_header / shard).read_bytes()
    key = b'"fsdp_ema_format_version":"1"'
    assert data.count(key) == 1
    (bad_header / shard).write_bytes(data.replace(key, b'"fsdp_ema_format_version":"2"'))
    with pytest.raises(RuntimeError, match=shard + r".*version"):
        ckpt.load_shard(bad_header / shard)
    with pytest.raises(RuntimeError, match=shard + r".*version"):
        ckpt.load(bad_header)
    assert verify_cli(bad_header).returncode != 0
