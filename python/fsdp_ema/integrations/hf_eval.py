"""Evaluation with the EMA weights inside a Hugging Face ``Trainer``'s evaluations during training
(``ShardedEMACallback(eval_with_ema=True or "both")``; docs/INTEGRATIONS.md, "Callback order").

The Trainer has no callback event at the start of an evaluation, so the EMA weights go in at its
first eval-mode forward (a forward pre-hook on the model, ahead of FSDP's own, so the EMA goes into
the shards before they are gathered) and out at its logs, the first event after it; a
training-mode forward always swaps back first. With ``"both"`` each evaluation batch goes once
more through the EMA weights (a forward hook) and the mean of the model's own loss over them,
all ranks, is logged beside the raw one. Imports no framework: the Trainer's objects come in as
arguments."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from ..distributed.groups import comm_device
from .common import HeldSwap, warn_user


def eval_prefix(logs: Mapping[str, Any]) -> str | None:
    """The metric prefix of an evaluation's logs (``"eval"``, ``"eval_<dataset>"``), or None
    when ``logs`` are not an evaluation's."""
    for key in logs:
        m = re.fullmatch(r"(.+)_runtime", key)
        if m and m.group(1) != "train" and f"{m.group(1)}_samples_per_second" in logs:
            return m.group(1)
    return None


class EMAEvaluation:
    """The EMA weights in the Trainer's evaluations: ``mode`` is ``eval_with_ema``,
    ``metric_name`` the EMA metric's name pattern, ``swap`` the callback's held swap (the one
    its other events put back). The callback sets ``control`` (the Trainer's ``TrainerControl``)
    at every event: ``should_evaluate`` there says an evaluation comes before its first
    forward."""

    def __init__(self, mode: bool | str, metric_name: str, swap: HeldSwap):
        self.mode, self.metric_name, self.swap = mode, metric_name, swap
        self.control = None          # the Trainer's TrainerControl, from the last event
        self._ema = None
        self._session = False        # an evaluation with the EMA weights is under way
        self._on_start = False       # args.eval_on_start: an evaluation before the first step
        self._rerun = False          # the "both" mode's EMA forward is running
        self._hooks: list[Any] = []
        self._loss: list[torch.Tensor] | None = None
        self._metrics: dict[str, float] = {}
        self._warned_no_loss = False

    def install(self, model: torch.nn.Module, ema, args) -> None:
        """At the start of training: the forward hooks on ``model`` (those of a ``train()``
        before this one that raised removed first)."""
        self.remove()
        if not self.mode:
            return
        self._ema = ema
        self._hooks = [model.register_forward_pre_hook(self._pre_forward, prepend=True)]
        if self.mode == "both":
            self._hooks.append(model.register_forward_hook(self._post_forward, with_kwargs=True))
        self._on_start = bool(getattr(args, "eval_on_start", False))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def end(self) -> None:
        """An event outside any evaluation: the training weights back, no session."""
        self.swap.exit()
        self._session = False
        self._on_start = False

    def _evaluating(self) -> bool:
        control = self.control
        return self._session or self._on_start or bool(control is not None
                                                       and control.should_evaluate)

    def _pre_forward(self, module, args):
        if self._rerun:
            return
        if module.training:
            self.swap.exit()  # never a training step on the EMA weights
            return
        if self.mode is True and self._evaluating() and self._ema is not None:
            self._session = True
            self.swap.enter(self._ema)

    def _post_forward(self, module, args, kwargs, output):
        if (self.mode != "both" or self._rerun or module.training or not self._evaluating()
                or self._ema is None):
            return
        self._session = True
        self._rerun = True
        # The model's own mean loss over the batch: the Trainer divides by the tokens of every
        # rank's batch (num_items_in_batch) and scales back after the forward, out of reach here.
        kwargs = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
        try:
            with torch.no_grad(), self._ema.swap():
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
        if self._loss is None:
            self._loss = [loss, torch.tensor(float(n), device=loss.device)]
        else:
            self._loss[0] += loss
            self._loss[1] += n

    def _metric(self, prefix: str) -> dict[str, float]:
        """Collective: the EMA's mean loss over this evaluation's batches, all ranks."""
        sums = self._loss
        self._loss = None
        device = sums[0].device if sums is not None else torch.device("cpu")
        t = (torch.stack([s.to(device) for s in sums]) if sums is not None
             else torch.zeros(2, device=device))
        if torch.distributed.is_initialized():
            t = t.to(comm_device(torch.distributed.group.WORLD, t.device))
            torch.distributed.all_reduce(t)
        if float(t[1]) == 0:
            return {}
        return {self.metric_name.format(name=f"{prefix}_loss"): float(t[0] / t[1])}

    def logged(self, logs: Mapping[str, Any]) -> dict[str, float] | None:
        """At ``on_log``: None when ``logs`` are not an evaluation's (or no evaluation uses the
        EMA); else the evaluation is over (its logs are the first event after it): the training
        weights come back before any other callback can read them, and the EMA's metrics to add
        to those logs are returned (``"both"``; none with ``True``). Collective with ``"both"``."""
        prefix = eval_prefix(logs) if self.mode else None
        if prefix is None:
            return None
        self.swap.exit()
        self._on_start = False
        if self.mode == "both":
            self._metrics = self._metric(prefix)
            return self._metrics
        return {}

    def evaluated(self, metrics: dict[str, float] | None) -> None:
        """At ``on_evaluate``: the training weights back, and the EMA's metrics into the
        evaluation's ``metrics`` (which ``metric_for_best_model`` reads)."""
        self.swap.exit()
        if metrics is not None and self._metrics:
            metrics.update(self._metrics)
            self._metrics = {}
