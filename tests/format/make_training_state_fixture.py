"""Writes tests/format/data/training_state/: a small training-state checkpoint
(fsdp_ema.save_training_state, one process, no RNG states) of a Linear(4, 3) after one AdamW
step, with its EMA: tensors "model.*", "optim.state.*", "ema.*" and "meta.training_state".
cli_test.sh exports its "ema." and "model." tensors with `fsdp-ema export --what`. Run with the
venv python from anywhere (after the library is built):

    /opt/fsdp_ema/venv/bin/python tests/format/make_training_state_fixture.py
"""

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

import fsdp_ema  # noqa: E402

out = os.path.join(HERE, "data", "training_state")
shutil.rmtree(out, ignore_errors=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
ema = fsdp_ema.ShardedEMA(model, 0.5)
model(torch.randn(2, 4)).sum().backward()
opt.step()
ema.update()
fsdp_ema.save_training_state(out, model=model, optimizer=opt, ema=ema, extra={"step": 1},
                             rng=False)
print(f"wrote {out}")
