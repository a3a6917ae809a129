"""A small DINO-style self-distillation run on FSDP2 whose teacher is the EMA itself.

    torchrun --nproc-per-node 2 examples/self_distillation.py --steps 50 --out /tmp/dino

gloo on the CPU (NCCL and one GPU per rank where CUDA is available). The student sees 2 global and
4 local crops of random images, the teacher the 2 global ones; the teacher's outputs are centered
and sharpened (temperatures 0.04 and 0.1), the center follows their batch mean. The teacher is
``ema.module()``: the student's structure sharded like the student, whose parameters are the EMA's
shards, so ``ema.update()`` (with DINO's cosine momentum) is the whole teacher update and there is
no second copy of the model. A training-state checkpoint is saved in ``--out`` at the end (and every
``--save-every`` steps); ``--resume`` continues from the last one, bit for bit the run that went on.

In place of DINOv3's by-hand teacher (a second model built and sharded like the student, and
``_foreach_mul_`` + ``_foreach_add_`` over its DTensor parameters each step), three lines:

    ema = fsdp_ema.ShardedEMA(student, schedule=fsdp_ema.CosineMomentum(0.996, 1.0, total_steps=N))
    teacher = ema.module()
    ema.update()                                      # after each optimizer step
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_ema


class Backbone(nn.Module):
    def __init__(self, width: int = 24):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.block = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)

    def forward(self, x):
        return F.gelu(self.block(F.gelu(self.stem(x)))).mean((2, 3))


class DINOHead(nn.Module):
    """MLP, L2-normalized bottleneck, then the prototypes (65 of them: uneven over the ranks)."""

    def __init__(self, dim: int = 48, hidden: int = 64, bottleneck: int = 32, prototypes: int = 65):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, bottleneck))
        self.last = nn.Linear(bottleneck, prototypes, bias=False)

    def forward(self, x):
        return self.last(F.normalize(self.mlp(x), dim=-1))


class Student(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone, self.head = Backbone(), DINOHead()

    def forward(self, x):
        return self.head(self.backbone(x))


def multi_crop(images: torch.Tensor, g: torch.Generator) -> list[torch.Tensor]:
    """2 global crops (24x24) and 4 local crops (12x12, upsampled to 16x16) of each image."""
    views = []
    for size, out, n in ((24, 24, 2), (12, 16, 4)):
        for _ in range(n):
            i, j = (int(v) for v in torch.randint(0, images.shape[-1] - size + 1, (2,),
                                                  generator=g))
            crop = images[..., i:i + size, j:j + size]
            views.append(F.interpolate(crop, size=out, mode="bilinear", align_corners=False))
    return views


def save(out: str, step: int, student, optimizer, ema, loss_fn) -> None:
    """The training state after ``step`` steps, in ``out/step-NNNNNN`` (collective)."""
    fsdp_ema.save_training_state(os.path.join(out, f"step-{step:06d}"), model=student,
                                 optimizer=optimizer, ema=ema, overwrite=True,
                                 extra={"step": step, "center": loss_fn.center.cpu()})


class DINOLoss(nn.Module):
    def __init__(self, prototypes: int = 65, student_temp: float = 0.1,
                 teacher_temp: float = 0.04, center_momentum: float = 0.9):
        super().__init__()
        self.student_temp, self.teacher_temp = student_temp, teacher_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, prototypes))

    def forward(self, student_out: list[torch.Tensor], teacher_out: list[torch.Tensor]):
        targets = [F.softmax((t - self.center) / self.teacher_temp, dim=-1) for t in teacher_out]
        terms = [-(p * F.log_softmax(s / self.student_temp, dim=-1)).sum(-1).mean()
                 for iq, p in enumerate(targets) for v, s in enumerate(student_out) if v != iq]
        return sum(terms) / len(terms)

    @torch.no_grad()
    def update_center(self, teacher_out: list[torch.Tensor]) -> None:
        mean = torch.cat(teacher_out).mean(0, keepdim=True)
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        self.center.mul_(self.center_momentum).add_(mean, alpha=1 - self.center_momentum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default="self_distillation_run")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device(
        "cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every rank
    mesh = init_device_mesh(device.type, (world,))
    student = Student().to(device)
    for layer in (student.backbone.stem, student.backbone.block, student.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(student, mesh=mesh)
    optimizer = torch.optim.AdamW(student.parameters(), lr=5e-3, weight_decay=0.04)
    loss_fn = DINOLoss().to(device)

    # The teacher: the EMA of the student, run as a model. No second copy, no update loop.
    ema = fsdp_ema.ShardedEMA(student, schedule=fsdp_ema.CosineMomentum(
        0.996, 1.0, total_steps=args.steps))
    teacher = ema.module()

    start = 0
    checkpoint = fsdp_ema.latest_checkpoint(args.out) if args.resume else None
    if checkpoint is not None:
        extra = fsdp_ema.load_training_state(checkpoint, model=student, optimizer=optimizer,
                                             ema=ema)
        start = extra["step"]
        loss_fn.center.copy_(extra["center"])
        if rank == 0:
            print(f"resumed from {checkpoint} at step {start}")

    g = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    for step in range(start, args.steps):
        g.manual_seed(1 + rank + 1000 * step)  # a resumed run sees the same data
        images = torch.randn(args.batch, 3, 32, 32, generator=g).to(device)
        views = multi_crop(images, g)
        with torch.no_grad():
            teacher_out = [teacher(v) for v in views[:2]]   # global crops only
        loss = loss_fn([student(v) for v in views], teacher_out)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_fn.update_center(teacher_out)
        ema.update()                                          # the whole teacher update
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  momentum "
                  f"{ema.decay_at(step):.6f}")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save(args.out, step + 1, student, optimizer, ema, loss_fn)

    # The teacher's parameters are the EMA's shards, and its forward is the EMA's.
    same = all(p.to_local().data_ptr() == ema.state_dict()[n].to_local().data_ptr()
               for n, p in teacher.named_parameters())
    probe = torch.randn(2, 3, 24, 24, generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        got = teacher(probe)
        with ema.swap():
            want = student(probe)
    ok = same and len(ema.shapes) == len(list(teacher.parameters())) and torch.equal(got, want)
    save(args.out, args.steps, student, optimizer, ema, loss_fn)
    if rank == 0:
        print(f"teacher == EMA: {'OK' if ok else 'FAILED'} ({ema.nbytes} bytes of EMA on rank 0, "
              f"which is all the teacher holds)")
    fsdp_ema.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
