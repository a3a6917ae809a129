"""``ShardedEMA``: a Lightning callback that keeps an EMA of the weights shard by shard.

Works with ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in ``configure_model``),
``FSDPStrategy`` (FSDP1), DDP and a single device. The callback only translates Lightning's events
into ``fsdp_ema.ShardedEMA`` calls (docs/INTEGRATIONS.md):

- ``on_fit_start`` (after the strategy has sharded the model): the EMA is made, from the shards;
- ``on_train_batch_end``: ``update()`` once per optimizer step (when ``trainer.global_step``
  advances, so gradient accumulation counts once);
- validation / test / predict: ``swap()`` (the EMA weights inside, the training weights back bit
  for bit after);
- checkpoints: an EMA of sharded tensors (DTensors, ShardedTensors) goes into
  ``checkpoint["state_dict"]`` under ``"<key>/"``, which Lightning writes with
  ``torch.distributed.checkpoint`` rank by rank, and comes back with ``dcp.load`` into the EMA's
  own shards; a replicated EMA (DDP, one device) is the callback's state. No rank ever gathers the
  EMA of a sharded model;
- ``on_train_end``: optionally ``copy_to()`` the model and ``export()`` a consolidated directory.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from . import HeldSwap, check_options, missing_framework

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError as _e:
    raise missing_framework(__name__, "Lightning (lightning >= 2.6)", "lightning") from _e

import fsdp_ema

__all__ = ["ShardedEMA"]


def _is_sharded(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    return isinstance(value, (DTensor, ShardedTensor))


class ShardedEMA(Callback):
    """Keeps a ``fsdp_ema.ShardedEMA`` of the LightningModule's weights, each rank only its shards.

    Args:
        decay: the EMA decay (``fsdp_ema.ShardedEMA``'s; the upper bound of a warmup).
        swap_for_validation, swap_for_test, swap_for_predict: run those loops with the EMA
            weights (``ShardedEMA.swap()``); the training weights come back bit for bit.
        copy_to_model_at_end: at the end of ``fit``, write the EMA into the model for good
            (``ShardedEMA.copy_to()``), as Lightning's ``WeightAveraging`` does.
        export_dir: at the end of ``fit``, write the full EMA weights there as a consolidated
            Hugging Face safetensors directory (``ShardedEMA.export``, collective, rank 0 writes
            bucket by bucket); ``export_dtype`` casts them.
        compile: ``True`` (or a dict of ``torch.compile`` arguments) compiles ``update()`` with
            ``fullgraph=True``.
        key: names this EMA in checkpoints (the callback's state key and the ``"<key>/"`` prefix
            of its entries in ``checkpoint["state_dict"]``); give each of several EMA callbacks
            its own.
        **options: every other ``fsdp_ema.ShardedEMA`` option, passed through as it is
            (``warmup``, ``update_every``, ``start_step``, ``params="trainable"``, ``device="cpu"``,
            ``dtype``, ``schedule``, ...).
    """

    def __init__(self, decay: float = 0.9999, *, swap_for_validation: bool = True,
                 swap_for_test: bool = True, swap_for_predict: bool = True,
                 copy_to_model_at_end: bool = False, export_dir: str | os.PathLike | None = None,
                 export_dtype: torch.dtype | None = None, compile: bool | dict = False,
                 key: str = "fsdp_ema", **options: Any):
        check_options(type(self).__name__, decay, options)
        if not key or "." in key or "/" in key:
            raise ValueError(f"ShardedEMA callback: key must be a non-empty name without '.' or "
                             f"'/', got {key!r}")
        self.decay, self.options = decay, options
        self.swap_for = {"validation": swap_for_validation, "test": swap_for_test,
                         "predict": swap_for_predict}
        self.copy_to_model_at_end = copy_to_model_at_end
        self.export_dir, self.export_dtype = export_dir, export_dtype
        self.compile, self.key = compile, key
        self.ema: fsdp_ema.ShardedEMA | None = None
        self._update = None
        self._last_step = 0           # trainer.global_step at the last update
        self._swap = HeldSwap()
        self._restore: tuple[str, Any] | None = None  # what a loaded checkpoint holds for the EMA
        self._sharded = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(key=self.key)

    @property
    def prefix(self) -> str:
        """The prefix of the EMA's entries in ``checkpoint["state_dict"]`` (sharded models)."""
        return self.key + "/"

    # --- making and restoring the EMA -------------------------------------------------------------

    def _make(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        # FSDP1 (FSDPStrategy) keeps the root's FlatParameter on the wrapper around the module.
        wrapped = trainer.strategy.model
        model = wrapped if isinstance(wrapped, FullyShardedDataParallel) else pl_module
        self.ema = fsdp_ema.ShardedEMA(model, self.decay, **self.options)
        # Sharded (read from the model, never from the strategy's settings): FSDP2 or FSDP1
        # modules, or DTensor parameters (tensor parallelism).
        self._sharded = any(isinstance(m, (FSDPModule, FullyShardedDataParallel))
                            for m in model.modules()) or any(
            _is_sharded(p) for p in model.parameters())
        self._update = self.ema.update
        if self.compile:
            kwargs = dict(self.compile) if isinstance(self.compile, dict) else {}
            self._update = torch.compile(self.ema.update, fullgraph=True, **kwargs)

    def _ensure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Makes the EMA if there is none, and loads what a restored checkpoint holds for it
        (collective for a sharded EMA: every rank gets here at the same event)."""
        restore, self._restore = self._restore, None
        if restore is not None and restore[0] == "none":
            warnings.warn(f"ShardedEMA callback: the checkpoint {restore[1]!r} holds no EMA under "
                          f"{self.state_key!r}; the EMA starts from the restored weights",
                          RuntimeWarning, stacklevel=2)
        if self.ema is None or (restore is not None and restore[0] == "none"):
            self._make(trainer, pl_module)
        if restore is None or restore[0] == "none":
            return
        kind, value = restore
        if kind == "state_dict":
            self.ema.load_state_dict(value)
        elif not self._load_distributed(value):
            raise RuntimeError(f"ShardedEMA callback: the checkpoint {os.fspath(value)!r} holds "
                               f"no '{self.prefix}' entries, though its callback state says the "
                               f"EMA was saved there")

    def _load_distributed(self, path: str | os.PathLike) -> bool:
        """``dcp.load`` of the ``"<key>/"`` entries of a distributed checkpoint straight into the
        EMA's shards (``state_dict()`` shares their memory), then ``load_state_dict``."""
        import torch.distributed.checkpoint as dcp

        # The strategy names the checkpoint's top-level entry ("state_dict" for
        # ModelParallelStrategy, "model" for FSDPStrategy): find the one holding our entries.
        suffix = "." + self.prefix + fsdp_ema.ShardedEMA.STEP_KEY  # DCP joins nested keys by "."
        metadata = dcp.FileSystemReader(os.fspath(path)).read_metadata()
        tops = sorted({k[:-len(suffix)] for k in metadata.state_dict_metadata
                       if k.endswith(suffix)})
        if not tops:
            return False
        sd = self.ema.state_dict()
        dcp.load({tops[0]: {self.prefix + k: v for k, v in sd.items()}}, checkpoint_id=path)
        self.ema.load_state_dict(sd)
        return True

    # --- Lightning's events -----------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The strategy has wrapped and sharded the model: the EMA is made from its shards.
        self._make(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The checkpoint (if any) is restored by now, with every strategy.
        self._ensure(trainer, pl_module)
        self._last_step = trainer.global_step

    def _catch_up(self, trainer: pl.Trainer) -> None:
        if self.ema is not None and not self._swap.active and trainer.global_step > self._last_step:
            self._update()
            self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._catch_up(trainer)

    def _swap_in(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loop: str) -> None:
        if not self.swap_for[loop] or self._swap.active:
            return
        if self._restore is not None:  # validate/test/predict(ckpt_path=...)
            self._ensure(trainer, pl_module)
        if self.ema is not None:
            self._swap.enter(self.ema)

    def _swap_out(self) -> None:
        self._swap.exit()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_in(trainer, pl_module, "validation")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_out()

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_in(trainer, pl_module, "test")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_out()

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_in(trainer, pl_module, "predict")

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_out()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._swap_out()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.ema is None:
            return
        if self.copy_to_model_at_end:
            self.ema.copy_to()
        if self.export_dir is not None:
            self.ema.export(self.export_dir, dtype=self.export_dtype, overwrite=True)

    # --- checkpoints ------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer  # state_dict() gets no trainer

    def state_dict(self) -> dict[str, Any]:
        if self.ema is None:
            return {}
        trainer = getattr(self, "_trainer", None)
        if trainer is not None and trainer.training:
            self._catch_up(trainer)
        if self._sharded:
            # The tensors go into checkpoint["state_dict"] (on_save_checkpoint), written sharded.
            return {"layout": "state_dict", "prefix": self.prefix}
        # A replicated EMA (DDP, one device): every rank holds it whole; rank 0 writes it. Copies,
        # so that a checkpoint written in the background never sees a later update.
        return {"layout": "callback",
                "ema": {k: v.detach().to("cpu", copy=True)
                        for k, v in self.ema.state_dict().items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # on_load_checkpoint, which also knows the checkpoint's path

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if self.ema is None:
            return
        # A checkpoint written between the optimizer step and this callback's batch end (by a
        # callback ahead of this one) gets the EMA of that step.
        if trainer.training:
            self._catch_up(trainer)
        if not self._sharded:
            return
        model_state = checkpoint.get("state_dict", {})
        if not any(_is_sharded(v) for v in model_state.values()):
            raise RuntimeError(
                "ShardedEMA callback: the EMA is sharded but this checkpoint is not (its "
                "state_dict holds full tensors, written by rank 0 alone); the EMA would have to be "
                "gathered on one rank. Save distributed checkpoints: "
                "ModelParallelStrategy(save_distributed_checkpoint=True) or "
                "FSDPStrategy(state_dict_type='sharded')")
        clash = [k for k in model_state if k.startswith(self.prefix)]
        if clash:
            raise RuntimeError(f"ShardedEMA callback: the model's state_dict already has "
                               f"{clash[0]!r}; give the callback another key=")
        model_state.update({self.prefix + k: v for k, v in self.ema.state_dict().items()})

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if not state:
            self._restore = ("none", trainer.ckpt_path)
        elif state.get("layout") == "callback":
            self._restore = ("state_dict", state["ema"])
        elif state.get("layout") == "state_dict":
            self._restore = ("dcp", trainer.ckpt_path)
        else:
            raise ValueError(f"ShardedEMA callback: unknown state in the checkpoint "
                             f"{trainer.ckpt_path!r}: {sorted(state)}")
