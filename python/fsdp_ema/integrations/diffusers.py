"""``EMAModel``: a drop-in for diffusers' ``EMAModel`` (``diffusers.training_utils``) that keeps
the EMA shard by shard on FSDP2 and FSDP1 models and whole on plain and DDP ones, with no rank
ever holding a full copy of a sharded model's EMA (``pip install "fsdp-ema[diffusers]"``).

The change to a diffusers training script::

    from fsdp_ema.integrations.diffusers import EMAModel    # was: diffusers.training_utils
    ema = EMAModel(unet, decay=..., use_ema_warmup=True, model_cls=UNet2DModel,
                   model_config=unet.config)                # the module, not unet.parameters()

The EMA is made from the model at its first use (``step``, ``copy_to``, ``state_dict``, ...), so
``EMAModel(unet)`` may come before ``accelerator.prepare`` (FSDP2's ``fully_shard`` shards
``unet`` in place, DDP wraps it: the EMA follows ``unet`` as they leave it); FSDP1 puts the model
inside a new root, so there the EMA is made from the model ``prepare`` returns. A validation
forward before the first use (FSDP2 then keeps the root's parameters unsharded) changes none of
this: ``step``, ``copy_to``, ``store`` and ``restore`` reshard the model before they read it.
The first update always copies the weights (diffusers' ``get_decay(1)`` is 0), so making the
EMA at the first ``step`` gives diffusers' average exactly. The rest is diffusers' API:

- ``step(parameters)`` (the model's parameters: ``unet.parameters()``), ``get_decay(k)``,
  ``optimization_step``, ``cur_decay_value``: diffusers' schedule (``DiffusersDecay``, computed
  on the device, the weight ``1 - decay`` formed in double); the averaging is
  ``fsdp_ema.ShardedEMA``'s, one fused update per step;
- ``copy_to(parameters)``, ``store(parameters)``, ``restore(parameters)``: shard into shard
  (``store`` keeps this rank's shards of the given parameters, on the host as diffusers does);
- ``state_dict()`` / ``load_state_dict()``: diffusers' keys. A whole EMA gives
  ``shadow_params`` as diffusers does (its tensors, in ``parameters()`` order) plus
  ``shadow_names``; a sharded one, inside ``accelerator.save_state`` (the object registered with
  ``accelerator.register_for_checkpointing``), writes its shards (each rank its own) into
  ``<dir>/custom_checkpoint_<i>_ema`` and returns a reference to it, which ``load_state`` reads
  back at any world size; elsewhere, ``shadow_params`` are DTensors (FSDP2) or ShardedTensors
  (FSDP1), which ``torch.distributed.checkpoint`` saves and reshards;
- ``save_pretrained(path)`` (collective on a sharded EMA: every rank gathers, rank 0 writes
  tensor by tensor) writes the folder ``model_cls.from_pretrained(path)`` loads, with the
  schedule in its ``config.json``; ``from_pretrained(path, model_cls)`` reads it back;
- ``to(device, dtype)``: the EMA beside the weights or, ``"cpu"`` for weights on an accelerator,
  in host memory (updated there from a staged copy); ``pin_memory()`` puts it in pinned host
  memory for good (the ``to`` calls of diffusers' offload loop then move nothing);
- ``params="trainable"`` (beyond diffusers): the EMA of a LoRA model's adapters only (a model
  with ``add_adapter(LoraConfig(...))``, as diffusers' LoRA scripts make it, or a peft
  ``PeftModel``); ``save_lora_adapter(path)`` writes it as diffusers
  (``unet.load_lora_adapter(path, prefix=None)``) and peft (``PeftModel.from_pretrained``) read
  it, and ``save_pretrained`` writes the model with the EMA adapters merged;
- ``ema``: the ``fsdp_ema.ShardedEMA`` doing the work (``swap()``, ``module()``, ``save()``...).

What cannot keep its meaning is refused with one error: an iterable of parameters in place of
the model, ``step``/``copy_to`` with parameters of another layout, ``shadow_params`` of a sharded
EMA (this rank holds shards; ``state_dict()`` gives them), ``to`` a device that is neither the
weights' nor the host. Buffers are not averaged (diffusers' EMA has parameters only); a frozen
parameter is averaged, which keeps it as it is while it stays frozen (diffusers copies it).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .common import caller_locals, missing_framework

try:
    import diffusers  # noqa: F401  (the framework this adapter serves)
except ImportError as _e:
    raise missing_framework(__name__, "diffusers", "diffusers") from _e

from ..ema.config import EMAConfig
from ..ema.sharded import ShardedEMA
from ..model.slots import FlatSlot, ShardedSlot, clean_modules, global_shape, is_ddp
from .diffusers_files import save_lora_adapter, save_pretrained
from .diffusers_schedule import SCALARS, DiffusersDecay, check_settings

__all__ = ["EMAModel", "DiffusersDecay"]

#: Keys of ``state_dict()`` beside diffusers' own: the names of ``shadow_params``, and the
#: folder a sharded EMA was saved into by ``accelerator.save_state``.
NAMES_KEY = "shadow_names"
SHARDED_KEY = "fsdp_ema.sharded"


def _params(parameters: Any, what: str) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        return list(parameters.parameters())
    if parameters is None or isinstance(parameters, torch.Tensor):
        raise TypeError(f"{what}: parameters must be an iterable of the model's parameters "
                        f"(unet.parameters()), got {type(parameters).__name__}")
    return list(parameters)


class _Registered:
    """The model's parameters as ``parameters()`` lists them and the dict each is registered in,
    from one walk of the model, so that the check of ``step``'s list costs one pass over it (a
    walk of the model's modules per step would cost as much as a small model's update)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.walk()

    def walk(self) -> None:
        seen: set[int] = set()
        self.params: list[torch.Tensor] = []
        self.owners: list[tuple[dict, str]] = []
        for module in self.model.modules():
            for key, p in module._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    self.params.append(p)
                    self.owners.append((module._parameters, key))

    def current(self) -> bool:
        """Whether every parameter of the last walk is still registered where it was (FSDP2's
        ``fully_shard``, its unsharding and ``assign=True`` loads replace them)."""
        return all(owner.get(key) is p for (owner, key), p in zip(self.owners, self.params))

    def own(self, given: list[torch.Tensor]) -> bool:
        """Whether ``given`` are the model's parameters, all of them, in any order: one pass when
        they are those of the last walk in its order and still registered, else a new walk."""
        if (len(given) == len(self.params) and all(map(operator.is_, given, self.params))
                and self.current()):
            return True
        self.walk()
        return len(given) == len(self.params) and (
            {id(p) for p in given} == {id(p) for p in self.params})


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: the local shard of a DTensor, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _accelerate_call(name: str, obj: Any) -> dict[str, Any] | None:
    """The locals of ``accelerate.checkpointing.<name>`` (``save_custom_state`` /
    ``load_custom_state``: the folder and index of a registered object) when it is calling us
    for ``obj`` itself (not for another object that holds it: two EMAs held by one registered
    object would share the folder)."""
    try:
        from accelerate import checkpointing
    except ImportError:
        return None
    code = getattr(getattr(checkpointing, name, None), "__code__", None)
    found = caller_locals(lambda c: c is code)
    return found if found is not None and found.get("obj") is obj else None


class EMAModel:
    """diffusers' ``EMAModel``, kept shard by shard (see the module's docstring).

    Args:
        parameters: the model (``unet``; DDP's wrapper, FSDP2's ``fully_shard``ed module and
            FSDP1's root are taken too). An iterable of parameters is refused: a sharded EMA
            needs the module (FSDP2 replaces the parameters when it shards).
        decay, min_decay, update_after_step, use_ema_warmup, inv_gamma, power: diffusers'
            schedule (``DiffusersDecay``).
        foreach: accepted for diffusers' signature (the update is always one fused call).
        model_cls, model_config: what ``save_pretrained`` writes (``model_cls(**model_config)``).
        params: ``"all"`` (diffusers': every parameter) or ``"trainable"`` (those with
            ``requires_grad``: a LoRA model's adapters).
        dtype: the EMA's dtype; None (diffusers'): each parameter's own.

    The schedule is the one the arguments give: diffusers' ``EMAModel`` turns
    ``use_ema_warmup`` on when handed a module (its deprecated form), which this class does not
    copy, so ``EMAModel(unet, ...)`` averages as diffusers' ``EMAModel(unet.parameters(), ...)``.
    """

    def __init__(self, parameters: nn.Module, decay: float = 0.9999, min_decay: float = 0.0,
                 update_after_step: int = 0, use_ema_warmup: bool = False,
                 inv_gamma: float | int = 1.0, power: float | int = 2 / 3,
                 foreach: bool = False, model_cls: Any | None = None,
                 model_config: dict[str, Any] | None = None, *, params: str = "all",
                 dtype: torch.dtype | None = None, **kwargs: Any):
        what = "fsdp_ema.integrations.diffusers.EMAModel"
        unknown = sorted(set(kwargs) - {"max_value", "min_value", "device"})
        if unknown:
            raise TypeError(f"{what}: unexpected argument(s) {unknown}")
        if not isinstance(parameters, nn.Module):
            raise TypeError(
                f"{what}: pass the model itself (EMAModel(unet, ...)), not its parameters: a "
                f"sharded EMA follows the module as FSDP shards it (fully_shard replaces the "
                f"parameters), got {type(parameters).__name__}")
        if kwargs.get("max_value") is not None:  # diffusers' deprecated names
            decay = kwargs["max_value"]
        if kwargs.get("min_value") is not None:
            min_decay = kwargs["min_value"]
        self.schedule = DiffusersDecay(decay, min_decay, update_after_step, use_ema_warmup,
                                       inv_gamma, power)
        self.config = EMAConfig.of(what, None, dict(schedule=self.schedule, dtype=dtype,
                                                    params=params, include_buffers=False))
        self.model = parameters.module if is_ddp(parameters) else parameters
        # What FSDP2 and DDP keep and FSDP1 changes (it flattens the parameters).
        self._initial_shapes = _parameter_shapes(self.model)
        self.foreach = foreach
        self.model_cls, self.model_config = model_cls, model_config
        self.temp_stored_params: list[torch.Tensor] | None = None
        self.cur_decay_value: float | None = None
        self._ema: ShardedEMA | None = None
        self._sharded = False
        self._registered = _Registered(self.model)
        self._pinned = False
        if kwargs.get("device") is not None:
            self.to(device=kwargs["device"])

    # --- diffusers' attributes --------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name in SCALARS and name != "optimization_step":
            return getattr(self.__dict__["schedule"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SCALARS and name != "optimization_step":
            check_settings(f"EMAModel.{name}", {name: value})
            setattr(self.schedule, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def optimization_step(self) -> int:
        """Updates so far (``step`` calls), as diffusers counts them."""
        return 0 if self._ema is None else self._ema.state.step_count()

    @optimization_step.setter
    def optimization_step(self, value: int) -> None:
        check_settings("EMAModel.optimization_step", {"optimization_step": value})
        self.ema.state.set_step(value)

    @property
    def shadow_params(self) -> list[torch.Tensor]:
        """The EMA's tensors in ``parameters()`` order (diffusers' list), for a whole EMA; a
        sharded EMA holds this rank's shards only and refuses."""
        ema = self.ema
        if self.sharded:
            raise RuntimeError(
                "EMAModel.shadow_params: the EMA of this sharded model holds this rank's shards "
                "only, not the full tensors diffusers lists; use state_dict() (DTensors / "
                "ShardedTensors), copy_to() or save_pretrained()")
        values = ema.state_dict()
        return [values[n] for n in self.names()]

    # --- the EMA, made at its first use -----------------------------------------------------------

    @property
    def ema(self) -> ShardedEMA:
        """The ``fsdp_ema.ShardedEMA`` doing the work, made from the model at the first use; one
        made before the model was sharded in place (FSDP2) is remade sharded, its values kept."""
        if self._ema is None:
            self._set(self._build())
        elif not self._sharded and not self._registered.current():
            self._registered.walk()
            if _is_sharded(self.model):
                old = self._ema
                self._set(self._build())
                self._ema.load_state_dict(old.state_dict())
        return self._ema

    def _set(self, ema: ShardedEMA) -> None:
        self._ema = ema
        self._sharded = any(isinstance(s, (ShardedSlot, FlatSlot)) for s in ema.state.slots)

    def _build(self) -> ShardedEMA:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = self.model
        changed = _parameter_shapes(model) != self._initial_shapes
        if changed and not isinstance(model, FullyShardedDataParallel):
            raise RuntimeError(
                f"EMAModel: the parameters of {type(model).__name__} changed since the EMAModel "
                f"was made (FSDP1, FullyShardedDataParallel, flattens them and puts the model "
                f"inside a new root); make the EMAModel from the model accelerator.prepare "
                f"returns")
        return ShardedEMA(model, self.config)

    @property
    def sharded(self) -> bool:
        """Whether the EMA keeps shards (FSDP2, FSDP1) rather than whole tensors."""
        return self._sharded

    def names(self) -> list[str]:
        """The EMA's tensor names in diffusers' order (the model's ``parameters()``): by
        module, in ``named_modules`` order, each module's in its own order."""
        order = {prefix: i for i, (prefix, _) in enumerate(clean_modules(self.model))}
        names = list(self.ema.shapes)
        return sorted(names, key=lambda n: order.get(n.rpartition(".")[0], len(order)))

    def _own(self, given: list[torch.Tensor]) -> bool:
        """Whether ``given`` are the model's parameters, all of them (after any resharding)."""
        return self._registered.own(given)

    # --- diffusers' methods -----------------------------------------------------------------------

    def get_decay(self, optimization_step: int) -> float:
        """diffusers' decay of update ``optimization_step`` (``DiffusersDecay.get_decay``)."""
        return self.schedule.get_decay(int(optimization_step))

    @torch.no_grad()
    def step(self, parameters: Any) -> None:
        """One EMA update from the model's current weights (call it after each optimizer step,
        under ``accelerator.sync_gradients``). ``parameters`` must be the model's."""
        ema = self.ema
        ema.state.reshard()
        if not self._own(_params(parameters, "EMAModel.step")):
            raise ValueError("EMAModel.step(parameters): the parameters are not those of the "
                             "model the EMA follows (pass the trained model's parameters, "
                             "unet.parameters(), or make the EMAModel from that model)")
        ema.update()
        self.cur_decay_value = self.get_decay(self.optimization_step)

    @torch.no_grad()
    def copy_to(self, parameters: Any) -> None:
        """Writes the EMA into ``parameters``: the model's own (each rank its shards), or those
        of a model laid out alike, one tensor per EMA tensor in order."""
        ema = self.ema
        ema.state.reshard()
        given = _params(parameters, "EMAModel.copy_to")
        if self._own(given):
            ema.copy_to()
            return
        targets = [_local(p) for p in given]
        values = ema.state.tensors
        if len(targets) != len(values) or any(
                t.shape != v.shape for t, v in zip(targets, values)):
            raise ValueError(
                f"EMAModel.copy_to: {len(targets)} parameters given, of other shapes than the "
                f"EMA's {len(values)} tensors of this rank; pass the model's parameters or a "
                f"model laid out alike")
        torch._foreach_copy_(targets, [v.to(t.device) for t, v in zip(targets, values)])

    @torch.no_grad()
    def store(self, parameters: Any) -> None:
        """Keeps a host copy of ``parameters`` (this rank's shards) for ``restore``."""
        self._reshard()
        self.temp_stored_params = [_local(p).detach().cpu().clone()
                                   for p in _params(parameters, "EMAModel.store")]

    @torch.no_grad()
    def restore(self, parameters: Any) -> None:
        """Writes back what ``store`` kept, bit for bit, and forgets it."""
        if self.temp_stored_params is None:
            raise RuntimeError("This ExponentialMovingAverage has no `store()`ed weights to "
                               "`restore()`")
        self._reshard()
        targets = [_local(p) for p in _params(parameters, "EMAModel.restore")]
        stored = self.temp_stored_params
        if len(targets) != len(stored) or any(t.shape != s.shape for t, s in zip(targets, stored)):
            raise ValueError(f"EMAModel.restore: {len(targets)} parameters given, not the "
                             f"{len(stored)} that store() kept (or of other shapes)")
        torch._foreach_copy_(targets, [s.to(t.device) for t, s in zip(targets, stored)])
        self.temp_stored_params = None

    def _reshard(self) -> None:
        """The model's shards in its parameters (FSDP2 keeps the root's unsharded after a
        forward without backward, an evaluation before the EMA's first use included)."""
        if self._ema is not None:
            self._ema.state.reshard()
            return
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def pin_memory(self) -> None:
        """For weights on an accelerator: the EMA in pinned host memory from now on, updated
        there (``to`` then moves nothing). Weights on the CPU: nothing to do."""
        self._pinned = True
        self._place("cpu")

    def to(self, device: Any = None, dtype: torch.dtype | None = None,
           non_blocking: bool = False) -> None:
        """``device``: the weights' device (the EMA beside them) or ``"cpu"`` (host memory, for
        weights on an accelerator); ``dtype``: the EMA's floating dtype."""
        del non_blocking
        if dtype is not None:
            if not dtype.is_floating_point:
                raise ValueError(f"EMAModel.to: dtype must be floating, got {dtype}")
            self._remake(dict(dtype=dtype))
        if device is not None and not self._pinned:
            self._place(device)

    def _place(self, device: Any) -> None:
        device = torch.device(device)
        weights = next(iter(self.model.parameters())).device
        if device.type == weights.type and device.index in (None, weights.index):
            self._remake(dict(device=None))
        elif device.type == "cpu":
            self._remake(dict(device="cpu"))
        else:
            raise ValueError(f"EMAModel.to: the EMA lives beside the weights ({weights}) or in "
                             f"host memory ('cpu'), not on {device}")

    def _remake(self, changes: dict[str, Any]) -> None:
        import dataclasses

        config = dataclasses.replace(self.config, **changes)
        if config == self.config:
            return
        self.config = config
        if self._ema is not None:
            old = self._ema
            self._set(self._build())
            self._ema.load_state_dict(old.state_dict())

    # --- state dicts ------------------------------------------------------------------------------

    def _scalars(self) -> dict[str, Any]:
        return {**self.schedule.settings(), "optimization_step": self.optimization_step}

    def state_dict(self) -> dict[str, Any]:
        """diffusers' keys (``decay`` ... ``power``, ``optimization_step``, ``shadow_params``)
        and ``shadow_names``; see the module's docstring for a sharded EMA."""
        ema = self.ema
        scalars = self._scalars()
        out: dict[str, Any] = {k: scalars[k] for k in SCALARS}
        saving = _accelerate_call("save_custom_state", self) if self.sharded else None
        if saving is not None:
            folder = f"custom_checkpoint_{saving['index']}_ema"
            ema.save(os.path.join(os.fspath(saving["path"]), folder), overwrite=True)
            out[SHARDED_KEY] = {"folder": folder, "names": self.names()}
            return out
        values = ema.state_dict()
        names = self.names()
        out["shadow_params"] = [values[n] for n in names]
        out[NAMES_KEY] = names
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a ``state_dict()`` of this class (at any world size) or of diffusers'
        ``EMAModel``; everything is checked before anything changes."""
        what = "EMAModel.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{what}: state_dict must be a dict, got {type(state_dict).__name__}")
        scalars = {k: state_dict[k] for k in SCALARS if k in state_dict}
        check_settings(what, scalars)
        ema = self.ema
        sharded = state_dict.get(SHARDED_KEY)
        shadow = state_dict.get("shadow_params")
        values = None
        if sharded is not None:
            folder = sharded.get("folder") if isinstance(sharded, Mapping) else None
            if not (isinstance(folder, str) and folder and os.path.basename(folder) == folder
                    and folder not in (".", "..")):
                raise ValueError(f"{what}: {SHARDED_KEY} must name a folder beside the state "
                                 f"dict's file ({{'folder': name}}), got {sharded!r}")
            loading = _accelerate_call("load_custom_state", self)
            if loading is None:
                raise ValueError(
                    f"{what}: this state dict refers to the EMA shards saved in the "
                    f"{folder!r} folder of an accelerator.save_state checkpoint; load "
                    f"it with accelerator.load_state (the EMAModel registered with "
                    f"register_for_checkpointing)")
            folder = os.path.join(os.fspath(loading["path"]), folder)
        elif shadow is not None:
            if not (isinstance(shadow, list) and all(isinstance(p, torch.Tensor)
                                                     for p in shadow)):
                raise ValueError(f"{what}: shadow_params must be a list of tensors")
            names = state_dict.get(NAMES_KEY) or self.names()
            if len(names) != len(shadow):
                raise ValueError(f"{what}: shadow_params holds {len(shadow)} tensors, the EMA "
                                 f"{len(names)}")
            shapes = ema.shapes
            for i, (name, value) in enumerate(zip(names, shadow)):
                if name not in shapes or global_shape(value) != shapes[name]:
                    raise ValueError(
                        f"{what}: shadow_params[{i}] ({name!r}) has shape "
                        f"{list(global_shape(value))}, the EMA's is "
                        f"{list(shapes[name]) if name in shapes else 'absent'}")
            values = dict(zip(names, shadow))
        if sharded is not None:
            ema.load(folder, allow_changes="all")
        elif values is not None:
            ema.load_state_dict(values)
        for name, value in scalars.items():
            if name == "optimization_step":
                ema.state.set_step(value)
            else:
                setattr(self.schedule, name, value)

    # --- folders ----------------------------------------------------------------------------------

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Writes ``model_cls(**model_config)`` with the EMA weights (and the schedule in its
        config) as a folder ``model_cls.from_pretrained(path)`` loads; for a LoRA EMA
        (``params="trainable"``), the model's weights with the EMA adapters merged
        (``W + scale * B @ A``). Collective when the EMA is sharded (every rank gathers, rank 0
        writes one tensor at a time) or of a LoRA adapter; a whole EMA (plain and DDP models) is
        written by rank 0 alone and the other ranks return at once, so that the main process
        may call it alone, as diffusers' scripts do."""
        if self.model_cls is None:
            raise ValueError("`save_pretrained` can only be used if `model_cls` was defined at "
                             "__init__.")
        if self.model_config is None:
            raise ValueError("`save_pretrained` can only be used if `model_config` was defined "
                             "at __init__.")
        with torch.no_grad():
            save_pretrained(self.ema, os.fspath(path), model_cls=self.model_cls,
                            model_config=self.model_config, extra_config=self._scalars(),
                            lora=self.config.params != "all", whole=not self.sharded)

    def save_lora_adapter(self, save_directory: str | os.PathLike,
                          adapter_name: str = "default", weight_name: str | None = None) -> None:
        """The EMA of a LoRA adapter (``params="trainable"``), as diffusers'
        ``save_lora_adapter`` writes it (``unet.load_lora_adapter(path, prefix=None)``) and as
        peft does (``PeftModel.from_pretrained(base, path)``). Collective."""
        with torch.no_grad():
            save_lora_adapter(self.ema, os.fspath(save_directory), adapter_name=adapter_name,
                              weight_name=weight_name)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, model_cls: Any,
                        foreach: bool = False) -> EMAModel:
        """An ``EMAModel`` of the model in ``path`` (as ``save_pretrained`` wrote it), with the
        schedule and step its config records (diffusers' ``from_pretrained``)."""
        config = model_cls.load_config(path)
        model = model_cls.from_pretrained(path)
        ema = cls(model, model_cls=model_cls, model_config=model.config, foreach=foreach)
        ema.load_state_dict({k: v for k, v in config.items() if k in SCALARS})
        return ema


def _parameter_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """The model's parameters by name, with their global shapes (a DTensor's are)."""
    return {name: p.shape for name, p in model.named_parameters()}


def _is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


# Classes carry their public path (repr, pickles, the settings a checkpoint records).
for _cls in (EMAModel,):
    _cls.__module__ = "fsdp_ema.integrations.diffusers"
