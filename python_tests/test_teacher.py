"""``ShardedEMA.module()``: the EMA as a teacher that runs (#36), on 2 gloo ranks: FSDP2 on a 1-D
mesh, HSDP and TP x FSDP on 2-D meshes, DDP and plain models; and ``CosineMomentum``.

References, independent of fsdp_ema: a float64 EMA of the student's gathered weights
(``full_tensor()`` after every step), loaded into an unsharded copy of the model; and DINOv3's
by-hand teacher (a deepcopy of the student before sharding, ``fully_shard``-ed alike, updated
with ``torch._foreach_mul_`` + ``torch._foreach_add_`` over the DTensor parameters, as
``dinov3/train/ssl_meta_arch.py``'s ``update_ema`` does).
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F
from dist_utils import PoolManager
from torch import nn

import fsdp_ema
from fsdp_ema import CosineMomentum, ShardedEMA

STEPS = 6
SCHEDULE = dict(base=0.8, final=1.0, total_steps=8)  # large moves: a stale teacher shows


class Backbone(nn.Module):
    """Uneven rows over 2 ranks everywhere (7, 9, 11 and 1 rows: rank 1 holds fewer, or none of
    ``gate``), a BatchNorm (buffers) and a second forward method, as DINOv3's
    ``get_intermediate_layers``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 7, 3, padding=1)
        self.proj = nn.Linear(7, 9)
        self.bn = nn.BatchNorm1d(9)
        self.head = nn.Linear(9, 11)
        self.gate = nn.Linear(9, 1)

    def _features(self, x):
        return self.bn(self.proj(self.conv(x).relu().mean((2, 3))))

    def features(self, x):  # registered with FSDP2 as a forward method: not called by forward
        return self._features(x)

    def forward(self, x):
        f = self._features(x)
        return self.head(F.gelu(f)) * torch.sigmoid(self.gate(f))


class TPNet(nn.Module):
    """For tensor parallelism: even columns (torch's TP infers wrong shapes for uneven ones)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 6)
        self.out = nn.Linear(6, 5)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x)))


def make(layout: str, **ema_options):
    """The student (sharded as ``layout`` says), an unsharded copy of its initial weights, its
    EMA and its teacher."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    torch.manual_seed(0)
    model = TPNet() if layout == "tp" else Backbone()
    plain = copy.deepcopy(model)
    world = dist.get_world_size()
    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model.conv, model.proj, model.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        register_fsdp_forward_method(model, "features")
    elif layout in ("hsdp", "hsdp_replicated"):  # a 2-D (replicate, shard) mesh
        # "hsdp": (1, world), every rank a shard; "hsdp_replicated": (world, 1), every rank a
        # replica of the whole model (the gradients all-reduced over the replicate dim).
        shape = (1, world) if layout == "hsdp" else (world, 1)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        fully_shard(model.proj, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":  # a 2-D (dp, tp) mesh: FSDP over TP-sharded (colwise, rowwise) layers
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"inp": ColwiseParallel(), "out": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout != "plain":
        raise ValueError(layout)
    ema = ShardedEMA(model, schedule=CosineMomentum(**SCHEDULE), **ema_options)
    return model, plain, ema


def inner(model):
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def batch(layout: str, rank: int, step: int) -> torch.Tensor:
    # Each rank its own data, but the ranks of a tensor-parallel group see the same inputs.
    g = torch.Generator().manual_seed(1000 * (0 if layout == "tp" else rank) + step)
    return torch.randn(8, 7, generator=g) if layout == "tp" else torch.randn(8, 3, 6, 6,
                                                                            generator=g)


def ema_index(ema: ShardedEMA) -> dict[str, int]:
    return {fqn: i for i, slot in enumerate(ema.state.slots) for fqn, _ in slot.names()}


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


# --- the teacher against a float64 EMA of the gathered weights ------------------------------------

def run_matches_reference(rank, world, layout):
    """Trains the student; after every step, the teacher's forward against an unsharded copy
    holding a float64 EMA of the gathered weights (rounded to float32)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*sequential all_gather.*")
    model, plain, ema = make(layout)
    teacher = ema.module()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ref = {n: full(p).double() for n, p in inner(model).named_parameters()}
    ref_buf = {n: full(b).double() if b.is_floating_point() else full(b)
               for n, b in inner(model).named_buffers()}
    probe = batch(layout, rank, 999)
    out, weight_err, stale = [], [], []
    for step in range(STEPS):
        loss = model(batch(layout, rank, step)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            before = teacher(probe).clone()
        ema.update()
        d = ema.decay_at(step)
        for n, p in inner(model).named_parameters():
            ref[n] = ref[n] + (1 - d) * (full(p).double() - ref[n])
        for n, b in inner(model).named_buffers():
            ref_buf[n] = (ref_buf[n] + (1 - d) * (full(b).double() - ref_buf[n])
                          if b.is_floating_point() else full(b))
        with torch.no_grad():
            for n, p in plain.named_parameters():
                p.copy_(ref[n])
            for n, b in plain.named_buffers():
                b.copy_(ref_buf[n])
            plain.eval()
            got, want = teacher(probe), plain(probe)
        out.append((got - want).abs().max().item())
        stale.append((got - before).abs().max().item())  # the update reached the forward
        teacher_full = {n: full(p).double() for n, p in teacher.named_parameters()}
        weight_err.append(max((teacher_full[n] - ref[n]).abs().max().item() for n in ref))
    index = ema_index(ema)
    shares, same_object = [], []
    for n, p in teacher.named_parameters():
        e = ema.state.tensors[index[n]]
        shares.append(local(p).untyped_storage().data_ptr() == e.untyped_storage().data_ptr()
                      and local(p).data_ptr() == e.data_ptr())
        same_object.append(local(p) is e)
    for n, b in teacher.named_buffers():
        e = ema.state.tensors[index[n]]
        shares.append(b.untyped_storage().data_ptr() == e.untyped_storage().data_ptr())
    features = None
    if layout == "fsdp2":  # the registered forward method gathers the EMA too
        with torch.no_grad():
            features = (teacher.features(probe) - plain.features(probe)).abs().max().item()
    return dict(out=out, weights=weight_err, stale=stale, shares=shares, same_object=same_object,
                requires_grad=[p.requires_grad for p in teacher.parameters()],
                training=teacher.training, features=features, kind=type(teacher).__name__,
                placements=[str(getattr(p, "placements", "")) for p in teacher.parameters()],
                cached=ema.module() is teacher, teacher_full=teacher_full,
                whole=[local(p).shape == p.shape for p in teacher.parameters()])


@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


@pytest.mark.parametrize("layout", ["fsdp2", "hsdp", "hsdp_replicated", "tp", "plain", "ddp"])
def test_teacher_forward_equals_an_unsharded_copy_holding_a_float64_ema(pools, layout):
    results = pools.get(2).run(run_matches_reference, layout)
    for res in results:
        # fp32 rounding: the EMA's float32 lerp against the float64 reference, rounded once.
        assert max(res["out"]) < 5e-7, res["out"]
        assert max(res["weights"]) < 2e-7, res["weights"]
        assert min(res["stale"]) > 1e-3, res["stale"]   # every update() moved the forward
        assert all(res["shares"]) and res["shares"], layout
        assert not any(res["requires_grad"]) and res["training"] is False
        assert res["cached"]
        if layout in ("fsdp2", "hsdp", "hsdp_replicated", "tp"):
            assert all(res["same_object"]), layout  # the DTensors' local tensors are the EMA's
            assert res["kind"].startswith("FSDP")
        else:
            assert res["kind"] in ("Backbone", "TPNet")
        if layout == "fsdp2":
            assert res["features"] < 5e-7
        if layout in ("hsdp", "hsdp_replicated"):
            assert "Replicate(), Shard(dim=0)" in res["placements"][0]
        if layout == "hsdp_replicated":  # a shard group of one: each rank holds whole tensors
            assert all(res["whole"]), res["whole"]
        if layout == "hsdp":  # each rank its rows
            assert not any(res["whole"][:8]), res["whole"]
    if layout == "hsdp_replicated":
        # The replicas saw different data; their gradients were all-reduced over the replicate
        # dim, so both ranks' students, EMAs and teachers are the same, bit for bit.
        a, b = (r["teacher_full"] for r in results)
        assert all(torch.equal(a[n], b[n]) for n in a) and len(a) == 10
        if layout == "tp":
            assert "_StridedShard" in res["placements"][0]


# --- storage and memory ---------------------------------------------------------------------------

class EvenNet(nn.Module):
    """Every row count even: FSDP2 pads nothing at 2 ranks."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.bn(self.a(x)))


def allocations_during(fn) -> tuple[list[int], object]:
    """The CPU allocations (bytes, in order) ``fn()`` makes, seen by torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        value = fn()
    sizes = [e.cpu_memory_usage for e in prof.events()
             if e.name == "[memory]" and e.cpu_memory_usage > 0]
    return sizes, value


def run_memory(rank, world):
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    warnings.filterwarnings("ignore")
    out = {}
    for name, cls in (("even", EvenNet), ("uneven", Backbone)):
        torch.manual_seed(0)
        model = cls()
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        mesh = init_device_mesh("cpu", (world,))
        for m in model.children():
            if isinstance(m, nn.Linear | nn.Conv2d):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ema = ShardedEMA(model, decay=0.9)
        storages_before = sum(t.untyped_storage().nbytes() for t in ema.state.tensors)
        sd = ema.state_dict()  # taken before: its DTensors stay views of the (grown) EMA
        sizes, teacher = allocations_during(ema.module)
        index = ema_index(ema)
        sd_valid = all(local(v).data_ptr() == ema.state.tensors[index[n]].data_ptr()
                       and torch.equal(local(v), ema.state.tensors[index[n]])
                       for n, v in sd.items() if n in index)
        # What the teacher holds: the storages of its tensors, each counted once.
        held = {}
        for t in [*teacher.parameters(), *teacher.buffers()]:
            s = local(t).untyped_storage()
            held[s.data_ptr()] = s.nbytes()
        ema_storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in ema.state.tensors}
        # FSDP2's padding of this rank's shards: the rows rank 0 holds, less this rank's.
        padding = 0
        for m in teacher.modules():
            if isinstance(m, FSDPModule):
                for g in m._get_fsdp_state()._fsdp_param_groups:
                    for fp in g.fsdp_params:
                        padding += (fp.padded_sharded_param_size.numel()
                                    - fp.sharded_size.numel()) * 4
        padded_shards = [fp.padded_sharded_param_size.numel() * 4
                         for m in teacher.modules() if isinstance(m, FSDPModule)
                         for g in m._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params
                         if fp.padded_sharded_param_size != fp.sharded_size]
        out[name] = dict(sizes=sizes, full_bytes=full_bytes, ema_nbytes=ema.nbytes,
                         held=held, ema_storages=ema_storages, padding=padding,
                         grown=sum(ema_storages.values()) - storages_before,
                         padded_shards=padded_shards, sd_valid=sd_valid)
    return out


def test_teacher_storage_is_the_ema_and_building_it_allocates_no_model(pools):
    for rank, res in enumerate(pools.get(2).run(run_memory)):
        even, uneven = res["even"], res["uneven"]
        for r in (even, uneven):
            # Every storage the teacher's parameters and buffers use is one of the EMA's.
            assert set(r["held"]) == set(r["ema_storages"]), rank
            assert sum(r["held"].values()) == r["ema_nbytes"] + r["padding"], rank
            assert r["grown"] == r["padding"] and r["sd_valid"], rank
        # Even rows: building the teacher allocates nothing (meta clone, meta fully_shard,
        # pointers set); the teacher holds no byte beyond the EMA.
        assert even["sizes"] == [] and even["padding"] == 0, (rank, even["sizes"])
        # Uneven rows: the only allocations are the EMA's storages grown in place to FSDP2's
        # padded shard size (one shard at a time), never a full tensor, let alone the model.
        assert sorted(uneven["sizes"]) == sorted(uneven["padded_shards"]), (rank, uneven)
        assert sum(uneven["sizes"]) < uneven["full_bytes"] / 1.5, rank
        if rank == 1:
            assert uneven["padding"] > 0


# --- DINO: against DINOv3's by-hand teacher, and resumed mid-run ---------------------------------

CENTER_MOMENTUM, T_STUDENT, T_TEACHER = 0.9, 0.1, 0.04


def crops(rank: int, step: int) -> list[torch.Tensor]:
    """Multi-crop from random tensors: 2 global crops (6x6) and 2 local ones (3x3)."""
    g = torch.Generator().manual_seed(7919 * rank + step)
    image = torch.randn(4, 3, 8, 8, generator=g)
    out = []
    for size in (6, 6, 3, 3):
        i, j = (int(v) for v in torch.randint(0, 8 - size + 1, (2,), generator=g))
        out.append(image[:, :, i:i + size, j:j + size] + 0.1 * torch.randn(
            4, 3, size, size, generator=g))
    return out


def dino_loss(student_out, teacher_out, center):
    teacher_p = [F.softmax((t - center) / T_TEACHER, dim=-1) for t in teacher_out]
    terms = [-(tp * F.log_softmax(s / T_STUDENT, dim=-1)).sum(-1).mean()
             for iq, tp in enumerate(teacher_p) for v, s in enumerate(student_out) if v != iq]
    return sum(terms) / len(terms)


def new_center(center, teacher_out):
    import torch.distributed as dist

    mean = torch.cat(teacher_out).mean(0, keepdim=True)
    dist.all_reduce(mean)
    return center * CENTER_MOMENTUM + mean / dist.get_world_size() * (1 - CENTER_MOMENTUM)


def dino_student():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Backbone()
    unsharded = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))

    def shard(m):
        for layer in (m.conv, m.proj, m.head):
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(m, mesh=mesh, reshard_after_forward=True)
        return m

    return shard(model), unsharded, shard


def dino_step(student, teacher, opt, center, rank, step):
    views = crops(rank, step)
    with torch.no_grad():
        teacher_out = [teacher(v) for v in views[:2]]
    loss = dino_loss([student(v) for v in views], teacher_out, center)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach(), new_center(center, teacher_out)


def run_dino_against_dinov3(rank, world):
    schedule = CosineMomentum(0.996, 1.0, total_steps=STEPS)
    # Ours: the EMA is the teacher.
    student, _, _ = dino_student()
    ema = ShardedEMA(student, schedule=schedule, include_buffers=False)
    teacher = ema.module()
    # SGD: a perturbation of the teacher moves the students apart linearly (Adam's normalized
    # steps would amplify rounding differences into unrelated trajectories).
    opt = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9)
    center = torch.zeros(1, 11)
    ours = []
    for step in range(STEPS):
        loss, center = dino_step(student, teacher, opt, center, rank, step)
        ema.update()
        ours.append(loss.item())
    ours_teacher = {n: full(p) for n, p in teacher.named_parameters()}
    # DINOv3's: a second model built before sharding, sharded alike, updated by two _foreach
    # passes over the DTensor parameters with the momentum as a Python float.
    student2, unsharded, shard = dino_student()
    teacher2 = shard(unsharded)
    teacher2.requires_grad_(False)
    teacher2.eval()
    opt2 = torch.optim.SGD(student2.parameters(), lr=0.05, momentum=0.9)
    s_params, t_params = list(student2.parameters()), list(teacher2.parameters())
    center2 = torch.zeros(1, 11)
    theirs = []
    for step in range(STEPS):
        loss, center2 = dino_step(student2, teacher2, opt2, center2, rank, step)
        m = dinov3_cosine(0.996, 1.0, STEPS, step)  # momentum_schedule[it]
        with torch.no_grad():
            torch._foreach_mul_(t_params, m)
            torch._foreach_add_(t_params, s_params, alpha=1 - m)
        theirs.append(loss.item())
    theirs_teacher = {n: full(p) for n, p in teacher2.named_parameters()}
    # One update from the same teacher and student shards, each against float64: ours rounds
    # once (the weight 1 - m formed in double), theirs rounds m and 1 - m to float32 and the
    # two passes' results.
    m = dinov3_cosine(0.996, 1.0, 100, 10)
    t_local = [local(p).clone() for p in teacher2.parameters()]
    s_local = [local(p).detach() for p in student2.parameters()]
    exact = [t.double() * m + s.double() * (1 - m) for t, s in zip(t_local, s_local)]
    a, b = [t.clone() for t in t_local], [t.clone() for t in t_local]
    fsdp_ema.update_(a, s_local, m)
    torch._foreach_mul_(b, m)
    torch._foreach_add_(b, s_local, alpha=1 - m)
    one_update = [max(((x.double() - e).abs() / e.abs().clamp_min(1e-30)).max().item()
                      for x, e in zip(got, exact) if e.numel()) for got in (a, b)]
    # The independent reference for ours: torch.lerp with the weight 1 - m formed in double.
    lerp_equal = all(torch.equal(x, torch.lerp(t, s, 1.0 - m))
                     for x, t, s in zip(a, t_local, s_local))
    return dict(ours=ours, theirs=theirs, ours_teacher=ours_teacher,
                theirs_teacher=theirs_teacher, one_update=one_update, lerp_equal=lerp_equal)


def test_dino_loop_matches_dinov3_by_hand_teacher_to_their_rounding(pools):
    res = pools.get(2).run(run_dino_against_dinov3)[0]
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(res["ours"], res["theirs"]))
    weight_diff = max((res["ours_teacher"][n] - res["theirs_teacher"][n]).abs().max().item()
                      for n in res["ours_teacher"])
    ours_err, theirs_err = res["one_update"]
    print(f"DINO vs DINOv3's teacher over {STEPS} steps: max relative loss difference "
          f"{loss_diff:.3g}, max teacher weight difference {weight_diff:.3g}; one update against "
          f"float64, max relative error: ours {ours_err:.3g}, theirs {theirs_err:.3g}")
    assert res["ours"][0] == res["theirs"][0]  # the same teacher before the first update
    assert loss_diff < 1e-5 and weight_diff < 1e-5, (loss_diff, weight_diff)
    # Ours is torch.lerp's float32 lerp bit for bit (the weight formed in double): it rounds the
    # difference and the fused multiply-add, within two ulps of float64 (2.4e-7; 1.0e-7 on an
    # AVX2 machine, 1.6e-7 on an AVX-512 one). Theirs rounds m and 1 - m to float32, then each of
    # its two passes: more than ours.
    assert res["lerp_equal"]
    assert ours_err < 2.4e-7 and ours_err <= theirs_err, res["one_update"]


def run_resume(rank, world, directory):
    def run(start, stop, resume):
        student, _, _ = dino_student()
        ema = ShardedEMA(student, schedule=CosineMomentum(0.9, 1.0, total_steps=STEPS))
        teacher = ema.module()  # made before the load: the load writes into what it runs on
        opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
        center = torch.zeros(1, 11)
        if resume:
            extra = fsdp_ema.load_training_state(directory, model=student, optimizer=opt,
                                                 ema=ema)
            center = extra["center"]
        losses = []
        for step in range(start, stop):
            # The same crops on both ranks: BatchNorm statistics, which FSDP2 does not
            # synchronize, then agree across the ranks, as a checkpoint of a replicated buffer
            # needs (each rank writes its rows of it).
            loss, center = dino_step(student, teacher, opt, center, 0, step)
            ema.update()
            losses.append(loss)
        if not resume and stop < STEPS:
            fsdp_ema.save_training_state(directory, model=student, optimizer=opt, ema=ema,
                                         extra={"center": center})
        return losses, {n: full(p) for n, p in teacher.named_parameters()}, int(ema.step)

    straight = run(0, STEPS, False)
    run(0, STEPS // 2, False)
    resumed = run(STEPS // 2, STEPS, True)
    return dict(straight=straight, resumed=resumed)


def test_resumed_mid_run_the_teacher_is_bit_for_bit_the_straight_runs(pools, tmp_path):
    for res in pools.get(2).run(run_resume, str(tmp_path / "state")):
        (s_losses, s_teacher, s_step), (r_losses, r_teacher, r_step) = (res["straight"],
                                                                        res["resumed"])
        assert s_step == r_step == STEPS
        assert [x.item() for x in s_losses[STEPS // 2:]] == [x.item() for x in r_losses]
        for n, t in s_teacher.items():
            assert torch.equal(t, r_teacher[n]), n


# --- gradients, reshard_after_forward, compile, LoRA, tied weights ------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.head = nn.Linear(4, 9, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


class LoRALinear(nn.Module):
    """A frozen base weight plus trainable low-rank factors (what peft's LoRA layer holds)."""

    def __init__(self, n_in, n_out, r=2):
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(r, n_in) * 0.1)
        self.lora_b = nn.Parameter(torch.zeros(n_out, r))

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


def run_gradients_reshard_compile_lora(rank, world):
    import warnings

    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    out = {}
    # Gradients: a teacher forward inside the student's graph, its input needing a gradient.
    model, _, ema = make("fsdp2")
    teacher = ema.module()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    before = [t.clone() for t in ema.state.tensors]
    x = batch("fsdp2", rank, 0).requires_grad_(True)
    loss = model(x).square().mean() + teacher(x).square().mean()
    loss.backward()
    opt.step()
    out["input_grad"] = x.grad is not None and x.grad.abs().sum().item() > 0
    out["teacher_grads"] = [p.grad for p in teacher.parameters()]
    out["ema_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, ema.state.tensors))
    out["ema_grads"] = [t.grad for t in ema.state.tensors]
    # reshard_after_forward=False keeps the gathered parameters between forwards: an update (or
    # a load) between two forwards must still reach the second.
    model, _, ema = make("fsdp2")
    kept = ema.module(reshard_after_forward=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    probe = batch("fsdp2", rank, 99)
    diffs = []
    for step in range(3):
        model(batch("fsdp2", rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            kept(probe)
        ema.update()
        with torch.no_grad():
            got = kept(probe)
            with ema.swap():
                model.eval()
                want = model(probe)
                model.train()
        diffs.append((got - want).abs().max().item())
    out["reshard_false"] = diffs
    out["distinct"] = ema.module() is not kept
    # torch.compile: the student's blocks compiled with nn.Module.compile, the teacher's alike;
    # the compiled teacher follows every update without recompiling.
    torch.manual_seed(0)
    net = nn.Sequential(Block(), Block(), nn.Linear(5, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in net:
        if isinstance(layer, Block):
            layer.compile(backend="aot_eager")  # as DINOv3 compiles its blocks
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    ema = ShardedEMA(net, decay=0.5)
    compiled = ema.module()  # with the student's torch.compile settings: aot_eager
    eager = ema.module(compile=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    probe = torch.randn(4, 5)
    compile_diffs, graphs = [], []
    for _ in range(3):
        net(torch.randn(4, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        with torch.no_grad():
            compile_diffs.append((compiled(probe) - eager(probe)).abs().max().item())
        graphs.append(counters["stats"]["unique_graphs"])
    out["compiled"] = [compiled[0]._compiled_call_impl is not None,
                       eager[0]._compiled_call_impl is None]
    out["compile_diffs"], out["graphs"] = compile_diffs, graphs
    # LoRA (params="trainable"): the teacher's frozen base weights are the student's own shards,
    # the adapters the EMA's; the EMA holds the adapters only.
    torch.manual_seed(0)
    lora = nn.Sequential(LoRALinear(6, 5), nn.ReLU(), LoRALinear(5, 3))
    for layer in (lora[0], lora[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(lora, mesh=mesh)
    ema = ShardedEMA(lora, decay=0.5, params="trainable")
    teacher = ema.module()
    opt = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.5)
    probe = torch.randn(4, 6)
    lora_diffs = []
    for _ in range(2):
        lora(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        with torch.no_grad(), ema.swap():
            want = lora(probe)
        with torch.no_grad():
            lora_diffs.append((teacher(probe) - want).abs().max().item())
    student_params = dict(lora.named_parameters())
    index = ema_index(ema)
    shared = {}
    for n, p in teacher.named_parameters():
        if n in index:
            shared[n] = local(p) is ema.state.tensors[index[n]]
        else:
            shared[n] = (local(p).untyped_storage().data_ptr()
                         == local(student_params[n]).untyped_storage().data_ptr())
    adapters = sum(local(p).numel() * 4 for n, p in lora.named_parameters() if "lora" in n)
    out["lora"] = dict(diffs=lora_diffs, shared=shared, nbytes=ema.nbytes, adapters=adapters)
    # Tied weights (an embedding and its output layer): one EMA tensor, one teacher parameter in
    # both modules.
    torch.manual_seed(0)
    tied = Tied()
    fully_shard([tied.emb, tied.head], mesh=mesh)  # one unit over both (a list of modules)
    fully_shard(tied, mesh=mesh)
    ema = ShardedEMA(tied, decay=0.5)
    teacher = ema.module()
    opt = torch.optim.SGD(tied.parameters(), lr=0.5)
    ids = torch.tensor([[1, 4, 8], [0, 2, 3]])
    tied(ids).square().mean().backward()
    opt.step()
    ema.update()
    with torch.no_grad(), ema.swap():
        want = tied(ids)
    with torch.no_grad():
        got = teacher(ids)
    out["tied"] = dict(diff=(got - want).abs().max().item(), names=sorted(ema.shapes),
                       same=teacher.head.weight is teacher.emb.weight)
    return out


def test_gradients_never_reach_the_teacher_and_reshard_compile_lora_follow_the_ema(pools):
    for res in pools.get(2).run(run_gradients_reshard_compile_lora):
        assert res["input_grad"]  # the gradient flowed through the teacher to its input
        assert all(g is None for g in res["teacher_grads"])
        assert all(g is None for g in res["ema_grads"]) and res["ema_unchanged"]
        assert max(res["reshard_false"]) < 1e-6 and res["distinct"], res["reshard_false"]
        assert all(res["compiled"])
        assert max(res["compile_diffs"]) < 1e-6, res["compile_diffs"]
        assert res["graphs"][0] == res["graphs"][-1] > 0, res["graphs"]  # no recompiles
        lora = res["lora"]
        assert max(lora["diffs"]) == 0.0, lora["diffs"]
        assert all(lora["shared"].values()) and len(lora["shared"]) == 8, lora["shared"]
        assert lora["nbytes"] == lora["adapters"]
        tied = res["tied"]
        assert tied["diff"] == 0.0 and tied["same"] and tied["names"] == ["emb.weight"], tied


# --- bad inputs ----------------------------------------------------------------------------------

def run_bad_inputs(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel

    errors = {}

    def error(name, fn):
        try:
            fn()
        except (ValueError, RuntimeError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
        else:
            errors[name] = None

    from fsdp_ema.ema.offload import forced_for_cpu_models

    with forced_for_cpu_models():  # the host-memory path for a CPU model
        model, _, ema = make("fsdp2", device="cpu")
    error("host", ema.module)
    model, _, ema = make("fsdp2")
    error("mesh", lambda: ema.module(mesh=init_device_mesh("cpu", (1, world),
                                                           mesh_dim_names=("a", "b"))))
    error("reshard", lambda: ema.module(reshard_after_forward="yes"))
    error("compile", lambda: ema.module(compile="inductor"))
    with ema.swap():
        error("swap", ema.module)
    inner(model).extra = nn.Parameter(torch.ones(3))
    error("added", ema.module)
    model, _, ema = make("plain")
    model.head.weight = nn.Parameter(torch.zeros(11, 9))  # a new tensor, same shape: followed
    error("replaced", ema.module)
    model.head.weight = nn.Parameter(torch.zeros(12, 9))
    error("reshaped", ema.module)
    model, _, ema = make("plain")
    model.head = nn.Linear(9, 11)  # a new module: the EMA's tensors are no longer the model's
    error("new module", ema.module)
    fsdp1 = FullyShardedDataParallel(nn.Linear(4, 3), device_id=torch.device("cpu"))
    error("fsdp1", ShardedEMA(fsdp1, decay=0.9).module)
    return errors


def test_bad_inputs_are_refused_naming_the_argument(pools):
    for e in pools.get(2).run(run_bad_inputs):
        assert "device='cpu'" in e["host"] and "host memory" in e["host"], e["host"]
        assert e["mesh"].startswith("ValueError: ShardedEMA.module(mesh=") and (
            "student's mesh" in e["mesh"]), e["mesh"]
        assert "reshard_after_forward" in e["reshard"] and "compile" in e["compile"]
        assert "inside swap()" in e["swap"]
        assert "'extra'" in e["added"] and "changed since the EMA was made" in e["added"]
        assert e["replaced"] is None
        assert "head.weight" in e["reshaped"] and "changed" in e["reshaped"], e["reshaped"]
        assert "'head.weight'" in e["new module"] and "changed" in e["new module"]
        assert "FSDP1" in e["fsdp1"] and "fully_shard" in e["fsdp1"], e["fsdp1"]


# --- mixed precision, buffers, a student resharded since the EMA ---------------------------------

def run_mixed_precision(rank, world):
    """A bf16 student (FSDP2 MixedPrecisionPolicy): the default teacher computes as the student
    does; ``mp_policy=`` replaces the policy of every teacher unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy()
    torch.manual_seed(0)
    model = TPNet()  # 6 and 5 rows: uneven over 2 ranks; no BatchNorm to meet bf16 inputs
    plain = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.inp, mesh=mesh, mp_policy=bf16)
    fully_shard(model, mesh=mesh, mp_policy=bf16)
    ema = ShardedEMA(model, decay=0.5)
    inherited, explicit = ema.module(), ema.module(mp_policy=fp32)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(8, 7, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    probe = torch.randn(8, 7, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        got, got32, own = inherited(probe), explicit(probe), model(probe)
        with ema.swap():
            want = model(probe)  # the student, bf16 policy, holding the EMA
        state = ema.state_dict()
        plain.load_state_dict({n: full(state[n]) for n in ema.shapes})
        want32 = plain(probe)  # the EMA's weights, unsharded, in fp32

    def policies(m):
        return [u._get_fsdp_state()._mp_policy for u in m.modules() if isinstance(u, FSDPModule)]

    return dict(student=policies(model), inherited=policies(inherited),
                explicit=policies(explicit), bf16=bf16, fp32=fp32,
                dtypes=(got.dtype, want.dtype, got32.dtype), swap_diff=(got - want).abs().max(),
                moved=(got - own).abs().max(), diff32=(got32 - want32).abs().max(),
                rounding=(got.float() - got32).abs().max(), cached=ema.module() is inherited,
                distinct=explicit is not inherited)


def test_teacher_takes_the_students_mixed_precision_policy_or_the_one_given(pools):
    for res in pools.get(2).run(run_mixed_precision):
        # Every teacher unit (inp and the root) has the student's policy, or the one given.
        assert res["student"] == res["inherited"] == [res["bf16"]] * 2, res["inherited"]
        assert res["explicit"] == [res["fp32"]] * 2, res["explicit"]
        # Inherited: it computes in bf16 (gloo all-gathers the bf16 shards), exactly as the
        # student does with the EMA swapped in; the EMA differs from the student's weights.
        assert res["dtypes"] == (torch.bfloat16, torch.bfloat16, torch.float32), res["dtypes"]
        assert res["swap_diff"].item() == 0.0 and res["moved"].item() > 1e-2, res
        # mp_policy=MixedPrecisionPolicy(): fp32, the unsharded EMA's forward to fp32 rounding;
        # the bf16 teacher is that to bf16's (2^-8 relative) and not closer.
        assert res["diff32"].item() < 1e-6, res["diff32"]
        assert 0.0 < res["rounding"].item() < 0.05, res["rounding"]
        assert res["cached"] and res["distinct"]


def buffers_of(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in m.named_buffers()}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def train_step(model, opt, layout, rank, step) -> None:
    model(batch(layout, rank, step)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def run_own_buffers(rank, world, layout):
    """``include_buffers=False``: the teacher's buffers are its own; a train()-mode forward of
    the teacher (MoCo's BatchNorm) updates them and nothing else."""
    model, _, ema = make(layout, include_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    train_step(model, opt, layout, rank, 0)  # the student's statistics move from their init
    ema.update()
    teacher = ema.module()
    student = inner(model)
    at_build, s0 = buffers_of(teacher), buffers_of(student)
    e0 = [t.clone() for t in ema.state.tensors]
    ema_storages = {t.untyped_storage().data_ptr() for t in ema.state.tensors}
    student_storages = {b.untyped_storage().data_ptr() for b in student.buffers()}
    own = [b.untyped_storage().data_ptr() not in ema_storages | student_storages
           for b in teacher.buffers()]
    teacher.train()
    with torch.no_grad():
        teacher(batch(layout, rank, 50))
    teacher.eval()
    after = buffers_of(teacher)
    untouched = equal(buffers_of(student), s0) and all(
        torch.equal(a, b) for a, b in zip(ema.state.tensors, e0))
    train_step(model, opt, layout, rank, 1)
    ema.update()  # averages the parameters only: the teacher's buffers stay its own
    return dict(own=own, copied=equal(at_build, s0), after=after, at_build=at_build,
                untouched=untouched, kept=equal(buffers_of(teacher), after),
                slots=[slot.buffer for slot in ema.state.slots], n_params=len(list(
                    student.parameters())), ema_moved=not all(
                    torch.equal(a, b) for a, b in zip(ema.state.tensors, e0)))


def run_ema_buffers(rank, world, layout, mode):
    """``include_buffers=True``: the teacher's buffers are the EMA's, averaged or copied from the
    student's at each update(); a train()-mode teacher forward writes them until the next one."""
    model, _, ema = make(layout, buffers=mode)
    teacher = ema.module()
    student = inner(model)
    index = ema_index(ema)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    prev = buffers_of(teacher)
    train_step(model, opt, layout, rank, 0)
    ema.update()
    d = ema.last_decay.item()
    s, t = buffers_of(student), buffers_of(teacher)
    shared = all(b.data_ptr() == ema.state.tensors[index[n]].data_ptr()
                 for n, b in teacher.named_buffers())
    lerp = max((t[n] - (d * prev[n] + (1 - d) * s[n])).abs().max().item()
               for n in s if s[n].is_floating_point())
    teacher.train()
    with torch.no_grad():
        teacher(batch(layout, rank, 50))
    teacher.eval()
    written = buffers_of(teacher)
    ema_written = not torch.equal(ema.state.tensors[index["bn.running_mean"]], t["bn.running_mean"])
    ema.update()  # no student step between: "copy" writes over it, "average" averages it in
    return dict(decay=d, student=s, teacher=t, shared=shared, lerp=lerp, written=written,
                ema_written=ema_written, again=buffers_of(teacher),
                decay2=ema.last_decay.item())


def run_buffers(rank, world):
    out = {}
    for layout in ("fsdp2", "plain"):
        out[layout] = dict(own=run_own_buffers(rank, world, layout),
                           copy=run_ema_buffers(rank, world, layout, "copy"),
                           average=run_ema_buffers(rank, world, layout, "average"))
    return out


def test_teacher_buffers_follow_include_buffers_and_the_buffers_option(pools):
    for res in pools.get(2).run(run_buffers):
        for layout, r in res.items():
            own, copied, averaged = r["own"], r["copy"], r["average"]
            # include_buffers=False: the EMA keeps parameters only; the teacher's buffers are
            # copies of the student's when module() built it, in storage of neither.
            assert not any(own["slots"]) and len(own["slots"]) == own["n_params"], layout
            assert all(own["own"]) and len(own["own"]) == 3 and own["copied"], layout
            # Its train()-mode forward moved its statistics (MoCo) and touched neither the
            # student's buffers nor the EMA; the next update() left them as they were.
            after, built = own["after"], own["at_build"]
            assert not torch.equal(after["bn.running_mean"], built["bn.running_mean"])
            assert not torch.equal(after["bn.running_var"], built["bn.running_var"])
            assert after["bn.num_batches_tracked"].item() == 2, after  # 1 from the student
            assert own["untouched"] and own["kept"] and own["ema_moved"], layout
            for mode, m in (("copy", copied), ("average", averaged)):
                assert m["shared"], (layout, mode)  # the teacher's buffers are the EMA's
                s, t = m["student"], m["teacher"]
                assert torch.equal(t["bn.num_batches_tracked"], s["bn.num_batches_tracked"])
                # The forward wrote the EMA's buffers; update() wrote over it from the student.
                assert m["ema_written"] and not torch.equal(m["written"]["bn.running_mean"],
                                                             s["bn.running_mean"]), mode
            # "copy": the student's, bit for bit, at every update.
            assert equal(copied["teacher"], copied["student"]), layout
            assert equal(copied["again"], copied["student"]), layout
            # "average": the EMA of the student's floating buffers (decay 0.8 here).
            assert averaged["decay"] == pytest.approx(0.8) and averaged["lerp"] < 1e-6, averaged
            assert not torch.equal(averaged["teacher"]["bn.running_mean"],
                                   averaged["student"]["bn.running_mean"])
            d = averaged["decay2"]  # the second update's
            want = {n: d * t + (1 - d) * averaged["student"][n]
                    for n, t in averaged["written"].items() if t.is_floating_point()}
            assert all((averaged["again"][n] - w).abs().max().item() < 1e-6
                       for n, w in want.items()), layout


def run_resharded(rank, world):
    """The EMA of a tensor-parallel student (1-D "tp" mesh), which is then sharded with FSDP2
    over the 2-D (dp, tp) mesh: same local shapes, another mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = TPNet()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"inp": ColwiseParallel(), "out": RowwiseParallel()})
    ema = ShardedEMA(model, decay=0.5)
    fully_shard(model, mesh=mesh["dp"])
    try:
        ema.module()
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_a_student_resharded_onto_another_mesh_since_the_ema_is_refused(pools):
    for e in pools.get(2).run(run_resharded):
        assert e is not None and e.startswith("RuntimeError: ShardedEMA.module(): the EMA of "
                                              "'inp.weight' was made on mesh "), e
        assert "the model is sharded on" in e and "make a new ShardedEMA for the new sharding" in e


def run_submodule_not_a_unit(rank, world):
    """The EMA of a submodule of an FSDP2 model: one that is not its own ``fully_shard`` unit
    (its parameters are its parent's unit's) is refused when the teacher is made; one that is
    its own unit runs as the EMA."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(seq[0], mesh=mesh)
    fully_shard(seq, mesh=mesh)
    try:
        ShardedEMA(seq[2], decay=0.5).module()
        refused = None
    except ValueError as e:
        refused = str(e)
    own = ShardedEMA(seq[0], decay=0.5)
    x = torch.randn(2, 4)
    with torch.no_grad():
        sd = own.state_dict()
        want = F.linear(x, full(sd["weight"]), full(sd["bias"]))
        got = own.module()(x)
    return dict(refused=refused, diff=(got - want).abs().max().item())


def test_the_teacher_of_a_submodule_that_is_not_its_own_fsdp2_unit_is_refused(pools):
    for res in pools.get(2).run(run_submodule_not_a_unit):
        e = res["refused"]
        assert e is not None and "'weight'" in e and "not its own fully_shard unit" in e, e
        assert "fully_shard(module)" in e and "ema.swap()" in e, e
        assert res["diff"] < 1e-6, res["diff"]  # a submodule that is its own unit: its EMA


def raised(fn) -> str | None:
    """``fn()``'s error as ``"Type: message"``, or None."""
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def run_ema_dtypes(rank, world):
    """An EMA in another dtype than the student's weights (float64 or bfloat16 of a float32
    student, float32 of a bfloat16 student without a policy): an FSDP2 teacher computes as the
    student does, bit for bit the student holding the EMA; where the teacher cannot (a plain
    model's, an ``mp_policy`` without ``param_dtype``), an input of the student's dtype is refused
    naming both dtypes and the fix."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    x32 = torch.randn(4, 4, generator=torch.Generator().manual_seed(5))

    def student(dtype, fsdp2=True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).to(dtype)  # uneven
        if fsdp2:
            fully_shard(model[0], mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model

    out = {}
    for name, ema_dtype, dtype in (("float64 EMA", torch.float64, torch.float32),
                                   ("bfloat16 EMA", torch.bfloat16, torch.float32),
                                   ("bfloat16 student", torch.float32, torch.bfloat16)):
        model = student(dtype)
        ema = ShardedEMA(model, decay=0.5, dtype=ema_dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3)
        ema.update()  # the EMA, between the two, differs from the student
        x = x32.to(dtype)
        with torch.no_grad():
            got = ema.module()(x)
            with ema.swap():
                want = model(x)  # the student holding the EMA, cast to its dtype
            own = model(x)
        out[name] = dict(dtype=got.dtype, equal=torch.equal(got, want),
                         moved=(got.float() - own.float()).abs().max().item())
    model = student(torch.float32)
    ema = ShardedEMA(model, decay=0.5, dtype=torch.float64)
    explicit = ema.module(mp_policy=MixedPrecisionPolicy())
    with torch.no_grad():
        out["policy refused"] = raised(lambda: explicit(x32))
        out["policy float64"] = explicit(x32.double()).dtype
    plain = student(torch.float32, fsdp2=False)
    ema = ShardedEMA(plain, decay=0.5, dtype=torch.float64)
    with torch.no_grad():
        out["plain refused"] = raised(lambda: ema.module()(x32))
        out["plain float64"] = ema.module()(x32.double()).dtype
    out["plain mp_policy"] = raised(lambda: ema.module(mp_policy=MixedPrecisionPolicy()))
    return out


def test_a_teacher_of_an_ema_in_another_dtype_computes_as_the_student_or_names_the_fix(pools):
    for res in pools.get(2).run(run_ema_dtypes):
        for name, want in (("float64 EMA", torch.float32), ("bfloat16 EMA", torch.float32),
                           ("bfloat16 student", torch.bfloat16)):
            r = res[name]
            assert r["dtype"] == want and r["equal"] and r["moved"] > 1e-3, (name, r)
        e = res["policy refused"]
        assert e is not None and "torch.float64" in e and "args[0] is torch.float32" in e, e
        assert "mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32)" in e, e
        assert res["policy float64"] == res["plain float64"] == torch.float64
        e = res["plain refused"]
        assert e is not None and "the EMA's (torch.float64)" in e and "torch.float32" in e, e
        assert "dtype=None" in e and "mp_policy=MixedPrecisionPolicy" in e, e
        e = res["plain mp_policy"]
        assert e is not None and e.startswith("ValueError") and "leave mp_policy out" in e, e


def run_teacher_misuse(rank, world, layout):
    """``teacher.requires_grad_(True)`` and an optimizer over the teacher: refused before the
    forward (the EMA unchanged), by update() and by module(); ``teacher.double()``: the teacher
    refuses to run, and ``module()`` builds a new one on the EMA."""
    model, _, ema = make(layout)
    teacher = ema.module()
    x = batch(layout, rank, 0)
    before = [t.clone() for t in ema.state.tensors]
    teacher.requires_grad_(True)
    opt = torch.optim.SGD(teacher.parameters(), lr=0.5)
    out = dict(forward=raised(lambda: teacher(x).square().mean().backward()),
               method=raised(lambda: teacher.features(x)) if layout == "fsdp2" else "n/a")
    opt.step()
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, ema.state.tensors))
    out["update"], out["module"] = raised(ema.update), raised(ema.module)
    teacher.requires_grad_(False)
    ema.update()
    teacher.double()
    with torch.no_grad():
        out["stale"] = raised(lambda: teacher(x.double()))
    fresh = ema.module()
    ema.update()
    index = ema_index(ema)
    with torch.no_grad():
        got = fresh(x)
        with ema.swap():
            inner(model).eval()
            want = model(x)
            inner(model).train()
    out.update(fresh=fresh is not teacher, equal=torch.equal(got, want),
               cached=ema.module() is fresh,
               shares=all(local(p).data_ptr() == ema.state.tensors[index[n]].data_ptr()
                          for n, p in fresh.named_parameters()))
    return out


@pytest.mark.parametrize("layout", ["fsdp2", "plain"])
def test_a_teacher_made_trainable_or_converted_is_refused_and_replaced(pools, layout):
    for res in pools.get(2).run(run_teacher_misuse, layout):
        assert res["unchanged"], res  # the optimizer had no gradient: the EMA as it was
        for key in ("forward", "update", "module") + (("method",) if layout == "fsdp2" else ()):
            e = res[key]
            assert e is not None and "requires grad" in e and "requires_grad_(False)" in e, (key, e)
        assert res["update"].startswith("RuntimeError: ShardedEMA.update(): "), res["update"]
        e = res["stale"]
        assert e is not None and "no longer runs on the EMA" in e and "ema.module()" in e, e
        assert res["fresh"] and res["equal"] and res["cached"] and res["shares"], res


# --- the trainers' callbacks expose the teacher --------------------------------------------------

def run_lightning_teacher(rank, world, root):
    import warnings

    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.strategies import ModelParallelStrategy

    from fsdp_ema.integrations.lightning import ShardedEMA as Callback

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "NODE_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    warnings.filterwarnings("ignore")

    class Student(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = Backbone()
            self.diffs = []

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            if not hasattr(self, "_sharded"):
                mesh = self.device_mesh["data_parallel"]
                for layer in (self.net.conv, self.net.head):
                    fully_shard(layer, mesh=mesh)
                fully_shard(self, mesh=mesh)
                self._sharded = True

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            ema = next(c for c in self.trainer.callbacks if isinstance(c, Callback)).ema
            teacher = ema.module()          # what a self-distillation step uses
            with torch.no_grad():
                t = teacher(x)
                with ema.swap():
                    self.eval()
                    want = self(x)
                    self.train()
            self.diffs.append((t - want).abs().max().item())
            return (self(x) - t).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(16, 3, 6, 6))
    module = Student()
    trainer = pl.Trainer(callbacks=[Callback(decay=0.5)], max_steps=3, accelerator="cpu",
                         strategy=ModelParallelStrategy(data_parallel_size=world,
                                                        tensor_parallel_size=1),
                         devices=world, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return module.diffs


def run_transformers_teacher(rank, world, root):
    import warnings

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    from fsdp_ema.integrations.transformers import ShardedEMACallback

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1"})
    AcceleratorState._reset_state(reset_partial_state=True)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(config)
    diffs = []

    class Distill(transformers.Trainer):
        """A self-distillation Trainer: the loss pulls the student towards the EMA teacher."""

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            ema = next(c for c in self.callback_handler.callbacks
                       if isinstance(c, ShardedEMACallback)).ema
            teacher = ema.module()
            with torch.no_grad():
                t = teacher(input_ids=inputs["input_ids"]).logits
                with ema.swap():
                    model.eval()
                    want = model(input_ids=inputs["input_ids"]).logits
                    model.train()
            diffs.append((t - want).abs().max().item())
            out = model(input_ids=inputs["input_ids"])
            return (out.logits - t).square().mean()

    ids = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=root, per_device_train_batch_size=2,
                                          max_steps=3, learning_rate=1e-2, report_to=[],
                                          disable_tqdm=True, save_strategy="no", use_cpu=True)
    trainer = Distill(model=model, args=args, train_dataset=data,
                      callbacks=[ShardedEMACallback(decay=0.5)])
    trainer.train()
    return diffs


def test_lightning_and_hf_callbacks_expose_the_teacher_for_the_training_step(pools, tmp_path):
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("transformers")
    for diffs in pools.get(2).run(run_lightning_teacher, str(tmp_path / "pl")):
        assert len(diffs) == 3 and max(diffs) < 1e-6, diffs
    for diffs in pools.get(2).run(run_transformers_teacher, str(tmp_path / "hf")):
        assert len(diffs) == 3 and max(diffs) < 1e-6, diffs


# --- CosineMomentum, one process ------------------------------------------------------------------

def dinov3_cosine(base, final, total, it):
    """DINOv3's CosineScheduler (trunc_extra=0, no warmup or freeze) at iteration ``it``,
    written out from its formula: final + 0.5 (base - final)(1 + cos(pi i / total))."""
    if it >= total:
        return final
    return final + 0.5 * (base - final) * (1 + math.cos(math.pi * it / total))


def test_cosine_momentum_is_dinos_schedule_on_the_device_and_resumes_by_step():
    s = CosineMomentum(0.996, 1.0, total_steps=10)
    for t in range(1, 14):
        want = dinov3_cosine(0.996, 1.0, 10, t - 1)
        assert s.decay_at(t) == pytest.approx(want, abs=1e-15)
        got = s.device_decay(torch.tensor(t))
        assert got.dtype == torch.float64 and got.item() == pytest.approx(want, abs=1e-15)
    assert s.decay_at(1) == 0.996 and s.decay_at(11) == 1.0 and s.device_decay(
        torch.tensor(11)).item() == 1.0
    # Through ShardedEMA: update k uses the schedule's k+1-th value; a fresh EMA given the step
    # (state_dict) continues where the first stopped, bit for bit.
    model = nn.Linear(4, 3)
    a = ShardedEMA(model, schedule=s)
    b = ShardedEMA(model, schedule=s)
    for k in range(5):
        a.update()
        assert a.last_decay.item() == a.decay_at(k) == s.decay_at(k + 1)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        model.weight.add_(1.0)
    a.update()
    b.update()
    assert torch.equal(a.state.tensors[0], b.state.tensors[0])
    assert a.last_decay.item() == b.last_decay.item()
    # Compiled: one graph whatever the step.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(a.update, fullgraph=True, backend="aot_eager")
    for _ in range(4):
        step()
    assert counters["stats"]["unique_graphs"] == 1 and int(a.step) == 10
    for bad in (dict(base=1.2), dict(final=-0.1), dict(total_steps=0), dict(total_steps=2.5)):
        with pytest.raises(ValueError, match="CosineMomentum"):
            CosineMomentum(**{"base": 0.996, "final": 1.0, "total_steps": 10, **bad})
    # A plain model's teacher: parameters over the EMA's storage, buffers included.
    bn = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    ema = ShardedEMA(bn, schedule=s)
    teacher = ema.module()
    index = ema_index(ema)
    held = [*teacher.named_parameters(), *teacher.named_buffers()]
    assert len(held) == len(index) == 7
    assert all(t.data_ptr() == ema.state.tensors[index[n]].data_ptr() for n, t in held)
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    # torch.compile(model) at the root: the teacher is compiled alike (here: the eager backend).
    compiled = torch.compile(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), backend="eager")
    ema = ShardedEMA(compiled, decay=0.5)
    teacher = ema.module(compile={"backend": "eager"})
    with torch.no_grad():
        compiled._orig_mod[0].weight.mul_(2.0)
    ema.update()
    x = torch.randn(2, 4)
    with torch.no_grad(), ema.swap():
        want = compiled(x)
    assert type(teacher).__name__ == "OptimizedModule" and torch.equal(teacher(x), want)
    assert sorted(n for n, _ in teacher._orig_mod.named_parameters()) == sorted(ema.shapes)
    # A power-function EMA's teacher runs its profile 0.
    power = fsdp_ema.ShardedPowerEMA(bn, sigma_rels=(0.05, 0.1))
    teacher = power.module()
    with torch.no_grad():
        bn[0].weight.add_(1.0)
    power.update()
    assert torch.equal(teacher[0].weight, power.state_dict()["0.weight"])
    assert teacher[0].weight.data_ptr() == power.profile_tensors(0)[0].data_ptr()


def test_ema_decay_at_counts_update_calls_from_0_and_a_schedule_averaging_updates_from_1():
    """The two counts, pinned: ``ema.decay_at(k)`` is the decay of update() call ``k`` (from 0:
    ``ema.step`` when it runs); a schedule's ``decay_at(t)`` that of the ``t``-th averaging update
    (from 1), so ``ema.decay_at(k) == schedule.decay_at(k // update_every + 1)`` on averaging
    updates and 1.0 between; a schedule asked for ``t = 0`` says so."""
    s = CosineMomentum(0.9, 1.0, total_steps=4)
    ema = ShardedEMA(nn.Linear(2, 2), schedule=s, update_every=3)
    for k in range(15):
        want = s.decay_at(k // 3 + 1) if k % 3 == 0 else 1.0
        assert int(ema.step) == k and ema.decay_at(k) == want, k
        ema.update()
        assert ema.last_decay.item() == pytest.approx(want, abs=1e-15), k
    assert s.decay_at(1) == 0.9 and ema.decay_at(0) == 0.9 and ema.decay_at(3) == s.decay_at(2)
    for schedule in (s, fsdp_ema.PowerEMA(0.1)):
        with pytest.raises(ValueError, match=r"t counts averaging updates from 1 .* got 0; "
                                             r"ShardedEMA.decay_at\(k\) counts update\(\) calls "
                                             r"from 0: .*decay_at\(k // update_every \+ 1\)"):
            schedule.decay_at(0)


def test_a_training_state_records_what_gives_the_decay_and_refuses_another_schedule(tmp_path,
                                                                                     monkeypatch):
    """``training_state.json``: no "decay" where a schedule gives the decays (the settings name the
    schedule), the decay of the last update; ``load_training_state`` refuses an EMA of another
    schedule before anything changes, as ``ShardedEMA.load`` does, takes it with
    ``allow_changes``, and loads an older document (no settings) whatever the schedule."""
    import json

    from fsdp_ema.store import training_state

    model = nn.Linear(4, 3)
    sched = CosineMomentum(**SCHEDULE)
    ema, fixed = ShardedEMA(model, schedule=sched), ShardedEMA(model, decay=0.9)
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(0.5)
        ema.update()
        fixed.update()
    docs = {}
    for name, e in (("scheduled", ema), ("fixed", fixed)):
        fsdp_ema.save_training_state(tmp_path / name, ema=e)
        docs[name] = json.loads((tmp_path / name / "training_state.json").read_text())["ema"]
    assert docs["scheduled"]["decay"] is None and repr(sched) in docs["scheduled"]["settings"][
        "schedule"], docs["scheduled"]
    assert docs["scheduled"]["last_decay"] == ema.decay_at(2) == sched.decay_at(3)
    assert docs["fixed"]["decay"] == docs["fixed"]["last_decay"] == 0.9, docs["fixed"]
    other_schedule = CosineMomentum(base=0.9, final=1.0, total_steps=8)
    other = ShardedEMA(model, schedule=other_schedule)
    before = [t.clone() for t in other.state.tensors]
    with pytest.raises(ValueError) as refused:
        fsdp_ema.load_training_state(tmp_path / "scheduled", ema=other)
    e = str(refused.value)
    assert repr(sched) in e and repr(other_schedule) in e and "allow_changes=['schedule']" in e, e
    assert int(other.step) == 0 and all(torch.equal(a, b)
                                        for a, b in zip(before, other.state.tensors))
    with pytest.raises(ValueError, match="not schedule settings"):
        fsdp_ema.load_training_state(tmp_path / "scheduled", ema=other, allow_changes=["dtype"])
    fsdp_ema.load_training_state(tmp_path / "scheduled", ema=other, allow_changes="schedule")
    assert int(other.step) == 3 and torch.equal(other.state.tensors[0], ema.state.tensors[0])
    again = ShardedEMA(model, schedule=sched)
    fsdp_ema.load_training_state(tmp_path / "scheduled", ema=again)
    assert int(again.step) == 3
    # A document an older fsdp_ema wrote: no settings to compare, the step taken.
    pieces = training_state._ema_pieces

    def older(*args):
        out = pieces(*args)
        return {"step": out["step"], "decay": 0.9999, "tensors": out["tensors"]}

    monkeypatch.setattr(training_state, "_ema_pieces", older)
    fsdp_ema.save_training_state(tmp_path / "older", ema=ema)
    old = ShardedEMA(model, schedule=other_schedule)
    fsdp_ema.load_training_state(tmp_path / "older", ema=old)
    assert int(old.step) == 3 and torch.equal(old.state.tensors[0], ema.state.tensors[0])


def marked(gm, example_inputs):
    """A torch.compile backend whose compiled code adds 100 to every output: where it ran shows
    in the values."""
    def run(*args):
        out = gm(*args)
        return type(out)(o + 100.0 for o in out) if isinstance(out, tuple | list) else out + 100.0
    return run


def test_the_teacher_compiles_with_the_students_torch_compile_settings():
    """``compile=True``: each module the student compiled (``nn.Module.compile``) or the root
    (``torch.compile(model)``) runs in the teacher with the student's backend and settings, not
    torch.compile's defaults; ``compile={...}`` gives other ones, ``compile=False`` none."""
    torch._dynamo.reset()
    x = torch.randn(2, 4)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    net[0].compile(backend=marked, dynamic=False)
    root = torch.compile(nn.Linear(4, 3), backend=marked)
    with torch.no_grad():
        for student in (net, root):
            ema = ShardedEMA(student, decay=0.5)
            teacher, plain = ema.module(), ema.module(compile=False)
            eager = ema.module(compile={"backend": "eager"})
            want, linear = plain(x), plain(x) if student is root else plain[0](x)
            assert not (want > 50).any()  # eager: no mark
            marked_linear = linear + 100.0  # the student's backend ran the linear layer
            assert torch.allclose(teacher(x), marked_linear.relu() if student is net
                                  else marked_linear), student
            assert torch.equal(eager(x), want)


# --- save and load resume the schedule ------------------------------------------------------------

def train_steps(model, ema, opt, layout, rank, steps) -> None:
    for step in steps:
        loss = model(batch(layout, rank, step)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ema.update()


def run_save_load_resumes(rank, world, layout, root):
    """An uninterrupted run of STEPS updates against one saved after 3 (the EMA with
    ``ema.save``, the student with ``save_shard_weights``) and resumed by a fresh process state
    (new student, EMA and optimizer; SGD keeps no state) with ``ema.load``: the EMA, its step,
    the last decay and the teacher's forward equal bit for bit. Every rank sees the same data:
    BatchNorm's running stats then stay replicated, as a save of replicated buffers assumes."""
    import torch.distributed as dist

    rank = 0  # the data of rank 0 everywhere

    probe = batch(layout, rank, 999)
    model, _, ema = make(layout)
    train_steps(model, ema, torch.optim.SGD(model.parameters(), lr=0.2), layout, rank,
                range(STEPS))
    with torch.no_grad():
        want_out = ema.module()(probe).clone()
    want = [t.clone() for t in ema.state.tensors]

    model, _, ema = make(layout)
    train_steps(model, ema, torch.optim.SGD(model.parameters(), lr=0.2), layout, rank, range(3))
    ema.save(os.path.join(root, "ema"))
    ema.save_shard_weights(os.path.join(root, "model"))
    dist.barrier()
    model, _, ema = make(layout)   # a new process's objects: fresh weights, EMA at step 0
    fsdp_ema.load_model_weights(model, os.path.join(root, "model"))
    ema.load(os.path.join(root, "ema"))
    step_after_load = int(ema.step)
    train_steps(model, ema, torch.optim.SGD(model.parameters(), lr=0.2), layout, rank,
                range(3, STEPS))
    with torch.no_grad():
        got_out = ema.module()(probe)

    # The same checkpoint into an EMA with another schedule: refused before anything changes,
    # naming both schedules; taken when the change is allowed.
    _, _, other = make(layout)
    other_sched = ShardedEMA(other.model, schedule=CosineMomentum(base=0.9, final=1.0,
                                                                 total_steps=8))
    before = [t.clone() for t in other_sched.state.tensors]
    try:
        other_sched.load(os.path.join(root, "ema"))
        refusal = None
    except (ValueError, RuntimeError) as e:  # agreed over the ranks: a RuntimeError
        refusal = str(e)
    unchanged = (all(torch.equal(a, b) for a, b in zip(before, other_sched.state.tensors))
                 and int(other_sched.step) == 0)
    other_sched.load(os.path.join(root, "ema"), allow_changes=["schedule"])
    return dict(equal=all(torch.equal(a, b) for a, b in zip(want, ema.state.tensors)),
                out_equal=torch.equal(want_out, got_out), step=int(ema.step),
                step_after_load=step_after_load, refusal=refusal, unchanged=unchanged,
                allowed_step=int(other_sched.step))


@pytest.mark.parametrize("layout", ["fsdp2", "plain"])
def test_save_then_load_resumes_a_scheduled_ema_and_its_teacher_bit_for_bit(pools, tmp_path,
                                                                           layout):
    for res in pools.get(2).run(run_save_load_resumes, layout, str(tmp_path)):
        assert res["step_after_load"] == 3 and res["step"] == STEPS
        assert res["equal"] and res["out_equal"], res
        assert res["refusal"] is not None and res["unchanged"], res
        saved = repr(CosineMomentum(**SCHEDULE))
        now = repr(CosineMomentum(base=0.9, final=1.0, total_steps=8))
        assert saved in res["refusal"] and now in res["refusal"], res["refusal"]
        assert "allow_changes=['schedule']" in res["refusal"], res["refusal"]
        assert res["allowed_step"] == 3
