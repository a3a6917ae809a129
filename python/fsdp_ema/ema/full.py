"""A ``ShardedEMA``'s full (unsharded) weights (one part of the class; ``ema.sharded`` says
which): ``full_state_dict`` and ``export``, both the bucketed gather of ``store.full_state``,
planned from the EMA's slots without communication so that a refusal raises on every rank before any
gather.

Reads the EMA through its ``state`` (``EMAState``).
"""

from __future__ import annotations

import os

import torch

from .._dtypes import check_ema_dtype
from ..store.collective import list_names
from ..store.full_state import DEFAULT_BUCKET_BYTES, DEFAULT_MAX_FILE_BYTES, Part, full_buckets
from ..store.full_state import export as _export


class FullStateMixin:
    """``full_state_dict``, ``export``."""

    def _full_plan(self, bucket_bytes: int, what: str) -> list[Part]:
        if int(bucket_bytes) != bucket_bytes or bucket_bytes <= 0:
            raise ValueError(f"ShardedEMA.{what}: bucket_bytes must be a positive integer, got "
                             f"{bucket_bytes}")
        self.synchronize()
        # Planned without communication, so a refusal raises on every rank before any gather.
        return [part for slot, ema in zip(self.state.slots, self.state.tensors)
                for part in slot.full_parts(ema)]

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = True, cpu_offload: bool = True,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, torch.Tensor]:
        """The full (unsharded) EMA tensors, keyed by clean FQN in ``state_dict()`` order.
        Collective: call it on every rank.

        Sharded tensors are gathered in buckets with the ``gather_shards`` op (one all-gather
        per bucket over the tensors' process group; FSDP1 members first go through one
        all_to_all per unit and bucket), so the transient memory on the EMA's device stays
        within ``bucket_bytes`` whatever the model size (a single tensor that needs more is a
        bucket of its own; see docs/SHARDED_EMA.md for what a bucket counts).

        Args:
            rank0_only: only rank 0 of the EMA's process group keeps the tensors; the other
                ranks take part in the gathers and return ``{}``.
            cpu_offload: each bucket is moved to the CPU as soon as it is gathered; the values
                never share memory with the EMA. Without it, values stay on the EMA's device,
                and tensors that are already full there (buffers, DDP/plain models, 0-dim and
                replicated DTensors) are the EMA's own tensors, as in ``state_dict()``.
            bucket_bytes: the transient device memory one bucket may take.
        """
        parts = self._full_plan(bucket_bytes, "full_state_dict")
        keep = not rank0_only or self.state.rank_world()[0] == 0
        out: dict[str, torch.Tensor] = {}
        for bucket in full_buckets(parts, bucket_bytes):
            if keep:
                for fqn, t, fresh in bucket:
                    out[fqn] = t.to("cpu", copy=not fresh) if cpu_offload else t
            del bucket  # before the next gather
        return {fqn: out[fqn] for fqn in self.state.shapes} if keep else {}

    @torch.no_grad()
    def export(self, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
               max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES, overwrite: bool = False,
               prefix: str | None = None, local: bool = False) -> int:
        """Writes the full EMA weights as a consolidated Hugging Face safetensors directory:
        ``path/model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files plus
        ``model.safetensors.index.json`` when the tensor data exceeds ``max_file_bytes``.
        Collective: every rank gathers the buckets (as ``full_state_dict``); rank 0 of the EMA's
        process group writes each bucket's tensors into place as it arrives, so no rank holds
        more than a bucket. Returns the bytes of tensor data written.

        ``dtype`` (float32/float64/bfloat16/float16) casts the F64/F32/F16/BF16 tensors;
        others are written as they are. The writer is the library's ``ExportWriter`` class
        (format/'s, the one ``fsdp-ema export`` uses: the same tensors give the same bytes):
        files staged in a hidden directory in ``path``, fsync'd and renamed into place, the
        index last; weight files of an earlier export in ``path`` are replaced only with
        ``overwrite=True``. A failure raises on every rank.

        ``prefix`` (e.g. ``"net."``): only the tensors whose names start with it, written without
        it (a submodule's weights under the names the submodule itself gives them).

        ``local=True``: written by the calling rank alone, with no collective, for an EMA that
        holds every tensor whole on this rank (a plain or DDP model): call it on one rank, e.g.
        under ``if rank == 0:`` (as training scripts save). A sharded EMA is refused: its
        tensors are gathered, on every rank.
        """
        path = os.fspath(path)
        what = f"ShardedEMA.export({path!r})"
        check_ema_dtype(what, dtype)
        if int(max_file_bytes) != max_file_bytes or max_file_bytes <= 0:
            raise ValueError(f"{what}: max_file_bytes must be a positive integer, got "
                             f"{max_file_bytes}")
        parts = self._full_plan(bucket_bytes, "export")
        names = None
        if prefix:
            parts = [p for p in parts if p.fqn.startswith(prefix) and len(p.fqn) > len(prefix)]
            if not parts:
                raise ValueError(f"{what}: no tensor name starts with {prefix!r} (the names are "
                                 f"{list_names(list(self.state.shapes), 4)})")
            names = {p.fqn: p.fqn[len(prefix):] for p in parts}
        if local and any(p.kind != "full" for p in parts):
            raise ValueError(f"{what}: local=True needs an EMA held whole on this rank (a plain "
                             f"or DDP model); this one is sharded, so export gathers it: call "
                             f"export() on every rank, without local")
        return _export(parts, path, dtype=dtype, max_file_bytes=int(max_file_bytes),
                       bucket_bytes=bucket_bytes, overwrite=overwrite,
                       group=None if local else self.state.group, device=self.state.device,
                       what=what, names=names)
