"""A file truncated under an ``mmap=True`` load, while the load verifies its views through the
mapping, is a RuntimeError naming the file, never a SIGBUS that kills the process (issue 41):
deterministically (a preloaded shim truncates each shard file right after it is mapped) and
against another process truncating and restoring the file in a loop. Each load runs in a child
process, so that the old behaviour (death by SIGBUS) fails the test instead of the pytest worker.
Views a load already returned keep the documented rule: touching one after its file shrank is a
SIGBUS in the caller's code, passed on to Python's faulthandler."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIM = Path(os.environ.get("FSDP_EMA_BUILD", ROOT / "build")) / "lib" / "libfsdp_ema_faultfs.so"

# The child's common part: a checkpoint of a 32 MiB tensor (its verification spans several read
# chunks and threads) and a BOOL tensor, the shard file's bytes, and where the big tensor's data
# starts.
PROLOGUE = """
import json, os, struct, sys
import torch
from fsdp_ema import checkpoint as ckpt
d = sys.argv[1]
state = {"w": torch.arange(1 << 23, dtype=torch.float32),
         "m": torch.arange(999) % 3 == 0}
ckpt.save(d, state)
path = os.path.join(d, ckpt.shard_file_name(0, 1))
raw = open(path, "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
w_begin = 8 + n + json.loads(raw[8:8 + n])["w"]["data_offsets"][0]
cut_w = (w_begin + 8192) // 4096 * 4096  # a page edge inside "w": the pages after it are gone

def restore():
    with open(path, "r+b") as f:
        f.write(raw)

def loads():
    return {"load": lambda: ckpt.load(d, mmap=True),
            "load_shard": lambda: {k: v[0] for k, v in ckpt.load_shard(path, mmap=True).items()}}

def equal(got):
    return all(torch.equal(got[k], v) for k, v in state.items())
"""


# Truncates the file to argv[2] bytes, writes it back and leaves it whole a moment (a load must
# open it whole to get as far as its verification), over and over, until told: "p" pauses (the
# file whole again; answers "."), "g" goes on, "q" or end of input stops.
TRUNCATOR = """
import os, select, sys, time
path, cut = sys.argv[1], int(sys.argv[2])
raw = open(path, "rb").read()
fd = os.open(path, os.O_RDWR)
running = True
while True:
    ready, _, _ = select.select([0], [], [], 0 if running else None)
    if ready:
        c = os.read(0, 1)
        if c in (b"", b"q"):
            break
        running = c == b"g"
        if not running:
            os.pwrite(fd, raw, 0)
            os.write(1, b".")
    if running:
        os.ftruncate(fd, cut)
        time.sleep(0.002)
        os.pwrite(fd, raw[cut:], cut)
        time.sleep(0.004)
"""


def run_child(body: str, tmp_path, *python_flags, env=None, timeout=240):
    script = textwrap.dedent(PROLOGUE) + textwrap.dedent(body)
    return subprocess.run([sys.executable, *python_flags, "-c", script, str(tmp_path), TRUNCATOR],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "python"), **(env or {})})


def shard_file(tmp_path):
    return str(tmp_path / "shard-00000-of-00001.safetensors")


# Truncated right after the mapping is made, before the load verifies it: each load is a clear
# error, the process goes on, and the next loads of the restored file are right. Then a view a
# load returned is touched after its file shrank: the caller's SIGBUS, which reaches Python's
# faulthandler (enabled or not) and kills the process, as documented.
@pytest.mark.parametrize("faulthandler", [False, True], ids=["plain", "faulthandler"])
def test_truncation_between_mapping_and_verification_is_an_error(tmp_path, faulthandler):
    if not SHIM.exists():
        pytest.skip(f"{SHIM} is not built")
    body = """
    results = {}
    for name, load in loads().items():
        for cut in (cut_w, 0):  # inside the big tensor; nothing left
            os.environ["FSDP_EMA_FAULT_TRUNCATE_ON_MMAP"] = str(cut)
            try:
                load()
                results[f"{name} {cut}"] = "loaded"
            except RuntimeError as e:
                results[f"{name} {cut}"] = str(e)
            del os.environ["FSDP_EMA_FAULT_TRUNCATE_ON_MMAP"]
            restore()
            results[f"{name} {cut} then"] = equal(load())
    print(json.dumps(results), flush=True)
    view = ckpt.load(d, mmap=True)["w"]
    os.truncate(path, 0)
    print("touching the view", flush=True)
    print(float(view.sum()), flush=True)
    """
    flags = ["-X", "faulthandler"] if faulthandler else []
    proc = run_child(body, tmp_path, *flags, env={"LD_PRELOAD": str(SHIM)})
    lines = proc.stdout.splitlines()
    assert lines and lines[0].startswith("{"), (proc.returncode, proc.stdout, proc.stderr)
    results = json.loads(lines[0])
    assert len(results) == 8, results
    for key, outcome in results.items():
        if key.endswith("then"):
            assert outcome is True, key
            continue
        assert shard_file(tmp_path) in outcome, (key, outcome)
        assert "could not be read through the file's mapping (SIGBUS)" in outcome, (key, outcome)
        assert "the file shrank" in outcome, (key, outcome)
    assert lines[1:] == ["touching the view"], proc.stdout
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr)
    # faulthandler reached (its whole line may be cut short: the view's sum runs on torch's
    # threads, and a second thread's fault can end the process while the first one writes it).
    assert ("Fatal Python error:" in proc.stderr) == faulthandler, proc.stderr


# Python's faulthandler enabled after the guard (the first zero-copy load) runs first: it prints
# its traceback and passes the signal on, and the load still raises the error; the process lives.
def test_faulthandler_enabled_after_the_first_mapped_load_passes_the_fault_on(tmp_path):
    if not SHIM.exists():
        pytest.skip(f"{SHIM} is not built")
    body = """
    import faulthandler
    assert equal(loads()["load"]())
    faulthandler.enable()
    os.environ["FSDP_EMA_FAULT_TRUNCATE_ON_MMAP"] = str(cut_w)
    try:
        loads()["load"]()
    except RuntimeError as e:
        print(json.dumps(str(e)), flush=True)
    """
    proc = run_child(body, tmp_path, env={"LD_PRELOAD": str(SHIM)})
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    error = json.loads(proc.stdout.splitlines()[-1])
    assert shard_file(tmp_path) in error and "the file shrank" in error, error
    assert "Fatal Python error: Bus error" in proc.stderr, proc.stderr


# faulthandler enabled before the guard and disabled afterwards puts back the default action it
# found, over the guard: the next zero-copy load installs the guard again (review of #41 item 5).
def test_the_guard_is_back_after_faulthandler_disable(tmp_path):
    if not SHIM.exists():
        pytest.skip(f"{SHIM} is not built")
    body = """
    import faulthandler
    faulthandler.enable()
    outcomes = []
    for _ in range(2):
        os.environ["FSDP_EMA_FAULT_TRUNCATE_ON_MMAP"] = str(cut_w)
        try:
            loads()["load"]()
            outcomes.append("loaded")
        except RuntimeError as e:
            outcomes.append(str(e))
        del os.environ["FSDP_EMA_FAULT_TRUNCATE_ON_MMAP"]
        restore()
        faulthandler.disable()
    print(json.dumps(outcomes), flush=True)
    """
    proc = run_child(body, tmp_path, env={"LD_PRELOAD": str(SHIM)})
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    outcomes = json.loads(proc.stdout.splitlines()[-1])
    assert len(outcomes) == 2, outcomes
    for error in outcomes:
        assert shard_file(tmp_path) in error and "the file shrank" in error, error


# Another process truncates the file and writes it back, over and over, while zero-copy loads
# run: every load returns the stored values (checked with the file whole again) or raises an
# error naming the file; the process never dies. The loop runs until the guarded verification
# was hit a few times, within a bound (300 loads), whichever error the timing gives.
def test_loads_racing_a_truncating_process_are_right_or_clear_errors(tmp_path):
    body = """
    import subprocess
    truncator = subprocess.Popen([sys.executable, "-c", sys.argv[2], path, str(cut_w)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def pause():
        truncator.stdin.write(b"p")
        truncator.stdin.flush()
        assert truncator.stdout.read(1) == b"."

    counts = {"loaded": 0, "wrong": 0, "guarded": 0, "other": 0}
    others = []
    calls = list(loads().values())
    i = 0
    while i < 300 and (i < 20 or counts["guarded"] < 3):
        try:
            got = calls[i % 2]()
            pause()
            counts["loaded"] += 1
            counts["wrong"] += not equal(got)
        except RuntimeError as e:
            pause()
            msg = str(e)
            assert path in msg, msg
            counts["guarded" if "the file shrank" in msg else "other"] += 1
            others.append(msg.splitlines()[0][:300])
        truncator.stdin.write(b"g")
        truncator.stdin.flush()
        i += 1
    truncator.stdin.write(b"q")
    truncator.stdin.close()
    truncator.wait()
    print(json.dumps({"counts": counts, "loads": i, "messages": others[:5]}), flush=True)
    """
    proc = run_child(body, tmp_path)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    out = json.loads(proc.stdout.splitlines()[-1])
    counts = out["counts"]
    assert counts["wrong"] == 0, out
    assert counts["loaded"] + counts["guarded"] + counts["other"] == out["loads"], out
    # Which error a racing load meets depends on the timing (on a quiet machine the truncation
    # is mostly seen at the open, "past the end of the data section"): every one names the file
    # (asserted in the child) and none killed the process. The guarded verification itself is
    # shown deterministically by the tests above.
