"""The student's structure as the teacher starts from it (``ema.teacher`` builds on it): the
student's FSDP2 units (``Unit``, ``student_units``: mesh, policy, what each shards) and its module
tree cloned onto the meta device (``Clone``: classes, attributes and hooks; no tensor data)."""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ..model.slots import WRAPPER_ATTRS, is_ddp, join_name

# Attributes of a module's __dict__ that belong to the wrappers around it, not to the module:
# FSDP2's markers for dynamo and nn.Module.compile's compiled call (bound to the student).
_DROPPED_ATTRS = frozenset({"_is_fsdp_managed_module", "_fsdp_use_orig_params",
                            "_compiled_call_impl"})
_COMPOSABLE_STATE = "__composable_api_state_key"  # fully_shard's state and registry keys
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


def _code_file(fn: Any) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    return code.co_filename.replace(os.sep, "/") if code is not None else ""


def _from_fsdp(fn: Any) -> bool:
    """A hook or method that FSDP2 installed (its pre/post-forward hooks, state-dict hooks,
    ``register_fsdp_forward_method``'s wrapper): the teacher's own units install their own."""
    return "torch/distributed/fsdp/" in _code_file(fn)


def _original_class(module: nn.Module) -> type:
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if issubclass(cls, FSDPModule):  # fully_shard's FSDP<cls>: the class it was made from
        cls = cls.__mro__[getattr(cls, "_orig_cls_mro_index", 2)]
    return cls


# --- the student's FSDP2 units ------------------------------------------------------------------

class Unit:
    """One of the student's ``fully_shard`` units: its modules, its MixedPrecisionPolicy, and its
    one parameter group (mesh, offload policy, FSDPParams), if it has parameters."""

    def __init__(self, state, name: str):
        self.state, self.name = state, name
        self.modules = list(state._modules)
        groups = list(getattr(state, "_fsdp_param_groups", None) or
                      ([state._fsdp_param_group] if state._fsdp_param_group else []))
        if len(groups) > 1:
            raise ValueError(f"ShardedEMA.module(): the FSDP2 unit {name or '<root>'!r} shards its "
                             f"parameters over {len(groups)} meshes (shard_placement_fn with "
                             f"ShardPlacementResult); a teacher of it is not supported")
        self.group = groups[0] if groups else None
        self.params = list(self.group.fsdp_params) if self.group else []
        self.mp_policy = state._mp_policy
        if self.group is not None and getattr(self.group.mesh_info, "is_spmd_mesh", False):
            raise ValueError(f"ShardedEMA.module(): the FSDP2 unit {name or '<root>'!r} was made "
                             f"with dp_mesh_dims (an SPMD mesh); a teacher of it is not supported")

    @property
    def mesh(self):
        return self.group.mesh_info.mesh if self.group is not None else None


def student_units(model: nn.Module, names: dict[int, str]) -> list[Unit]:
    """The student's FSDP2 units, children before parents (the order fully_shard needs)."""
    from torch.distributed.fsdp import FSDPModule

    seen, units = set(), []
    for module in reversed(list(model.modules())):
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if id(state) not in seen:
                seen.add(id(state))
                units.append(Unit(state, names.get(id(module), "")))
    return units


# --- cloning the structure onto the meta device --------------------------------------------------

class Clone:
    """The student's module tree, module by module, with meta placeholders for its parameters.

    Each module is an instance of its own class (FSDP2's ``FSDP<cls>`` stripped, DDP unwrapped)
    made without ``__init__``: its ``__dict__`` is the student module's, shallow (plain attributes
    are shared), except the children (cloned), the parameters (meta placeholders, replaced later),
    the buffers (set later) and what belongs to wrappers: FSDP2's state, hooks and forward-method
    wrappers, and ``nn.Module.compile``'s compiled call. Other hooks are kept (tensor parallelism's
    input/output redistribution hooks, the user's), bound methods of student modules rebound to
    their clones. Modules the student compiled are recorded, to be compiled again.
    """

    def __init__(self, root: nn.Module, placeholder: Callable[[nn.Module, str, Any], nn.Parameter]):
        from torch._dynamo.eval_frame import OptimizedModule

        self._placeholder = placeholder
        self._optimized = OptimizedModule
        self.of: dict[int, nn.Module] = {}           # id(student module) -> clone
        self.student: dict[int, nn.Module] = {}      # id(clone) -> student module
        self.names: dict[int, str] = {}              # id(student module) -> clean name
        self.params: dict[int, nn.Parameter] = {}    # id(student parameter) -> placeholder
        self.forward_methods: list[tuple[nn.Module, str]] = []  # register_fsdp_forward_method
        # Clones of modules nn.Module.compile'd, each with the student's compiled call; the
        # student's torch.compile(model) (an OptimizedModule) where the root was one.
        self.compiled: list[tuple[nn.Module, Any]] = []
        self.wrap_compiled: Any = None
        self.root = self._clone(root, "")

    def _clone(self, m: nn.Module, prefix: str) -> nn.Module:
        if id(m) in self.of:
            return self.of[id(m)]
        if is_ddp(m):
            return self._clone(m.module, prefix)
        if isinstance(m, self._optimized):
            if self.of:  # a module was cloned before it: it is below the root
                raise ValueError("ShardedEMA.module(): a torch.compile'd submodule "
                                 "(OptimizedModule) below the root is not supported; compile it "
                                 "with module.compile() instead, which the teacher mirrors")
            self.wrap_compiled = m
            inner = self._clone(m._orig_mod, prefix)
            self.of[id(m)] = inner
            return inner
        cls = _original_class(m)
        new = object.__new__(cls)
        self.of[id(m)] = new
        self.student[id(new)] = m
        self.names[id(m)] = prefix
        state = {}
        for key, value in m.__dict__.items():
            if key in _DROPPED_ATTRS or key.startswith(_COMPOSABLE_STATE):
                continue
            if isinstance(value, types.MethodType) and isinstance(value.__self__, nn.Module):
                if _from_fsdp(value):  # register_fsdp_forward_method's wrapper: redone later
                    self.forward_methods.append((new, key))
                    continue
                value = types.MethodType(value.__func__, self._rebind(value.__self__))
            state[key] = value
        new.__dict__.update(state)
        if "_compiled_call_impl" in m.__dict__ and m.__dict__["_compiled_call_impl"] is not None:
            new._compiled_call_impl = None
            self.compiled.append((new, m.__dict__["_compiled_call_impl"]))
        for key in _HOOK_DICTS:
            hooks = getattr(m, key, None)
            if hooks is not None:
                setattr(new, key, type(hooks)(
                    (i, self._rebind_hook(h)) for i, h in hooks.items() if not _from_fsdp(h)))
        for key in _HOOK_FLAGS:
            flags = getattr(m, key, None)
            if flags is not None:
                setattr(new, key, type(flags)(
                    (i, v) for i, v in flags.items()
                    if any(i in getattr(new, d) for d in _HOOK_DICTS)))
        new._parameters = {name: None if p is None else self._param(m, name, p)
                           for name, p in m._parameters.items()}
        new._buffers = dict(m._buffers)  # replaced by the builder
        new._non_persistent_buffers_set = set(m._non_persistent_buffers_set)
        children = {}
        for name, child in m._modules.items():
            if child is None:
                children[name] = None
                continue
            skip = name in WRAPPER_ATTRS or (name == "module" and is_ddp(m))
            children[name] = self._clone(child, prefix if skip else join_name(prefix, name))
        new._modules = children
        return new

    def _param(self, module: nn.Module, name: str, p) -> nn.Parameter:
        if id(p) not in self.params:
            self.params[id(p)] = self._placeholder(module, name, p)
        return self.params[id(p)]

    def _rebind(self, obj: nn.Module) -> Any:
        # A module of the student seen before its clone exists (a hook bound to a later sibling)
        # keeps pointing at the student: never the case for hooks bound to their own module.
        return self.of.get(id(obj), obj)

    def _rebind_hook(self, hook: Any) -> Any:
        if isinstance(hook, types.MethodType) and isinstance(hook.__self__, nn.Module):
            return types.MethodType(hook.__func__, self._rebind(hook.__self__))
        return hook

    def modules(self) -> Iterator[tuple[nn.Module, nn.Module]]:
        """(student module, clone) pairs."""
        for student in self.student.values():
            yield student, self.of[id(student)]
