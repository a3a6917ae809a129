"""``ShardedEMA``: a Lightning callback that keeps an EMA of the weights shard by shard.

Works with ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in ``configure_model``),
``FSDPStrategy`` (FSDP1), DDP and a single device. The callback only translates Lightning's events
into ``fsdp_ema.ShardedEMA`` calls (docs/INTEGRATIONS.md):

- ``on_fit_start`` (after the strategy has sharded the model): the EMA is made, from the shards,
  and checkpoint settings that cannot hold a sharded EMA are refused;
- ``on_train_batch_end``: ``update()`` once per optimizer step (when ``trainer.global_step``
  advances, so gradient accumulation counts once), and ``ema/decay``, ``ema/step`` logged;
- validation / test / predict: the EMA weights from the loop's first batch to its epoch end
  (``swap()``; the training weights come back bit for bit), or with ``"both"`` each batch's step
  run again with them, its logged metrics renamed (``val_loss`` -> ``val_loss_ema``);
- checkpoints: an EMA of sharded tensors (DTensors, ShardedTensors) goes into
  ``checkpoint["state_dict"]`` under ``"<key>/"``, which Lightning writes with
  ``torch.distributed.checkpoint`` rank by rank, and comes back with ``dcp.load`` into the EMA's
  own shards; a replicated EMA (DDP, one device) is the callback's state. Beside it: the global
  step and the model's fingerprint at the save (``fsdp_ema.store.binding``), which a resume checks
  against the restored trainer state and model before loading. No rank ever gathers the EMA of a
  sharded model;
- ``on_train_end``: optionally ``copy_to()`` the model and ``export()`` a consolidated directory.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

import torch

from .common import CallbackCore, is_fsdp, missing_framework, pretrained_model, warn_user

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError as _e:
    raise missing_framework(__name__, "Lightning (lightning >= 2.6)", "lightning") from _e

from ..ema.config import EMAConfig  # in the signature's annotations (resolved by LightningCLI)
from ..model.layouts import is_dtensor, is_sharded_tensor
from ..store.binding import Binding, bind

__all__ = ["ShardedEMA"]

#: The name of the binding tensor among the EMA's entries of a distributed checkpoint:
#: int64 ``[global_step, fingerprint high 32 bits, fingerprint low 32 bits]``.
BINDING_TENSOR = "fsdp_ema.binding"
_LOOPS = ("validation", "test", "predict")
_SAFE_CHECKPOINTS = ("ModelCheckpoint(filename='{epoch}-{step}', monitor='step', mode='max', "
                     "save_top_k=2, save_last='link')")


def _is_sharded(value: Any) -> bool:
    return is_dtensor(value) or is_sharded_tensor(value)


def _binding_tensor(binding: Binding) -> torch.Tensor:
    fp = int(binding.fingerprint, 16)
    return torch.tensor([binding.global_step, fp >> 32, fp & 0xFFFFFFFF], dtype=torch.int64)


def _from_binding_tensor(t: torch.Tensor) -> tuple[int, str]:
    step, high, low = (int(v) for v in t.tolist())
    return step, f"{(high << 32) | low:016x}"


class ShardedEMA(CallbackCore, Callback):
    """Keeps a ``fsdp_ema.ShardedEMA`` of the LightningModule's weights, each rank only its shards.

    Args:
        config: the EMA's options, an ``fsdp_ema.EMAConfig`` (or the decay as a number, as in
            ``ShardedEMA(0.999)``; None: the defaults); the keywords below that are
            ``EMAConfig`` fields replace its values.
        swap_for_validation, swap_for_test: ``True`` (the default): those loops run with the EMA
            weights, from their first batch to their epoch end (the training weights come back
            bit for bit, before ``ModelCheckpoint`` or another callback's loop-end hook reads
            them); ``False``: with the training weights; ``"both"``: with the training weights,
            and each batch's ``validation_step`` / ``test_step`` runs again with the EMA weights,
            what it logs renamed by ``ema_metric_name`` (``val_loss`` and ``val_loss_ema``).
        swap_for_predict: ``True`` or ``False``, as above.
        ema_metric_name: the EMA's metric name from the raw one's (``"{name}_ema"``).
        copy_to_model_at_end: at the end of ``fit``, write the EMA into the model for good
            (``ShardedEMA.copy_to()``), as Lightning's ``WeightAveraging`` does.
        export_dir: at the end of ``fit``, write the full EMA weights there as a consolidated
            Hugging Face safetensors directory (``export()``); ``export_module`` and
            ``export_dtype`` as ``export()``'s ``module`` and ``dtype``.
        strict_resume, allow_changes: a resume refuses an EMA saved with other options (decay,
            warmup, schedule, update_every, start_step, dtype, params, buffers), with another
            parameter set, at another global step than the restored trainer state or beside other
            model weights than the restored model, naming the difference;
            ``allow_changes={"decay"}`` accepts a change of those options,
            ``strict_resume=False`` resumes whatever differs (with a warning).
        log: log ``ema/decay`` and ``ema/step`` after each update (``LightningModule.log``).
        compile: ``True`` (or a dict of ``torch.compile`` arguments) compiles ``update()`` with
            ``fullgraph=True``.
        key: names this EMA in checkpoints (the callback's state key and the ``"<key>/"`` prefix
            of its entries in ``checkpoint["state_dict"]``); give each of several EMA callbacks
            its own.
        **options: the EMA's options as keywords, each an ``fsdp_ema.EMAConfig`` field
            (``decay``, ``warmup``, ``update_every``, ``start_step``, ``params="trainable"``,
            ``device="cpu"``, ``dtype``, ``schedule``, ...); an unknown one is refused here.
    """

    def __init__(self, config: EMAConfig | float | None = None, *,
                 swap_for_validation: bool | str = True,
                 swap_for_test: bool | str = True, swap_for_predict: bool = True,
                 ema_metric_name: str = "{name}_ema", copy_to_model_at_end: bool = False,
                 export_dir: str | os.PathLike | None = None, export_module: str | None = None,
                 export_dtype: torch.dtype | None = None, strict_resume: bool = True,
                 allow_changes: Collection[str] = (), log: bool = True,
                 compile: bool | dict = False, key: str = "fsdp_ema", **options: Any):
        what = f"{type(self).__name__} callback"
        super().__init__(what, config, options, ema_metric_name=ema_metric_name,
                         strict_resume=strict_resume, allow_changes=allow_changes, log=log,
                         compile=compile)
        if not key or "." in key or "/" in key:
            raise ValueError(f"{what}: key must be a non-empty name without '.' or '/', got "
                             f"{key!r}")
        self.swap_for = {"validation": swap_for_validation, "test": swap_for_test,
                         "predict": swap_for_predict}
        for loop, mode in self.swap_for.items():
            if mode not in (True, False) and not (mode == "both" and loop != "predict"):
                raise ValueError(f"{what}: swap_for_{loop} must be True, False"
                                 f"{' or both' if loop != 'predict' else ''}, got {mode!r}")
        self.copy_to_model_at_end = copy_to_model_at_end
        self.export_dir, self.export_module, self.export_dtype = (export_dir, export_module,
                                                                  export_dtype)
        self.key = key
        self._last_step = 0           # trainer.global_step at the last update
        # What a loaded checkpoint holds for the EMA: (kind, value, callback state, global step).
        self._restore: tuple[str, Any, Any, int | None] | None = None
        self._sharded = False
        self._trainer: pl.Trainer | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(key=self.key)

    @property
    def prefix(self) -> str:
        """The prefix of the EMA's entries in ``checkpoint["state_dict"]`` (sharded models)."""
        return self.key + "/"

    # --- making and restoring the EMA -------------------------------------------------------------

    def _make(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        # FSDP1 (FSDPStrategy) keeps the root's FlatParameter on the wrapper around the module.
        wrapped = trainer.strategy.model
        model = wrapped if isinstance(wrapped, FullyShardedDataParallel) else pl_module
        self.make_ema(model)
        # Sharded (read from the model, never from the strategy's settings): FSDP2 or FSDP1
        # modules, or DTensor parameters (tensor parallelism).
        self._sharded = is_fsdp(model) or any(_is_sharded(p) for p in model.parameters())

    def _check_strategy(self, trainer: pl.Trainer) -> None:
        """At the start of fit: a sharded EMA cannot go into a full checkpoint (rank 0 alone
        writes it), and a sharding strategy over a model it did not shard is reported."""
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        strategy = trainer.strategy
        if not self._sharded:
            if isinstance(strategy, (ModelParallelStrategy, FSDPStrategy)):
                self._warn_not_sharded(f"{type(strategy).__name__}")
            return
        full = ((isinstance(strategy, ModelParallelStrategy)
                 and not getattr(strategy, "_save_distributed_checkpoint", True))
                or (isinstance(strategy, FSDPStrategy)
                    and getattr(strategy, "_state_dict_type", "sharded") == "full"))
        if full and trainer.checkpoint_callbacks:
            raise ValueError(f"{self.what}: {self._full_checkpoint_message()}")

    def _full_checkpoint_message(self) -> str:
        return ("the EMA is sharded but the strategy saves full checkpoints (written by rank 0 "
                "alone): the EMA would have to be gathered on one rank. Save distributed "
                "checkpoints: ModelParallelStrategy(save_distributed_checkpoint=True) or "
                "FSDPStrategy(state_dict_type='sharded')")

    def _ensure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Makes the EMA if there is none, and loads what a restored checkpoint holds for it,
        after the resume checks (collective for a sharded EMA: every rank gets here at the same
        event)."""
        restore, self._restore = self._restore, None
        if restore is not None and restore[0] == "none":
            warn_user(f"{type(self).__name__} callback: the checkpoint {restore[1]!r} holds no EMA "
                      f"under {self.state_key!r}; the EMA starts from the restored weights")
        if self.ema is None or (restore is not None and restore[0] == "none"):
            self._make(trainer, pl_module)
        if restore is None or restore[0] == "none":
            return
        kind, value, state, step = restore
        saved = Binding.from_json(state.get("binding"))
        where = f"the checkpoint {os.fspath(trainer.ckpt_path)!r}"
        if kind == "state_dict":
            self._check(saved, None, step, [k for k in value if k != self.ema.STEP_KEY], where)
            self.ema.load_state_dict(value, strict=self.checks.strict)
        else:
            self._load_distributed(value, saved, step, where)

    def _check(self, saved: Binding | None, stored: tuple[int, str] | None,
               global_step: int | None, names, where: str) -> None:
        """The resume checks: options and names, then (a sharded EMA) the binding stored with
        the distributed tensors against the one in ``meta.pt``, then the binding against the
        trainer's restored ``global_step`` (the checkpoint's) and model."""
        fingerprint = self.ema.model_fingerprint()
        torn = (stored is not None and saved is not None
                and stored != (saved.global_step, saved.fingerprint))
        if torn:
            problem = (
                f"{where} is torn: its distributed files (model, optimizer and EMA) were written "
                f"at global step {stored[0]}, its meta.pt (the trainer's loops and callbacks) at "
                f"step {saved.global_step}: a save over this checkpoint was stopped between "
                f"them, and Lightning restored the weights of one save with the loop state of "
                f"the other. It cannot resume exactly: resume from another checkpoint, and save "
                f"under new names so that a stopped save never tears the only one, e.g. "
                f"{_SAFE_CHECKPOINTS}")
            if self.checks.strict:
                raise ValueError(f"{type(self).__name__} callback: {problem} (strict_resume=False "
                                 f"resumes anyway)")
            warn_user(f"{type(self).__name__} callback(strict_resume=False): {problem}")
            return
        if stored is not None and saved is not None:
            saved = Binding(stored[0], stored[1], saved.settings)
        self.checks.check(
            self.ema, saved, global_step=global_step, fingerprint=fingerprint,
            saved_names=names, where=where, restored="the model Lightning restored from it",
            step_hint=f"resume from another checkpoint, and save under new names, e.g. "
                      f"{_SAFE_CHECKPOINTS}",
            weights_hint=f"its files come from more than one save (a save over it stopped after "
                         f"some ranks' files were rewritten?), or its model was replaced; resume "
                         f"from another checkpoint, and save under new names, e.g. "
                         f"{_SAFE_CHECKPOINTS}")

    def _load_distributed(self, path: str | os.PathLike, saved: Binding | None,
                          global_step: int | None, where: str) -> None:
        """``dcp.load`` of the ``"<key>/"`` entries of a distributed checkpoint straight into the
        EMA's shards (``state_dict()`` shares their memory), once the binding stored with them
        (a separate, small load) and the names agree with the trainer's restored state."""
        import torch.distributed.checkpoint as dcp

        # The strategy names the checkpoint's top-level entry ("state_dict" for
        # ModelParallelStrategy, "model" for FSDPStrategy): find the one holding our entries.
        step_suffix = "." + self.prefix + self.ema.STEP_KEY  # DCP joins keys by "."
        metadata = dcp.FileSystemReader(os.fspath(path)).read_metadata()
        keys = metadata.state_dict_metadata
        tops = sorted({k[:-len(step_suffix)] for k in keys if k.endswith(step_suffix)})
        if not tops:
            raise RuntimeError(f"{type(self).__name__} callback: {where} holds no "
                               f"'{self.prefix}' entries, though its callback state says the "
                               f"EMA was saved there")
        top = tops[0] + "." + self.prefix
        names = [k[len(top):] for k in keys if k.startswith(top)]
        stored = None
        if BINDING_TENSOR in names:
            t = torch.zeros(3, dtype=torch.int64)
            dcp.load({tops[0]: {self.prefix + BINDING_TENSOR: t}}, checkpoint_id=path)
            stored = _from_binding_tensor(t)
        names = [n for n in names if n not in (BINDING_TENSOR, self.ema.STEP_KEY)]
        self._check(saved, stored, global_step, names, where)
        sd = self.ema.state_dict()
        if not self.checks.strict:
            sd = {k: v for k, v in sd.items() if k in names or k == self.ema.STEP_KEY}
        dcp.load({tops[0]: {self.prefix + k: v for k, v in sd.items()}}, checkpoint_id=path)
        self.ema.load_state_dict(sd, strict=self.checks.strict)

    # --- Lightning's events -----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer  # state_dict() gets no trainer

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The strategy has wrapped and sharded the model: the EMA is made from its shards.
        self._make(trainer, pl_module)
        self._check_strategy(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The checkpoint (if any) is restored by now, with every strategy.
        self._ensure(trainer, pl_module)
        self._last_step = trainer.global_step

    def _catch_up(self, trainer: pl.Trainer, pl_module: pl.LightningModule | None = None) -> None:
        if self.ema is not None and not self._swap.active and trainer.global_step > self._last_step:
            self._update()
            self._last_step = trainer.global_step
            if pl_module is not None:
                for name, value in self._logged().items():
                    pl_module.log(name, value, on_step=True, on_epoch=False)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._catch_up(trainer, pl_module)

    # --- evaluation loops: the EMA weights from the first batch to the epoch end ------------------

    def _swap_in(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loop: str) -> None:
        if self._restore is not None:  # validate/test/predict(ckpt_path=...)
            self._ensure(trainer, pl_module)
        if self.swap_for[loop] is True and self.ema is not None:
            self._swap.enter(self.ema)

    def _again_with_ema(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loop: str,
                        batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        """``"both"``: the batch's step once more with the EMA weights, its logs renamed."""
        if self.swap_for[loop] != "both" or self.ema is None:
            return
        step = "validation_step" if loop == "validation" else "test_step"
        args = [batch, batch_idx]
        if len(getattr(trainer, f"num_{'val' if loop == 'validation' else 'test'}_batches")) > 1:
            args.append(dataloader_idx)
        log, log_dict, pattern = pl_module.log, pl_module.log_dict, self.ema_metric_name

        def renamed_log(name, value, *a, **k):
            return log(pattern.format(name=name), value, *a, **k)

        def renamed_log_dict(values, *a, **k):
            return log_dict({pattern.format(name=n): v for n, v in values.items()}, *a, **k)

        pl_module.log, pl_module.log_dict = renamed_log, renamed_log_dict
        try:
            with self.ema.swap():
                getattr(trainer.strategy, step)(*args)
        finally:
            del pl_module.log, pl_module.log_dict

    def _swap_out(self) -> None:
        self._swap.exit()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._swap_in(trainer, pl_module, "validation")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx,
                                dataloader_idx=0):
        self._again_with_ema(trainer, pl_module, "validation", batch, batch_idx, dataloader_idx)

    def on_validation_epoch_end(self, trainer, pl_module):
        self._swap_out()

    def on_validation_end(self, trainer, pl_module):
        self._swap_out()

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._swap_in(trainer, pl_module, "test")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._again_with_ema(trainer, pl_module, "test", batch, batch_idx, dataloader_idx)

    def on_test_epoch_end(self, trainer, pl_module):
        self._swap_out()

    def on_test_end(self, trainer, pl_module):
        self._swap_out()

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._swap_in(trainer, pl_module, "predict")

    def on_predict_epoch_end(self, trainer, pl_module):
        self._swap_out()

    def on_predict_end(self, trainer, pl_module):
        self._swap_out()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._swap_out()

    # --- the end of fit, exports ------------------------------------------------------------------

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.ema is None:
            return
        if self.copy_to_model_at_end:
            self.ema.copy_to()
        if self.export_dir is not None:
            self.export(self.export_dir, module=self.export_module, dtype=self.export_dtype)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # fit(ckpt_path=...) of a checkpoint at or past the end (max_epochs or max_steps reached:
        # a requeued job that had finished) restores it and skips training, so on_train_start
        # never loaded its EMA: load it now (collective; every rank gets here), so that the
        # callback's EMA, its swap and its teacher are the checkpoint's, not a fresh one.
        if self._restore is not None:
            self._ensure(trainer, pl_module)

    def export(self, path: str | os.PathLike, *, module: str | None = None,
               dtype: torch.dtype | None = None) -> list[str]:
        """Writes the full EMA weights as a consolidated Hugging Face safetensors directory
        (``fsdp_ema.ShardedEMA.export``; collective, rank 0 writes bucket by bucket). ``module``:
        the LightningModule's submodule to export (an attribute path, e.g. ``"net"``), its
        tensors named as the submodule names them (``net.0.weight`` -> ``0.weight``), with its
        ``config.json`` (and ``generation_config.json``) when it is a ``PreTrainedModel``, so that
        ``from_pretrained`` loads the directory. Works after ``fit`` and after
        ``trainer.validate(model, ckpt_path=...)`` of any saved checkpoint (the EMA comes back
        from it first). Returns the files written beside the weights."""
        trainer = self._trainer
        if self._restore is not None and trainer is not None:
            self._ensure(trainer, trainer.lightning_module)
        if self.ema is None:
            raise RuntimeError(f"{type(self).__name__} callback: no EMA to export yet (it is made "
                               f"when fit starts, or from a checkpoint a trainer restored)")
        prefix, submodule = None, None
        if module:
            root = trainer.lightning_module if trainer is not None else self.ema.model
            submodule = root.get_submodule(module)
            prefix = module + "."
        # The config files only when the submodule is the pretrained model itself: its names are
        # the weights' names.
        pretrained = pretrained_model(submodule) if submodule is not None else None
        return self._export(path, dtype=dtype, prefix=prefix,
                            pretrained=pretrained if pretrained is submodule else None)

    # --- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self.ema is None:
            return {}
        trainer = self._trainer
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
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if not state:
            return  # save_weights_only: no callback state, no EMA
        model_state = checkpoint.get("state_dict", {})
        if self._sharded and not any(_is_sharded(v) for v in model_state.values()):
            raise RuntimeError(f"{type(self).__name__} callback: "
                               f"{self._full_checkpoint_message()}")
        # Collective (every rank dumps the checkpoint): what identifies this training state.
        binding = bind(self.ema, trainer.global_step)
        state["binding"] = binding.to_json()
        if not self._sharded:
            return
        clash = [k for k in model_state if k.startswith(self.prefix)]
        if clash:
            raise RuntimeError(f"{type(self).__name__} callback: the model's state_dict already "
                               f"has {clash[0]!r}; give the callback another key=")
        model_state.update({self.prefix + k: v for k, v in self.ema.state_dict().items()})
        # Written with the distributed tensors, read back against meta.pt's copy: a save stopped
        # between the two is seen.
        model_state[self.prefix + BINDING_TENSOR] = _binding_tensor(binding)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        step = checkpoint.get("global_step")
        if not state:
            self._restore = ("none", trainer.ckpt_path, None, step)
        elif state.get("layout") == "callback":
            self._restore = ("state_dict", state["ema"], state, step)
        elif state.get("layout") == "state_dict":
            self._restore = ("dcp", trainer.ckpt_path, state, step)
        else:
            raise ValueError(f"{type(self).__name__} callback: unknown state in the checkpoint "
                             f"{trainer.ckpt_path!r}: {sorted(state)}")
