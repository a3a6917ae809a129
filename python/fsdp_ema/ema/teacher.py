"""The EMA as a module that runs: ``ShardedEMA.module()``, the teacher of self-distillation (DINO,
iBOT, I-JEPA, BYOL, MoCo, data2vec), whose parameters are the EMA's own tensors.

The teacher is the student's module tree cloned onto the meta device (classes, attributes and
hooks; no tensor data), then, for FSDP2, sharded with the student's own ``fully_shard`` units
(mesh, MixedPrecisionPolicy, placements; nothing is allocated, the parameters being meta), and
then pointed at the EMA. FSDP2 keeps, for each sharded parameter, a padded 1-D tensor that its
all-gather reads (``FSDPParam._sharded_param_data``) and a DTensor whose local tensor is the
unpadded rows of it; both become views of the EMA's tensor, whose storage is grown in place to the
padded size where the rows are uneven (a row block at most, as FSDP2 pads its own shards). So
``ShardedEMA.update()`` is the whole teacher update, and the next forward's all-gather reads the
new values. Plain and DDP models: each parameter is an ``nn.Parameter`` over the EMA's tensor.

Parameters the EMA does not keep (``params="trainable"``: a LoRA model's frozen base) are the
student's own tensors (FSDP2: its padded shards). Buffers the EMA keeps are the EMA's tensors;
the others are the teacher's own, copied from the student's once. An FSDP2 teacher computes as
the student does (each unit's ``param_dtype``, or the student's parameters' dtype), and modules
the student compiled are compiled with the student's settings. What keeps the teacher the EMA's
while it runs (frozen, on the EMA's tensors, given inputs of its dtype) is ``teacher_checks``'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import torch
from torch import nn

from ..model.layouts import is_dtensor
from ..model.slots import FlatSlot, join_name
from .teacher_checks import BeforeForward, DtypeCheck, Links, ReshardWhenStale, Teacher, local_of
from .teacher_clone import Clone, Unit, student_units

# --- the builder ---------------------------------------------------------------------------------

def _meta_like(p, dtype: torch.dtype, spec=None) -> nn.Parameter:
    """A meta placeholder of ``p``'s global shape in ``dtype``; a meta DTensor over ``spec``'s mesh
    and placements for a parameter that is a DTensor before FSDP2 shards it (tensor parallel)."""
    shape = torch.Size(p.shape)
    if spec is None:
        return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, _ = compute_local_shape_and_global_offset(shape, spec.mesh, spec.placements)
    stride = torch.empty(shape, device="meta").stride()
    meta_spec = DTensorSpec(spec.mesh, tuple(spec.placements),
                            tensor_meta=TensorMeta(shape, stride, dtype))
    local = torch.empty(local_shape, dtype=dtype, device="meta")
    return nn.Parameter(DTensor(local, meta_spec, requires_grad=False), requires_grad=False)


def _grow_to(t: torch.Tensor, numel: int, what: str) -> torch.Tensor:
    """A 1-D view of ``numel`` elements from the start of ``t``'s storage, which is grown in place
    (same storage object, so every view of ``t`` stays valid) where it is smaller: FSDP2's padded
    shard, whose first ``t.numel()`` elements are ``t`` itself."""
    storage = t.untyped_storage()
    need = numel * t.element_size()
    if storage.nbytes() < need:
        if t.storage_offset() != 0 or not t.is_contiguous():
            raise RuntimeError(f"ShardedEMA.module(): the EMA of {what} is not the start of its "
                               f"own storage; cannot pad it in place")
        storage.resize_(need)
        # The padding is all-gathered and dropped; zeros keep the gathered buffer deterministic.
        t.as_strided((numel,), (1,), 0)[t.numel():].zero_()
    return t.as_strided((numel,), (1,), 0)


def module(ema, *, mp_policy=None, reshard_after_forward: bool | int = True, mesh=None,
           compile: bool | dict = True) -> nn.Module:
    """``ShardedEMA.module()``: built once per set of arguments, then the same module (a training
    step may ask for it every time)."""
    builder = TeacherBuilder(ema, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                             mesh=mesh, compile=compile)
    builder.check()
    if mesh is not None:
        from torch.distributed.fsdp import FSDPModule

        model = ema.model
        names = {id(m): n for m, n in _named(model)}
        builder.check_mesh(student_units(model, names) if any(
            isinstance(m, FSDPModule) for m in model.modules()) else [])
    key = (mp_policy, reshard_after_forward, repr(compile))
    built = ema.state.teachers
    teacher = built.get(key)
    if teacher is not None:
        builder.resolve()  # what update() checks too: a model resharded or reshaped since
        if teacher.links.replaced():  # converted since (teacher.double()): its forward refuses
            teacher = None
        else:
            teacher.links.refuse_grad("ShardedEMA.module()")
    if teacher is None:
        teacher = built[key] = builder.build()
    return teacher.module


class TeacherBuilder:
    """Builds ``ShardedEMA.module()`` (see the module docstring)."""

    def __init__(self, ema, *, mp_policy, reshard_after_forward, mesh, compile):
        self.ema = ema
        self.mp_policy, self.reshard_after_forward = mp_policy, reshard_after_forward
        self.mesh, self.compile = mesh, compile

    # --- checks, before anything is built --------------------------------------------------------

    def check(self) -> None:
        ema = self.ema
        if ema.state.host is not None:
            raise ValueError("ShardedEMA.module(): this EMA lives in host memory (device='cpu'), "
                             "where the model's device cannot run it; make the EMA beside the "
                             "weights (device=None) to run it as a teacher")
        if ema.state.swapped:
            raise RuntimeError("ShardedEMA.module() inside swap(): the model holds the EMA "
                               "weights there; make the teacher outside the swap() block")
        if any(isinstance(slot, FlatSlot) for slot in ema.state.slots):
            raise ValueError(
                "ShardedEMA.module(): FSDP1 (FullyShardedDataParallel) models are not supported: "
                "an FSDP1 teacher would be its own FullyShardedDataParallel, which materializes "
                "each unit unsharded on every rank when it is built and lays its FlatParameters "
                "out by dtype; shard the student with FSDP2 (torch.distributed.fsdp.fully_shard), "
                "or evaluate with ema.swap()")
        if not (isinstance(self.reshard_after_forward, bool) or (
                isinstance(self.reshard_after_forward, int) and self.reshard_after_forward > 1)):
            raise ValueError(f"ShardedEMA.module(): reshard_after_forward must be a bool or an "
                             f"int > 1, got {self.reshard_after_forward!r}")
        if not (isinstance(self.compile, bool) or isinstance(self.compile, dict)):
            raise TypeError(f"ShardedEMA.module(): compile must be a bool or a dict of "
                            f"torch.compile arguments, got {self.compile!r}")
        if self.mp_policy is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            if not isinstance(self.mp_policy, MixedPrecisionPolicy):
                raise TypeError(f"ShardedEMA.module(): mp_policy must be a MixedPrecisionPolicy, "
                                f"got {self.mp_policy!r}")

    def resolve(self) -> list[torch.Tensor]:
        """The model's tensors as the EMA keeps them, checked: refreshed (a model resharded since
        the EMA was made raises), and each found again in the model."""
        try:
            return list(self.ema.state.refresh())
        except (KeyError, AttributeError) as e:
            raise RuntimeError(f"ShardedEMA.module(): the model changed since the EMA was made "
                               f"({type(e).__name__}: {e}); make a new ShardedEMA of it") from None

    # --- build ------------------------------------------------------------------------------------

    def build(self) -> Teacher:
        from torch.distributed.fsdp import FSDPModule

        ema = self.ema  # module() ran check() and the mesh check
        ema.state.check_selection("ShardedEMA.module")
        live = self.resolve()
        slot_of = {id(t): i for i, t in enumerate(live)}
        model = ema.model
        fsdp2 = any(isinstance(m, FSDPModule) for m in model.modules())
        if self.mp_policy is not None and not fsdp2:
            raise ValueError(f"ShardedEMA.module(mp_policy={self.mp_policy}): mp_policy is the "
                             f"policy of FSDP2 units, and this model is not sharded with "
                             f"fully_shard: its teacher runs on the EMA's tensors, in their "
                             f"dtype; leave mp_policy out")

        # The student's FSDPParams by (module, name) (shared parameters under every owner): the
        # sharded DTensor even while FSDP2 holds the unsharded one in the module.
        managed: dict[tuple[int, str], Any] = {}
        names = {id(m): n for m, n in _named(model)}
        units = student_units(model, names) if fsdp2 else []
        for unit in units:
            for fp in unit.params:
                info = fp._module_info
                managed[(id(info.module), info.param_name)] = fp
                for sm, sn in zip(info.shared_modules, info.shared_param_names):
                    managed[(id(sm), sn)] = fp
        _check_own_units(model, managed)

        def student_param(module, name, p):
            fp = managed.get((id(module), name))
            return fp.sharded_param if fp is not None else p

        def slot_index(p) -> int | None:
            return slot_of.get(id(p._local_tensor if is_dtensor(p) else p))

        def placeholder(module, name, p):
            fp = managed.get((id(module), name))
            sp = student_param(module, name, p)
            i = slot_index(sp)
            dtype = ema.state.tensors[i].dtype if i is not None else sp.dtype
            spec = fp._unsharded_dtensor_spec if fp is not None and fp.is_dtensor else None
            return _meta_like(sp, dtype, spec)

        clone = Clone(model, placeholder)
        self._check_same_model(clone, student_param, slot_index, live)
        # FSDP2 registers gathered parameters on the modules between a forward and its reshard.
        links = Links(registered=clone.root.parameters) if fsdp2 else Links()
        ignored = self._own_tensors(clone, managed, slot_index, links)
        root = clone.root
        policies = []
        if fsdp2:
            policies = self._shard(clone, units, ignored)
            self._point(clone, managed, slot_index, links)
        root.requires_grad_(False)
        root.eval()
        checks = [c for c in (self._dtype_check(clone, policies, managed),) if c is not None]
        if self.reshard_after_forward is not True and fsdp2:
            checks.append(ReshardWhenStale(root, ema))
        teacher = self._compiled(clone)
        # The checks run before every forward, eagerly where the root is torch.compile(model)'s.
        BeforeForward(teacher, clone.forward_methods, links, checks)
        return Teacher(teacher, links)

    def _own_tensors(self, clone: Clone, managed, slot_index, links: Links) -> set[nn.Parameter]:
        """Parameters FSDP2 does not manage (plain, DDP; DTensors outside any unit) and buffers:
        the EMA's tensors, or the student's own; returns the parameters (for ``ignored_params``)."""
        ema = self.ema
        ignored: set[nn.Parameter] = set()
        done: dict[int, nn.Parameter] = {}
        for student, new in clone.modules():
            prefix = clone.names[id(student)]
            for name, p in student._parameters.items():
                if p is None or (id(student), name) in managed:
                    continue
                if id(p) not in done:
                    done[id(p)], local = self._unmanaged(p, slot_index(p))
                    links.add(join_name(prefix, name),
                              lambda m=new, n=name: m._parameters.get(n), local)
                new._parameters[name] = done[id(p)]
                ignored.add(done[id(p)])
            for name, b in student._buffers.items():
                if b is None:
                    continue
                i = slot_index(b)
                # A DTensor buffer (rare: tensor parallelism) is the teacher's own copy too.
                if i is not None and not is_dtensor(b):
                    new._buffers[name] = ema.state.tensors[i]
                    links.add(join_name(prefix, name), lambda m=new, n=name: m._buffers.get(n),
                              ema.state.tensors[i])
                else:
                    new._buffers[name] = b.detach().clone()
        return ignored

    def _compiled(self, clone: Clone) -> nn.Module:
        """The teacher, its modules compiled where the student's were: ``compile=True`` with the
        student's own torch.compile settings (backend, mode, options, fullgraph, dynamic: the
        compile context itself, applied to the teacher's module), ``compile={...}`` with those
        arguments."""
        teacher = clone.root
        if self.compile is False:
            return teacher
        for m, student_call in clone.compiled:
            context = self._compile_context(student_call, clone.names[id(clone.student[id(m)])])
            if context is not None:
                m._compiled_call_impl = context(m._call_impl)  # what nn.Module.compile does
            else:
                m.compile(**(self.compile if isinstance(self.compile, dict) else {}))
        if clone.wrap_compiled is not None:
            context = self._compile_context(clone.wrap_compiled, "<root>")
            teacher = (context(teacher) if context is not None else
                       torch.compile(teacher, **(self.compile if isinstance(self.compile, dict)
                                                 else {})))
        return teacher

    def _compile_context(self, compiled: Any, name: str) -> Any:
        """The torch.compile context behind the student's ``compiled`` (an OptimizedModule's
        ``dynamo_ctx``, or the one a function torch.compile made closes over, as
        ``nn.Module.compile``'s call), for ``compile=True``; None for ``compile={...}``, or with a
        warning where it cannot be read (torch.compile's defaults then)."""
        from torch._dynamo.eval_frame import _TorchDynamoContext

        if self.compile is not True:
            return None
        context = getattr(compiled, "dynamo_ctx", None)
        code = getattr(compiled, "__code__", None)
        if context is None and code is not None:
            for var, cell in zip(code.co_freevars, compiled.__closure__ or ()):
                if var == "self":
                    with contextlib.suppress(ValueError):  # an empty cell
                        context = cell.cell_contents
        if isinstance(context, _TorchDynamoContext):
            return context
        warnings.warn(f"ShardedEMA.module(): cannot read the torch.compile settings the student's "
                      f"{name!r} was compiled with; the teacher's is compiled with torch.compile's "
                      f"defaults (pass compile={{...}} to give its arguments)", RuntimeWarning,
                      stacklevel=4)
        return None

    def _dtype_check(self, clone: Clone, policies, managed) -> DtypeCheck | None:
        """A ``DtypeCheck`` where the teacher computes in one dtype and the student in another
        (and the teacher's root does not cast its inputs): a plain or DDP model's EMA in another
        dtype than the model, or an FSDP2 ``mp_policy`` without ``param_dtype``."""
        student, teacher = set(), set()
        for unit, policy in policies:
            if unit.params:
                student |= ({unit.mp_policy.param_dtype} if unit.mp_policy.param_dtype else
                            {fp.sharded_param.dtype for fp in unit.params})
                teacher |= ({policy.param_dtype} if policy.param_dtype else
                            {_placeholder(clone, fp).dtype for fp in unit.params})
        for s, new in clone.modules():
            for name, p in s._parameters.items():
                if p is not None and (id(s), name) not in managed:
                    student.add(p.dtype)
                    teacher.add(new._parameters[name].dtype)
        student = {d for d in student if d.is_floating_point}
        teacher = {d for d in teacher if d.is_floating_point}
        if len(student) != 1 or len(teacher) != 1 or student == teacher:
            return None
        root_policy = next((policy for unit, policy in policies
                            if clone.of[id(unit.modules[0])] is clone.root), None)
        if root_policy is not None and root_policy.param_dtype and root_policy.cast_forward_inputs:
            return None  # the root casts the inputs to its param_dtype
        return DtypeCheck(student.pop(), teacher.pop(), bool(policies), self.mp_policy)

    def _unmanaged(self, p, i: int | None) -> tuple[nn.Parameter, torch.Tensor]:
        """A parameter FSDP2 does not shard: over the EMA's tensor, or the student's own tensor
        where the EMA does not keep it; with the (local) tensor it runs on."""
        from ..model.slots import dtensor_view

        if i is None:
            data = p.detach()
        elif is_dtensor(p):
            data = dtensor_view(self.ema.state.tensors[i], p.device_mesh, p.placements, p.shape,
                                p.stride())
        else:
            data = self.ema.state.tensors[i]
        return nn.Parameter(data, requires_grad=False), local_of(data)

    def check_mesh(self, units: list[Unit]) -> None:
        meshes = [(u.name, u.mesh) for u in units if u.mesh is not None]
        if not meshes:
            raise ValueError(f"ShardedEMA.module(mesh={self.mesh}): the model is not sharded with "
                             f"FSDP2, so the EMA was made on no mesh; leave mesh out")
        for name, m in meshes:
            if m != self.mesh:
                raise ValueError(
                    f"ShardedEMA.module(mesh={self.mesh}): the EMA was made on the student's mesh "
                    f"{m} (FSDP2 unit {name or '<root>'!r}) and holds its shards; a teacher on "
                    f"another mesh would need other shards. Leave mesh out, or make the EMA of a "
                    f"model sharded on that mesh")

    def _check_same_model(self, clone: Clone, student_param, slot_index, live) -> None:
        """Every parameter the EMA selects is one the EMA keeps, and every tensor the EMA keeps is
        in the model: otherwise the model changed since the EMA was made."""
        ema = self.ema
        select = (None if ema.params == "all" else
                  (lambda fqn, p: bool(p.requires_grad)) if ema.params == "trainable" else
                  ema.params)
        found = set()
        for student, _ in clone.modules():
            prefix = clone.names[id(student)]
            for name, p in student._parameters.items():
                if p is None:
                    continue
                sp = student_param(student, name, p)
                i = slot_index(sp)
                fqn = join_name(prefix, name)
                if i is None and (select is None or select(fqn, sp)):
                    raise RuntimeError(
                        f"ShardedEMA.module(): the model has a parameter {fqn!r} "
                        f"({list(sp.shape)}) that the EMA does not keep: the model changed since "
                        f"the EMA was made; make a new ShardedEMA of it")
                if i is not None:
                    found.add(i)
            for b in student._buffers.values():
                i = slot_index(b) if b is not None else None
                if i is not None:
                    found.add(i)
        lost = [ema.state.slots[i].describe() for i in range(len(live)) if i not in found]
        if lost:
            raise RuntimeError(f"ShardedEMA.module(): the EMA keeps {', '.join(lost[:4])}, which "
                               f"the model no longer holds: the model changed since the EMA was "
                               f"made; make a new ShardedEMA of it")

    def _shard(self, clone: Clone, units: list[Unit],
               ignored: set[nn.Parameter]) -> list[tuple[Unit, Any]]:
        """The student's fully_shard units, applied to the clone (children first); returns each
        unit with the teacher's policy of it."""
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
        from torch.distributed.tensor import Shard

        policies = []
        for unit in units:
            modules = [clone.of[id(m)] for m in unit.modules]
            policies.append((unit, self._policy(unit, clone)))
            kwargs: dict[str, Any] = dict(reshard_after_forward=self.reshard_after_forward,
                                          mp_policy=policies[-1][1])
            if unit.group is not None:
                kwargs["mesh"] = unit.mesh
                if isinstance(unit.group.offload_policy, CPUOffloadPolicy):
                    # The EMA is not pinned: FSDP2 would pin a copy of it.
                    kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
                placements = {}
                for fp in unit.params:
                    info = fp._module_info
                    placeholder = clone.of[id(info.module)]._parameters[info.param_name]
                    placements[id(placeholder)] = fp.fsdp_placement
                if any(p != Shard(0) for p in placements.values()):
                    kwargs["shard_placement_fn"] = lambda p, pl=placements: pl.get(id(p))
            if ignored:
                kwargs["ignored_params"] = ignored
            fully_shard(modules if len(modules) > 1 else modules[0], **kwargs)
        from torch.distributed.fsdp import register_fsdp_forward_method

        for module, name in clone.forward_methods:
            register_fsdp_forward_method(module, name)
        return policies

    def _policy(self, unit: Unit, clone: Clone):
        """The teacher unit's MixedPrecisionPolicy: ``mp_policy``, else the student unit's; where
        that computes in the parameters' own dtype (no ``param_dtype``), one dtype, and the
        teacher's parameters (the EMA's) are of another, ``param_dtype`` is the student's and the
        inputs are not cast (the student casts none): the teacher computes as the student does."""
        policy = self.mp_policy or unit.mp_policy
        if self.mp_policy is not None or policy.param_dtype is not None or not unit.params:
            return policy
        student = {fp.sharded_param.dtype for fp in unit.params}
        teacher = {_placeholder(clone, fp).dtype for fp in unit.params}
        if len(student) == 1 and teacher != student:
            return dataclasses.replace(policy, param_dtype=student.pop(),
                                       cast_forward_inputs=False)
        return policy

    def _point(self, clone: Clone, managed, slot_index, links: Links) -> None:
        """Every sharded parameter of the teacher over the EMA's tensor (or the student's shard
        where the EMA does not keep it): FSDP2's padded buffer and the DTensor's local tensor."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad

        ema = self.ema
        for module in clone.root.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            for group in list(getattr(state, "_fsdp_param_groups", None) or
                              ([state._fsdp_param_group] if state._fsdp_param_group else [])):
                for fp in group.fsdp_params:
                    info = fp._module_info
                    student = clone.student[id(info.module)]
                    sfp = managed[(id(student), info.param_name)]
                    fqn = join_name(clone.names[id(student)], info.param_name)
                    if (fp.sharded_size != sfp.sharded_size
                            or fp.padded_sharded_param_size != sfp.padded_sharded_param_size
                            or fp.fsdp_placement != sfp.fsdp_placement):
                        raise RuntimeError(
                            f"ShardedEMA.module(): the teacher's {fqn!r} is sharded as "
                            f"{list(fp.sharded_size)} of {list(fp.padded_sharded_param_size)} "
                            f"({fp.fsdp_placement}) but the student's as "
                            f"{list(sfp.sharded_size)} of {list(sfp.padded_sharded_param_size)} "
                            f"({sfp.fsdp_placement})")
                    i = slot_index(sfp.sharded_param)
                    padded = fp.padded_sharded_param_size.numel()
                    if i is None:  # not kept (a frozen base weight): the student's own shard
                        local, data = sfp._sharded_local_tensor, sfp._sharded_param_data
                    else:
                        slot = ema.state.slots[i]
                        spec = fp._sharding_spec
                        if slot.mesh != spec.mesh or tuple(slot.placements) != tuple(
                                spec.placements):
                            raise RuntimeError(
                                f"ShardedEMA.module(): the EMA of {fqn!r} was made on mesh "
                                f"{slot.mesh} with placements {slot.placements}, the model is "
                                f"sharded on {spec.mesh} with {tuple(spec.placements)} now; make "
                                f"a new ShardedEMA for the new sharding")
                        local = ema.state.tensors[i]
                        if local.shape != fp.sharded_size:
                            raise RuntimeError(
                                f"ShardedEMA.module(): the EMA of {fqn!r} has a local shard of "
                                f"shape {list(local.shape)}, the teacher's is "
                                f"{list(fp.sharded_size)}")
                        data = _grow_to(local, padded, repr(fqn))
                    fp._sharded_param_data = data
                    param = nn.Parameter(_from_local_no_grad(local, fp._sharding_spec),
                                         requires_grad=False)
                    # nn.Parameter detached the DTensor (a new local tensor object over the same
                    # memory); the local tensor is the EMA's tensor itself, as FSDP2 sets it.
                    param._local_tensor = local
                    fp.sharded_param = param
                    fp._setattr_on_modules(param)
                    links.add(fqn, lambda fp=fp: fp.sharded_param, local)


def _check_own_units(model: nn.Module, managed) -> None:
    """Refuses a model (the EMA's) holding a parameter that an FSDP2 unit above it shards: the
    model is a submodule of a sharded model and not its own ``fully_shard`` unit, so the teacher
    would have no unit to gather that parameter (its forward would fail in DTensor's sharding
    propagation)."""
    for m, prefix in _named(model):
        if not m.__dict__.get("_is_fsdp_managed_module"):
            continue
        for name, p in m._parameters.items():
            if p is not None and is_dtensor(p) and (id(m), name) not in managed:
                raise ValueError(
                    f"ShardedEMA.module(): the model's parameter {join_name(prefix, name)!r} is "
                    f"sharded by an FSDP2 unit outside the model the EMA was made of (a "
                    f"{type(model).__name__} that is not its own fully_shard unit), so a teacher "
                    f"of it would have no unit to gather it; make the module its own unit "
                    f"(fully_shard(module) before fully_shard of its parent), or evaluate the "
                    f"EMA with ema.swap()")


def _placeholder(clone: Clone, fp) -> nn.Parameter:
    """The teacher's placeholder of the student's FSDPParam ``fp`` (in the EMA's dtype)."""
    info = fp._module_info
    return clone.of[id(info.module)]._parameters[info.param_name]


def _named(model: nn.Module) -> list[tuple[nn.Module, str]]:
    from ..model.slots import clean_modules

    return [(m, n) for n, m in clean_modules(model)]
