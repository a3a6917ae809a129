"""Loads while another process rewrites the checkpoint's files in place (issue 33).

A second process toggles bytes of a shard file's data, by ``pwrite`` and through a ``MAP_SHARED``
mapping whose page is already dirty (such writes move neither mtime nor ctime, so ``fstat``
cannot see them), while loads run: whole, resharded (2 ranks of a 1-rank checkpoint, 3 of 2),
``load_into``, ``OpenCheckpoint``'s check-then-write, ``load_shard``. Every verified load either
returns the stored bytes or raises; none returns a changed byte. The same loads with
``verify=False`` do return changed bytes: the writer really reaches them.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from fsdp_ema import checkpoint as ckpt

TRIES = 24

# Toggles a random byte of [lo, hi) of the file, keeps it changed for a moment, restores it;
# forever, until killed. mode "pwrite" or "mapped" (a MAP_SHARED mapping, its pages dirtied once
# first so that later writes move no time stamp).
_WRITER = textwrap.dedent("""
    import mmap, os, random, sys, time
    path, lo, hi, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, 0, mmap.MAP_SHARED) if mode == "mapped" else None
    if m is not None:
        for page in range(lo - lo % 4096, hi, 4096):
            m[page] = m[page]
    rng = random.Random(3)
    print("ready", flush=True)
    while True:
        at = rng.randrange(lo, hi)
        if m is not None:
            m[at] ^= 0x40
            time.sleep(0.0005)
            m[at] ^= 0x40
        else:
            b = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([b[0] ^ 0x40]), at)
            time.sleep(0.0005)
            os.pwrite(fd, b, at)
        time.sleep(0.0002)
""")


def data_range(path) -> tuple[int, int]:
    """[begin, end) of all tensor bytes of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    ends = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
    return 8 + n + min(b for b, _ in ends), 8 + n + max(e for _, e in ends)


@contextmanager
def rewriting(path, mode: str):
    lo, hi = data_range(path)
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(lo), str(hi), mode],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield
    finally:
        proc.kill()
        proc.wait()


def state():
    g = torch.Generator().manual_seed(33)
    # 3 MiB over 3 tensors: several blocks each, uneven rows.
    return {"w": torch.randn(4099, 128, generator=g), "b": torch.randn(1000, generator=g),
            "v": torch.randn(257, 1024, generator=g).to(torch.bfloat16)}


def save_by(directory, ref, writers: int) -> None:
    for r in range(writers):
        pieces = {}
        for k, t in ref.items():
            rows = torch.chunk(t, writers)[r]
            offset = sum(c.shape[0] for c in torch.chunk(t, writers)[:r])
            pieces[k] = (rows, [offset] + [0] * (t.dim() - 1), list(t.shape))
        ckpt.save_shard(directory, pieces, rank=r, world_size=writers, fsync=False)
    ckpt.commit(directory, writers, fsync=False)


def count(load, expect, verify: bool) -> tuple[int, int]:
    """(wrong, refused) over TRIES calls of load(verify) against expect()."""
    wrong = refused = 0
    for i in range(TRIES):
        try:
            got = load(verify, i)
        except RuntimeError as e:
            assert "checksum mismatch" in str(e) or "changed since it was opened" in str(e), e
            refused += 1
            continue
        want = expect(i)
        wrong += any(not torch.equal(got[k], want[k]) for k in want)
    return wrong, refused


def cases(tmp_path):
    ref = state()
    one, two = tmp_path / "one", tmp_path / "two"
    save_by(one, ref, 1)
    save_by(two, ref, 2)
    target = one / ckpt.shard_file_name(0, 1)
    rows = lambda r, w: {k: torch.chunk(t, w)[r] for k, t in ref.items()}  # noqa: E731

    def load_into(verify, i):
        dst = {k: torch.zeros_like(t) for k, t in ref.items()}
        ckpt.load_into(one, dst, verify=verify)
        return dst

    def check_then_write(verify, i):
        opened = ckpt.open_checkpoint(one)
        dst = {k: torch.zeros_like(t) for k, t in ref.items()}
        opened.check_into(dst, verify=verify)
        opened.load_into(dst, verify=verify, checked=True)
        return dst

    def shard(verify, i):
        return {k: v[0] for k, v in ckpt.load_shard(target, verify=verify).items()}

    return target, two / ckpt.shard_file_name(1, 2), {
        "whole": (lambda v, i: ckpt.load(one, verify=v), lambda i: ref),
        "1->2": (lambda v, i: ckpt.load(one, rank=i % 2, world_size=2, verify=v),
                 lambda i: rows(i % 2, 2)),
        "load_into": (load_into, lambda i: ref),
        "check_then_write": (check_then_write, lambda i: ref),
        "load_shard": (shard, lambda i: ref),
    }, {
        "2->3": (lambda v, i: ckpt.load(two, rank=i % 3, world_size=3, verify=v),
                 lambda i: rows(i % 3, 3)),
    }


@pytest.mark.parametrize("mode", ["pwrite", "mapped"])
def test_no_verified_load_returns_a_byte_another_process_changed(tmp_path, mode):
    one_file, two_file, on_one, on_two = cases(tmp_path)
    results = {}
    for file, loads in ((one_file, on_one), (two_file, on_two)):
        with rewriting(file, mode):
            for name, (load, expect) in loads.items():
                results[name] = count(load, expect, verify=True)
                results[name + " unverified"] = count(load, expect, verify=False)
    for name in list(on_one) + list(on_two):
        assert results[name][0] == 0, f"{name}: {results[name][0]} wrong loads of {TRIES} ({mode})"
    # The writer reaches the loads: unverified, some of them return its bytes.
    assert sum(results[n + " unverified"][0] for n in list(on_one) + list(on_two)) > 0, results


def test_a_write_through_a_dirty_shared_page_between_check_and_write_is_refused(tmp_path):
    """fstat sees no change (the page was dirty already), so only the write pass's hash can."""
    ref = state()
    save_by(tmp_path, ref, 1)
    path = tmp_path / ckpt.shard_file_name(0, 1)
    lo, _ = data_range(path)
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, 0, mmap.MAP_SHARED)
        m[lo] = m[lo]  # dirty the page before the checkpoint is opened
        opened = ckpt.open_checkpoint(tmp_path)
        dst = {k: torch.zeros_like(t) for k, t in ref.items()}
        opened.check_into(dst)
        m[lo + 1] ^= 0x40  # the same page: mtime and ctime stay
        opened.check_unchanged()  # fstat cannot tell
        with pytest.raises(RuntimeError, match="checksum mismatch"):
            opened.load_into(dst, checked=True)
        with pytest.raises(RuntimeError, match="checksum mismatch"):
            opened.load(list(ref))
        m[lo + 1] ^= 0x40
        opened.load_into(dst, checked=True)
        assert all(torch.equal(dst[k], ref[k]) for k in ref)
        m.close()
    finally:
        os.close(fd)


def test_mmap_views_are_verified_at_load_and_then_show_the_file(tmp_path):
    """mmap=True returns views of the file (documented): verified when loaded, live after."""
    ref = state()
    save_by(tmp_path, ref, 1)
    path = Path(tmp_path) / ckpt.shard_file_name(0, 1)
    views = ckpt.load(tmp_path, mmap=True)
    assert all(torch.equal(views[k], ref[k]) for k in ref)
    lo, _ = data_range(path)
    with open(path, "r+b") as f:
        f.seek(lo)
        b = f.read(1)
        f.seek(lo)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        ckpt.load(tmp_path, mmap=True)
    # The views taken before show the change: they are the file's pages.
    changed = sum(int(not torch.equal(views[k], ref[k])) for k in ref)
    assert changed == 1
