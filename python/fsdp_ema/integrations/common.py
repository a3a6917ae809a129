"""What the Lightning and Hugging Face adapters share, so that both behave alike and neither holds
a rule of its own: ``CallbackCore``, the base of both callbacks (the EMA's options as one
``fsdp_ema.EMAConfig``, checked when a callback is made; the resume checks' settings; the EMA's
metric name; the EMA made once the trainer has wrapped the model, compiled or not; the swap held
across trainer events), the resume checks themselves (options, tensor names, the saved global step
and model fingerprint of ``fsdp_ema.store.binding``), warnings from rank 0 at the user's call
site, the values both log, and the export with the Hugging Face files that make it loadable.
Imports no framework."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..distributed.groups import default_group, rank_world
from ..ema.config import EMAConfig
from ..store.binding import SETTINGS, Binding, name_changes, setting_changes, settings

if TYPE_CHECKING:
    from ..ema.sharded import ShardedEMA


def make_ema(model: torch.nn.Module, config: EMAConfig,
             compile: bool | dict) -> tuple[Any, Callable[[], None]]:
    """The ``fsdp_ema.ShardedEMA`` of ``model`` and the update a callback calls: ``ema.update``,
    or with ``compile`` (True, or a dict of ``torch.compile`` arguments) that update compiled
    with ``fullgraph=True``."""
    from ..ema.sharded import ShardedEMA

    ema = ShardedEMA(model, config)
    update = ema.update
    if compile:
        kwargs = dict(compile) if isinstance(compile, dict) else {}
        update = torch.compile(ema.update, fullgraph=True, **kwargs)
    return ema, update


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``) or FSDP1, read from its modules."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def missing_framework(module: str, framework: str, extra: str) -> ImportError:
    """The one error an integration raises when its framework is not installed."""
    return ImportError(f"{module} needs {framework}, which is not installed: pip install "
                       f"\"fsdp-ema[{extra}]\"")


class HeldSwap:
    """The EMA weights swapped into the model between two trainer events (an evaluation's start
    and its end), which one ``with ema.swap():`` block cannot span. ``enter`` is a no-op while a
    swap is held; a swap that fails to enter leaves nothing held."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    @property
    def active(self) -> bool:
        return self._stack is not None

    def enter(self, ema: Any) -> None:
        if self._stack is None:
            stack = contextlib.ExitStack()
            stack.enter_context(ema.swap())
            self._stack = stack

    def exit(self) -> None:
        """Puts the training weights back (no-op when no swap is held)."""
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()


# --- options shared by both callbacks -------------------------------------------------------------

class ResumeChecks:
    """``strict_resume`` and ``allow_changes`` of a callback, checked when it is made.

    With ``strict`` (the default) a resume refuses an EMA saved with other options (any of
    ``fsdp_ema.store.binding.SETTINGS`` not in ``allow``), with other tensors, at another global
    step or beside other model weights than the trainer restored; ``strict=False`` resumes
    anyway, with one warning that lists what differs."""

    def __init__(self, what: str, strict: bool, allow: Iterable[str]):
        if not isinstance(strict, bool):
            raise TypeError(f"{what}: strict_resume must be True or False, got {strict!r}")
        allow = frozenset([allow] if isinstance(allow, str) else allow)
        unknown = sorted(allow - set(SETTINGS))
        if unknown:
            raise ValueError(f"{what}: allow_changes names no option a resume compares: "
                             f"{unknown} (those are {list(SETTINGS)})")
        self.what, self.strict, self.allow = what, strict, allow

    def check(self, ema, saved: Binding | None, *, global_step: int | None,
              fingerprint: str | None, saved_names: Collection[str], where: str,
              restored: str, step_hint: str, weights_hint: str) -> None:
        """Raises ``ValueError`` (the same on every rank: every input is) naming what differs
        between the EMA saved in ``where`` and this resume: its options (``saved.settings``
        against ``ema``'s; checked first, as they are the user's to fix), its tensor names, then
        the global step it was saved at against ``global_step`` (``step_hint`` says what to do)
        and the model weights it was saved beside against ``fingerprint``, the trainer's restored
        model (``restored`` names it; ``weights_hint`` says what to do). ``None``: not checked
        (a checkpoint of an older fsdp_ema holds no binding). Non-strict: one warning instead."""
        problems = []
        options = setting_changes(saved.settings, settings(ema), self.allow) if saved else []
        if options:
            problems.append(
                f"the EMA's options changed since {where} was saved: {'; '.join(options)} "
                f"(pass allow_changes={set(k.split(':')[0] for k in options)!r} to resume with "
                f"the new ones)")
        names = name_changes(saved_names, ema.shapes)
        if names:
            problems.append(f"{where} holds another set of tensors than the EMA of this model: "
                            f"{'; '.join(names)} (the model or params= changed)")
        if saved is not None and global_step is not None and saved.global_step != global_step:
            problems.append(f"{where} was saved at global step {saved.global_step}, but the "
                            f"trainer resumes at step {global_step}: {step_hint}")
        elif (saved is not None and fingerprint is not None
              and saved.fingerprint != fingerprint):
            problems.append(f"{where} was saved beside other model weights (fingerprint "
                            f"{saved.fingerprint}) than {restored} (fingerprint {fingerprint}): "
                            f"{weights_hint}")
        if not problems:
            return
        if self.strict:
            raise ValueError(f"{self.what}: cannot resume the EMA: " + " Also: ".join(problems)
                             + " (strict_resume=False resumes anyway)")
        warn_user(f"{self.what}(strict_resume=False): resuming the EMA of {where} although "
                  + " Also: ".join(problems))


def check_metric_name(what: str, pattern: str) -> str:
    """``pattern`` (e.g. ``"{name}_ema"``) of the EMA's metric names, checked when made."""
    if not isinstance(pattern, str) or "{name}" not in pattern:
        raise ValueError(f"{what}: ema_metric_name must be a string with '{{name}}' in it, e.g. "
                         f"'{{name}}_ema', got {pattern!r}")
    if pattern.format(name="x") == "x":
        raise ValueError(f"{what}: ema_metric_name={pattern!r} gives the raw metric's own name")
    return pattern


def logged_values(ema) -> dict[str, float]:
    """What both callbacks log after each update: ``ema/decay`` (the decay the last update
    used: 0 for a copy, 1 for a skipped update) and ``ema/step`` (updates so far). Read from the
    host's count: no device sync."""
    step = ema.state.step_count()
    return {"ema/decay": float(ema.decay_at(step - 1)) if step > 0 else 0.0,
            "ema/step": float(step)}


# --- the base of both callbacks -------------------------------------------------------------------

class CallbackCore:
    """What both callbacks hold and do alike, a base of each beside its framework's callback
    class: the EMA's options (``config``: one ``EMAConfig``, from ``config`` and the option
    keywords, checked here), the resume checks' settings (``checks``), the EMA metric's name
    pattern, ``log`` and ``compile``; the EMA (``ema``, None until ``make_ema``) and the update
    the trainer's events call; the swap held across those events; the values logged, the
    warning for a sharding request over an unsharded model, and the export with the Hugging
    Face files. ``what`` names the callback in messages."""

    def __init__(self, what: str, config: EMAConfig | float | None, options: dict[str, Any], *,
                 ema_metric_name: str, strict_resume: bool, allow_changes: Collection[str],
                 log: bool, compile: bool | dict):
        self.what = what
        self.config = EMAConfig.of(type(self).__name__, config, options)
        self.ema_metric_name = check_metric_name(what, ema_metric_name)
        self.checks = ResumeChecks(what, strict_resume, allow_changes)
        self.log, self.compile = log, compile
        self.ema: ShardedEMA | None = None
        self._update: Callable[[], None] | None = None
        self._swap = HeldSwap()

    def make_ema(self, model: torch.nn.Module) -> ShardedEMA:
        """The EMA of ``model`` as the trainer hands it over (FSDP2 and FSDP1 shard by shard, DDP
        and one device whole), with its update (compiled with ``compile``)."""
        self.ema, self._update = make_ema(model, self.config, self.compile)
        return self.ema

    def _logged(self) -> dict[str, float]:
        """``logged_values`` of the EMA (none before it is made)."""
        return logged_values(self.ema) if self.log and self.ema is not None else {}

    def _warn_not_sharded(self, asked_by: str) -> None:
        warn_not_sharded(self.what, asked_by)

    def _export(self, path: str | os.PathLike, *, dtype: torch.dtype | None,
                prefix: str | None = None, pretrained=None) -> list[str]:
        """``export_ema`` of the EMA (collective)."""
        return export_ema(self.ema, path, dtype=dtype, prefix=prefix, pretrained=pretrained)


# --- warnings -------------------------------------------------------------------------------------

def _framework_dirs() -> tuple[str, ...]:
    dirs = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # fsdp_ema
    for name in ("torch", "transformers", "accelerate", "lightning", "lightning_fabric",
                 "pytorch_lightning"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(module.__file__)))
    return tuple(d + os.sep for d in dirs)


def caller_locals(code_matches: Callable[[Any], bool],
                  locals_match: Callable[[dict[str, Any]], bool] | None = None,
                  ) -> dict[str, Any] | None:
    """The locals of the innermost frame on this thread's call stack whose code object
    ``code_matches`` accepts (and, given, whose locals ``locals_match`` accepts), or None: what a
    framework hands its callbacks no other way (the Trainer's training loop, accelerate's
    ``save_custom_state``). Only a matching frame's locals are read."""
    frame = sys._getframe(1)
    while frame is not None:
        if code_matches(frame.f_code):
            local = frame.f_locals
            if locals_match is None or locals_match(local):
                return local
        frame = frame.f_back
    return None


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """One warning, from rank 0 only, pointing at the user's code: the innermost frame outside
    fsdp_ema, torch and the trainer frameworks (the line that called ``trainer.train()`` or
    ``fit()``), not at the trainer's callback dispatch."""
    if rank_world(default_group())[0] != 0:
        return
    skip = _framework_dirs()
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(skip)
                                 or frame.f_code.co_filename.startswith("<frozen")):
        frame = frame.f_back
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__", "__main__"),
                           registry=module_globals.setdefault("__warningregistry__", {}),
                           module_globals=module_globals)


def warn_not_sharded(what: str, asked_by: str) -> None:
    """The warning when FSDP was asked for but the model the trainer trains is not sharded."""
    warn_user(f"{what}: FSDP was asked for ({asked_by}), but the model the trainer trains is not "
              f"sharded (no FSDP module, no DTensor parameter; Accelerate drops the FSDP plugin "
              f"on a CPU and trains DDP): every rank keeps the whole EMA")


# --- Hugging Face files beside an export ----------------------------------------------------------

def pretrained_model(module: torch.nn.Module):
    """The first ``transformers.PreTrainedModel`` in ``module`` (itself included), or None (also
    when transformers is not installed)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    for m in module.modules():
        if isinstance(m, PreTrainedModel):
            return m
    return None


def export_ema(ema, path: str | os.PathLike, *, dtype: torch.dtype | None,
               prefix: str | None = None, pretrained=None) -> list[str]:
    """``ema.export`` (collective; a previous export in ``path`` replaced) and, when
    ``pretrained`` (a ``PreTrainedModel``) is given, its ``write_hf_metadata`` beside, so that
    ``from_pretrained`` loads the directory. Returns the files written beside the weights."""
    ema.export(path, dtype=dtype, overwrite=True, prefix=prefix)
    return write_hf_metadata(pretrained, path) if pretrained is not None else []


def write_hf_metadata(model, path: str | os.PathLike) -> list[str]:
    """On rank 0: the ``config.json`` of ``model`` (a ``PreTrainedModel``) and, for a model that
    generates, its ``generation_config.json``, into ``path`` beside exported weights, so that
    ``from_pretrained`` and ``generate()`` work from there. Returns the names written."""
    if rank_world(default_group())[0] != 0:
        return []
    path = os.fspath(path)
    model.config.save_pretrained(path)
    written = ["config.json"]
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and (can_generate is None or can_generate()):
        generation.save_pretrained(path)
        written.append("generation_config.json")
    return written
