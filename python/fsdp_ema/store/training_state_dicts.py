"""The state dicts a training-state save writes and a load fills: the model's and the optimizer's
from ``torch.distributed.checkpoint.state_dict`` (DTensors for FSDP2, ShardedTensors for FSDP1,
plain tensors otherwise; collective for FSDP1), the EMA's from ``ShardedEMA.state_dict()``. Saves
and loads take them with the same options, so a load's templates match what the save wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .._dtypes import from_name
from ..distributed.groups import check_dtype_kind
from ..model.slots import clean_modules, join_name
from .training_doc import decode


class States(NamedTuple):
    """The state dicts of a save or load (None for what is not saved or loaded)."""

    model: dict[str, Any] | None
    optimizer: dict[str, Any] | None
    ema: dict[str, Any] | None


def state_options():
    """Sharded (each rank its own part) and where the tensors are: no gather, no copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def model_state(model):
    """``model``'s sharded state dict."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=state_options())


def optim_state(model, optimizer):
    """``optimizer``'s sharded state dict, keyed by ``model``'s FQNs."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=state_options())


def fresh_optim_state(model, optimizer, saved: Mapping[str, Any],
                      tensors: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The sharded state dict of an optimizer that has no state yet (a resumed job's), made from
    its parameters and the checkpoint instead of by ``get_optimizer_state_dict``, which runs a
    step at lr 0 to make one (zero gradients and state for every parameter: two thirds of a
    resume's time at 2 ranks, bench/RESULTS.md). ``saved``: the document's optimizer part
    (``{"type": class name, "state": {fqn: {key: {"tensor": name} | {"value": ...}}}, ...}``);
    ``tensors``: the checkpoint's tensors (``info()["tensors"]``). Each saved tensor is the shape
    of its parameter (a template like the parameter: a DTensor on its mesh for FSDP2, memory
    never touched) or 0-dim (a host scalar, as torch keeps ``step``), of the parameter's dtype
    (``step``: the saved one), as ``Optimizer.load_state_dict`` casts them; the templates are
    what the load fills or replaces, and ``load_optim_state`` hands the result to
    ``optimizer.load_state_dict``.

    None (torch's way is taken) where the parameters do not say what the state is: an optimizer
    of another class than the saved one (the template would take another class's state keys
    from the checkpoint, which ``Optimizer.load_state_dict`` or the next step trips over after
    the model is written; torch's template, from a step of this optimizer, has them refused
    before anything is), FSDP1 units, a parameter under two names or outside the model, saved
    names other than the parameters that require gradients, or a saved tensor of another shape
    or of another dtype kind than its parameter (torch's template says whether it is refused)."""
    try:
        return _fresh_optim_state(model, optimizer, saved, tensors)
    except (TypeError, ValueError, KeyError, AttributeError):
        return None  # a malformed document: the load's checks (agreed) name what is wrong


def _fresh_optim_state(model, optimizer, saved, tensors) -> dict[str, Any] | None:
    if not isinstance(saved, Mapping) or saved.get("type") != type(optimizer).__name__:
        return None
    saved = saved["state"]
    fqns = _param_fqns(model)
    if fqns is None or not isinstance(saved, Mapping):
        return None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(id(p) not in fqns for p in params):
        return None
    by_fqn = {fqns[id(p)]: p for p in params if p.requires_grad}
    if set(by_fqn) != set(saved):
        return None
    state: dict[str, dict[str, Any]] = {}
    for fqn, entries in saved.items():
        p = by_fqn[fqn]
        state[fqn] = {}
        for key, entry in entries.items():
            if "tensor" not in entry:
                state[fqn][key] = decode(entry["value"], f"optimizer state {fqn}.{key}")
                continue
            stored = tensors.get(entry["tensor"])
            if stored is None:
                return None  # the load names it
            shape = list(stored["shape"])
            dtype = from_name(stored["torch_dtype"], repr(entry["tensor"]))
            # Another kind than the parameter's (an integer moment of a float parameter): a
            # TypeError, None. Else the dtype ``Optimizer.load_state_dict`` casts it to.
            check_dtype_kind(entry["tensor"], dtype, p.dtype)
            dtype = dtype if key == "step" else p.dtype
            if shape == [] and p.dim() > 0:
                state[fqn][key] = torch.empty((), dtype=dtype)
            elif shape == list(p.shape) and p.dim() > 0:
                state[fqn][key] = torch.empty_like(p, dtype=dtype, requires_grad=False)
            else:
                return None
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [fqns[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def load_optim_state(optimizer, optim_sd: Mapping[str, Any]) -> None:
    """A state dict ``fresh_optim_state`` made (and the load filled) into ``optimizer``: its
    ``load_state_dict`` with the entries keyed by position, as ``Optimizer.state_dict`` numbers
    the parameters (``set_optimizer_state_dict`` would first run its step at lr 0 on an optimizer
    without state). The template's groups list the FQNs in the optimizer's own order, so an
    FQN's position there is its number."""
    index = {fqn: i for i, fqn in
             enumerate(fqn for g in optim_sd["param_groups"] for fqn in g["params"])}
    groups = [{**{k: v for k, v in mine.items() if k != "params"},
               "params": [index[fqn] for fqn in mine["params"]]}
              for mine in optim_sd["param_groups"]]
    optimizer.load_state_dict({"state": {index[fqn]: dict(entries)
                                         for fqn, entries in optim_sd["state"].items()},
                               "param_groups": groups})


def _param_fqns(model) -> dict[int, str] | None:
    """Each parameter's clean FQN (``get_optimizer_state_dict``'s names) by ``id``; None for a
    model with FSDP1 units or a parameter under two names."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    out: dict[int, str] = {}
    for prefix, module in clean_modules(model):
        if isinstance(module, FullyShardedDataParallel):
            return None
        for name, p in module.named_parameters(recurse=False):
            if id(p) in out:
                return None
            out[id(p)] = join_name(prefix, name)
    return out
