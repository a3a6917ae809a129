"""examples/self_distillation.py (DINO on scikit-learn's digits, the teacher ``ema.module()``)
under torchrun with 2 gloo ranks, shortened to 120 steps at twice the learning rate (the default
1e-3, made for 600 steps, leaves the teacher 0.9 points above the random network's k-NN): it
learns, does not collapse, and a run resumed from its mid-way checkpoint ends bit for bit where
the straight run ended."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from fsdp_ema import checkpoint

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY = 120, 60


def run_example(tmp_path: Path, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", str(ROOT / "examples" / "self_distillation.py"),
                          "--steps", str(STEPS), "--lr", "2e-3", "--eval-every", str(SAVE_EVERY),
                          "--save-every", str(SAVE_EVERY), *args],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "teacher == EMA: OK" in out.stdout, out.stdout[-3000:]
    return out.stdout


def figures(out: str) -> dict[str, float]:
    """The summary the example prints at the end, as numbers."""
    knn = re.search(r"random init ([\d.]+), student ([\d.]+), teacher ([\d.]+) "
                    r"\(the raw pixels: ([\d.]+)\)", out)
    entropy = re.search(r"teacher entropy ([\d.]+) nats per image, ([\d.]+) of the mean", out)
    assert knn and entropy, out[-3000:]
    return dict(zip(("random", "student", "teacher", "pixels", "entropy", "mean_entropy"),
                    map(float, knn.groups() + entropy.groups())))


def test_example_learns_without_collapse_and_resumes(tmp_path):
    """The k-NN accuracy (k = 20) of the teacher's and the student's backbone features on the 450
    test digits beats the randomly initialized network's by 1 point (4.5 test digits) or more
    (measured: 2.0 and 2.2 points; seeds fixed, the same figures in repeated runs); the
    teacher's targets are neither uniform (their entropy per image at least 1 nat below ln K) nor
    one prototype for every image (the entropy of their mean at least 2 nats; 65 prototypes).
    The example before issue 41 collapsed: entropy ln K, no k-NN. Then, as if killed after the
    checkpoint at step 60, again with ``--resume``: it continues at step 60, prints the same
    losses and figures, and its last checkpoint is the straight run's."""
    run = tmp_path / "run"
    straight = run_example(tmp_path, "--out", str(run))
    got = figures(straight)
    assert got["teacher"] >= got["random"] + 0.01, got  # measured: 0.962 and 0.964 against 0.942
    assert got["student"] >= got["random"] + 0.01, got
    assert got["entropy"] <= math.log(65) - 1 and got["mean_entropy"] >= 2, got
    assert sorted(p.name for p in run.iterdir()) == ["step-000060", "step-000120"]

    shutil.move(run / "step-000120", tmp_path / "straight")  # the run stopped after step 60
    resumed = run_example(tmp_path, "--out", str(run), "--resume")
    assert f"resumed from {run / 'step-000060'} at step 60" in resumed, resumed
    assert figures(resumed) == got

    def from_60(out: str) -> list[str]:
        return [line for line in out.splitlines()
                if line.startswith("step ") and int(line.split()[1]) >= SAVE_EVERY]

    # The straight run's k-NN line at step 60 was printed before the checkpoint.
    assert from_60(resumed) == from_60(straight)[1:], (from_60(straight), from_60(resumed))
    a, b = checkpoint.load(tmp_path / "straight"), checkpoint.load(run / "step-000120")
    compared = [n for n in a if n.split(".")[0] in ("model", "optim", "ema")]
    assert sorted(a) == sorted(b) and sum(n.startswith("ema.") for n in compared) == 17, a.keys()
    different = [n for n in compared if not torch.equal(a[n], b[n])]
    assert not different, different
