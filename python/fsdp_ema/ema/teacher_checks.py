"""What keeps a teacher (``ShardedEMA.module()``) the EMA's, checked while it runs: before each
forward (the root's forward pre-hook, and the forward methods registered with FSDP2), when
``module()`` returns it again and at every eager ``update()``.

- ``Links``: each parameter of the teacher and each buffer the EMA keeps, with the tensor it must
  run on. A parameter that requires grad is refused everywhere (an optimizer stepping it would
  write the EMA); one replaced since the teacher was built (``teacher.double()``, ``.to(...)``)
  means the teacher no longer follows ``update()``: its forward refuses, and ``module()`` builds
  a new teacher in its place.
- ``DtypeCheck``: where the teacher computes in another dtype than the student (a plain or DDP
  model's teacher runs on the EMA's tensors, in the EMA's dtype; an FSDP2 teacher given an
  ``mp_policy`` without ``param_dtype``), an input in the student's dtype is refused before the
  forward, naming both dtypes and the fix (torch's own error names neither the EMA nor
  ``mp_policy``).
- ``ReshardWhenStale``: a teacher that keeps gathered parameters between forwards
  (``reshard_after_forward`` other than True) reshards when the EMA was written since.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..model.layouts import is_dtensor

_FROZEN = ("keep the teacher frozen (teacher.requires_grad_(False)); to train a copy of the EMA, "
           "copy it into a model of your own (ema.copy_to(model))")


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, or the tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


@dataclasses.dataclass
class Links:
    """The teacher's tensors and what each must be: ``(fqn, current, expected)`` where
    ``current()`` reads the tensor the teacher runs on now (FSDP2: the sharded parameter) and
    ``expected`` is the EMA's tensor (or the student's, where the EMA keeps none); ``registered``
    reads every parameter an FSDP2 teacher's modules hold now (the gathered ones between a
    forward and its reshard), whose ``requires_grad`` is checked too."""

    tensors: list[tuple[str, Callable[[], Any], torch.Tensor]] = dataclasses.field(
        default_factory=list)
    registered: Callable[[], Iterable[torch.Tensor]] = lambda: ()

    def add(self, fqn: str, current: Callable[[], Any], expected: torch.Tensor) -> None:
        self.tensors.append((fqn, current, expected))

    def requiring_grad(self) -> list[str]:
        """The teacher's parameters that require grad."""
        out = [fqn for fqn, current, _ in self.tensors
               if isinstance(t := current(), nn.Parameter) and t.requires_grad]
        if not out and any(p.requires_grad for p in self.registered()):
            out.append("<a gathered parameter>")
        return out

    def replaced(self) -> list[str]:
        """The teacher's tensors that no longer are the ones it was built on."""
        out = []
        for fqn, current, expected in self.tensors:
            t = current()
            if t is None or not _same(local_of(t), expected):
                out.append(fqn)
        return out

    def refuse_grad(self, what: str) -> None:
        names = self.requiring_grad()
        if names:
            raise RuntimeError(
                f"{what}: the teacher's parameter {names[0]!r} requires grad (teacher."
                f"requires_grad_(True)?): the teacher's parameters are the EMA's own tensors (or "
                f"the student's, where the EMA keeps none), so an optimizer stepping them would "
                f"write the EMA; {_FROZEN}")

    def check_forward(self) -> None:
        """Before a forward: refuses a teacher that requires grad or no longer runs on the EMA."""
        self.refuse_grad("ShardedEMA.module()'s teacher")
        names = self.replaced()
        if names:
            raise RuntimeError(
                f"ShardedEMA.module()'s teacher no longer runs on the EMA: its {names[0]!r} was "
                f"replaced since it was built (teacher.double(), .half(), .to(...) or the "
                f"like), so it would not follow ema.update(); call ema.module() for a "
                f"teacher on the EMA. Its parameters have the EMA's dtype: to compute in another, "
                f"pass module(mp_policy=MixedPrecisionPolicy(param_dtype=...)) (FSDP2) or make "
                f"the EMA in that dtype (ShardedEMA(..., dtype=...))")


def _same(t: torch.Tensor, expected: torch.Tensor) -> bool:
    return (t.dtype == expected.dtype and t.device == expected.device
            and t.shape == expected.shape and t.data_ptr() == expected.data_ptr())


@dataclasses.dataclass
class Teacher:
    """A teacher ``module()`` built and the links that keep it the EMA's (``EMAState.teachers``
    holds one per set of ``module()`` arguments)."""

    module: nn.Module
    links: Links


def check_teachers(teachers: dict, what: str) -> None:
    """Every teacher of an EMA, at ``update()``: one whose parameters require grad is refused
    (one whose tensors were replaced no longer runs on the EMA: its own forward refuses, and
    ``module()`` builds a new one)."""
    for teacher in teachers.values():
        if not teacher.links.replaced():
            teacher.links.refuse_grad(what)


@dataclasses.dataclass
class DtypeCheck:
    """The teacher computes in ``teacher`` where the student computes in ``student``: a floating
    input of the student's dtype (outside autocast) would fail inside the forward with torch's
    dtype error; it is refused before, naming both dtypes and the fix."""

    student: torch.dtype
    teacher: torch.dtype
    fsdp2: bool
    mp_policy: Any

    def __call__(self, args: tuple, kwargs: dict) -> None:
        named = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
        for where, x in named:
            if (isinstance(x, torch.Tensor) and x.dtype == self.student
                    and not torch.is_autocast_enabled(x.device.type)):
                raise RuntimeError(self.message(where))

    def message(self, where: str) -> str:
        s, t = self.student, self.teacher
        if self.fsdp2:
            return (f"ShardedEMA.module(mp_policy={self.mp_policy})'s teacher computes in {t} "
                    f"(the EMA's dtype: the policy sets no param_dtype) but its input {where} is "
                    f"{s}, the student's dtype; pass module(mp_policy=MixedPrecisionPolicy("
                    f"param_dtype={s})) to compute as the student does (or leave mp_policy out), "
                    f"or feed it {t} inputs")
        return (f"ShardedEMA.module()'s teacher computes in its parameters' dtype, the EMA's "
                f"({t}), but its input {where} is {s}, the model's dtype: the teacher of a model "
                f"not sharded with FSDP2 runs on the EMA's own tensors, so feed it {t} inputs, or "
                f"make the EMA in the model's dtype (ShardedEMA(..., dtype=None)); "
                f"module(mp_policy=MixedPrecisionPolicy(param_dtype=...)), which casts, is for "
                f"FSDP2 (fully_shard) students")


class ReshardWhenStale:
    """With ``reshard_after_forward`` other than True the teacher keeps gathered parameters
    between forwards, which would not see an ``update()`` (or a load) of the EMA since: before a
    forward, if any EMA tensor was written since the last one (its version counter moved), every
    unit is resharded so that the forward gathers the new values."""

    def __init__(self, root: nn.Module, ema):
        from torch.distributed.fsdp import FSDPModule

        self.ema = ema
        self.units = [m for m in root.modules() if isinstance(m, FSDPModule)]
        self.seen: list[int] | None = None

    def __call__(self, args: tuple, kwargs: dict) -> None:
        versions = [t._version for t in self.ema.state.tensors]
        if versions != self.seen:
            for m in self.units:
                m.reshard()
            self.seen = versions


class BeforeForward:
    """Runs ``checks`` (each ``check(args, kwargs)``) and the links' check before every forward
    of the teacher: a forward pre-hook of ``root`` (first of its hooks, before FSDP2 gathers
    anything) and a wrapper of each forward method FSDP2 runs (``register_fsdp_forward_method``).
    The links are not checked while torch.compile traces (a root compiled with
    ``nn.Module.compile()``: its hooks run in the graph); ``update()`` and ``module()`` check
    them."""

    def __init__(self, root: nn.Module, forward_methods, links: Links,
                 checks: list[Callable[[tuple, dict], None]]):
        self.links, self.checks = links, checks
        root.register_forward_pre_hook(self.hook, prepend=True, with_kwargs=True)
        for module, name in forward_methods:
            method = getattr(module, name)

            @functools.wraps(method)
            def checked(*args, _method=method, **kwargs):
                self(args, kwargs)
                return _method(*args, **kwargs)

            setattr(module, name, checked)

    def hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self(args, kwargs)

    def __call__(self, args: tuple, kwargs: dict) -> None:
        if not torch.compiler.is_compiling():
            self.links.check_forward()
        for check in self.checks:
            check(args, kwargs)
