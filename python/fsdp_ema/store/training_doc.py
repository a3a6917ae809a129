"""The JSON document of a training-state checkpoint: the names it and its tensors go by, the tagged
JSON of non-tensor values, and the document as the uint8 tensor of rank 0's file, read back and
checked. Saves and loads both go through here, so a value is encoded by one rule and decoded by
its inverse (docs/TRAINING_STATE.md, "The JSON document").
"""

from __future__ import annotations

import base64
import json
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from .. import _dtypes, _ops
from . import checkpoint as _ckpt

# The uint8 tensor (rank 0's file) holding the UTF-8 JSON document of the non-tensor state, and
# the prefixes of the EMA's and the model's tensors: format/'s names (fsdp_ema/format/names.h),
# which `fsdp-ema export` reads too.
META_TENSOR, EMA_PREFIX, MODEL_PREFIX = _ops.training_state_names()
#: Human-readable copy of that JSON, written beside the shard files before the commit.
SIDECAR_NAME = "training_state.json"
INDEX_NAME = _ops.index_file_name()  # format/'s name (fsdp_ema/format/names.h)
FORMAT_NAME = "fsdp_ema.training_state"
FORMAT_VERSION = 1

OPTIM_PREFIX, RNG_PREFIX = "optim.state.", "rng."


# --- JSON for non-tensor values -------------------------------------------------------------------
# Plain JSON for str/int/bool/None/finite floats/lists/dicts with string keys; a dict of one
# reserved key tags everything else: {"__tuple__": [...]}, {"__float__": "inf"},
# {"__dict__": [[key, value], ...]} (non-string keys, or a dict that looks like a tag),
# {"__bytes__": "<base64>"}, {"__tensor__": {"dtype", "shape", "data": "<base64>"}}.

_TAGS = frozenset({"__tuple__", "__float__", "__dict__", "__bytes__", "__tensor__"})


def encode(v: Any, where: str = "extra") -> Any:
    """``v`` as JSON, tagged where plain JSON would lose it; a value that is neither JSON nor a
    tensor raises TypeError naming ``where``."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        v = float(v)
        return v if math.isfinite(v) else {"__float__": repr(v)}
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": {"dtype": _dtypes.name_of(t.dtype),
                               "shape": list(t.shape),
                               "data": base64.b64encode(data).decode("ascii")}}
    if isinstance(v, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(v)).decode("ascii")}
    if isinstance(v, tuple):
        return {"__tuple__": [encode(x, f"{where}[{i}]") for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [encode(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        if all(isinstance(k, str) for k in v) and not (len(v) == 1 and next(iter(v)) in _TAGS):
            return {k: encode(x, f"{where}[{k!r}]") for k, x in v.items()}
        return {"__dict__": [[encode(k, where), encode(x, f"{where}[{k!r}]")]
                             for k, x in v.items()]}
    if hasattr(v, "tolist") and hasattr(v, "dtype"):  # numpy arrays
        return encode(torch.from_numpy(v), where)
    raise TypeError(f"save_training_state: {where} is a {type(v).__name__}, which is stored "
                    f"neither as JSON nor as a tensor; pass its state_dict() or plain values")


def decode_base64(body: Any, where: str) -> bytes:
    """The bytes of base64 text read from a checkpoint (the tags' and the RNG states'); anything
    else raises ValueError naming ``where``."""
    # validate=True: a character outside the alphabet is an error, never silently dropped bytes.
    if not isinstance(body, str):
        raise ValueError(f"{where}: base64 text expected, got {type(body).__name__}")
    try:
        return base64.b64decode(body, validate=True)
    except ValueError as e:
        raise ValueError(f"{where}: invalid base64 ({e})") from None


def decode(v: Any, where: str = "extra") -> Any:
    """Inverse of ``encode``; a malformed tag raises ValueError naming ``where``."""
    if isinstance(v, list):
        return [decode(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if not isinstance(v, dict):
        return v
    if len(v) == 1 and next(iter(v)) in _TAGS:
        (tag, body), = v.items()
        if tag == "__tuple__":
            if not isinstance(body, list):
                raise ValueError(f"{where}: __tuple__ holds a {type(body).__name__}, not a list")
            return tuple(decode(x, f"{where}[{i}]") for i, x in enumerate(body))
        if tag == "__float__":
            if body not in ("inf", "-inf", "nan"):
                raise ValueError(f"{where}: __float__ {body!r} is not inf, -inf or nan")
            return float(body)
        if tag == "__dict__":
            if not (isinstance(body, list) and all(isinstance(p, list) and len(p) == 2
                                                   for p in body)):
                raise ValueError(f"{where}: __dict__ must hold [key, value] pairs")
            out = {}
            for k, x in body:
                key = decode(k, where)
                try:
                    out[key] = decode(x, f"{where}[{key!r}]")
                except TypeError:
                    raise ValueError(f"{where}: key {key!r} is not hashable") from None
            return out
        if tag == "__bytes__":
            return decode_base64(body, where)
        # __tensor__
        if not (isinstance(body, dict) and set(body) == {"dtype", "shape", "data"}):
            raise ValueError(f"{where}: __tensor__ needs exactly dtype, shape and data")
        dtype = _dtypes.from_name(body["dtype"], where)
        shape = body["shape"]
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"{where}: tensor shape {shape!r} is not a list of sizes")
        raw = bytearray(decode_base64(body["data"], where))
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if len(raw) != expected:
            raise ValueError(f"{where}: a {body['dtype']} tensor of shape {shape} needs "
                             f"{expected} bytes, the data has {len(raw)}")
        flat = (torch.frombuffer(raw, dtype=torch.uint8) if raw
                else torch.empty(0, dtype=torch.uint8))
        return flat.view(dtype).reshape(shape).clone()
    return {k: decode(x, f"{where}[{k!r}]") for k, x in v.items()}


# --- the document as a tensor ---------------------------------------------------------------------

def json_tensor(doc: Any) -> torch.Tensor:
    """``doc`` as UTF-8 JSON in a uint8 tensor: stored in a shard file, it is checksummed and
    committed with the tensors (keys sorted, so the same state gives the same bytes)."""
    raw = bytearray(json.dumps(doc, sort_keys=True, allow_nan=False).encode("utf-8"))
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


def tensor_json(t: torch.Tensor) -> Any:
    """Inverse of ``json_tensor``."""
    return json.loads(bytes(t.contiguous().numpy()).decode("utf-8"))


def read_doc(ckpt: _ckpt.OpenCheckpoint, info: dict | None, verify: bool) -> dict:
    """The document of the open checkpoint ``ckpt`` (``info``: its ``info()`` if the caller has
    it), refused unless it is a training-state document of this format and version."""
    directory = ckpt.directory
    info = info if info is not None else ckpt.info()
    if META_TENSOR not in info["tensors"]:
        raise ValueError(f"{directory!r} is a checkpoint but not a training-state checkpoint "
                         f"(no {META_TENSOR!r})")
    doc = tensor_json(ckpt.load([META_TENSOR], verify=verify)[META_TENSOR])
    if doc.get("format") != FORMAT_NAME or doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"{directory!r}: unknown training-state format "
                         f"{doc.get('format')!r} version {doc.get('version')!r}")
    return doc
