"""ShardedEMA on 2-D meshes and FSDP1 strategies beyond FULL_SHARD (#16): HSDP (replicate x
shard), FSDP2 + tensor parallel (2 x 2 on 4 gloo ranks), FSDP1 NO_SHARD; update, swap,
state_dict, save/load at another mesh shape, export and gather, each exact against the EMA of
the full weights recomputed with torch.lerp (the weights are set each step to known full tensors
through torch's own ``distribute_tensor``, so the reference never goes through fsdp_ema).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import PoolManager
from torch import nn

from fsdp_ema import ShardedEMA

DECAY = 0.75  # 1 - decay exact in binary: the op and torch.lerp round alike
STEPS = 3


class Net(nn.Module):
    """Uneven everywhere: 5 and 3 rows, 7 and 5 columns over 2-way mesh dimensions."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x)))


def weights_at(step: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(100 + step)
    return {n: torch.randn_like(p) for n, p in Net().named_parameters()}


def reference(steps: int = STEPS) -> dict[str, torch.Tensor]:
    ema = weights_at(0)
    for s in range(1, steps + 1):
        ema = {n: torch.lerp(ema[n], t, 1 - DECAY) for n, t in weights_at(s).items()}
    return ema


def build(layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    world = torch.distributed.get_world_size()
    if layout == "fsdp2":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model.inp, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout in ("tp_rowwise", "tp_colwise"):
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        style = RowwiseParallel if layout == "tp_rowwise" else ColwiseParallel
        parallelize_module(model, mesh["tp"], {"inp": style(), "out": style()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        raise ValueError(layout)
    return model


def set_weights(model, step: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    full = weights_at(step)
    with torch.no_grad():
        for n, p in model.named_parameters():
            # src_data_rank=None: every rank splits its own copy (no scatter; uneven strided ok)
            local = distribute_tensor(full[n], p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(local.to_local())


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def run_layout(rank, world, layout, ckpt, export_dir):
    from torch.distributed.tensor import DTensor

    model = build(layout)
    set_weights(model, 0)
    ema = ShardedEMA(model, decay=DECAY)
    for s in range(1, STEPS + 1):
        set_weights(model, s)
        ema.update()
    raw = full_params(model)
    placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
    sd = ema.state_dict()
    sd_info = {n: (type(v) is DTensor and tuple(v.placements) == placements[n],
                   v.full_tensor().clone()) for n, v in sd.items() if n in placements}
    with ema.swap():
        swapped = full_params(model)
    restored = full_params(model)
    full = ema.full_state_dict(rank0_only=False)
    ema.save(ckpt)
    ema.export(export_dir)
    return dict(raw=raw, sd=sd_info, swapped=swapped, restored=restored, full=full,
                placements={n: str(p) for n, p in placements.items()})


def run_load(rank, world, layout, ckpt):
    model = build(layout)
    ema = ShardedEMA(model, decay=DECAY)
    ema.load(ckpt)
    return ema.full_state_dict(rank0_only=False)


@pytest.fixture(scope="module")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()


def check_layout_results(results, ref):
    for res in results:
        for name, r in ref.items():
            same_placements, value = res["sd"][name]
            assert same_placements, (name, res["placements"][name])
            assert torch.equal(value, r), name
            assert torch.equal(res["swapped"][name], r), name
            assert torch.equal(res["restored"][name], res["raw"][name]), name
            assert torch.equal(res["full"][name], r), name


@pytest.mark.parametrize("layout,other", [("hsdp", "tp_rowwise"), ("tp_rowwise", "tp_colwise"),
                                          ("tp_colwise", "hsdp")])
def test_2d_mesh_update_swap_state_dict_save_export_gather_exact(pools, tmp_path, layout, other):
    from safetensors.torch import load_file

    import fsdp_ema

    ckpt, export_dir = tmp_path / "ckpt", tmp_path / "export"
    pool = pools.get(4)
    results = pool.run(run_layout, layout, str(ckpt), str(export_dir))
    ref = reference()
    check_layout_results(results, ref)
    if layout == "tp_rowwise":
        assert "Shard(dim=1)" in results[0]["placements"]["inp.weight"]
    elif layout == "tp_colwise":  # torchtitan's layout: FSDP2 over a TP Shard(0)
        assert "_StridedShard" in results[0]["placements"]["inp.weight"]
    else:
        assert "Replicate" in results[0]["placements"]["inp.weight"]
    # The checkpoint and the export, read independently of the ranks.
    saved = fsdp_ema.checkpoint.load(ckpt)
    exported = load_file(export_dir / "model.safetensors")
    for name, r in ref.items():
        assert torch.equal(saved[name], r) and torch.equal(exported[name], r), name
    # Loaded at another mesh shape (the other 2-D layout, and a 1-D FSDP2 mesh of 4).
    for target in (other, "fsdp2"):
        for full in pool.run(run_load, target, str(ckpt)):
            for name, r in ref.items():
                assert torch.equal(full[name], r), (target, name)


def run_unsupported(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Linear(3, 2)
    # A Partial (pending-sum) parameter: no rank holds its value.
    model.weight = nn.Parameter(DTensor.from_local(torch.ones(2, 3), mesh, [Partial()]))
    try:
        ShardedEMA(model)
    except ValueError as e:
        return str(e)
    return None


def test_an_unsupported_placement_is_refused_naming_the_parameter_and_placement(pools):
    from torch.distributed.tensor.placement_types import _StridedShard

    from fsdp_ema.model.layouts import check_placements

    for message in pools.get(4).run(run_unsupported):
        assert message is not None and "'weight'" in message and "Partial" in message
    # A strided shard that is not FSDP2 over a TP Shard of the same dim (no later Shard(0)).
    with pytest.raises(ValueError, match=r"'w' has placements .*_StridedShard.* is not supported"):
        check_placements("w", [_StridedShard(0, split_factor=2)], mesh=None)


def run_resharded(rank, world):
    """The model's DTensor weight re-made on a mesh of the reversed rank order: every rank's shard
    has the same shape, but holds the other rank's rows. Then on a 2-D mesh whose first dimension
    has size 1: the same rows as before."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    model = nn.Linear(6, 4, bias=False)
    model.weight = nn.Parameter(distribute_tensor(full, init_device_mesh("cpu", (world,)),
                                                  [Shard(0)]))
    ema = ShardedEMA(model, decay=0.5)
    teacher = ema.module()  # cached: later calls check the model as update() does
    before = ema.state_dict()["weight"].full_tensor()
    out = {}
    for name, mesh in (("same rows", init_device_mesh("cpu", (1, world))),
                       ("other rows", DeviceMesh("cpu", list(reversed(range(world)))))):
        placements = [Shard(0)] * mesh.ndim  # the (1, world) mesh's first dimension splits nothing
        model.weight = nn.Parameter(distribute_tensor(full + 1, mesh, placements))
        try:
            ema.update()
            out[name] = None
        except RuntimeError as e:
            out[name] = str(e)
        try:
            out[f"module, {name}"] = ema.module() is teacher
        except RuntimeError as e:
            out[f"module, {name}"] = str(e)
    # One update (the first), at decay 0.5 towards full + 1; the refused one changed nothing.
    out["updated_once"] = torch.equal(ema.state_dict()["weight"].full_tensor(), before + 0.5)
    return out


def test_a_model_resharded_onto_other_elements_is_refused_by_update(pools):
    for res in pools.get(2).run(run_resharded):
        assert res["same rows"] is None, res  # another mesh, the same elements: updated
        assert res["other rows"] is not None and res["other rows"].startswith(
            "ShardedEMA: the model's sharding changed since the EMA was made: 'weight' holds "
            "the elements at offsets "), res
        assert "make a new ShardedEMA for the new sharding" in res["other rows"], res
        assert res["module, same rows"] is True, res  # the cached teacher, the EMA's tensors
        assert res["module, other rows"] == res["other rows"], res  # the same refusal
        assert res["updated_once"], res


# --- FSDP1 NO_SHARD (2 ranks) and HYBRID_SHARD (4 ranks) ---------------------------------------

def run_fsdp1_strategy(rank, world, strategy, ckpt, export_dir):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    kwargs = {}
    if strategy == "HYBRID_SHARD":  # 2 replicas of 2 shards
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", (2, world // 2))
    model = FSDP(Net(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                 sharding_strategy=getattr(ShardingStrategy, strategy),
                 device_id=torch.device("cpu"), **kwargs)

    def set_full(step):
        full = weights_at(step)
        with FSDP.summon_full_params(model, writeback=True), torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(full[n.replace("_fsdp_wrapped_module.", "")])

    set_full(0)
    ema = ShardedEMA(model, decay=DECAY)
    for s in range(1, STEPS + 1):
        set_full(s)
        ema.update()
    sd = ({n: v.clone() for n, v in ema.state_dict().items() if n != ShardedEMA.STEP_KEY}
          if strategy == "NO_SHARD" else None)
    full = ema.full_state_dict(rank0_only=False)
    ema.save(ckpt)
    ema.export(export_dir)
    fresh = ShardedEMA(model, decay=DECAY)
    fresh.load(ckpt)
    return dict(sd=sd, full=full, loaded=fresh.full_state_dict(rank0_only=False))


def test_fsdp1_no_shard_state_dict_save_load_export_exact(pools, tmp_path):
    from safetensors.torch import load_file

    import fsdp_ema

    ckpt, export_dir = tmp_path / "ckpt", tmp_path / "export"
    results = pools.get(2).run(run_fsdp1_strategy, "NO_SHARD", str(ckpt), str(export_dir))
    ref = reference()
    saved = fsdp_ema.checkpoint.load(ckpt)
    exported = load_file(export_dir / "model.safetensors")
    assert fsdp_ema.checkpoint.info(ckpt)["world_size"] == 2
    for res in results:
        for name, r in ref.items():
            assert torch.equal(res["sd"][name], r), name
            assert torch.equal(res["full"][name], r), name
            assert torch.equal(res["loaded"][name], r), name
    for name, r in ref.items():
        assert torch.equal(saved[name], r) and torch.equal(exported[name], r), name


def test_fsdp1_hybrid_shard_save_load_export_exact(pools, tmp_path):
    from safetensors.torch import load_file

    import fsdp_ema

    ckpt, export_dir = tmp_path / "ckpt", tmp_path / "export"
    results = pools.get(4).run(run_fsdp1_strategy, "HYBRID_SHARD", str(ckpt), str(export_dir))
    ref = reference()
    saved = fsdp_ema.checkpoint.load(ckpt)
    exported = load_file(export_dir / "model.safetensors")
    for res in results:
        for name, r in ref.items():
            assert torch.equal(res["full"][name], r), name
            assert torch.equal(res["loaded"][name], r), name
    for name, r in ref.items():
        assert torch.equal(saved[name], r) and torch.equal(exported[name], r), name
    # What a replica holds, read at the shard group's world size (2): rows of torch.chunk.
    for rank in range(2):
        rows = fsdp_ema.checkpoint.load(ckpt, rank=rank, world_size=2)
        for name, r in ref.items():
            assert torch.equal(rows[name], torch.chunk(r, 2)[rank]), name


def run_fsdp1_mixed_unit(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    net = Net()
    net.inp.weight.requires_grad_(False)  # frozen next to trainable ones in the one root unit
    model = FSDP(net, use_orig_params=True, device_id=torch.device("cpu"))
    try:
        ShardedEMA(model, params="trainable")
    except ValueError as e:
        return str(e)
    return None


def test_fsdp1_unit_mixing_selected_and_unselected_parameters_is_an_error(pools):
    for message in pools.get(2).run(run_fsdp1_mixed_unit):
        assert message is not None and "but not 'inp.weight'" in message, message
