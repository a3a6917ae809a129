"""``ShardedEMACallback``: a Hugging Face ``TrainerCallback`` that keeps an EMA of the weights shard
by shard, under the ``Trainer`` on one device, DDP, and Accelerate's FSDP2 and FSDP1, and in
Accelerate loops of your own (docs/INTEGRATIONS.md).

The callback only translates the trainer's events into ``fsdp_ema`` calls:

- ``on_train_begin`` (the trainer has wrapped the model): the EMA is made from the model it hands
  over, shard by shard (FSDP is read from the model, not from the arguments); on a resumed run
  the EMA and its step come back from ``checkpoint-N/ema/``;
- ``on_step_end`` (after the optimizer step; once per accumulated step): ``update()``;
- ``on_save`` (every rank, with no barrier before it): ``fsdp_ema.save_training_state`` of the EMA
  into ``checkpoint-N/ema/`` (one file per rank, committed by rank 0 once every rank's file is
  written; the trainer's ``save_total_limit`` rotation removes it with the checkpoint);
- evaluation during training with ``eval_with_ema=True``: ``swap()`` around it;
- ``on_train_end``: optionally the EMA weights as a directory ``from_pretrained`` loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import HeldSwap, check_options, missing_framework

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as _e:
    raise missing_framework(__name__, "transformers (and accelerate)", "transformers") from _e

import fsdp_ema

__all__ = ["ShardedEMACallback"]

#: The trainer's state file in every checkpoint folder (transformers.trainer.TRAINER_STATE_NAME).
TRAINER_STATE_NAME = "trainer_state.json"


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``) or FSDP1, read from its modules."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return any(isinstance(m, PeftModel) for m in model.modules())


def _pretrained_config(model: nn.Module):
    """The ``PretrainedConfig`` of the first ``PreTrainedModel`` in ``model`` (None if none)."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return m.config
    return None


class ShardedEMACallback(TrainerCallback):
    """Keeps a ``fsdp_ema.ShardedEMA`` of the model the ``Trainer`` trains, each rank only its
    shards.

    Args:
        decay: the EMA decay (``fsdp_ema.ShardedEMA``'s; the upper bound of a warmup).
        eval_with_ema: evaluations during training run with the EMA weights; the training
            weights come back bit for bit before anything else (a checkpoint) reads them.
        save_ema_model: at the end of training, write the EMA weights there: a directory that
            ``AutoModel*.from_pretrained`` loads (``ShardedEMA.export`` plus the model's
            ``config.json``), or, for a peft model, the EMA adapter that
            ``PeftModel.from_pretrained(base, path)`` loads (``fsdp_ema.export_peft_adapter``).
        save_ema_dtype: casts the weights of that export.
        async_save: the EMA is staged in host memory in ``on_save`` and written and committed in
            the background (``fsdp_ema.save_training_state(..., async_=True)``); the next save,
            a resume and the end of training wait for it.
        subdir: the EMA's folder inside each ``checkpoint-N/``.
        resume_from: the checkpoint folder to take the EMA from on a resumed run, when it is
            neither ``args.resume_from_checkpoint`` nor ``output_dir/checkpoint-<global_step>``.
        compile: ``True`` (or a dict of ``torch.compile`` arguments) compiles ``update()`` with
            ``fullgraph=True``.
        **options: every other ``fsdp_ema.ShardedEMA`` option, as it is (``warmup``,
            ``update_every``, ``start_step``, ``params="trainable"``, ``device="cpu"``, ...).

    In a loop of your own (Accelerate), call ``attach(model, accelerator)`` after
    ``accelerator.prepare``, ``update()`` after each optimizer step, and ``swap()`` to evaluate:
    ``accelerator.save_state(dir)`` / ``load_state(dir)`` then save and load ``dir/ema`` too.
    """

    def __init__(self, decay: float = 0.9999, *, eval_with_ema: bool = False,
                 save_ema_model: str | os.PathLike | None = None,
                 save_ema_dtype: torch.dtype | None = None, async_save: bool = False,
                 subdir: str = "ema", resume_from: str | os.PathLike | None = None,
                 compile: bool | dict = False, **options: Any):
        check_options(type(self).__name__, decay, options)
        if not subdir or os.sep in subdir or subdir in (".", ".."):
            raise ValueError(f"ShardedEMACallback: subdir must be a folder name, got {subdir!r}")
        self.decay, self.options = decay, options
        self.eval_with_ema = eval_with_ema
        self.save_ema_model, self.save_ema_dtype = save_ema_model, save_ema_dtype
        self.async_save, self.subdir, self.resume_from = async_save, subdir, resume_from
        self.compile = compile
        self.ema: fsdp_ema.ShardedEMA | None = None
        self._update = None
        self._swap = HeldSwap()
        self._handle = None  # the async save in flight
        self._warned_multi_eval = False

    # --- the EMA, for the Trainer and for loops of your own ---------------------------------------

    def attach(self, model: nn.Module, accelerator: Any = None) -> fsdp_ema.ShardedEMA:
        """Makes the EMA of ``model`` as the trainer (or ``accelerator.prepare``) hands it over:
        FSDP2 and FSDP1 models shard by shard, DDP and plain models whole. With an Accelerate
        ``accelerator``, ``accelerator.save_state(dir)`` also saves the EMA into ``dir/ema`` and
        ``accelerator.load_state(dir)`` restores it."""
        self.wait()
        self.ema = fsdp_ema.ShardedEMA(model, self.decay, **self.options)
        self._update = self.ema.update
        if self.compile:
            kwargs = dict(self.compile) if isinstance(self.compile, dict) else {}
            self._update = torch.compile(self.ema.update, fullgraph=True, **kwargs)
        if accelerator is not None:
            accelerator.register_save_state_pre_hook(
                lambda models, weights, output_dir: self.save(output_dir))
            accelerator.register_load_state_pre_hook(lambda models, input_dir: self.load(input_dir))
        return self.ema

    def _ema(self, what: str) -> fsdp_ema.ShardedEMA:
        if self.ema is None:
            raise RuntimeError(f"ShardedEMACallback.{what}: no EMA yet (the Trainer makes it when "
                               f"training begins; in a loop of your own, call attach(model))")
        return self.ema

    def update(self) -> None:
        """Folds the current weights into the EMA (after each optimizer step)."""
        self._ema("update")
        self._update()

    @contextlib.contextmanager
    def swap(self) -> Iterator[nn.Module]:
        """The model holds the EMA weights inside, its own weights after (bit for bit)."""
        with self._ema("swap").swap() as model:
            yield model

    def save(self, checkpoint_dir: str | os.PathLike, *, global_step: int | None = None) -> None:
        """Saves the EMA and its step into ``checkpoint_dir/<subdir>`` (collective; a previous
        save there is replaced). Asynchronous with ``async_save``."""
        ema = self._ema("save")
        self.wait()
        extra = {} if global_step is None else {"global_step": int(global_step)}
        result = fsdp_ema.save_training_state(
            os.path.join(os.fspath(checkpoint_dir), self.subdir), ema=ema, rng=False,
            extra=extra, overwrite=True, async_=self.async_save)
        if self.async_save:
            self._handle = result

    def load(self, checkpoint_dir: str | os.PathLike) -> dict:
        """Restores the EMA and its step from ``checkpoint_dir/<subdir>`` (collective, at any
        world size); returns what ``save`` stored beside it."""
        ema = self._ema("load")
        self.wait()
        return fsdp_ema.load_training_state(
            os.path.join(os.fspath(checkpoint_dir), self.subdir), ema=ema, rng=False)

    def wait(self) -> None:
        """Waits for the async save in flight (raising its error on every rank)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.result()

    def save_model(self, path: str | os.PathLike) -> None:
        """Writes the EMA weights as a model directory (collective; rank 0 writes): for a peft
        model the EMA adapter (``PeftModel.from_pretrained``), else the consolidated safetensors
        of the EMA plus the model's ``config.json`` (``AutoModel*.from_pretrained``)."""
        ema = self._ema("save_model")
        path = os.fspath(path)
        if _is_peft(ema.model):
            fsdp_ema.export_peft_adapter(ema, path, dtype=self.save_ema_dtype)
            return
        ema.export(path, dtype=self.save_ema_dtype, overwrite=True)
        config = _pretrained_config(ema.model)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if config is not None and rank == 0:
            config.save_pretrained(path)

    # --- the Trainer's events ---------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise RuntimeError("ShardedEMACallback: the trainer handed over no model")
        if getattr(args, "fsdp_plugin_args", None) is not None and not is_fsdp(model):
            warnings.warn(
                "ShardedEMACallback: the TrainingArguments ask for FSDP, but the model the "
                "Trainer trains is not sharded (Accelerate dropped the FSDP plugin, as it does "
                "on the CPU): every rank keeps the whole EMA", RuntimeWarning, stacklevel=2)
        self.attach(model)
        if state.global_step > 0:  # a resumed run: the EMA of its checkpoint
            self._resume(args, state)

    def _resume(self, args, state) -> None:
        candidates = [self.resume_from, getattr(args, "resume_from_checkpoint", None),
                      os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")]
        checkpoint = None
        for c in candidates:
            if isinstance(c, (str, os.PathLike)) and _checkpoint_step(c) == state.global_step:
                checkpoint = os.fspath(c)
                break
        if checkpoint is None:
            raise FileNotFoundError(
                f"ShardedEMACallback: training resumes at step {state.global_step}, but none of "
                f"{[os.fspath(c) for c in candidates if c]} is a checkpoint of that step; pass "
                f"ShardedEMACallback(resume_from=<the checkpoint folder>)")
        if not os.path.isdir(os.path.join(checkpoint, self.subdir)):
            warnings.warn(f"ShardedEMACallback: {checkpoint} holds no EMA ({self.subdir}/); the "
                          f"EMA starts from the restored weights", RuntimeWarning, stacklevel=3)
            return
        extra = self.load(checkpoint)
        if extra.get("global_step", state.global_step) != state.global_step:
            raise RuntimeError(f"ShardedEMACallback: {checkpoint}/{self.subdir} was saved at "
                               f"step {extra['global_step']}, the trainer resumes at step "
                               f"{state.global_step}")

    def on_step_end(self, args, state, control, **kwargs):
        self.update()
        if control.should_save:
            # The trainer may now remove older checkpoints (save_total_limit): none may still be
            # written to.
            self.wait()
        if self.eval_with_ema and control.should_evaluate:
            self._swap_in()

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:
            self.wait()
        if self.eval_with_ema and control.should_evaluate:
            self._swap_in()

    def _swap_in(self) -> None:
        if self.ema is not None:
            self._swap.enter(self.ema)

    def _swap_out(self) -> None:
        self._swap.exit()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not self._swap.active:
            return
        # The evaluation is over; the trainer may save next, which must see the training weights.
        self._swap_out()
        if metrics and "eval_runtime" not in metrics and not self._warned_multi_eval:
            self._warned_multi_eval = True
            warnings.warn("ShardedEMACallback(eval_with_ema=True): with several eval datasets, "
                          "only the first is evaluated with the EMA weights (the trainer gives "
                          "callbacks no event between them); evaluate the others in "
                          "`with callback.swap(): trainer.evaluate(...)`", RuntimeWarning,
                          stacklevel=2)

    def on_save(self, args, state, control, **kwargs):
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self.save(checkpoint, global_step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._swap_out()
        self.wait()
        if self.save_ema_model is not None and self.ema is not None:
            self.save_model(self.save_ema_model)


def _checkpoint_step(path: str | os.PathLike) -> int | None:
    """The ``global_step`` in ``path/trainer_state.json``, or None without one."""
    try:
        with open(os.path.join(os.fspath(path), TRAINER_STATE_NAME), encoding="utf-8") as f:
            return json.load(f).get("global_step")
    except (OSError, ValueError):
        return None
