"""Every rank's RNG states in a training-state checkpoint (torch CPU, CUDA if initialized, Python,
NumPy): taken at a save, checked whole at a load before anything is written, restored last. Each
rank's states are JSON text in its own ``rng.<rank>`` tensor (``training_doc.RNG_PREFIX``).
"""

from __future__ import annotations

import base64
import random
from collections.abc import Mapping
from typing import Any

import torch

from .training_doc import decode, decode_base64, encode


def rng_state() -> dict[str, Any]:
    """This rank's RNG states as JSON values (the generators' bytes in base64)."""
    state: dict[str, Any] = {
        "torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
        "python": encode(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode("ascii")
                         for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        pass
    else:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def checked_rng_state(state: Any, where: str) -> dict[str, Any]:
    """Decodes one rank's saved RNG states and checks each against this torch, Python and NumPy
    (a scratch generator takes it first), so that restoring them afterwards cannot fail."""
    if not isinstance(state, dict) or "torch_cpu" not in state or "python" not in state:
        raise ValueError(f"{where}: an RNG state needs 'torch_cpu' and 'python'")
    out: dict[str, Any] = {}
    raw = decode_base64(state["torch_cpu"], f"{where}.torch_cpu")
    want = torch.get_rng_state().numel()
    if len(raw) != want:
        raise ValueError(f"{where}.torch_cpu: {len(raw)} bytes, but this torch's CPU generator "
                         f"state has {want}")
    cpu = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
    try:
        torch.Generator().set_state(cpu)
    except RuntimeError as e:
        raise ValueError(f"{where}.torch_cpu: refused by torch: {e}") from None
    out["torch_cpu"] = cpu
    python_state = decode(state["python"], f"{where}.python")
    try:
        random.Random().setstate(python_state)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}.python: refused by random.setstate: {e}") from None
    out["python"] = python_state
    if "cuda" in state and torch.cuda.is_available():
        if not isinstance(state["cuda"], list):
            raise ValueError(f"{where}.cuda: a list of per-device states expected")
        out["cuda"] = []
        for i, b64 in enumerate(state["cuda"][:torch.cuda.device_count()]):
            raw = decode_base64(b64, f"{where}.cuda[{i}]")
            want = torch.cuda.get_rng_state(i).numel()
            if len(raw) != want:
                raise ValueError(f"{where}.cuda[{i}]: {len(raw)} bytes, but this torch's CUDA "
                                 f"generator state has {want}")
            out["cuda"].append(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())
    if "numpy" in state:
        import numpy as np

        try:
            name, keys, pos, has_gauss, cached = state["numpy"]
            np_state = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
            np.random.RandomState().set_state(np_state)
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"{where}.numpy: refused by numpy: {e}") from None
        out["numpy"] = np_state
    return out


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restores what ``checked_rng_state`` returned."""
    torch.set_rng_state(state["torch_cpu"])
    random.setstate(state["python"])
    for i, s in enumerate(state.get("cuda", [])):
        torch.cuda.set_rng_state(s, i)
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
