"""The one door from Python to the compiled operators: every module of the Python front calls the
ops through the functions here, never ``torch.ops.fsdp_ema`` or ``torch.classes.fsdp_ema`` itself
(``scripts/rules_once.py`` fails on a direct call elsewhere).

One thin, typed function per op the front uses, in the order of the registration table, each
with the schema's meaning in a line. They look the op up when called (so a test may
``monkeypatch`` ``torch.ops.fsdp_ema.<op>``) and add nothing else: no checks, no conversions
beyond the schema's; ``torch.compile`` inlines them, so the update step traces without a graph
break. Adding an op the front calls: its function here, and nowhere else in Python.

Importing this module loads the library and sets torch.compile's side-effect marks of the ops
that write files (the one mark that only Python can set; registration/ says why).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from ._library import load_library

load_library()

# A save_shard whose byte count is unused stays in a compiled graph (TorchScript's mark is set
# in the library itself; torch.compile's can only be set from Python).
torch.fx.node.has_side_effect(torch.ops.fsdp_ema.save_shard.default)
torch.fx.node.has_side_effect(torch.ops.fsdp_ema.commit_checkpoint.after)


# --- the update and the gather --------------------------------------------------------------------

def update_(ema: list[torch.Tensor], model: list[torch.Tensor],
            decay: float | torch.Tensor) -> None:
    """``ema[i] <- lerp(ema[i], model[i], 1 - decay)`` for every pair, in one call."""
    torch.ops.fsdp_ema.update_(ema, model, decay)


def update_multi_(ema_flat: list[torch.Tensor], model: list[torch.Tensor],
                  decays: list[float] | list[torch.Tensor]) -> None:
    """K EMA lists of the same model tensors, flattened profile-major, one read of the model."""
    torch.ops.fsdp_ema.update_multi_(ema_flat, model, decays)


def gather_shards(shards: list[torch.Tensor], rows: list[int],
                  group_name: str) -> list[torch.Tensor]:
    """Dim-0 shards of N tensors -> the N full tensors on every rank, one all-gather."""
    return torch.ops.fsdp_ema.gather_shards(shards, rows, group_name)


@functools.cache
def gather_align() -> int:
    """The byte alignment ``gather_shards`` starts every packed piece at, in its send and receive
    buffers (the ``gather_alignment`` op: ``kAlign`` in ops/gather/gather_shards.cpp); what
    ``model.layouts.part_cost`` counts."""
    return int(torch.ops.fsdp_ema.gather_alignment())


# --- saves and loads ------------------------------------------------------------------------------

def save_shard(directory: str, rank: int, world_size: int, names: list[str],
               shards: list[torch.Tensor], offsets: list[int], global_shapes: list[int],
               fsync: bool, overwrite: bool) -> torch.Tensor:
    """One rank's local shards into its shard file, atomically; the file's bytes (0-dim)."""
    return torch.ops.fsdp_ema.save_shard(directory, rank, world_size, names, shards, offsets,
                                         global_shapes, fsync, overwrite)


def commit_checkpoint(directory: str, world_size: int, overwrite: bool, fsync: bool,
                      metadata: list[str] = ()) -> int:
    """The index (the commit marker) once every rank's file is there, with ``metadata`` (key,
    value, key, value, ...) in its "metadata" object; the number of tensors."""
    if metadata:
        return torch.ops.fsdp_ema.commit_checkpoint.with_metadata(directory, world_size,
                                                             list(metadata), overwrite, fsync)
    return torch.ops.fsdp_ema.commit_checkpoint(directory, world_size, overwrite, fsync)


def load_shard(path: str, verify: bool, device: Any, mmap: bool
               ) -> tuple[list[str], list[torch.Tensor], list[int], list[int]]:
    """One shard file back, verified: names, local shards, offsets, global shapes (flat)."""
    return torch.ops.fsdp_ema.load_shard(path, verify, device, mmap)


def load_tensors(directory: str, names: list[str], rank: int, world_size: int, verify: bool,
                 device: Any, mmap: bool) -> list[torch.Tensor]:
    """Named tensors of a committed checkpoint, whole or rank ``rank`` of ``world_size``'s rows."""
    return torch.ops.fsdp_ema.load_tensors(directory, names, rank, world_size, verify, device,
                                           mmap)


def load_into_(directory: str, names: list[str], out: list[torch.Tensor], rank: int,
               world_size: int, verify: bool) -> None:
    """``load_tensors``' tensors read into existing ones, everything checked first."""
    torch.ops.fsdp_ema.load_into_(directory, names, out, rank, world_size, verify)


def checkpoint_info(directory: str) -> str:
    """JSON description of a checkpoint directory: layout, world size, tensors, metadata."""
    return torch.ops.fsdp_ema.checkpoint_info(directory)


def open_checkpoint(directory: str) -> Any:
    """A committed checkpoint opened once (the ``OpenCheckpoint`` class of the library)."""
    return torch.classes.fsdp_ema.OpenCheckpoint(directory)


def export_writer(path: str, names: list[str], like: list[torch.Tensor],
                  dtype: Optional[torch.dtype], max_file_bytes: int, overwrite: bool,
                  fsync: bool) -> Any:
    """The streaming Hugging Face export writer (the ``ExportWriter`` class of the library: what
    ``fsdp-ema export`` writes, byte for byte)."""
    return torch.classes.fsdp_ema.ExportWriter(path, names, like, dtype, max_file_bytes,
                                               overwrite, fsync)


# --- directories (the rules: format/) -------------------------------------------------------------

def is_committed(directory: str) -> bool:
    """True when the directory holds a committed checkpoint; creates nothing."""
    return torch.ops.fsdp_ema.is_committed(directory)


def write_sidecar(directory: str, name: str, content: str, fsync: bool) -> None:
    """A small file beside the shard files (not a layout name), written atomically."""
    torch.ops.fsdp_ema.write_sidecar(directory, name, content, fsync)


def committed_checkpoints(root: str, follow_links: bool) -> list[str]:
    """The committed checkpoint directories directly inside ``root``, in name order."""
    return torch.ops.fsdp_ema.committed_checkpoints(root, follow_links)


def remove_checkpoint(directory: str, first: list[str] = ()) -> None:
    """Removes a checkpoint directory: the index first (and the files named in ``first``: other
    writers' commit markers), durably, then the rest; never through a link."""
    if first:
        torch.ops.fsdp_ema.remove_checkpoint.first(directory, list(first))
    else:
        torch.ops.fsdp_ema.remove_checkpoint(directory)


# --- rules that live in C++ -----------------------------------------------------------------------

def index_file_name() -> str:
    """The index's file name, the commit marker (fsdp_ema/format/names.h)."""
    return torch.ops.fsdp_ema.index_file_name()


def shard_file_name(rank: int, world_size: int) -> str:
    """The name rank ``rank`` of ``world_size`` writes its shard file under (format's names)."""
    return torch.ops.fsdp_ema.shard_file_name(rank, world_size)


def training_state_names() -> list[str]:
    """A training state's document tensor and its EMA and model prefixes (format's names)."""
    return torch.ops.fsdp_ema.training_state_names()


def chunk_rows(rows: int, rank: int, world_size: int) -> list[int]:
    """``[begin, end)``: the dim-0 rows ``torch.chunk`` gives rank ``rank`` of ``world_size``."""
    return torch.ops.fsdp_ema.chunk_rows(rows, rank, world_size)


def dtypes() -> str:
    """JSON: the dtype table (names, torch names, sizes, roles)."""
    return torch.ops.fsdp_ema.dtypes()


def overlapping(tensors: list[torch.Tensor], names: list[str] | None = None) -> list[int]:
    """Indices of the tensors that share memory with another of them, each first checked as
    memory a load writes (dense, inside its storage, no two of its own elements sharing memory);
    errors name ``names[i]`` (ops/common/memory.h)."""
    return torch.ops.fsdp_ema.overlapping(tensors, names or [])


# --- post-hoc EMA ---------------------------------------------------------------------------------

def power_ema_gamma(sigma_rel: float) -> float:
    """gamma of a power-function EMA profile from its relative standard deviation."""
    return torch.ops.fsdp_ema.power_ema_gamma(sigma_rel)


def power_ema_sigma_rel(gamma: float) -> float:
    """The profile's relative standard deviation from gamma."""
    return torch.ops.fsdp_ema.power_ema_sigma_rel(gamma)


def posthoc_plan(snapshot_root: str, sigma_rel: float, step: Optional[int],
                 out: Optional[str]) -> str:
    """JSON plan of a reconstruction from a snapshot root (with ``out``: the output checked)."""
    return torch.ops.fsdp_ema.posthoc_plan(snapshot_root, sigma_rel, step, out)
