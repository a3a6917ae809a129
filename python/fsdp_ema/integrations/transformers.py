"""``ShardedEMACallback``: a Hugging Face ``TrainerCallback`` that keeps an EMA of the weights shard
by shard, under the ``Trainer`` on one device, DDP, and Accelerate's FSDP2 and FSDP1, and in
Accelerate loops of your own (docs/INTEGRATIONS.md).

The callback only translates the trainer's events into ``fsdp_ema`` calls:

- ``on_train_begin`` (the trainer has wrapped the model): the EMA is made from the model it hands
  over, shard by shard (FSDP is read from the model, not from the arguments); on a resumed run
  the EMA comes back from the checkpoint whose model the Trainer restored (the folder read from
  the Trainer's own frame, ``restored_checkpoint``), proven by the step and the model fingerprint
  recorded beside it (``_common.ResumeChecks``);
- ``on_step_end`` (after the optimizer step; once per accumulated step): ``update()``;
- ``on_save``: the EMA into ``checkpoint-N/ema/`` (``fsdp_ema.save_training_state``, one file per
  rank, committed by rank 0 once every rank's file is written); the checkpoint rotation
  (``save_total_limit``) runs after that commit, so the previous checkpoint stays until the new
  one holds its EMA, and orders the checkpoints by step (``rotate_by_step``);
- evaluation during training with ``eval_with_ema``: the EMA weights from the evaluation's first
  forward to its end (or, with ``"both"``, a second forward of each evaluation batch with them);
- ``on_log``: ``ema/decay`` and ``ema/step`` in the trainer's logs;
- ``on_train_end``: optionally the EMA weights as a directory ``from_pretrained`` loads.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import sys
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .common import (
    HeldSwap,
    ResumeChecks,
    check_metric_name,
    is_fsdp,
    logged_values,
    make_ema,
    missing_framework,
    pretrained_model,
    warn_not_sharded,
    warn_user,
    write_hf_metadata,
)

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as _e:
    raise missing_framework(__name__, "transformers (and accelerate)", "transformers") from _e

import fsdp_ema

from .. import _ops
from ..distributed.groups import comm_device, default_group, rank_world
from ..ema.config import EMAConfig
from ..store import binding as _binding
from ..store.collective import agreed

__all__ = ["ShardedEMACallback"]

#: The trainer's state file in every checkpoint folder (transformers.trainer.TRAINER_STATE_NAME).
TRAINER_STATE_NAME = "trainer_state.json"
#: The key of the binding in the EMA checkpoint's ``extra``.
BINDING_KEY = "fsdp_ema.binding"
_NAME_IT = ("pass ShardedEMACallback(resume_from=<a checkpoint folder holding the ema/ saved with "
            "that checkpoint>)")


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return any(isinstance(m, PeftModel) for m in model.modules())


def fsdp_asked_by(args=None, accelerator=None) -> str | None:
    """What asked for FSDP: the ``TrainingArguments``, an Accelerate plugin, or the environment
    that ``accelerate launch`` sets from a config file with ``distributed_type: FSDP``; None if
    nothing did."""
    if args is not None and (getattr(args, "fsdp", None)
                             or getattr(args, "fsdp_plugin_args", None) is not None):
        return "TrainingArguments(fsdp=..., fsdp_config=...)"
    if accelerator is not None and getattr(accelerator.state, "fsdp_plugin", None) is not None:
        return "the Accelerator's FSDP plugin"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("true", "1"):
        return ("ACCELERATE_USE_FSDP=true in the environment, as `accelerate launch` sets it from "
                "a config with distributed_type: FSDP")
    return None


def _agree(fn, ema, what: str):
    """``fn()`` on every rank with the failure agreement of the saves and loads."""
    return agreed(fn, group=ema.process_group, device=torch.device("cpu"), what=what)


class _Candidate:
    """A checkpoint folder the EMA of a resumed run may come from, and what its ``ema/`` holds:
    ``"absent"``, ``"incomplete"`` (files but no commit) or ``"committed"`` (then ``doc``, the
    training state's document, and ``binding``)."""

    def __init__(self, folder: str, subdir: str):
        self.folder, self.ema_dir = folder, os.path.join(folder, subdir)
        self.doc: dict | None = None
        self.binding: _binding.Binding | None = None
        if not os.path.isdir(self.ema_dir):
            self.kind = "absent"
        elif not _ops.is_committed(self.ema_dir):
            self.kind = "incomplete"
        else:
            self.kind = "committed"
            self.doc = fsdp_ema.training_state.read_training_state_json(self.ema_dir)
            extra = self.doc.get("extra")
            self.binding = _binding.Binding.from_json(
                extra.get(BINDING_KEY) if isinstance(extra, dict) else None)
            if self.binding is not None:
                saved = (self.doc.get("ema") or {}).get("settings")
                self.binding = _binding.Binding(self.binding.global_step,
                                                self.binding.fingerprint,
                                                dict(saved) if isinstance(saved, dict) else {})

    def describe(self) -> str:
        if self.kind == "absent":
            return f"{self.folder} has no {os.path.basename(self.ema_dir)}/"
        if self.kind == "incomplete":
            return f"{self.ema_dir} was never committed (a save stopped before its commit)"
        if self.binding is None:
            return f"{self.ema_dir} records no global step and model fingerprint"
        return (f"{self.ema_dir} was saved at step {self.binding.global_step} beside model "
                f"weights {self.binding.fingerprint}")


class ShardedEMACallback(TrainerCallback):
    """Keeps a ``fsdp_ema.ShardedEMA`` of the model the ``Trainer`` trains, each rank only its
    shards.

    Args:
        config: the EMA's options, an ``fsdp_ema.EMAConfig`` (or the decay as a number, as in
            ``ShardedEMACallback(0.999)``; None: the defaults); the keywords below that are
            ``EMAConfig`` fields replace its values.
        eval_with_ema: ``False`` (the default): evaluations during training see the training
            weights; ``True``: they run with the EMA weights, swapped in at the evaluation's first
            forward and out at its logs (the training weights come back bit for bit before
            anything else, a checkpoint included, reads them); ``"both"``: every evaluation batch
            also goes through the EMA weights, and the mean of the model's own loss over them is
            logged as ``ema_metric_name`` of the evaluation's loss (``eval_loss_ema``).
        ema_metric_name: the name of the EMA's metric, from the raw one's (``"{name}_ema"``).
        save_ema_model: at the end of training, write the EMA weights there: a directory that
            ``AutoModel*.from_pretrained`` loads (``ShardedEMA.export`` plus the model's
            ``config.json`` and ``generation_config.json``), or, for a peft model, the EMA
            adapter that ``PeftModel.from_pretrained(base, path)`` loads
            (``fsdp_ema.export_peft_adapter``).
        save_ema_dtype: casts the weights of that export.
        async_save: the EMA is staged in host memory in ``on_save`` and written and committed in
            the background (``fsdp_ema.save_training_state(..., async_=True)``); the rotation
            waits for the commit, the next save, a resume and the end of training wait for it.
        subdir: the EMA's folder inside each ``checkpoint-N/``.
        resume_from: another checkpoint folder the EMA of a resumed run may come from. The
            callback looks first in the folder the Trainer restored (read from the Trainer's
            ``train`` frame: ``train(resume_from_checkpoint=<anywhere>)``), then here, in
            ``args.resume_from_checkpoint`` and in ``output_dir/checkpoint-<global_step>``, and
            takes the EMA whose recorded step and model fingerprint are the restored model's.
        strict_resume, allow_changes: a resume refuses an EMA saved with other options (decay,
            warmup, schedule, update_every, start_step, dtype, params, buffers), with another
            parameter set, or beside other model weights than the Trainer restored, naming the
            difference; ``allow_changes={"decay"}`` accepts a change of those options,
            ``strict_resume=False`` resumes whatever differs (with a warning).
        log: add ``ema/decay`` and ``ema/step`` to the Trainer's training logs.
        compile: ``True`` (or a dict of ``torch.compile`` arguments) compiles ``update()`` with
            ``fullgraph=True``.
        **options: the EMA's options as keywords, each an ``fsdp_ema.EMAConfig`` field
            (``decay``, ``warmup``, ``update_every``, ``start_step``, ``params="trainable"``,
            ``device="cpu"``, ...); an unknown one is refused here.

    In a loop of your own (Accelerate), call ``attach(model, accelerator)`` after
    ``accelerator.prepare``, ``update()`` after each optimizer step, and ``swap()`` to evaluate:
    ``accelerator.save_state(dir)`` / ``load_state(dir)`` then save and load ``dir/ema`` too.
    """

    def __init__(self, config: EMAConfig | float | None = None, *,
                 eval_with_ema: bool | str = False,
                 ema_metric_name: str = "{name}_ema",
                 save_ema_model: str | os.PathLike | None = None,
                 save_ema_dtype: torch.dtype | None = None, async_save: bool = False,
                 subdir: str = "ema", resume_from: str | os.PathLike | None = None,
                 strict_resume: bool = True, allow_changes: Collection[str] = (),
                 log: bool = True, compile: bool | dict = False, **options: Any):
        what = type(self).__name__
        self.config = EMAConfig.of(what, config, options)
        if not subdir or os.sep in subdir or subdir in (".", ".."):
            raise ValueError(f"{what}: subdir must be a folder name, got {subdir!r}")
        if eval_with_ema not in (False, True, "both"):
            raise ValueError(f"{what}: eval_with_ema must be False, True or 'both', got "
                             f"{eval_with_ema!r}")
        self.eval_with_ema = eval_with_ema
        self.ema_metric_name = check_metric_name(what, ema_metric_name)
        self.save_ema_model, self.save_ema_dtype = save_ema_model, save_ema_dtype
        self.async_save, self.subdir, self.resume_from = async_save, subdir, resume_from
        self.checks = ResumeChecks(what, strict_resume, allow_changes)
        self.log, self.compile = log, compile
        self.ema: fsdp_ema.ShardedEMA | None = None
        self._update = None
        self._swap = HeldSwap()
        self._handle = None          # the async save in flight
        self._after_commit = None    # what waits for its commit (the rotation)
        self._args = None
        self._limit: int | None = None  # save_total_limit, which the callback applies
        self._control = None         # the Trainer's TrainerControl, from the last event
        self._session = False        # an evaluation with the EMA weights is under way
        self._eval_on_start = False
        self._rerun = False          # the "both" mode's EMA forward is running
        self._hooks: list[Any] = []
        self._ema_loss: list[torch.Tensor] | None = None
        self._ema_metrics: dict[str, float] = {}
        self._warned_no_loss = False

    # --- the EMA, for the Trainer and for loops of your own ---------------------------------------

    def attach(self, model: nn.Module, accelerator: Any = None) -> fsdp_ema.ShardedEMA:
        """Makes the EMA of ``model`` as the trainer (or ``accelerator.prepare``) hands it over:
        FSDP2 and FSDP1 models shard by shard, DDP and plain models whole. With an Accelerate
        ``accelerator``, ``accelerator.save_state(dir)`` also saves the EMA into ``dir/ema`` and
        ``accelerator.load_state(dir)`` restores it."""
        self.wait()
        if accelerator is not None and not is_fsdp(model):
            asked = fsdp_asked_by(accelerator=accelerator)
            if asked is not None:
                warn_not_sharded(type(self).__name__, asked)
        self.ema, self._update = make_ema(model, self.config, self.compile)
        if accelerator is not None:
            accelerator.register_save_state_pre_hook(
                lambda models, weights, output_dir: self.save(output_dir))
            accelerator.register_load_state_pre_hook(
                lambda models, input_dir: self._load_checked(_Candidate(input_dir, self.subdir),
                                                             None))
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
        """Saves the EMA, its step and what binds it to the training state (``global_step`` and
        the model's fingerprint now) into ``checkpoint_dir/<subdir>`` (collective; a previous
        save there is replaced). Asynchronous with ``async_save``."""
        self.wait()
        self._save(checkpoint_dir, global_step)

    def _save(self, checkpoint_dir: str | os.PathLike, global_step: int | None) -> None:
        ema = self._ema("save")
        binding = _binding.bind(ema, global_step)
        result = fsdp_ema.save_training_state(
            os.path.join(os.fspath(checkpoint_dir), self.subdir), ema=ema, rng=False,
            extra={BINDING_KEY: binding.to_json()}, overwrite=True, async_=self.async_save)
        if self.async_save:
            self._handle = result

    def load(self, checkpoint_dir: str | os.PathLike) -> dict:
        """Restores the EMA and its step from ``checkpoint_dir/<subdir>`` (collective, at any
        world size), after the checks of a resume (options and tensor names; ``strict_resume``,
        ``allow_changes``); returns what ``save`` stored beside it."""
        return self._load_checked(_Candidate(os.fspath(checkpoint_dir), self.subdir), None)

    def _load_checked(self, candidate: _Candidate, global_step: int | None,
                      fingerprint: str | None = None, restored: str | None = None) -> dict:
        """Loads the EMA of ``candidate`` after the resume checks; ``restored`` is the folder
        the Trainer restored the model from, when known (the messages name it)."""
        ema = self._ema("load")
        self.wait()
        if candidate.kind != "committed":
            raise FileNotFoundError(f"{type(self).__name__}: no EMA to load: "
                                    f"{candidate.describe()}")
        model = "the model the Trainer restored" + (f" from {restored}" if restored else "")
        self.checks.check(
            ema, candidate.binding, global_step=global_step, fingerprint=fingerprint,
            saved_names=(candidate.doc.get("ema") or {}).get("tensors", []),
            where=candidate.ema_dir, restored=model,
            step_hint=f"it belongs to another checkpoint; {_NAME_IT}",
            weights_hint=f"it belongs to another training state: another run's checkpoint of "
                         f"the same step, or an {self.subdir}/ copied from elsewhere ({_NAME_IT}), "
                         f"or a save of this step into {candidate.folder} again that was "
                         f"stopped after the Trainer rewrote the model (then remove it and "
                         f"resume from the checkpoint before it: rm -r '{candidate.folder}')")
        return fsdp_ema.load_training_state(candidate.ema_dir, ema=ema, rng=False,
                                            strict=self.checks.strict)

    def wait(self) -> None:
        """Waits for the async save in flight (raising its error on every rank), then runs what
        waited for its commit (the checkpoint rotation)."""
        self._wait(rotate=True)

    def _wait(self, rotate: bool) -> None:
        # The rotation that waits for an async commit runs only before the Trainer starts its
        # next checkpoint: once that exists (on_save) it would count as the most recent one, and
        # the one just committed could go before the new one holds its EMA. That next
        # checkpoint's own rotation does the work then.
        handle, self._handle = self._handle, None
        after, self._after_commit = self._after_commit, None
        if handle is not None:
            handle.result()
        if after is not None and rotate:
            after()

    def save_model(self, path: str | os.PathLike) -> None:
        """Writes the EMA weights as a model directory (collective; rank 0 writes): for a peft
        model the EMA adapter (``PeftModel.from_pretrained``), else the consolidated safetensors
        of the EMA plus the model's ``config.json`` and ``generation_config.json``
        (``AutoModel*.from_pretrained``, ``generate()``)."""
        ema = self._ema("save_model")
        path = os.fspath(path)
        if _is_peft(ema.model):
            fsdp_ema.export_peft_adapter(ema, path, dtype=self.save_ema_dtype)
            return
        ema.export(path, dtype=self.save_ema_dtype, overwrite=True)
        pretrained = pretrained_model(ema.model)
        if pretrained is not None:
            write_hf_metadata(pretrained, path)

    # --- the Trainer's events ---------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise RuntimeError("ShardedEMACallback: the trainer handed over no model")
        self._control, self._args = control, args
        self._check_settings(args)
        if not is_fsdp(model):
            asked = fsdp_asked_by(args)
            if asked is not None:
                warn_not_sharded(type(self).__name__, asked)
        self.attach(model)
        if state.global_step > 0:  # a resumed run: the EMA of the checkpoint the Trainer restored
            self._resume(args, state)
        self._take_over_rotation(args)  # after a resume that may refuse: args untouched then
        self._remove_hooks()  # a train() before this one that raised
        if self.eval_with_ema:
            # Before FSDP's own pre-forward hook (prepend): the EMA goes into the shards before
            # they are gathered.
            self._hooks = [model.register_forward_pre_hook(self._pre_forward, prepend=True)]
            if self.eval_with_ema == "both":
                self._hooks.append(model.register_forward_hook(self._post_forward,
                                                               with_kwargs=True))
            self._eval_on_start = bool(getattr(args, "eval_on_start", False))

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _check_settings(self, args) -> None:
        _, world = rank_world(default_group())
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if getattr(args, "save_on_each_node", False) and local_world < world:
            raise ValueError(
                "ShardedEMACallback: save_on_each_node=True saves each node's checkpoints on "
                "its own disk, but the EMA is one checkpoint of every rank's shards in "
                "checkpoint-N/ema, committed by rank 0: use an output_dir every node sees, "
                "with save_on_each_node=False")

    def _take_over_rotation(self, args) -> None:
        # The Trainer rotates checkpoints inside its own save, before on_save: the previous
        # checkpoint would go before the new one holds its EMA. The callback runs the Trainer's
        # rotation itself once the EMA is committed (and puts the setting back at the end).
        if args.save_total_limit is not None and args.save_total_limit > 0:
            self._limit = args.save_total_limit
            args.save_total_limit = None
        elif args.save_total_limit is not None:
            self._limit = None
        # else: a second train() after one that stopped early keeps the limit taken over

    def _rotate(self, args, state, newest: str | None = None) -> None:
        """The Trainer's ``save_total_limit`` rotation, once ``newest`` (the checkpoint just
        saved) holds its EMA; see ``rotate_by_step``."""
        if self._limit is None or not args.should_save:
            return
        # The step being saved now is protected too: with async_save this rotation runs at the
        # next save, whose folder other ranks may already have begun (their RNG files).
        current = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        rotate_by_step(args.output_dir, self._limit, newest=newest,
                       keep=(state.best_model_checkpoint, current))

    def _end_of_training_rotation(self, args, state) -> None:
        """What the Trainer does at the end of training with ``save_total_limit=1`` and a best
        checkpoint (it removes every other one), done once the last EMA is committed."""
        if self._limit != 1 or state.best_model_checkpoint is None or not args.should_save:
            return
        from transformers.trainer_utils import sort_checkpoints

        best = state.best_model_checkpoint
        for checkpoint in sort_checkpoints(output_dir=args.output_dir,
                                           best_model_checkpoint=best):
            if os.path.exists(best) and not os.path.samefile(checkpoint, best):
                shutil.rmtree(checkpoint, ignore_errors=True)

    def _marker_key(self) -> str:
        return f"fsdp_ema:{self.subdir}"

    def _mark(self, state) -> None:
        # In every trainer_state.json the Trainer writes from now on: this run keeps an EMA in
        # <subdir>/ (a key that names no callback class, so the Trainer's callback restore
        # skips it).
        if isinstance(state.stateful_callbacks, dict):
            state.stateful_callbacks[self._marker_key()] = {"global_step": state.global_step,
                                                            "ema": self.subdir}

    def _resume(self, args, state) -> None:
        step = state.global_step
        # The folder the Trainer restored, read from its own frame (train(resume_from_checkpoint=
        # <anywhere>) sets no argument a callback sees); then what the user named, then the
        # output_dir's checkpoint of that step. The fingerprint decides among them.
        restored = restored_checkpoint()
        folders = []
        for c in (restored, self.resume_from, getattr(args, "resume_from_checkpoint", None),
                  os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")):
            if isinstance(c, (str, os.PathLike)) and os.path.abspath(c) not in folders:
                folders.append(os.path.abspath(c))
        restored = os.path.abspath(restored) if restored is not None else None
        ema = self._ema("resume")
        candidates = _agree(lambda: [_Candidate(f, self.subdir) for f in folders if
                                     os.path.isdir(f)], ema, "ShardedEMACallback resume")
        fingerprint = ema.model_fingerprint()
        for c in candidates:
            if (c.kind == "committed" and c.binding is not None
                    and c.binding.global_step == step and c.binding.fingerprint == fingerprint):
                self._load_checked(c, step, fingerprint, restored)
                return
        committed = [c for c in candidates if c.kind == "committed"]
        if committed:
            # Committed, but not of the model the Trainer restored (another run's checkpoint of
            # the same step, say; the restored folder's own first): refused, naming both, unless
            # strict_resume=False.
            self._load_checked(committed[0], step, fingerprint, restored)
            return
        self._no_ema(args, state, restored, folders, candidates)

    def _no_ema(self, args, state, restored: str | None, folders: list[str],
                candidates: list[_Candidate]) -> None:
        """No committed EMA in any candidate: a refusal saying what to do when the restored
        checkpoint was saved by a run that kept an EMA, else a warning (a fresh EMA)."""
        step = state.global_step
        source = f"from {restored}" if restored else "from a checkpoint"
        others = "; ".join(c.describe() for c in candidates) or f"none of {folders} exists"
        marker = (state.stateful_callbacks or {}).get(self._marker_key())
        incomplete = next((c for c in candidates if c.kind == "incomplete"), None)
        # An EMA was kept: the restored trainer_state.json says so, or an ema/ began to be saved.
        if not ((isinstance(marker, dict) and marker.get("global_step") == step)
                or incomplete is not None):
            warn_user(f"ShardedEMACallback: the Trainer resumed at step {step} {source}, saved "
                      f"without this callback ({others}); the EMA starts from the restored "
                      f"weights")
            return
        # The folder the message is about: the restored one, or the interrupted save's when the
        # restored one is not known; what it says and the command it gives both name it.
        if incomplete is not None and restored in (None, incomplete.folder):
            interrupted = incomplete.folder
            why = (f"the run was stopped while saving it ({incomplete.ema_dir} has files but no "
                   f"commit)")
        else:
            interrupted = restored or next((c.folder for c in candidates), None)
            why = (f"{interrupted or 'the restored checkpoint'} has no committed {self.subdir}/: "
                   f"either the run was stopped before saving it, or the checkpoint was copied "
                   f"or moved without its {self.subdir}/")
        fix = _NAME_IT
        if interrupted is not None:
            previous = _previous_checkpoint(os.path.dirname(interrupted), step)
            fix = (f"if the run was stopped, remove the checkpoint and resume again (from the "
                   f"checkpoint before it{', ' + previous if previous else ''}, which holds "
                   f"model, optimizer and EMA): rm -r '{interrupted}'; if its {self.subdir}/ "
                   f"is elsewhere, {_NAME_IT}")
        raise RuntimeError(
            f"ShardedEMACallback: the Trainer resumed at step {step} {source}, saved by a run "
            f"that kept an EMA, but no committed EMA of that step was found ({others}): {why}. "
            f"To go on: {fix}")

    def on_step_begin(self, args, state, control, **kwargs):
        self._control = control
        self._end_eval()

    def on_step_end(self, args, state, control, **kwargs):
        self._control = control
        self.update()
        self._mark(state)
        if control.should_save:  # the Trainer saves next: the save in flight lands first
            self.wait()

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._control = control
        self._end_eval()

    def on_epoch_end(self, args, state, control, **kwargs):
        self._control = control
        self._end_eval()
        self._mark(state)
        if control.should_save:
            self.wait()

    # --- evaluation with the EMA weights ----------------------------------------------------------

    def _evaluating(self) -> bool:
        control = self._control
        return self._session or self._eval_on_start or bool(control is not None
                                                            and control.should_evaluate)

    def _pre_forward(self, module, args):
        if self._rerun:
            return
        if module.training:
            self._swap.exit()  # never a training step on the EMA weights
            return
        if self.eval_with_ema is True and self._evaluating() and self.ema is not None:
            self._session = True
            self._swap.enter(self.ema)

    def _post_forward(self, module, args, kwargs, output):
        if (self.eval_with_ema != "both" or self._rerun or module.training
                or not self._evaluating() or self.ema is None):
            return
        self._session = True
        self._rerun = True
        # The model's own mean loss over the batch: the Trainer divides by the tokens of every
        # rank's batch (num_items_in_batch) and scales back after the forward, out of reach here.
        kwargs = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
        try:
            with torch.no_grad(), self.ema.swap():
                out = module(*args, **kwargs)
        finally:
            self._rerun = False
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if loss is None:
            if not self._warned_no_loss:
                self._warned_no_loss = True
                warn_user("ShardedEMACallback(eval_with_ema='both'): the model returned no loss "
                          "(no labels in the evaluation batches?): no EMA metric is logged")
            return
        first = next((v for v in list(args) + list(kwargs.values())
                      if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        n = first.shape[0] if first is not None else 1
        loss = loss.detach().float().mean() * n
        if self._ema_loss is None:
            self._ema_loss = [loss, torch.tensor(float(n), device=loss.device)]
        else:
            self._ema_loss[0] += loss
            self._ema_loss[1] += n

    def _end_eval(self) -> None:
        self._swap.exit()
        self._session = False
        self._eval_on_start = False

    def _eval_prefix(self, logs: Mapping[str, Any]) -> str | None:
        """The metric prefix of an evaluation's logs (``"eval"``, ``"eval_<dataset>"``)."""
        for key in logs:
            m = re.fullmatch(r"(.+)_runtime", key)
            if m and m.group(1) != "train" and f"{m.group(1)}_samples_per_second" in logs:
                return m.group(1)
        return None

    def _ema_metric(self, prefix: str) -> dict[str, float]:
        """Collective: the EMA's mean loss over this evaluation's batches, all ranks."""
        sums = self._ema_loss
        self._ema_loss = None
        device = sums[0].device if sums is not None else torch.device("cpu")
        t = (torch.stack([s.to(device) for s in sums]) if sums is not None
             else torch.zeros(2, device=device))
        if torch.distributed.is_initialized():
            t = t.to(comm_device(torch.distributed.group.WORLD, t.device))
            torch.distributed.all_reduce(t)
        if float(t[1]) == 0:
            return {}
        return {self.ema_metric_name.format(name=f"{prefix}_loss"): float(t[0] / t[1])}

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._control = control
        if logs is None:
            return
        prefix = self._eval_prefix(logs) if self.eval_with_ema else None
        added: dict[str, float] = {}
        if prefix is not None:
            # The evaluation is over (its logs are the first event after it): the training
            # weights come back before any other callback can read them.
            self._swap.exit()
            self._eval_on_start = False
            if self.eval_with_ema == "both":
                added = self._ema_metrics = self._ema_metric(prefix)
        elif self.log and self.ema is not None and "loss" in logs:
            added = logged_values(self.ema)
        if added:
            logs.update(added)
            last = state.log_history[-1] if state.log_history else None
            if isinstance(last, dict) and all(last.get(k) == v for k, v in logs.items()
                                              if k not in added):
                last.update(added)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._control = control
        self._swap.exit()
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
            self.wait()  # a new best is saved right after this event
        if metrics is not None and self._ema_metrics:
            metrics.update(self._ema_metrics)  # for metric_for_best_model
            self._ema_metrics = {}

    # --- saves ------------------------------------------------------------------------------------

    def on_save(self, args, state, control, **kwargs):
        self._control = control
        self._end_eval()
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        ema = self._ema("on_save")
        self._wait(rotate=False)

        def exists() -> None:
            # The writer of the Trainer's files has written the folder by its on_save (the
            # others reach theirs with no barrier): the EMA never creates or revives one.
            if args.should_save and not os.path.isfile(os.path.join(checkpoint,
                                                                    TRAINER_STATE_NAME)):
                raise FileNotFoundError(f"{checkpoint}/{TRAINER_STATE_NAME} is missing: the "
                                        f"Trainer's checkpoint is not there to hold the EMA")

        _agree(exists, ema, f"ShardedEMACallback.on_save({checkpoint!r})")
        self._save(checkpoint, state.global_step)
        rotate = functools.partial(self._rotate, args, state, checkpoint)
        if self._handle is not None:
            self._after_commit = rotate  # once the background commit is done
        else:
            rotate()

    def on_train_end(self, args, state, control, **kwargs):
        self._control = control
        self._end_eval()
        self._remove_hooks()
        self.wait()
        if self._limit is not None:
            self._end_of_training_rotation(args, state)
            args.save_total_limit, self._limit = self._limit, None
        if self.save_ema_model is not None and self.ema is not None:
            self.save_model(self.save_ema_model)


def _checkpoint_folders(output_dir: str) -> list[tuple[int, str]]:
    """``(N, path)`` of each ``checkpoint-<N>`` folder in ``output_dir`` (none if unreadable)."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return []
    found = []
    for name in names:
        m = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", name)
        path = os.path.join(output_dir, name)
        if m and os.path.isdir(path):
            found.append((int(m.group(1)), path))
    return found


def _previous_checkpoint(output_dir: str, step: int) -> str | None:
    """The last ``checkpoint-<k>`` folder in ``output_dir`` with ``k < step``, or None."""
    earlier = [f for f in _checkpoint_folders(output_dir) if f[0] < step]
    return max(earlier)[1] if earlier else None


def restored_checkpoint() -> str | None:
    """The checkpoint folder the running ``Trainer`` restored, or None: the local
    ``resume_from_checkpoint`` of the innermost ``Trainer._inner_training_loop`` (or ``train``)
    frame on the call stack, which ``train()`` has resolved from ``True`` to a path before the
    loop runs and calls ``on_train_begin``. The Trainer hands callbacks neither that folder nor
    itself, and ``train(resume_from_checkpoint=...)`` leaves ``args.resume_from_checkpoint``
    unset."""
    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if trainer_cls is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if (code.co_name in ("_inner_training_loop", "train")
                and "resume_from_checkpoint" in code.co_varnames):
            local = frame.f_locals
            if isinstance(local.get("self"), trainer_cls):
                value = local.get("resume_from_checkpoint")
                return os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
        frame = frame.f_back
    return None


def rotate_by_step(output_dir: str, limit: int, *, newest: str | None = None,
                   keep: Collection[str | None] = ()) -> list[str]:
    """The Trainer's ``save_total_limit`` rotation (``transformers.trainer_utils.
    rotate_checkpoints``), with the ``checkpoint-<N>`` folders ordered by their step N, not by
    modification time as the Trainer orders them (``use_mtime=True``): a rotation killed halfway
    leaves a half-deleted old folder with a fresh mtime, which the mtime order would keep as
    "most recent" while removing a complete one. ``newest`` (the checkpoint just saved) is kept
    and counted as the most recent whatever its step (a run resumed from an older checkpoint
    saves below steps already on disk); folders of a higher step than it (an abandoned branch's,
    or an older run's in the same output_dir) count as older than every step up to it, as the
    Trainer's modification-time order would have them. The folders of ``keep`` (the best
    checkpoint, the step being saved) are never removed. Returns the folders removed."""
    found = [(step, os.path.abspath(path)) for step, path in _checkpoint_folders(output_dir)]
    newest = os.path.abspath(newest) if newest is not None else None
    top = next((step for step, path in found if path == newest), None)
    ordered = [path for _, path in sorted(
        found, key=lambda f: (f[1] == newest, top is None or f[0] <= top, f[0]))]
    if len(ordered) <= limit:
        return []
    protected = {ordered[-1]} | {os.path.abspath(k) for k in keep if k is not None}
    kept = max(limit, len(protected))
    removed = []
    for path in ordered:
        if len(ordered) - len(removed) <= kept:
            break
        if path not in protected:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
