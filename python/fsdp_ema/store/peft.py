"""Exports of a LoRA EMA for PEFT users (#16): the EMA adapters as a PEFT adapter directory, and
the merged full weights (base + scale * B @ A per adapted layer) as a consolidated Hugging Face
safetensors export that loads into the unadapted model.

Collective, like ``ShardedEMA.export``: every rank gathers (``store.full_state``), rank 0
writes. Only ShardedEMA's public API is used (``model``, ``shapes``, ``process_group``,
``full_state_dict``); the merged weights stream through ``store.full_state.export``, the route
``ShardedEMA.export`` takes.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
from torch import nn

from ..distributed.groups import raise_if_any_rank_failed, rank_world
from ..model.apply import reshard_fsdp2
from ..model.slots import clean_modules, discover, join_name
from .full_state import DEFAULT_BUCKET_BYTES, DEFAULT_MAX_FILE_BYTES
from .full_state import export as _export

ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's file names (peft.utils.constants)


class _Lora(NamedTuple):
    prefix: str         # clean name of the LoRA layer
    scaling: float
    fan_in_fan_out: bool


class _Adapted(NamedTuple):
    prefix: str         # clean name of the module holding the adapters' configs
    holder: Any         # a PeftModel, or a model peft injected adapters into (its peft_config)
    base: str           # clean name of the unadapted model (PeftModel: its base_model.model)


def _peft_root(model: nn.Module, what: str) -> _Adapted:
    """The PeftModel in ``model`` (which may wrap it) or, where there is none, the module peft
    injected adapters into (``inject_adapter_in_model``; diffusers' and transformers'
    ``add_adapter``), which holds their configs as ``peft_config``."""
    try:
        from peft import PeftModel
    except ImportError as e:
        raise ImportError(f"{what} needs peft (pip install peft)") from e
    modules = clean_modules(model)
    for prefix, module in modules:
        if isinstance(module, PeftModel):
            return _Adapted(prefix, module, join_name(prefix, "base_model.model"))
    for prefix, module in modules:
        if isinstance(getattr(module, "peft_config", None), dict) and module.peft_config:
            return _Adapted(prefix, module, prefix)
    raise ValueError(f"{what}: {type(model).__name__} holds no peft PeftModel and no adapter "
                     f"peft injected (add_adapter)")


def _lora_layers(model: nn.Module, adapter: str, what: str) -> dict[str, _Lora]:
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    out = {}
    for prefix, module in clean_modules(model):
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        kind = type(module).__name__  # fully_shard subclasses it (FSDPLinear)
        if (not isinstance(module, LoraLinear) or module.use_dora.get(adapter, False)
                or getattr(module, "lora_bias", {}).get(adapter, False)):
            raise NotImplementedError(
                f"{what}: LoRA layer {prefix!r} ({type(module).__module__}.{kind}, DoRA "
                f"{module.use_dora.get(adapter, False)}) is not supported; only plain LoRA on "
                f"nn.Linear is merged")
        out[prefix] = _Lora(prefix, float(module.scaling[adapter]), bool(module.fan_in_fan_out))
    if not out:
        raise ValueError(f"{what}: the model has no LoRA layer with adapter {adapter!r}")
    return out


def _lora_names(layer: _Lora, adapter: str) -> tuple[str, str]:
    return (join_name(layer.prefix, f"lora_A.{adapter}.weight"),
            join_name(layer.prefix, f"lora_B.{adapter}.weight"))


def _ema_adapters(ema, layers: dict[str, _Lora], adapter: str, what: str) -> None:
    missing = [n for layer in layers.values() for n in _lora_names(layer, adapter)
               if n not in ema.shapes]
    if missing:
        raise ValueError(f"{what}: the EMA does not keep {missing[0]!r} (and "
                         f"{len(missing) - 1} more LoRA weights); make it with params='trainable' "
                         f"or params='all'")


def _agree(ema, error: BaseException | None, what: str) -> None:
    """Collective over the EMA's group: raises on every rank if any rank passes an error."""
    raise_if_any_rank_failed(error, ema.process_group, what, torch.device("cpu"))


def export_peft_adapter(ema, path: str | os.PathLike, *, adapter_name: str = "default",
                        dtype: torch.dtype | None = None) -> None:
    """Writes the EMA of the LoRA adapters as a PEFT adapter directory: ``path/
    adapter_model.safetensors`` (PEFT's keys: the adapter name left out) and
    ``adapter_config.json`` (the model's ``LoraConfig``), which ``PeftModel.from_pretrained(base,
    path)`` loads. Collective; rank 0 of the EMA's group writes. ``dtype`` casts the weights."""
    path = os.fspath(path)
    what = f"fsdp_ema.export_peft_adapter({path!r})"
    error, layers, config, base = None, {}, None, ""
    try:
        adapted = _peft_root(ema.model, what)
        if adapter_name not in adapted.holder.peft_config:
            raise ValueError(f"{what}: the model has no adapter {adapter_name!r} (it has "
                             f"{sorted(adapted.holder.peft_config)})")
        config = adapted.holder.peft_config[adapter_name]
        layers = _lora_layers(ema.model, adapter_name, what)
        _ema_adapters(ema, layers, adapter_name, what)
        base = adapted.base
    except Exception as e:  # noqa: BLE001 (raised on every rank by the agreement)
        error = e
    _agree(ema, error, what)
    full = ema.full_state_dict(rank0_only=True)
    error = None
    if rank_world(ema.process_group)[0] == 0:
        try:
            from safetensors.torch import save_file

            tensors = {}
            for layer in layers.values():
                for name in _lora_names(layer, adapter_name):
                    t = full[name]
                    tensors[_peft_key(name, base, adapter_name)] = (
                        t if dtype is None else t.to(dtype)).contiguous()
            # PEFT's own writers: save_pretrained creates the directory and adapter_config.json,
            # safetensors the weights file (format/'s export writer names model*.safetensors).
            config.save_pretrained(path)
            save_file(tensors, os.path.join(path, ADAPTER_FILE), metadata={"format": "pt"})
        except Exception as e:  # noqa: BLE001
            error = e
    _agree(ema, error, what)


@torch.no_grad()
def export_merged(ema, path: str | os.PathLike, *, adapter_name: str = "default",
                  max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, overwrite: bool = False) -> int:
    """Writes the merged full weights of a LoRA model with the EMA adapters as a consolidated
    Hugging Face safetensors export (as ``ShardedEMA.export``) named as the unadapted model's
    ``state_dict()``: each adapted layer's weight is ``W + scaling * B @ A`` (``B.T``/``A.T`` for
    ``fan_in_fan_out``) with the EMA's A and B, computed as peft's ``merge_and_unload`` does and
    stored in W's dtype; every other tensor is the EMA's where the EMA keeps it, else the
    model's own. Collective: the base weights are gathered a bucket at a time. Returns the bytes
    of tensor data written."""
    path = os.fspath(path)
    what = f"fsdp_ema.export_merged({path!r})"
    model = ema.model
    error, layers, parts, names = None, {}, [], {}
    try:
        base = _peft_root(model, what).base
        layers = _lora_layers(model, adapter_name, what)
        _ema_adapters(ema, layers, adapter_name, what)
        reshard_fsdp2(model)
        slots = discover(model, True, "copy")
        lora_names = {n for layer in layers.values() for n in _lora_names(layer, adapter_name)}
        base_prefix = base + "." if base else ""
        for slot in slots:
            for part in slot.full_parts(slot.get()):
                if part.fqn in lora_names:
                    continue
                if ".lora_" in part.fqn:
                    raise NotImplementedError(f"{what}: {part.fqn!r} belongs to another adapter "
                                              f"or LoRA kind; only {adapter_name!r} is merged")
                out = part.fqn.removeprefix(base_prefix)
                for prefix in _layer_prefixes(part.fqn, layers):
                    out = (join_name(prefix, "") + part.fqn[len(prefix) + len(".base_layer."):]
                           ).removeprefix(base_prefix)
                parts.append(part)
                names[part.fqn] = out
    except Exception as e:  # noqa: BLE001
        error = e
    _agree(ema, error, what)
    adapters = ema.full_state_dict(rank0_only=True)  # the EMA's tensors (the adapters, ...)
    weights = {join_name(prefix, "base_layer.weight"): layer for prefix, layer in layers.items()}

    def merged(fqn: str, t: torch.Tensor) -> torch.Tensor:  # on rank 0, as each tensor arrives
        dtype = t.dtype
        if fqn in adapters:  # the EMA keeps this base tensor too (params="all")
            t = adapters[fqn].to(dtype)
        layer = weights.get(fqn)
        if layer is not None:
            a, b = (adapters[n] for n in _lora_names(layer, adapter_name))
            delta = b @ a
            delta = (delta.T if layer.fan_in_fan_out else delta) * layer.scaling
            # peft: base_layer.weight.data += delta (computed in the promoted dtype).
            t = (t.to(delta.device) + delta).to(dtype)
        return t

    return _export(parts, path, dtype=None, max_file_bytes=int(max_file_bytes),
                   bucket_bytes=bucket_bytes, overwrite=overwrite, group=ema.process_group,
                   device=torch.device("cpu"), what=what, names=names, transform=merged)


def _peft_key(name: str, base: str, adapter: str) -> str:
    """PEFT's key of an adapter tensor (``PeftModel.save_pretrained``'s): its name under the
    unadapted model, behind ``base_model.model.``, without the adapter's name."""
    under = name[len(base) + 1:] if base else name
    return "base_model.model." + under.replace(f".{adapter}.", ".")


def _layer_prefixes(fqn: str, layers: dict[str, _Lora]) -> list[str]:
    """The LoRA layer whose ``base_layer`` holds ``fqn`` (zero or one)."""
    head, sep, _ = fqn.partition(".base_layer.")
    return [head] if sep and head in layers else []
