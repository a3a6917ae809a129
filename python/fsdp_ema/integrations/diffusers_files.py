"""The folders the diffusers ``EMAModel`` (``integrations.diffusers``) writes, from a
``fsdp_ema.ShardedEMA``'s public API: the EMA weights as the folder ``model_cls.from_pretrained``
loads (``ShardedEMA.export``, or for a LoRA EMA ``fsdp_ema.export_merged``, under diffusers' file
names, with the model's ``config.json``), and a LoRA EMA's adapter as diffusers
(``load_lora_adapter``) and peft (``PeftModel.from_pretrained``) read it
(``fsdp_ema.export_peft_adapter``). Collective: every rank gathers, rank 0 writes one tensor
at a time (a LoRA adapter, small, whole)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from ..distributed.groups import raise_if_any_rank_failed, rank_world
from ..store.peft import ADAPTER_FILE, export_merged, export_peft_adapter

__all__ = ["save_pretrained", "save_lora_adapter", "WEIGHTS_NAME", "LORA_WEIGHTS_NAME"]

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"  # diffusers' SAFETENSORS_WEIGHTS_NAME
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
LORA_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
EXPORT_NAME = "model.safetensors"  # what ShardedEMA.export and export_merged write
INDEX_SUFFIX = ".index.json"
# The shards diffusers' own save_pretrained writes (its _REGEX_SHARD on WEIGHTS_NAME).
DIFFUSERS_SHARD = re.compile(r"diffusion_pytorch_model-\d{5}-of-\d{5}\.safetensors")


def _agree(ema, error: BaseException | None, what: str) -> None:
    raise_if_any_rank_failed(error, ema.process_group, what, torch.device("cpu"))


def _writer(ema) -> bool:
    return rank_world(ema.process_group)[0] == 0


def save_pretrained(ema, path: str, *, model_cls: Any, model_config: Mapping[str, Any],
                    extra_config: Mapping[str, Any], lora: bool, whole: bool) -> None:
    """``path``: the EMA weights (with ``lora``, the model's weights with the EMA adapters
    merged) as ``diffusion_pytorch_model.safetensors`` (or its shards and index) and
    ``model_cls(**model_config)``'s ``config.json`` with ``extra_config`` registered in it (the
    EMA's schedule, as diffusers' ``EMAModel.save_pretrained`` records it). Collective, except
    for an EMA held ``whole`` on every rank (plain, DDP) without ``lora``: rank 0 writes alone
    and the others return at once, so that it may be called on the main process only, as
    diffusers' training scripts call it."""
    what = f"EMAModel.save_pretrained({path!r})"
    local = whole and not lora
    if local and not _writer(ema):
        return
    if lora:
        export_merged(ema, path, overwrite=True)
    else:
        ema.export(path, overwrite=True, local=local)
    error = None
    if _writer(ema):
        try:
            _rename_export(path)
            # The config through diffusers' own writer, from a model made on the meta device
            # (no weights allocated).
            with torch.device("meta"):
                model = model_cls.from_config(dict(model_config))
            model.register_to_config(**extra_config)
            model.save_config(path)
        except Exception as e:  # noqa: BLE001 (raised on every rank)
            error = e
    if local:
        if error is not None:
            raise error
        return
    _agree(ema, error, what)


def _rename_export(path: str) -> None:
    """diffusers' file names for what the export wrote (on rank 0), and the weights an earlier
    save left in ``path`` removed (diffusers' or ours): ``from_pretrained`` reads an index
    whenever there is one, so a stale index beside the new single file (and the shards it names)
    would load the old weights. The stale index goes before the new file takes its name."""
    single = os.path.join(path, EXPORT_NAME)
    index = single + INDEX_SUFFIX
    wrote_index = os.path.exists(index)
    for name in os.listdir(path):
        stale_index = name == WEIGHTS_NAME + INDEX_SUFFIX and not wrote_index
        if stale_index or DIFFUSERS_SHARD.fullmatch(name):
            os.remove(os.path.join(path, name))
    if os.path.exists(single):
        os.replace(single, os.path.join(path, WEIGHTS_NAME))
    if wrote_index:
        os.replace(index, os.path.join(path, WEIGHTS_NAME + INDEX_SUFFIX))
        if os.path.exists(os.path.join(path, WEIGHTS_NAME)):
            os.remove(os.path.join(path, WEIGHTS_NAME))
    _sync_folder(path)


def _sync_folder(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_lora_adapter(ema, path: str, *, adapter_name: str, weight_name: str | None) -> None:
    """``path``: the EMA of the LoRA adapter ``adapter_name`` as peft writes an adapter
    (``adapter_config.json``, ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base,
    path)``) and as diffusers' ``save_lora_adapter`` writes it (``pytorch_lora_weights.
    safetensors``, or ``weight_name``, with the adapter's config in its metadata:
    ``unet.load_lora_adapter(path, prefix=None)``). Collective."""
    export_peft_adapter(ema, path, adapter_name=adapter_name)
    error = None
    if _writer(ema):
        try:
            from safetensors import safe_open
            from safetensors.torch import save_file

            tensors = {}
            with safe_open(os.path.join(path, ADAPTER_FILE), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    tensors[key.removeprefix("base_model.model.")] = f.get_tensor(key)
            with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
                config = json.load(f)
            metadata = {"format": "pt",
                        LORA_METADATA_KEY: json.dumps(config, indent=2, sort_keys=True)}
            save_file(tensors, os.path.join(path, weight_name or LORA_WEIGHTS_NAME),
                      metadata=metadata)
            _sync_folder(path)
        except Exception as e:  # noqa: BLE001 (raised on every rank)
            error = e
    _agree(ema, error, f"EMAModel.save_lora_adapter({path!r})")
