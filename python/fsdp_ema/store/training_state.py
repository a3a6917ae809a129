"""Training-state checkpoints: model, optimizer, EMA, step, RNG and user state in one directory.

``save_training_state(dir, model=..., optimizer=..., ema=..., extra={...})`` writes every tensor
shard by shard through ``fsdp_ema.checkpoint.save_shard`` (one safetensors file per rank, the
format of docs/FORMAT.md) and the small non-tensor state as JSON text stored in a uint8 tensor of
rank 0's file, so the index written last by rank 0 commits (and checksums) all of it at once.
``load_training_state(dir, model=..., optimizer=..., ema=...)`` restores it at any world size and
returns ``extra``. Layout and usage: docs/TRAINING_STATE.md.

The model and optimizer state dicts come from ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``get_optimizer_state_dict`` and the ``set_*`` counterparts), which
give DTensors for FSDP2, ShardedTensors for FSDP1 and plain tensors otherwise; the EMA's from
``ShardedEMA.state_dict()``. Nothing is pickled.
"""

from __future__ import annotations

import base64
import json
import math
import numbers
import os
import random
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .. import _dtypes, _ops
from ..distributed.groups import default_group
from ..distributed.groups import rank_world as _rank_world
from ..model.layouts import layout_of
from . import checkpoint as _ckpt
from .binding import settings
from .collective import LoadTarget, agreed, load_collective, save_collective

__all__ = ["save_training_state", "load_training_state", "latest_checkpoint",
           "read_training_state_json", "META_TENSOR", "INDEX_NAME", "SIDECAR_NAME"]

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


def _encode(v: Any, where: str = "extra") -> Any:
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
        return {"__tuple__": [_encode(x, f"{where}[{i}]") for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [_encode(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        if all(isinstance(k, str) for k in v) and not (len(v) == 1 and next(iter(v)) in _TAGS):
            return {k: _encode(x, f"{where}[{k!r}]") for k, x in v.items()}
        return {"__dict__": [[_encode(k, where), _encode(x, f"{where}[{k!r}]")]
                             for k, x in v.items()]}
    if hasattr(v, "tolist") and hasattr(v, "dtype"):  # numpy arrays
        return _encode(torch.from_numpy(v), where)
    raise TypeError(f"save_training_state: {where} is a {type(v).__name__}, which is stored "
                    f"neither as JSON nor as a tensor; pass its state_dict() or plain values")


def _b64(body: Any, where: str) -> bytes:
    # validate=True: a character outside the alphabet is an error, never silently dropped bytes.
    if not isinstance(body, str):
        raise ValueError(f"{where}: base64 text expected, got {type(body).__name__}")
    try:
        return base64.b64decode(body, validate=True)
    except ValueError as e:
        raise ValueError(f"{where}: invalid base64 ({e})") from None


def _decode(v: Any, where: str = "extra") -> Any:
    """Inverse of ``_encode``; a malformed tag raises ValueError naming ``where``."""
    if isinstance(v, list):
        return [_decode(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if not isinstance(v, dict):
        return v
    if len(v) == 1 and next(iter(v)) in _TAGS:
        (tag, body), = v.items()
        if tag == "__tuple__":
            if not isinstance(body, list):
                raise ValueError(f"{where}: __tuple__ holds a {type(body).__name__}, not a list")
            return tuple(_decode(x, f"{where}[{i}]") for i, x in enumerate(body))
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
                key = _decode(k, where)
                try:
                    out[key] = _decode(x, f"{where}[{key!r}]")
                except TypeError:
                    raise ValueError(f"{where}: key {key!r} is not hashable") from None
            return out
        if tag == "__bytes__":
            return _b64(body, where)
        # __tensor__
        if not (isinstance(body, dict) and set(body) == {"dtype", "shape", "data"}):
            raise ValueError(f"{where}: __tensor__ needs exactly dtype, shape and data")
        dtype = _dtypes.from_name(body["dtype"], where)
        shape = body["shape"]
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"{where}: tensor shape {shape!r} is not a list of sizes")
        raw = bytearray(_b64(body["data"], where))
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if len(raw) != expected:
            raise ValueError(f"{where}: a {body['dtype']} tensor of shape {shape} needs "
                             f"{expected} bytes, the data has {len(raw)}")
        flat = (torch.frombuffer(raw, dtype=torch.uint8) if raw
                else torch.empty(0, dtype=torch.uint8))
        return flat.view(dtype).reshape(shape).clone()
    return {k: _decode(x, f"{where}[{k!r}]") for k, x in v.items()}


def _json_tensor(doc: Any) -> torch.Tensor:
    raw = bytearray(json.dumps(doc, sort_keys=True, allow_nan=False).encode("utf-8"))
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


def _tensor_json(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.contiguous().numpy()).decode("utf-8"))


# --- RNG ------------------------------------------------------------------------------------------

def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
        "python": _encode(random.getstate()),
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


def _checked_rng_state(state: Any, where: str) -> dict[str, Any]:
    """Decodes one rank's saved RNG states and checks each against this torch, Python and NumPy
    (a scratch generator takes it first), so that restoring them afterwards cannot fail."""
    if not isinstance(state, dict) or "torch_cpu" not in state or "python" not in state:
        raise ValueError(f"{where}: an RNG state needs 'torch_cpu' and 'python'")
    out: dict[str, Any] = {}
    raw = _b64(state["torch_cpu"], f"{where}.torch_cpu")
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
    python_state = _decode(state["python"], f"{where}.python")
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
            raw = _b64(b64, f"{where}.cuda[{i}]")
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


def _set_rng_state(state: Mapping[str, Any]) -> None:
    """Restores what ``_checked_rng_state`` returned."""
    torch.set_rng_state(state["torch_cpu"])
    random.setstate(state["python"])
    for i, s in enumerate(state.get("cuda", [])):
        torch.cuda.set_rng_state(s, i)
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


# --- collecting state -----------------------------------------------------------------------------

def _state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def _model_state(model):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_state_options())


def _optim_state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_state_options())


def _optim_key(fqn: str, key: str) -> str:
    return f"{OPTIM_PREFIX}{fqn}.{key}"


# --- saving ---------------------------------------------------------------------------------------

def save_training_state(directory: str | os.PathLike, *, model=None, optimizer=None, ema=None,
                        extra: Mapping[str, Any] | None = None, rng: bool = True,
                        keep_last: int | None = None, overwrite: bool = False,
                        async_: bool = False, if_busy: str = "wait"):
    """Writes a training-state checkpoint into ``directory``. Collective: every rank calls it.

    Args:
        model: the (FSDP2, FSDP1, DDP or plain) model; its sharded state dict is saved under
            ``model.<fqn>``.
        optimizer: its optimizer (needs ``model``): state tensors under
            ``optim.state.<fqn>.<key>``, ``param_groups`` hyperparameters in the JSON.
        ema: a ``ShardedEMA``: ``ema.<fqn>`` tensors, its step in the JSON.
        extra: JSON-able user state (step, epoch, ``lr_scheduler.state_dict()``, data-loader
            position...); tuples, non-finite floats, bytes and small tensors are tagged (see
            docs/TRAINING_STATE.md). Returned as it was by ``load_training_state``.
        rng: save every rank's RNG states (torch CPU, CUDA if initialized, Python, NumPy).
        keep_last: after the commit, remove all but the ``keep_last`` last committed
            training-state checkpoints among ``directory``'s siblings (by name order; the new
            one is never removed).
        overwrite: replace a committed checkpoint in ``directory`` (else an error).
        async_: return a ``SaveHandle`` once the state is staged into host buffers (reused
            between saves); the files are written, committed (and older ones rotated) on a
            background thread. ``handle.result()`` returns the bytes or raises on every rank.
        if_busy: with a save of this function still in flight, ``"wait"`` for it or
            ``"raise"`` (on every rank).

    A failure on any rank raises on every rank and leaves ``directory`` uncommitted (no index).
    Returns the bytes of this rank's shard file (or the handle for them).
    """
    directory = os.fspath(directory)
    what = f"save_training_state({directory!r})"
    if keep_last is not None and (int(keep_last) != keep_last or keep_last < 1):
        raise ValueError(f"{what}: keep_last must be an integer >= 1 or None, got {keep_last}")
    if optimizer is not None and model is None:
        raise ValueError(f"{what}: saving an optimizer needs its model (for the FQNs)")
    group = default_group()
    rank, world = _rank_world(group)
    # Collective parts first (FSDP1 state dicts all-gather / all_to_all): every rank gets here.
    states = _States(model=_model_state(model) if model is not None else None,
                     optimizer=_optim_state(model, optimizer) if optimizer is not None else None,
                     ema=ema.state_dict() if ema is not None else None)
    save = _Save(directory, what, rank, world, states, optimizer=optimizer, ema=ema, rng=rng,
                 extra=extra, keep_last=keep_last)
    saver = None
    if async_:
        from .async_save import default_saver

        saver = default_saver("save_training_state")
    return save_collective(directory, save.pieces, group=group, device=torch.device("cpu"),
                           what=what, overwrite=overwrite, collective_pieces=False,
                           prepare=save.prepare, after_commit=save.after_commit,
                           async_saver=saver, if_busy=if_busy)


class _States(NamedTuple):
    """The state dicts of a save or load (None for what is not saved or loaded)."""

    model: dict[str, Any] | None
    optimizer: dict[str, Any] | None
    ema: dict[str, Any] | None


def _optimizer_pieces(optim_sd: Mapping[str, Any], optimizer, rank: int,
                      shards: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's part of the document; its state tensors' pieces go into ``shards``."""
    state: dict[str, Any] = {}
    for fqn, entries in optim_sd["state"].items():
        state[fqn] = {}
        for key, v in entries.items():
            if isinstance(v, torch.Tensor):
                name = _optim_key(fqn, key)
                shards.update(layout_of(name, v).piece(rank))
                state[fqn][key] = {"tensor": name}
            else:
                state[fqn][key] = {"value": _encode(v, f"optimizer state {fqn}.{key}")}
    groups = [{k: _encode(v, f"param_groups[{i}][{k!r}]") for k, v in g.items()}
              for i, g in enumerate(optim_sd["param_groups"])]
    return {"type": type(optimizer).__name__, "state": state, "param_groups": groups}


def _ema_pieces(ema, ema_sd: Mapping[str, Any], rank: int,
                shards: dict[str, Any]) -> dict[str, Any]:
    """The EMA's part of the document; its tensors' pieces go into ``shards``."""
    step_key = type(ema).STEP_KEY
    names = [k for k in ema_sd if k != step_key]
    for fqn in names:
        shards.update(layout_of(EMA_PREFIX + fqn, ema_sd[fqn]).piece(rank))
    # The host's count when known: int() of a device step would wait for all the work queued on
    # the stream (an async save would block on the training).
    return {"step": ema.state.step_count() if step_key in ema_sd else None, "decay": ema.decay,
            "settings": settings(ema), "tensors": sorted(names)}


class _Save:
    """The steps of one ``save_training_state`` that ``save_collective`` runs: ``pieces`` (with
    the directory check, before any write: what this rank writes, and on rank 0 the document),
    ``prepare`` (once this rank's file is written: the sidecar) and ``after_commit`` (the
    rotation)."""

    def __init__(self, directory: str, what: str, rank: int, world: int, states: _States, *,
                 optimizer, ema, rng: bool, extra: Mapping[str, Any] | None,
                 keep_last: int | None):
        self.directory, self.what, self.rank, self.world = directory, what, rank, world
        self.states, self.optimizer, self.ema = states, optimizer, ema
        self.rng, self.extra, self.keep_last = rng, extra, keep_last
        self.sidecar: str | None = None

    def pieces(self) -> dict[str, Any]:
        rank, states, shards = self.rank, self.states, {}
        doc: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION,
                               "world_size": self.world}
        for fqn, v in (states.model or {}).items():
            shards.update(layout_of(MODEL_PREFIX + fqn, v).piece(rank))
        doc["model"] = {"tensors": sorted(states.model)} if states.model is not None else None
        doc["optimizer"] = (None if states.optimizer is None else
                            _optimizer_pieces(states.optimizer, self.optimizer, rank, shards))
        doc["ema"] = None if self.ema is None else _ema_pieces(self.ema, states.ema, rank, shards)
        doc["rng"] = {"ranks": self.world} if self.rng else None
        if self.rng:
            shards[f"{RNG_PREFIX}{rank}"] = _json_tensor(_rng_state())
        doc["extra"] = _encode(dict(self.extra or {}))
        if rank == 0:
            shards[META_TENSOR] = _json_tensor(doc)
            self.sidecar = json.dumps(doc, indent=1, sort_keys=True)
        return shards

    def prepare(self) -> None:
        if self.sidecar is not None:
            _ops.write_sidecar(self.directory, SIDECAR_NAME, self.sidecar, True)

    def after_commit(self) -> None:
        if self.rank == 0 and self.keep_last is not None:
            # The save is committed: a rotation that fails is a warning, never this save's error.
            try:
                _rotate(self.directory, int(self.keep_last))
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"{self.what}: committed, but removing older checkpoints failed: "
                              f"{e}", RuntimeWarning, stacklevel=5)


# --- rotation and lookup (the directory work is format/'s: committed_checkpoints,
# remove_checkpoint) ---------------------------------------------------------------------------

def _is_training_state(path: str) -> bool:
    try:
        return META_TENSOR in _ckpt.info(path)["tensors"]
    except Exception:  # noqa: BLE001 (unreadable: not a checkpoint we may count or remove)
        return False


def _committed(root: str, follow_links: bool) -> list[str]:
    return [name for name in _ops.committed_checkpoints(root, follow_links)
            if _is_training_state(os.path.join(root, name))]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The last (in name order) committed training-state checkpoint directory in ``root``, or
    None. Directories without an index (a save that did not finish) are skipped."""
    committed = _committed(os.fspath(root), follow_links=True)
    return Path(root) / committed[-1] if committed else None


def _rotate(new: str, keep_last: int) -> None:
    """Removes committed checkpoints beside ``new`` beyond the last ``keep_last`` (name order),
    never ``new`` itself. Only real directories directly in the root count and are removed: a
    symbolic link (to a checkpoint elsewhere, say) is neither followed nor touched
    (``remove_checkpoint`` opens everything without following links, so nothing outside the root
    is ever changed). Each goes index first, so an interrupted removal leaves an incomplete
    directory, never a committed one with missing files. Raises on the first failure (the caller
    warns: the new checkpoint is committed by then)."""
    new = os.path.abspath(new)
    root, new_name = os.path.dirname(new), os.path.basename(new)
    for name in _committed(root, follow_links=False)[:-keep_last]:
        if name != new_name:
            _ops.remove_checkpoint(os.path.join(root, name))


# --- loading --------------------------------------------------------------------------------------

def read_training_state_json(directory: str | os.PathLike, *, verify: bool = True,
                             info: dict | None = None) -> dict:
    """The JSON document of a committed training-state checkpoint (from rank 0's file,
    checksum verified), tags not decoded. ``info``: ``fsdp_ema.checkpoint.info(directory)``
    if the caller has it."""
    directory = os.fspath(directory)
    return _read_doc(_ckpt.open_checkpoint(directory), info, verify)


def _read_doc(ckpt: _ckpt.OpenCheckpoint, info: dict | None, verify: bool) -> dict:
    directory = ckpt.directory
    info = info if info is not None else ckpt.info()
    if META_TENSOR not in info["tensors"]:
        raise ValueError(f"{directory!r} is a checkpoint but not a training-state checkpoint "
                         f"(no {META_TENSOR!r})")
    doc = _tensor_json(ckpt.load([META_TENSOR], verify=verify)[META_TENSOR])
    if doc.get("format") != FORMAT_NAME or doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"{directory!r}: unknown training-state format "
                         f"{doc.get('format')!r} version {doc.get('version')!r}")
    return doc


def load_training_state(directory: str | os.PathLike, *, model=None, optimizer=None, ema=None,
                        rng: bool = True, strict: bool = True, verify: bool = True) -> dict:
    """Restores what ``save_training_state`` wrote, at the same or another world size, into
    ``model``, ``optimizer`` and ``ema`` (each optional), and returns ``extra``. Collective.

    Each rank reads only the rows it holds (its rank and world size) where the layout is
    torch.chunk dim-0 rows (FSDP2, FSDP1), whole tensors otherwise, straight into the state
    dicts' tensors where the dtype is the stored one (for FSDP2 and plain models the parameters',
    the optimizer's and the EMA's own). RNG states: rank ``r`` restores the state rank ``r``
    saved; ranks past the saved world size keep theirs. Everything is checked (checksums
    included) on every rank before anything is written: a failure on any rank raises on every
    rank and leaves every object (and the RNGs) as it was.
    """
    directory = os.fspath(directory)
    what = f"load_training_state({directory!r})"
    if optimizer is not None and model is None:
        raise ValueError(f"{what}: loading an optimizer needs its model (for the FQNs)")
    group = default_group()
    rank, _ = _rank_world(group)
    given = {"model": model, "optimizer": optimizer, "ema": ema}
    # Nothing is written until every rank has read and checked everything it will restore (the
    # JSON document, extra, its RNG states, every tensor's data and dtype) and all ranks agree:
    # a failure anywhere raises on every rank and leaves model, optimizer, EMA and RNGs as they
    # were.
    ckpt, info, doc, extra, rng_state = agreed(
        lambda: _read_checked(directory, given, rank, rng, verify), group=group,
        device=torch.device("cpu"), what=what)
    # Templates (collective for FSDP1; the optimizer's state is initialized if it is empty).
    optim_sd = _optim_state(model, optimizer) if optimizer is not None else None
    states = _States(model=_model_state(model) if model is not None else None,
                     optimizer=optim_sd, ema=ema.state_dict() if ema is not None else None)
    # Every rank checks every tensor (names, shapes, dtypes, every destination and checksum)
    # before any rank writes; then each reads into the state dicts' tensors in place, which for
    # FSDP2 and plain models are the parameters', the optimizer's and the EMA's own.
    plan = _LoadPlan(doc, states, ema, strict)
    load_collective(ckpt, plan.targets, info=info, group=group, device=torch.device("cpu"),
                    what=what, verify=verify)
    _restore(plan.states, model, optimizer, ema, rng_state, strict)
    return extra


def _read_checked(directory: str, given: Mapping[str, Any], rank: int, rng: bool,
                  verify: bool) -> tuple[_ckpt.OpenCheckpoint, dict, dict, dict, Any]:
    """Step 1 of a load (agreed): the document, ``extra`` and this rank's RNG states, read and
    checked from one open of the checkpoint (every later read sees the same files)."""
    ckpt = _ckpt.open_checkpoint(directory)
    info = ckpt.info()
    doc = _read_doc(ckpt, info, verify)
    for part, value in given.items():
        if value is not None and doc.get(part) is None:
            raise ValueError(f"the checkpoint holds no {part} state")
    extra = _decode(doc.get("extra"), f"{directory}: extra")
    if not isinstance(extra, dict):
        raise ValueError(f"extra is a {type(extra).__name__}, not a dict")
    if given["ema"] is not None and doc["ema"]["step"] is not None and (
            type(doc["ema"]["step"]) is not int or doc["ema"]["step"] < 0):
        raise ValueError(f"the EMA step {doc['ema']['step']!r} is not a count")
    rng_state = None
    if rng and doc.get("rng") and rank < doc["rng"]["ranks"]:
        name = f"{RNG_PREFIX}{rank}"
        if name not in info["tensors"]:
            raise KeyError(f"{name!r} (rank {rank}'s RNG states) is not in the checkpoint")
        rng_state = _checked_rng_state(_tensor_json(ckpt.load([name], verify=verify)[name]),
                                       f"{directory}: {name}")
    return ckpt, info, doc, extra, rng_state


class _LoadPlan:
    """Step 2 of a load (in the collective load's check): the names checked against the
    document and the tensors to read (``targets``); the state dicts' non-tensor values (the
    optimizer's, the EMA's step) are set from the document, and the model's keeps only the saved
    names (``states``)."""

    def __init__(self, doc: Mapping[str, Any], states: _States, ema, strict: bool):
        self.doc, self.states, self.ema, self.strict = doc, states, ema, strict

    def targets(self, _info) -> list[LoadTarget]:
        targets: list[LoadTarget] = []
        if self.states.model is not None:
            targets += self._model_targets()
        if self.states.optimizer is not None:
            targets += self._optimizer_targets()
            self._param_groups()
        if self.states.ema is not None:
            targets += self._ema_targets()
        return targets

    def _model_targets(self) -> list[LoadTarget]:
        saved = set(self.doc["model"]["tensors"])
        _check_names("model", set(self.states.model), saved, self.strict)
        model_sd = {k: v for k, v in self.states.model.items() if k in saved}
        self.states = self.states._replace(model=model_sd)
        return [layout_of(MODEL_PREFIX + k, v).target() for k, v in model_sd.items()]

    def _optimizer_targets(self) -> list[LoadTarget]:
        optim_sd, saved_state = self.states.optimizer, self.doc["optimizer"]["state"]
        _check_names("optimizer state", set(optim_sd["state"]), set(saved_state), self.strict)
        targets = []
        for fqn, entries in optim_sd["state"].items():
            if fqn not in saved_state:
                continue
            for key, v in list(entries.items()):
                entry = saved_state[fqn].get(key)
                where = f"optimizer state {fqn}.{key}"
                if entry is None:
                    raise KeyError(f"{where} is not in the checkpoint")
                if "tensor" in entry:
                    if not isinstance(v, torch.Tensor):
                        raise TypeError(f"{where} is a tensor in the checkpoint but a "
                                        f"{type(v).__name__} here")
                    targets.append(layout_of(entry["tensor"], v).target())
                    continue
                value = _decode(entry["value"], where)
                if isinstance(v, torch.Tensor) or type(value) is not type(v):
                    raise TypeError(f"{where} is a {type(value).__name__} in the checkpoint "
                                    f"but a {type(v).__name__} here")
                entries[key] = value
        return targets

    def _param_groups(self) -> None:
        optim_sd = self.states.optimizer
        saved_groups = [_decode(g, f"param_groups[{i}]")
                        for i, g in enumerate(self.doc["optimizer"]["param_groups"])]
        if len(saved_groups) != len(optim_sd["param_groups"]):
            raise ValueError(f"the checkpoint has {len(saved_groups)} param groups, the "
                             f"optimizer {len(optim_sd['param_groups'])}")
        for mine, theirs in zip(optim_sd["param_groups"], saved_groups):
            if sorted(mine["params"]) != sorted(theirs["params"]):
                raise ValueError("the optimizer's param groups hold other parameters than the "
                                 "checkpoint's")
            mine.update({k: v for k, v in theirs.items() if k != "params"})

    def _ema_targets(self) -> list[LoadTarget]:
        ema_sd, step_key = self.states.ema, type(self.ema).STEP_KEY
        saved = set(self.doc["ema"]["tensors"])
        mine = {k for k in ema_sd if k != step_key}
        _check_names("EMA", mine, saved, self.strict)
        if self.doc["ema"]["step"] is not None:
            ema_sd[step_key] = torch.tensor(self.doc["ema"]["step"], dtype=torch.int64)
        return [layout_of(EMA_PREFIX + k, ema_sd[k]).target() for k in mine if k in saved]


def _restore(states: _States, model, optimizer, ema, rng_state, strict: bool) -> None:
    """Step 3 of a load, once every tensor is read: the state dicts into their objects, then
    the RNG states."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if states.model is not None:
        set_model_state_dict(model, states.model, options=StateDictOptions(strict=strict))
    if states.optimizer is not None:
        set_optimizer_state_dict(model, optimizer, states.optimizer, options=_state_options())
    if states.ema is not None:
        ema.load_state_dict(states.ema, strict=strict)
    if rng_state is not None:
        _set_rng_state(rng_state)


def _check_names(what: str, mine: set[str], saved: set[str], strict: bool) -> None:
    if not strict:
        return
    missing, unexpected = sorted(mine - saved), sorted(saved - mine)
    if missing or unexpected:
        raise ValueError(f"{what}: missing from the checkpoint {missing[:8]}, only in the "
                         f"checkpoint {unexpected[:8]}")
