"""``ShardedEMACallback``: a Hugging Face ``TrainerCallback`` that keeps an EMA of the weights shard
by shard, under the ``Trainer`` on one device, DDP, and Accelerate's FSDP2 and FSDP1, and in
Accelerate loops of your own (docs/INTEGRATIONS.md).

The callback only translates the trainer's events into ``fsdp_ema`` calls; what it does with the
Trainer's checkpoint folders (which one a resume restored, the rotation) is ``hf_checkpoints``'s:

- ``on_train_begin`` (the trainer has wrapped the model): the EMA is made from the model it hands
  over, shard by shard (FSDP is read from the model, not from the arguments); on a resumed run
  the EMA comes back from the checkpoint whose model the Trainer restored
  (``hf_checkpoints.restored_checkpoint``), proven by the step and the model fingerprint
  recorded beside it (``common.ResumeChecks``), and with ``save_total_limit`` the checkpoints
  above the restored step (an abandoned branch) go before the first step; a hyperparameter-search
  trial's checkpoints are in its own folder (``hf_checkpoints.run_folder``);
- ``on_step_end`` (after the optimizer step; once per accumulated step): ``update()``;
- ``on_save``: the EMA into ``checkpoint-N/ema/`` (``fsdp_ema.save_training_state``, one file per
  rank, committed by rank 0 once every rank's file is written); the ``save_total_limit``
  rotation (``hf_checkpoints.Rotation``) runs after that commit, so the previous checkpoint stays
  until the new one holds its EMA;
- evaluation during training with ``eval_with_ema``: the EMA weights from the evaluation's first
  forward to its end (or, with ``"both"``, a second forward of each evaluation batch with them);
- ``on_log``: ``ema/decay`` and ``ema/step`` in the trainer's logs;
- ``on_train_end``: optionally the EMA weights as a directory ``from_pretrained`` loads.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .common import CallbackCore, is_fsdp, missing_framework, pretrained_model, warn_user

try:
    from transformers import TrainerCallback
except ImportError as _e:
    raise missing_framework(__name__, "transformers (and accelerate)", "transformers") from _e

from ..distributed.groups import default_group, rank_world
from ..ema.config import EMAConfig  # in the signature's annotations (get_type_hints)
from ..store.binding import bind
from ..store.collective import agreed
from ..store.peft import export_peft_adapter
from ..store.training_state import load_training_state, save_training_state
from .hf_checkpoints import (
    BINDING_KEY,
    NAME_THE_FOLDER,
    TRAINER_STATE_NAME,
    EMAFolder,
    Rotation,
    checkpoint_folder,
    mark_ema_kept,
    missing_ema,
    restored_checkpoint,
    resume_folders,
    run_folder,
)
from .hf_eval import EMAEvaluation

if TYPE_CHECKING:
    from ..ema.sharded import ShardedEMA

__all__ = ["ShardedEMACallback"]


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


class ShardedEMACallback(CallbackCore, TrainerCallback):
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
        super().__init__(what, config, options, ema_metric_name=ema_metric_name,
                         strict_resume=strict_resume, allow_changes=allow_changes, log=log,
                         compile=compile)
        if not subdir or os.sep in subdir or subdir in (".", ".."):
            raise ValueError(f"{what}: subdir must be a folder name, got {subdir!r}")
        if eval_with_ema not in (False, True, "both"):
            raise ValueError(f"{what}: eval_with_ema must be False, True or 'both', got "
                             f"{eval_with_ema!r}")
        self.save_ema_model, self.save_ema_dtype = save_ema_model, save_ema_dtype
        self.async_save, self.subdir, self.resume_from = async_save, subdir, resume_from
        self.rotation = Rotation()   # save_total_limit, which the callback applies
        self._run_dir: str | None = None  # where this run's checkpoint-N are (a trial's own)
        self._handle = None          # the async save in flight
        self._after_commit = None    # what waits for its commit (the rotation)
        self.evaluation = EMAEvaluation(eval_with_ema, self.ema_metric_name, self._swap)

    @property
    def eval_with_ema(self) -> bool | str:
        return self.evaluation.mode

    # --- the EMA, for the Trainer and for loops of your own ---------------------------------------

    def attach(self, model: nn.Module, accelerator: Any = None) -> ShardedEMA:
        """Makes the EMA of ``model`` as the trainer (or ``accelerator.prepare``) hands it over:
        FSDP2 and FSDP1 models shard by shard, DDP and plain models whole. With an Accelerate
        ``accelerator``, ``accelerator.save_state(dir)`` also saves the EMA into ``dir/ema`` and
        ``accelerator.load_state(dir)`` restores it."""
        self.wait()
        if accelerator is not None and not is_fsdp(model):
            asked = fsdp_asked_by(accelerator=accelerator)
            if asked is not None:
                self._warn_not_sharded(asked)
        self.make_ema(model)
        if accelerator is not None:
            accelerator.register_save_state_pre_hook(
                lambda models, weights, output_dir: self.save(output_dir))
            accelerator.register_load_state_pre_hook(
                lambda models, input_dir: self._load_checked(EMAFolder(input_dir, self.subdir),
                                                             None))
        return self.ema

    def _ema(self, what: str) -> ShardedEMA:
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
        binding = bind(ema, global_step)
        result = save_training_state(
            os.path.join(os.fspath(checkpoint_dir), self.subdir), ema=ema, rng=False,
            extra={BINDING_KEY: binding.to_json()}, overwrite=True, async_=self.async_save)
        if self.async_save:
            self._handle = result

    def load(self, checkpoint_dir: str | os.PathLike) -> dict:
        """Restores the EMA and its step from ``checkpoint_dir/<subdir>`` (collective, at any
        world size), after the checks of a resume (options and tensor names; ``strict_resume``,
        ``allow_changes``); returns what ``save`` stored beside it."""
        return self._load_checked(EMAFolder(os.fspath(checkpoint_dir), self.subdir), None)

    def _load_checked(self, candidate: EMAFolder, global_step: int | None,
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
            saved_names=candidate.tensor_names,
            where=candidate.ema_dir, restored=model,
            step_hint=f"it belongs to another checkpoint; {NAME_THE_FOLDER}",
            weights_hint=f"it belongs to another training state: another run's checkpoint of "
                         f"the same step, or an {self.subdir}/ copied from elsewhere "
                         f"({NAME_THE_FOLDER}), or a save of this step into {candidate.folder} "
                         f"again that was stopped after the Trainer rewrote the model (then "
                         f"remove it and resume from the checkpoint before it: rm -r "
                         f"'{candidate.folder}')")
        # The resume checks above compared every setting (allow_changes, strict_resume).
        return load_training_state(candidate.ema_dir, ema=ema, rng=False,
                                   strict=self.checks.strict, allow_changes=["all"])

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
            export_peft_adapter(ema, path, dtype=self.save_ema_dtype)
            return
        self._export(path, dtype=self.save_ema_dtype, pretrained=pretrained_model(ema.model))

    # --- the Trainer's events ---------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise RuntimeError("ShardedEMACallback: the trainer handed over no model")
        self.evaluation.control = control
        self._check_settings(args)
        self._run_dir = run_folder(args, state)  # a search trial's: output_dir/run-<id>
        if not is_fsdp(model):
            asked = fsdp_asked_by(args)
            if asked is not None:
                self._warn_not_sharded(asked)
        self.attach(model)
        if state.global_step > 0:  # a resumed run: the EMA of the checkpoint the Trainer restored
            self._resume(args, state)
        # After a resume that may refuse: args untouched then.
        self.rotation.take_over(args, self._run_dir)
        if state.global_step > 0:  # a resumed run: the checkpoints above it are not its own
            self.rotation.remove_above(args, state.global_step,
                                       keep=(state.best_model_checkpoint, restored_checkpoint()))
        self.evaluation.install(model, self.ema, args)

    def _folder(self, args) -> str:
        """The folder of this run's ``checkpoint-N`` (``run_folder``, read when training
        began)."""
        return self._run_dir if self._run_dir is not None else args.output_dir

    def _check_settings(self, args) -> None:
        _, world = rank_world(default_group())
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if getattr(args, "save_on_each_node", False) and local_world < world:
            raise ValueError(
                "ShardedEMACallback: save_on_each_node=True saves each node's checkpoints on "
                "its own disk, but the EMA is one checkpoint of every rank's shards in "
                "checkpoint-N/ema, committed by rank 0: use an output_dir every node sees, "
                "with save_on_each_node=False")

    def _resume(self, args, state) -> None:
        """The EMA of the checkpoint the Trainer restored: among the folders it may be in
        (``hf_checkpoints.resume_folders``), the one whose recorded step and model fingerprint
        are the restored model's."""
        step = state.global_step
        restored = restored_checkpoint()
        named = (self.resume_from, getattr(args, "resume_from_checkpoint", None))
        folders = resume_folders(restored, named, self._folder(args), step)
        restored = os.path.abspath(restored) if restored is not None else None
        ema = self._ema("resume")
        candidates = _agree(lambda: [EMAFolder(f, self.subdir) for f in folders if
                                     os.path.isdir(f)], ema, "ShardedEMACallback resume")
        fingerprint = ema.model_fingerprint()
        found = next((c for c in candidates if c.binds(step, fingerprint)), None)
        if found is None:
            # Committed, but not of the model the Trainer restored (another run's checkpoint of
            # the same step, say; the restored folder's own first): refused, naming both, unless
            # strict_resume=False.
            found = next((c for c in candidates if c.kind == "committed"), None)
        if found is not None:
            self._load_checked(found, step, fingerprint, restored)
            return
        refuse, message = missing_ema(state, self.subdir, restored, folders, candidates)
        if refuse:
            raise RuntimeError(message)
        warn_user(message)

    def on_step_begin(self, args, state, control, **kwargs):
        self.evaluation.control = control
        self.evaluation.end()

    def on_step_end(self, args, state, control, **kwargs):
        self.evaluation.control = control
        self.update()
        mark_ema_kept(state, self.subdir)
        if control.should_save:  # the Trainer saves next: the save in flight lands first
            self.wait()

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.evaluation.control = control
        self.evaluation.end()

    def on_epoch_end(self, args, state, control, **kwargs):
        self.evaluation.control = control
        self.evaluation.end()
        mark_ema_kept(state, self.subdir)
        if control.should_save:
            self.wait()

    # --- logs and evaluations ---------------------------------------------------------------------

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.evaluation.control = control
        if logs is None:
            return
        added = self.evaluation.logged(logs)  # an evaluation's logs: its end
        if added is None:
            added = self._logged() if "loss" in logs else {}
        if added:
            logs.update(added)
            last = state.log_history[-1] if state.log_history else None
            if isinstance(last, dict) and all(last.get(k) == v for k, v in logs.items()
                                              if k not in added):
                last.update(added)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluation.control = control
        self.evaluation.evaluated(metrics)  # also for metric_for_best_model
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
            self.wait()  # a new best is saved right after this event

    # --- saves ------------------------------------------------------------------------------------

    def on_save(self, args, state, control, **kwargs):
        self.evaluation.control = control
        self.evaluation.end()
        checkpoint = checkpoint_folder(self._folder(args), state.global_step)
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
        rotate = functools.partial(self.rotation.after_commit, args, state, checkpoint)
        if self._handle is not None:
            self._after_commit = rotate  # once the background commit is done
        else:
            rotate()

    def on_train_end(self, args, state, control, **kwargs):
        self.evaluation.control = control
        self.evaluation.end()
        self.evaluation.remove()
        self.wait()
        self.rotation.hand_back(args, state)
        if self.save_ema_model is not None and self.ema is not None:
            self.save_model(self.save_ema_model)

