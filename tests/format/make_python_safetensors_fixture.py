"""Writes tests/format/data/python_safetensors.safetensors with the reference `safetensors`
package (no DCP or fsdp_ema metadata), for ShardFile.ReadsAFileWrittenByThePythonSafetensorsPackage:

    /opt/fsdp_ema/venv/bin/python tests/format/make_python_safetensors_fixture.py
"""

import os

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))

tensors = {
    "weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.5 - 1.0,
    "half": torch.tensor([1.0, -2.0], dtype=torch.bfloat16),
    "scalar": torch.tensor(-7, dtype=torch.int64),
    "empty": torch.zeros(0, 3, dtype=torch.float16),
    "flags": torch.tensor([True, False, True]),
}
out = os.path.join(HERE, "data", "python_safetensors.safetensors")
save_file(tensors, out, metadata={"format": "pt", "source": "safetensors.torch.save_file"})
os.chmod(out, 0o644)
print(out, os.path.getsize(out))
