"""What ties an EMA checkpoint to the training state it was saved with, and the checks a resume
makes against it (docs/INTEGRATIONS.md, "What a resume checks").

- ``fingerprint(pieces, ...)``: a fingerprint of tensors given as the pieces ranks write of them
  (``ShardedEMA.model_fingerprint`` hashes the model's weights this way): every element is hashed
  with its position in the full tensor, so the value is the same at any world size and sharding,
  and ranks combine their sums with one ``all_reduce`` of two integers (no rank gathers a tensor).
- ``settings(ema)``: the options that define the average, as JSON, and ``setting_changes`` /
  ``name_changes``: what differs between a saved EMA and the one made now, named.
- ``Binding``: the global step and the model's fingerprint at a save, with the EMA's settings;
  what both trainer integrations record beside every EMA they save and check on resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .._dtypes import name_of
from ..distributed.groups import comm_device
from ..ema.config import RESUME_SETTINGS

# Arithmetic modulo the Mersenne prime 2^31 - 1 in int64, every product of two reduced values
# below 2^62: exact on every device, so each rank's partial sums add up to the same total
# whichever rank hashed which element. Two lanes with their own constants give ~62 bits.
_P = (1 << 31) - 1
_LANES = ((0x5BD1E995 % _P, 0x27D4EB2F % _P, 0x165667B1 % _P, 0x61C88647 % _P,
           0x3C6EF372 % _P, 0x1B873593 % _P),
          (0x85EBCA6B % _P, 0x2545F491 % _P, 0x4F1BBCDC % _P, 0x6A09E667 % _P,
           0x510E527F % _P, 0x1F83D9AB % _P))
_CHUNK_WORDS = 1 << 22  # words hashed at once: bounds the transient int64 memory (~32 MiB each)


def _name_weights(name: str, dtype: torch.dtype, shape: Iterable[int]) -> tuple[int, int]:
    """Per-lane weights in [1, P) of one tensor: its name, dtype and global shape."""
    key = f"{name}\0{dtype}\0{list(shape)}".encode()
    digest = hashlib.blake2b(key, digest_size=16).digest()
    return tuple(1 + int.from_bytes(digest[8 * k:8 * k + 8], "little") % (_P - 1)
                 for k in range(2))


def _words(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The bytes of ``values`` (contiguous, at least 1-d) as int64 words of 16 bits (8 for
    1-byte dtypes), ``wpe`` words per element, element-major."""
    size = values.element_size()
    flat = values.reshape(-1)
    if size == 1:
        return flat.view(torch.uint8).to(torch.int64), 1
    return flat.view(torch.int16).to(torch.int64) & 0xFFFF, size // 2


def _global_index(offsets: list[int], shape: list[int], global_shape: list[int],
                  device: torch.device) -> torch.Tensor:
    """The flat index in the full tensor of each element of the box ``shape`` at ``offsets``,
    in the box's row-major order."""
    strides = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    index = torch.zeros((), dtype=torch.int64, device=device)
    for d, (o, s, g) in enumerate(zip(offsets, shape, strides)):
        axis = (torch.arange(s, dtype=torch.int64, device=device) + o) * g
        index = index.unsqueeze(-1) + axis.view(*([1] * d), s) if d else axis
    return index.reshape(-1)


def _lane_sums(words: torch.Tensor, word_index: torch.Tensor) -> list[int]:
    g1, g2 = word_index % _P, (word_index // _P) % _P
    out = []
    for c1, c2, c3, c4, c5, c6 in _LANES:
        t = (words * c1 + (g1 * c2) % _P + (g2 * c3) % _P + c4) % _P
        t = (t * t) % _P
        t = (t * c5 + words + c6) % _P
        t = (t * t) % _P
        out.append(int(t.sum()) % _P)
    return out


def _piece_sums(local: torch.Tensor, offsets: list[int], global_shape: list[int]) -> list[int]:
    """This piece's per-lane sums (mod P) over its 16-bit words, each hashed with its word's
    index in the full tensor."""
    if local.dim() == 0:
        local, offsets, global_shape = local.reshape(1), [0], [1]
    local = local.detach()
    sums = [0, 0]
    if local.numel() == 0:
        return sums
    row_numel = max(1, local[0].numel())
    rows_per_chunk = max(1, _CHUNK_WORDS // (row_numel * max(1, local.element_size() // 2)))
    for begin in range(0, local.shape[0], rows_per_chunk):
        chunk = local[begin:begin + rows_per_chunk].contiguous()
        words, wpe = _words(chunk)
        elements = _global_index([offsets[0] + begin, *offsets[1:]], list(chunk.shape),
                                 global_shape, chunk.device)
        word_index = (elements.unsqueeze(-1) * wpe
                      + torch.arange(wpe, dtype=torch.int64, device=chunk.device)).reshape(-1)
        for k, s in enumerate(_lane_sums(words, word_index)):
            sums[k] = (sums[k] + s) % _P
    return sums


def fingerprint(pieces: Mapping[str, Any], *, group, device: torch.device) -> str:
    """Collective: the fingerprint (16 hex digits) of the tensors whose pieces the ranks hold
    (``save_shard``'s input: a whole tensor, or ``(local, offsets, global_shape)``), each element
    counted once over all ranks. Equal for equal tensors (bit for bit) at any world size; any
    changed bit, moved element, renamed or reshaped tensor changes it (up to a ~2^-62 chance)."""
    total = [0, 0]
    for name, value in pieces.items():
        if isinstance(value, torch.Tensor):
            local, offsets, shape = value, [0] * value.dim(), list(value.shape)
        else:
            local, offsets, shape = value[0], list(value[1]), list(value[2])
        weights = _name_weights(name, local.dtype, shape)
        for k, s in enumerate(_piece_sums(local, offsets, shape)):
            total[k] = (total[k] + s * weights[k]) % _P
    if group is not None:
        t = torch.tensor(total, dtype=torch.int64, device=comm_device(group, device))
        dist.all_reduce(t, group=group)
        total = [int(v) % _P for v in t.tolist()]
    return f"{total[0]:08x}{total[1]:08x}"


# --- the EMA's settings ---------------------------------------------------------------------------

#: The options a resume compares: the fields of ``EMAConfig`` marked *compared* (``buffers``:
#: whether floating buffers are averaged or copied; None when the EMA keeps none).
SETTINGS = RESUME_SETTINGS


def _schedule(schedule: Any) -> Any:
    if schedule is None:
        return None
    text = repr(schedule)
    kind = f"{type(schedule).__module__}.{type(schedule).__qualname__}"
    # An object's default repr holds its address: only the type can be compared then.
    return kind if " at 0x" in text else f"{kind}: {text}"


def _params(params: Any) -> str:
    if isinstance(params, str):
        return params
    return f"callable {getattr(params, '__qualname__', type(params).__name__)}"


# How each setting is written as JSON (the others: as they are).
_AS_JSON = {
    "warmup": lambda w: None if w is None else dataclasses.asdict(w),
    "schedule": _schedule,
    "dtype": lambda d: None if d is None else name_of(d),
    "params": _params,
}


def config_settings(config, floating_buffers: bool) -> dict[str, Any]:
    """The options of ``config`` (an ``EMAConfig``) that define an average (``SETTINGS``), as
    JSON values; ``buffers`` is None when the EMA keeps no floating buffer."""
    out = {name: _AS_JSON.get(name, lambda v: v)(getattr(config, name)) for name in SETTINGS}
    if not floating_buffers:
        out["buffers"] = None
    return out


def settings(ema) -> dict[str, Any]:
    """The options that define ``ema``'s average (``ema.state.settings()``)."""
    return ema.state.settings()


def setting_changes(saved: Mapping[str, Any], current: Mapping[str, Any],
                    allow: Collection[str] = ()) -> list[str]:
    """``"<option>: <saved> when saved, <current> now"`` for each setting that differs and is not
    in ``allow`` (settings missing from ``saved``, written by an older fsdp_ema, are not
    compared)."""
    out = []
    for key in SETTINGS:
        if key in allow or key not in saved:
            continue
        if saved[key] != current.get(key):
            out.append(f"{key}: {saved[key]!r} when saved, {current.get(key)!r} now")
    return out


def name_changes(saved: Collection[str], current: Collection[str], limit: int = 8) -> list[str]:
    """What differs between the tensor names of a saved EMA and those of the EMA made now."""
    missing, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    out = []
    for what, names in (("not in the checkpoint", missing), ("only in the checkpoint", extra)):
        if names:
            more = f" and {len(names) - limit} more" if len(names) > limit else ""
            out.append(f"{len(names)} tensor(s) {what}: {names[:limit]}{more}")
    return out


@dataclasses.dataclass(frozen=True)
class Binding:
    """What identifies the training state an EMA was saved with: the trainer's global step (None
    in a loop with no trainer) and the fingerprint of the model's weights at that save, with the
    EMA's settings."""

    global_step: int | None
    fingerprint: str
    settings: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "fingerprint": self.fingerprint,
                "settings": self.settings}

    @classmethod
    def from_json(cls, value: Any) -> Binding | None:
        """None for anything that is not a saved binding (a checkpoint of an older fsdp_ema)."""
        if not (isinstance(value, Mapping) and (value.get("global_step") is None
                                                 or type(value.get("global_step")) is int)
                and isinstance(value.get("fingerprint"), str)):
            return None
        saved = value.get("settings")
        return cls(value["global_step"], value["fingerprint"],
                   dict(saved) if isinstance(saved, Mapping) else {})


def bind(ema, global_step: int | None) -> Binding:
    """Collective: the binding of ``ema`` saved at ``global_step`` now."""
    return Binding(None if global_step is None else int(global_step), ema.model_fingerprint(),
                   settings(ema))
