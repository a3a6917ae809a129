"""Checkpoints at the tensor counts of real training states: 25k, 50k, 100k and 200k tiny tensors
(one rank), and an index of 2,000 tensors x 64 ranks, with dcp.save/dcp.load and safetensors at
200k tensors measured in the same run, on tmpfs (the cost measured is the format's, not the disk's).

Rows (seconds; min and median of --repeat interleaved repeats: this VM is noisy, and every size
and method takes its turn in each round):
  save + commit   fsdp_ema.checkpoint.save (save_shard + commit_checkpoint, fsync on)
  verify          the `fsdp-ema verify` command line (index, headers, coverage, every checksum)
  load one        open the checkpoint and load one tensor (fsdp_ema.checkpoint.load)
  load all        every tensor, as load_training_state reads them (owned memory, verified)

Targets (on the medians): every row at 200k tensors <= 2 s, and 200k/100k <= 2.3 per row (linear).
The anchors repeat --anchor-repeat times (default 2: one dcp.save of 200k tensors takes ~85 s).

    python bench/bench_scale.py [--repeat 5] [--anchor-repeat 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from report import finish  # noqa: E402

from fsdp_ema import checkpoint as ckpt  # noqa: E402

warnings.filterwarnings("ignore")
CLI = ROOT / "build" / "bin" / "fsdp-ema"
SIZES = (25_000, 50_000, 100_000, 200_000)
ROWS = ("save + commit", "verify", "load one", "load all")


def tiny_state(n: int) -> dict:
    # Names as long as a transformer's ("model.layers.12.mlp.3.weight"), 4 floats each.
    return {f"model.layers.{i // 8}.mlp.{i % 8}.weight": torch.full((4,), float(i))
            for i in range(n)}


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def verify(directory: Path) -> None:
    proc = subprocess.run([str(CLI), "verify", str(directory)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fsdp-ema verify failed: {proc.stdout}{proc.stderr}")


def reads(directory: Path, expected: dict, one: str) -> dict:
    """The verify, load-one and load-all rows of a committed checkpoint of `expected`."""
    names = list(expected)
    out = {}
    t0 = time.perf_counter()
    verify(directory)
    out["verify"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    single = ckpt.load(directory, [one])
    out["load one"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    every = ckpt.load(directory, names)
    out["load all"] = time.perf_counter() - t0
    assert torch.equal(single[one], expected[one])
    assert len(every) == len(names) and torch.equal(every[names[-1]], expected[names[-1]])
    return out


def ours(directory: Path, state: dict) -> dict:
    """One round of our four rows on `state`; returns seconds per row."""
    names = list(state)
    out = {}
    fresh(directory)
    t0 = time.perf_counter()
    ckpt.save(directory, state)
    out["save + commit"] = time.perf_counter() - t0
    out.update(reads(directory, state, names[len(names) // 2]))
    return out


def ranks64(directory: Path, tensors: int = 2000, world: int = 64) -> dict:
    """An index of `tensors` x `world` pieces: each rank saves its torch.chunk rows of each one."""
    full = {f"model.layers.{i // 8}.mlp.{i % 8}.weight": torch.full((world + 3, 2), float(i))
            for i in range(tensors)}
    names = list(full)
    out = {}
    fresh(directory)
    t0 = time.perf_counter()
    for rank in range(world):
        shards = {}
        for name, t in full.items():
            rows = t.size(0)
            cs = -(-rows // world)
            b, e = min(rank * cs, rows), min(rank * cs + cs, rows)
            shards[name] = (t[b:e], [b, 0], list(t.shape))
        ckpt.save_shard(directory, shards, rank=rank, world_size=world)
    ckpt.commit(directory, world)
    out["save + commit"] = time.perf_counter() - t0
    out.update(reads(directory, full, names[7]))  # whole tensors: each from 64 pieces
    return out


def anchors(base: Path, state: dict) -> dict:
    """dcp.save/dcp.load and safetensors save_file/load_file on the same 200k tensors."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    out = {}
    d = fresh(base / "dcp")
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=str(d))
    out["dcp.save"] = time.perf_counter() - t0
    target = {k: torch.empty_like(v) for k, v in state.items()}
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=str(d))
    out["dcp.load"] = time.perf_counter() - t0
    f = fresh(base / "st") / "m.safetensors"
    t0 = time.perf_counter()
    save_file(state, str(f))
    out["safetensors save_file"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = load_file(str(f))
    for t in loaded.values():  # load_file maps lazily: touch every tensor
        t.sum()
    out["safetensors load_file (+ touch)"] = time.perf_counter() - t0
    return out


def stats(xs):
    return min(xs), statistics.median(xs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--anchor-repeat", type=int, default=2)
    parser.add_argument("--base", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not CLI.exists():
        sys.exit(f"{CLI} is missing: build first (bash scripts/build.sh)")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{args.repeat} interleaved repeats (anchors {args.anchor_repeat}), under {args.base}")
    work = Path(tempfile.mkdtemp(prefix="fsdp_ema_scale_", dir=args.base))
    states = {n: tiny_state(n) for n in SIZES}
    runs = {n: {r: [] for r in ROWS} for n in (*SIZES, "2000x64")}
    anchor_runs: dict = {}
    try:
        for rep in range(max(args.repeat, args.anchor_repeat)):
            if rep < args.repeat:
                for n in SIZES:
                    for row, s in ours(work / f"ours{n}", states[n]).items():
                        runs[n][row].append(s)
                for row, s in ranks64(work / "r64").items():
                    runs["2000x64"][row].append(s)
            if rep < args.anchor_repeat:
                for row, s in anchors(work, states[SIZES[-1]]).items():
                    anchor_runs.setdefault(row, []).append(s)
            print(f"  round {rep + 1} done", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'tensors':>10s}  " + "  ".join(f"{r:>22s}" for r in ROWS))
    print(f"{'':>10s}  " + "  ".join(f"{'min / median':>22s}" for _ in ROWS))
    for n, rows in runs.items():
        cells = [f"{stats(rows[r])[0]:9.3f} / {stats(rows[r])[1]:8.3f}" for r in ROWS]
        print(f"{str(n):>10s}  " + "  ".join(f"{c:>22s}" for c in cells))
    print("\nanchors at 200,000 tensors (min / median s), and ours beside them:")
    big = runs[SIZES[-1]]
    pairs = {"dcp.save": "save + commit", "safetensors save_file": "save + commit",
             "dcp.load": "load all", "safetensors load_file (+ touch)": "load all"}
    for row, xs in anchor_runs.items():
        mn, md = stats(xs)
        ours_md = stats(big[pairs[row]])[1]
        print(f"  {row:34s} {mn:8.3f} / {md:8.3f}   ours ({pairs[row]}) {ours_md:.3f}: "
              f"{md / ours_md:.2f}x")

    checks = []
    for r in ROWS:
        md200 = stats(runs[200_000][r])[1]
        md100 = stats(runs[100_000][r])[1]
        checks.append((f"{r} at 200k", md200 <= 2.0, f"median {md200:.3f} s (target <= 2 s)"))
        checks.append((f"{r} 200k/100k", md200 / md100 <= 2.3,
                       f"{md200 / md100:.2f} (target <= 2.3, linear)"))
    results = {"ours": {str(k): v for k, v in runs.items()}, "anchors": anchor_runs}
    finish(results, checks, args.json)


if __name__ == "__main__":
    main()
