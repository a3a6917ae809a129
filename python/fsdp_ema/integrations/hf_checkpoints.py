"""The Hugging Face ``Trainer``'s checkpoint folders as ``ShardedEMACallback`` sees them: which
``output_dir/checkpoint-<N>`` folders there are, which one a resume restored, what the EMA's
folder in each holds, what ``trainer_state.json`` records of the EMA, which folder to name when a
resume cannot go on, and the ``save_total_limit`` rotation, which removes folders in the order
that never leaves one looking complete. The callback translates the Trainer's events; the policy
on folders is here, apart from it. A folder is removed marker first, as the format removes its own
checkpoints index first: the Trainer's ``trainer_state.json``, then the EMA and the rest through
the format's operations (``fsdp_ema._ops``: ``committed_checkpoints``, ``remove_checkpoint``;
docs/INTEGRATIONS.md, "Rotation" and "What a kill can leave")."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Collection
from typing import Any

from .common import caller_locals, missing_framework, warn_user

try:
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as _e:
    raise missing_framework(__name__, "transformers (and accelerate)", "transformers") from _e

from .. import _ops
from ..store.binding import Binding
from ..store.training_state import read_training_state_json

#: The trainer's state file in every checkpoint folder (transformers.trainer.TRAINER_STATE_NAME),
#: written after the model, optimizer, scheduler and RNG files: the Trainer's commit marker.
TRAINER_STATE_NAME = "trainer_state.json"
#: The key of the binding in the EMA checkpoint's ``extra``.
BINDING_KEY = "fsdp_ema.binding"
#: What a refusal tells the user to pass when the EMA is in another folder.
NAME_THE_FOLDER = ("pass ShardedEMACallback(resume_from=<a checkpoint folder holding the ema/ "
                   "saved with that checkpoint>)")


# --- where the folders are ------------------------------------------------------------------------

def checkpoint_folder(output_dir: str | os.PathLike, step: int) -> str:
    """The folder the Trainer saves global step ``step`` into."""
    return os.path.join(os.fspath(output_dir), f"{PREFIX_CHECKPOINT_DIR}-{step}")


def checkpoint_folders(output_dir: str) -> list[tuple[int, str]]:
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


def previous_complete_checkpoint(output_dir: str, step: int, subdir: str) -> str | None:
    """The last ``checkpoint-<k>`` folder in ``output_dir`` with ``k < step`` that holds the
    Trainer's state and a committed ``subdir/`` (model, optimizer and EMA together), or None. A
    folder whose removal was stopped has no ``trainer_state.json`` and is never named."""
    earlier = sorted((f for f in checkpoint_folders(output_dir) if f[0] < step), reverse=True)
    for _, path in earlier:
        if (os.path.isfile(os.path.join(path, TRAINER_STATE_NAME))
                and _ops.is_committed(os.path.join(path, subdir))):
            return path
    return None


def _training_frame() -> dict[str, Any] | None:
    """The locals of the innermost ``Trainer._inner_training_loop`` (or ``train``) frame on the
    call stack (``self`` is the Trainer; ``resume_from_checkpoint`` and ``trial`` are its
    arguments), or None. The Trainer hands callbacks neither itself nor those arguments: its
    frame is the one place that says."""
    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if trainer_cls is None:
        return None
    return caller_locals(
        lambda code: (code.co_name in ("_inner_training_loop", "train")
                      and "resume_from_checkpoint" in code.co_varnames),
        lambda local: isinstance(local.get("self"), trainer_cls))


def restored_checkpoint() -> str | None:
    """The checkpoint folder the running ``Trainer`` restored, or None: the local
    ``resume_from_checkpoint`` of its training frame (``_training_frame``), which ``train()``
    has resolved from ``True`` to a path before the loop runs and calls ``on_train_begin``
    (``train(resume_from_checkpoint=...)`` leaves ``args.resume_from_checkpoint`` unset)."""
    local = _training_frame()
    value = local.get("resume_from_checkpoint") if local is not None else None
    return os.fspath(value) if isinstance(value, (str, os.PathLike)) else None


def run_folder(args, state) -> str:
    """The folder the running ``Trainer`` saves this run's ``checkpoint-<N>`` folders in:
    ``args.output_dir``, or for a hyperparameter-search trial the trial's own
    (``output_dir/run-<trial id>``, or ``hp_name(trial)``), as the Trainer's
    ``_get_output_dir(trial)`` names it for its own saves (read from its training frame, with
    the ``trial`` it trains): the EMA of a trial goes beside the trial's checkpoint, and the
    rotation and a resume stay in the trial's folder. A trial whose folder cannot be read (a
    Trainer subclass that replaces ``train`` and ``_inner_training_loop``, or a transformers
    without ``_get_output_dir``) raises ``RuntimeError`` naming the trial folders, before its
    first step: an ``output_dir/checkpoint-<N>`` of another run is never written or removed."""
    local = _training_frame()
    trial = local.get("trial") if local is not None else None
    if trial is None and not getattr(state, "is_hyper_param_search", False):
        return os.fspath(args.output_dir)
    trainer_folder = getattr(local.get("self") if local is not None else None,
                             "_get_output_dir", None)
    if trial is not None and callable(trainer_folder):
        return os.fspath(trainer_folder(trial))
    trials = os.path.join(args.output_dir, "run-<trial id>", "checkpoint-<N>")
    raise RuntimeError(
        f"ShardedEMACallback: this run is a hyperparameter-search trial, whose checkpoints the "
        f"Trainer saves in the trial's own folder ({trials}, or hp_name(trial) in the "
        f"run-<trial id>'s place), but that folder "
        f"could not be read from the Trainer (a Trainer subclass that replaces train and "
        f"_inner_training_loop hides its training frame): refused before the first step, so "
        f"that no checkpoint-<N> of another run in {args.output_dir} is written or removed")


def resume_folders(restored: str | None, named: Collection[Any], output_dir: str,
                   step: int) -> list[str]:
    """Where the EMA of a run resumed at ``step`` may be, in the order they are tried: the folder
    the Trainer restored, the folders the user named (``resume_from``,
    ``args.resume_from_checkpoint``), then ``output_dir``'s checkpoint of that step; absolute,
    each once. The model fingerprint decides among them."""
    folders: list[str] = []
    for c in (restored, *named, checkpoint_folder(output_dir, step)):
        if isinstance(c, (str, os.PathLike)) and os.path.abspath(c) not in folders:
            folders.append(os.path.abspath(c))
    return folders


# --- what a folder holds of the EMA ---------------------------------------------------------------

class EMAFolder:
    """A checkpoint folder the EMA of a resumed run may come from, and what its ``subdir/``
    holds: ``kind`` is ``"absent"``, ``"incomplete"`` (files but no commit) or ``"committed"``
    (then ``doc``, the training state's document, and ``binding``, with the EMA's settings as
    the document records them)."""

    def __init__(self, folder: str, subdir: str):
        self.folder, self.ema_dir = folder, os.path.join(folder, subdir)
        self.doc: dict | None = None
        self.binding: Binding | None = None
        if not os.path.isdir(self.ema_dir):
            self.kind = "absent"
        elif not _ops.is_committed(self.ema_dir):
            self.kind = "incomplete"
        else:
            self.kind = "committed"
            self.doc = read_training_state_json(self.ema_dir)
            extra = self.doc.get("extra")
            self.binding = Binding.from_json(extra.get(BINDING_KEY) if isinstance(extra, dict)
                                             else None)
            if self.binding is not None:
                saved = (self.doc.get("ema") or {}).get("settings")
                self.binding = dataclasses.replace(
                    self.binding, settings=dict(saved) if isinstance(saved, dict) else {})

    @property
    def tensor_names(self) -> list[str]:
        """The names of the EMA tensors the committed folder holds."""
        return ((self.doc or {}).get("ema") or {}).get("tensors", [])

    def binds(self, step: int, fingerprint: str) -> bool:
        """Whether this is the EMA saved at ``step`` beside the model weights ``fingerprint``."""
        return (self.kind == "committed" and self.binding is not None
                and self.binding.global_step == step and self.binding.fingerprint == fingerprint)

    def describe(self) -> str:
        if self.kind == "absent":
            return f"{self.folder} has no {os.path.basename(self.ema_dir)}/"
        if self.kind == "incomplete":
            return f"{self.ema_dir} was never committed (a save stopped before its commit)"
        if self.binding is None:
            return f"{self.ema_dir} records no global step and model fingerprint"
        return (f"{self.ema_dir} was saved at step {self.binding.global_step} beside model "
                f"weights {self.binding.fingerprint}")


def _marker_key(subdir: str) -> str:
    # Names no callback class, so the Trainer's restore of stateful callbacks skips it.
    return f"fsdp_ema:{subdir}"


def mark_ema_kept(state, subdir: str) -> None:
    """Records in ``state`` (so in every ``trainer_state.json`` the Trainer writes from now on)
    that this run keeps an EMA in ``subdir/``: a resume that finds none can say it is missing."""
    if isinstance(state.stateful_callbacks, dict):
        state.stateful_callbacks[_marker_key(subdir)] = {"global_step": state.global_step,
                                                         "ema": subdir}


def ema_was_kept(state, subdir: str) -> bool:
    """Whether the restored ``trainer_state.json`` says its run kept an EMA in ``subdir/``."""
    marker = (state.stateful_callbacks or {}).get(_marker_key(subdir))
    return isinstance(marker, dict) and marker.get("global_step") == state.global_step


def missing_ema(state, subdir: str, restored: str | None, folders: list[str],
                candidates: list[EMAFolder]) -> tuple[bool, str]:
    """No committed EMA in any candidate: ``(True, why and what to do)`` when the restored
    checkpoint was saved by a run that kept an EMA (a refusal), else ``(False, what happens)``
    (a warning: the EMA starts from the restored weights)."""
    step = state.global_step
    source = f"from {restored}" if restored else "from a checkpoint"
    others = "; ".join(c.describe() for c in candidates) or f"none of {folders} exists"
    incomplete = next((c for c in candidates if c.kind == "incomplete"), None)
    # An EMA was kept: the restored trainer_state.json says so, or an ema/ began to be saved.
    if not (ema_was_kept(state, subdir) or incomplete is not None):
        return False, (f"ShardedEMACallback: the Trainer resumed at step {step} {source}, saved "
                       f"without this callback ({others}); the EMA starts from the restored "
                       f"weights")
    # The folder the message is about: the restored one, or the interrupted save's when the
    # restored one is not known; what it says and the command it gives both name it.
    if incomplete is not None and restored in (None, incomplete.folder):
        interrupted = incomplete.folder
        why = f"the run was stopped while saving it ({incomplete.ema_dir} has files but no commit)"
    else:
        interrupted = restored or next((c.folder for c in candidates), None)
        why = (f"{interrupted or 'the restored checkpoint'} has no committed {subdir}/: either "
               f"the run was stopped before saving it, or the checkpoint was copied or moved "
               f"without its {subdir}/")
    fix = NAME_THE_FOLDER
    if interrupted is not None:
        previous = previous_complete_checkpoint(os.path.dirname(interrupted), step, subdir)
        fix = (f"if the run was stopped, remove the checkpoint and resume again (from the "
               f"checkpoint before it{', ' + previous if previous else ''}, which holds model, "
               f"optimizer and EMA): rm -r '{interrupted}'; if its {subdir}/ is elsewhere, "
               f"{NAME_THE_FOLDER}")
    return True, (f"ShardedEMACallback: the Trainer resumed at step {step} {source}, saved by a "
                  f"run that kept an EMA, but no committed EMA of that step was found "
                  f"({others}): {why}. To go on: {fix}")


# --- removing folders: the rotation ---------------------------------------------------------------

def remove_checkpoint_folder(folder: str) -> None:
    """Removes the Trainer checkpoint folder ``folder`` with one format operation
    (``remove_checkpoint`` with ``first``), in an order after which a kill at any moment leaves
    nothing that looks complete:

    1. ``trainer_state.json``, the Trainer's commit marker (written after its other files; a
       resume refuses a folder without it), with the folder's own index if any, made durable:
       from here on neither the Trainer nor the callback resumes from the folder, nor names it
       as complete;
    2. the rest, where each checkpoint nested in it (the EMA's ``ema/``) loses its index before
       any of its files: never a committed EMA with files missing;
    3. the folder itself. All under the folder's lock, nothing reached through a link.

    Raises ``RuntimeError`` (the op's: a folder reached through a link is refused, untouched)."""
    _ops.remove_checkpoint(folder, first=[TRAINER_STATE_NAME])


def _remove(folder: str) -> bool:
    """``remove_checkpoint_folder``; a failure is one warning (the rotation goes on: the
    checkpoint just saved is complete by then), False."""
    try:
        remove_checkpoint_folder(folder)
    except (OSError, RuntimeError) as e:
        if os.path.lexists(folder):
            warn_user(f"ShardedEMACallback: the checkpoint rotation could not remove {folder} "
                      f"({e}); it stays")
            return False
    return True


def rotate_by_step(output_dir: str, limit: int, *, newest: str | None = None,
                   keep: Collection[str | None] = (), saving: str | None = None) -> list[str]:
    """The Trainer's ``save_total_limit`` rotation (``transformers.trainer_utils.
    rotate_checkpoints``), with the ``checkpoint-<N>`` folders ordered by their step N, not by
    modification time as the Trainer orders them (``use_mtime=True``): a rotation killed halfway
    leaves a half-removed old folder with a fresh mtime, which the mtime order would keep as
    "most recent" while removing a complete one. ``newest`` (the checkpoint just saved) is kept
    and counted as the most recent whatever its step (a run resumed from an older checkpoint
    saves below steps already on disk); folders of a higher step than it (an abandoned branch's,
    or an older run's in the same output_dir) count as older than every step up to it, as the
    Trainer's modification-time order would have them. The folders of ``keep`` (the best
    checkpoint) are never removed. ``saving`` (the folder of a save that has begun while an
    ``async_save`` rotation runs: other ranks may be writing into it) is neither removed nor
    counted: the limit is that of the checkpoints written, as when the rotation runs right after
    the save. Each folder goes by ``remove_checkpoint_folder``. Returns the folders removed."""
    saving = os.path.abspath(saving) if saving is not None else None
    found = [(step, os.path.abspath(path)) for step, path in checkpoint_folders(output_dir)
             if os.path.abspath(path) != saving]
    newest = os.path.abspath(newest) if newest is not None else None
    top = next((step for step, path in found if path == newest), None)
    ordered = [path for _, path in sorted(
        found, key=lambda f: (f[1] == newest, top is None or f[0] <= top, f[0]))]
    if len(ordered) <= limit:
        return []
    # Only folders that are there count as kept ones.
    protected = {ordered[-1]} | ({os.path.abspath(k) for k in keep if k is not None}
                                 & set(ordered))
    kept = max(limit, len(protected))
    # A folder that could not be removed (a link, say: one warning) counts as gone: the rotation
    # removes no other complete checkpoint in its place (the Trainer's own does the same).
    removed, tried = [], 0
    for path in ordered:
        if len(ordered) - tried <= kept:
            break
        if path in protected:
            continue
        tried += 1
        if _remove(path):
            removed.append(path)
    return removed


class Rotation:
    """The Trainer's ``save_total_limit``, applied by the callback once the checkpoint just saved
    holds its committed EMA (``after_commit``), and handed back at the end of training.

    The Trainer's own rotation cannot be kept: it runs inside ``Trainer._save_checkpoint`` before
    any callback event (a kill before the EMA's commit would leave no checkpoint with an EMA),
    orders the folders by modification time (a half-removed folder outlives a complete one) and
    removes them with ``shutil.rmtree`` in directory order (a kill can leave
    ``trainer_state.json`` beside a folder whose optimizer is gone, which the Trainer resumes
    from, starting a fresh optimizer without a word). It is a module function the Trainer calls
    by name, with no hook: patching it would change every Trainer in the process. So the
    callback turns the setting off while it trains (``take_over``) and runs this one."""

    def __init__(self) -> None:
        self.limit: int | None = None  # the save_total_limit taken over
        self.folder: str | None = None  # the run's folder (run_folder); None: args.output_dir

    def take_over(self, args, folder: str | None = None) -> None:
        """At the start of training, before the first save; ``folder``: where this run's
        checkpoints are (``run_folder``: a trial's own)."""
        self.folder = folder
        if args.save_total_limit is not None and args.save_total_limit > 0:
            self.limit = args.save_total_limit
            args.save_total_limit = None
        elif args.save_total_limit is not None:
            self.limit = None
        # else: a second train() after one that stopped early keeps the limit taken over

    def remove_above(self, args, step: int, keep: Collection[str | None] = ()) -> list[str]:
        """A run resumed at ``step`` below checkpoints already in its folder (an abandoned
        branch's, or another run's): with the rotation on, they go now, before the run's first
        step, highest first, each by ``remove_checkpoint_folder`` (its ``trainer_state.json``
        first). ``resume_from_checkpoint=True`` takes the highest step: were they left until the
        first rotation, a kill before it would continue that branch. The folders of ``keep``
        (the best checkpoint, the restored one) stay. Returns the folders removed."""
        if self.limit is None or not args.should_save:
            return []
        kept = {os.path.abspath(k) for k in keep if k is not None}
        removed = []
        for n, path in sorted(checkpoint_folders(self.folder or args.output_dir), reverse=True):
            if n > step and os.path.abspath(path) not in kept and _remove(path):
                removed.append(path)
        return removed

    def after_commit(self, args, state, newest: str | None = None) -> list[str]:
        """The rotation, once ``newest`` (the checkpoint just saved) holds its EMA; see
        ``rotate_by_step``. Returns the folders removed."""
        if self.limit is None or not args.should_save:
            return []
        # With async_save this rotation runs at the step end that schedules the next save, whose
        # folder other ranks may already have begun (their RNG files): not removed, not counted.
        folder = self.folder or args.output_dir
        current = checkpoint_folder(folder, state.global_step)
        saving = current if newest is None or os.path.abspath(newest) != os.path.abspath(
            current) else None
        return rotate_by_step(folder, self.limit, newest=newest,
                              keep=(state.best_model_checkpoint,), saving=saving)

    def hand_back(self, args, state) -> None:
        """At the end of training, once the last EMA is committed: what the Trainer does then
        with ``save_total_limit=1`` and a best checkpoint (it removes every other one), and the
        setting back into ``args``."""
        if self.limit is None:
            return
        best = state.best_model_checkpoint
        if self.limit == 1 and best is not None and args.should_save and os.path.exists(best):
            for _, folder in sorted(checkpoint_folders(self.folder or args.output_dir)):
                if not os.path.samefile(folder, best):
                    _remove(folder)
        args.save_total_limit, self.limit = self.limit, None
