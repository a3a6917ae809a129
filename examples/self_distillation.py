"""DINO on scikit-learn's digits with FSDP2, whose teacher is the EMA itself (``ema.module()``).

    torchrun --nproc-per-node 2 examples/self_distillation.py --out /tmp/dino [--png docs/]

gloo on the CPU (NCCL and one GPU per rank where CUDA is available). The data: the 1797 8x8 digits
that ship with scikit-learn (``sklearn.datasets.load_digits``), split once (fixed seed) into 1347
training and 450 test images; training uses the training images and no label.

DINO's recipe, small: each image is seen in 2 global views (small rotations, zooms and shifts,
noise, pixel dropout; ``--local-views N`` adds N zoomed-in crops, DINO's multi-crop). The
student sees every view, the teacher the 2 global ones; the loss is the cross-entropy between the
teacher's softmax on one view and the student's log-softmax on each other view, over K = 65
prototypes. Against collapse, the teacher's outputs are **centered** (a running mean of its
outputs, all-reduced over the ranks, is subtracted: no prototype can win for every image) and
**sharpened** (temperature 0.04 against the student's 0.1: the targets are not uniform), and the
head normalizes its hidden units over the batch (BatchNorm, DINO's ``use_bn`` head option: without
it this small network's outputs are the same for every image and the run collapses, as
``--no-head-bn`` shows). The teacher is the EMA of the student, with DINO's cosine momentum:

    ema = fsdp_ema.ShardedEMA(student, schedule=fsdp_ema.CosineMomentum(0.99, 1.0, total_steps=N))
    teacher = ema.module()        # the EMA's shards, run as the student: no second copy
    ema.update()                  # after each optimizer step: the whole teacher update

Every ``--eval-every`` steps (and before the first) it prints the k-NN accuracy (k = 20, cosine
similarity) on the test images of the backbone's features of the student and of the teacher, and
of the network as initialised (random weights of the same architecture), and the collapse
diagnostics: the entropy of the teacher's targets per image (ln K would be the uniform collapse)
and of their mean over the batch (0 would be the one-prototype collapse). A training state is
saved in ``--out`` at the end (and every ``--save-every`` steps); ``--resume`` continues from the
last one, bit for bit the run that went on. ``--png DIR`` draws the curves into DIR.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

import fsdp_ema

PROTOTYPES = 65  # K; 65 rows of the last layer: uneven over 2 ranks, as FSDP2 allows


# --- the data: scikit-learn's digits -------------------------------------------------------------

def load_digits(test_size: int = 450, seed: int = 0):
    """The 1797 digits as (N, 1, 8, 8) floats in [0, 1] and their labels, split into a training
    and a test set by a fixed permutation (the same on every rank)."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    test, train = order[:test_size], order[test_size:]
    return images[train], labels[train], images[test], labels[test]


def augment(images: torch.Tensor, g: torch.Generator, *, zoom: tuple[float, float],
            shift: float, degrees: float = 15.0, noise: float = 0.1,
            dropout: float = 0.1) -> torch.Tensor:
    """One random view of each image: a rotation by up to ``degrees``, a zoom (``zoom`` is the
    range of the fraction of the image the view shows: below 1 a crop, shown at 8x8), a shift
    (in half-widths), then Gaussian noise and pixels dropped with probability ``dropout``."""
    n = len(images)

    def uniform(lo, hi):
        return lo + (hi - lo) * torch.rand(n, generator=g)

    angle = uniform(-degrees, degrees) * math.pi / 180
    scale = uniform(*zoom)
    tx, ty = uniform(-shift, shift), uniform(-shift, shift)
    cos, sin = torch.cos(angle) * scale, torch.sin(angle) * scale
    theta = torch.stack([torch.stack([cos, -sin, tx], 1), torch.stack([sin, cos, ty], 1)], 1)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    view = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros",
                         align_corners=False)
    view = view + noise * torch.randn(view.shape, generator=g)
    return view * (torch.rand(view.shape, generator=g) >= dropout)


def multi_view(images: torch.Tensor, g: torch.Generator, local_views: int):
    """DINO's multi-crop on 8x8 digits: 2 global views (most of the digit), then ``local_views``
    crops of 40-65% of its width, anywhere on it."""
    views = [augment(images, g, zoom=(0.85, 1.1), shift=0.15) for _ in range(2)]
    views += [augment(images, g, zoom=(0.4, 0.65), shift=0.4) for _ in range(local_views)]
    return views


# --- the model: a small convolutional backbone and DINO's head -----------------------------------

class Backbone(nn.Module):
    """8x8 -> 4x4 -> 2x2 convolutions, then the mean over positions: 128 features."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.GELU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.GELU())

    def forward(self, x):
        return self.convs(x).mean((2, 3))


class DINOHead(nn.Module):
    """DINO's projection head: an MLP to a bottleneck, L2-normalized, then K prototypes whose
    weight rows are L2-normalized too (DINO's weight-normalized last layer, its norm fixed at 1):
    each logit is a cosine, in [-1, 1]. The MLP's BatchNorms (DINO's ``use_bn`` option) normalize
    each hidden unit over the batch: the head's outputs cannot be the same for every image. They
    keep no running statistics (``track_running_stats=False``): no buffers, the teacher's batch
    is normalized by its own statistics, and no state is left to keep equal across ranks."""

    def __init__(self, dim: int = 128, hidden: int = 256, bottleneck: int = 64,
                 prototypes: int = PROTOTYPES, use_bn: bool = True):
        super().__init__()

        def norm():
            return nn.BatchNorm1d(hidden, track_running_stats=False) if use_bn else nn.Identity()

        self.mlp = nn.Sequential(nn.Linear(dim, hidden), norm(), nn.GELU(),
                                 nn.Linear(hidden, hidden), norm(), nn.GELU(),
                                 nn.Linear(hidden, bottleneck))
        self.last = nn.Linear(bottleneck, prototypes, bias=False)
        for layer in self.modules():  # DINO's initialization
            if isinstance(layer, nn.Linear):
                nn.init.trunc_normal_(layer.weight, std=0.02)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)

    def forward(self, x):
        return F.linear(F.normalize(self.mlp(x), dim=-1), F.normalize(self.last.weight, dim=-1))


class Student(nn.Module):
    def __init__(self, use_bn: bool = True):
        super().__init__()
        self.backbone, self.head = Backbone(), DINOHead(use_bn=use_bn)

    def forward(self, x):
        return self.head(self.backbone(x))

    def features(self, x):
        """The backbone's features, what k-NN evaluates (registered with FSDP2 in main)."""
        return self.backbone(x)


# --- the loss: centering and sharpening ----------------------------------------------------------

class DINOLoss(nn.Module):
    def __init__(self, prototypes: int = PROTOTYPES, student_temp: float = 0.1,
                 teacher_temp: float = 0.04, center_momentum: float = 0.9):
        super().__init__()
        self.student_temp, self.teacher_temp = student_temp, teacher_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, prototypes))

    def targets(self, teacher_out: list[torch.Tensor]) -> list[torch.Tensor]:
        """The teacher's outputs centered and sharpened into distributions over the prototypes."""
        return [F.softmax((t - self.center) / self.teacher_temp, dim=-1) for t in teacher_out]

    def forward(self, student_out: list[torch.Tensor], targets: list[torch.Tensor]):
        """The mean cross-entropy of each teacher view's target against each *other* view's
        student prediction (the teacher's views are the first ``len(targets)``)."""
        terms = [-(p * F.log_softmax(s / self.student_temp, dim=-1)).sum(-1).mean()
                 for i, p in enumerate(targets) for v, s in enumerate(student_out) if v != i]
        return sum(terms) / len(terms)

    @torch.no_grad()
    def update_center(self, teacher_out: list[torch.Tensor]) -> None:
        """The center follows the mean teacher output over every rank's batch."""
        mean = torch.cat(teacher_out).mean(0, keepdim=True)
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        self.center.mul_(self.center_momentum).add_(mean, alpha=1 - self.center_momentum)


@torch.no_grad()
def collapse_diagnostics(targets: list[torch.Tensor]) -> tuple[float, float]:
    """(the mean entropy of the teacher's target per image, the entropy of their mean), in nats,
    over every rank's batch. Uniform collapse: the first near ln K. One-prototype collapse: the
    second near 0. Learning: the first well below ln K, the second well above 0."""
    p = torch.cat(targets)
    per_image = -(p * p.clamp_min(1e-12).log()).sum(-1).mean()
    stats = torch.cat([per_image.reshape(1), p.mean(0)])  # one all-reduce for both
    dist.all_reduce(stats)
    stats /= dist.get_world_size()
    mean = stats[1:]
    return stats[0].item(), -(mean * mean.clamp_min(1e-12).log()).sum().item()


# --- evaluation: k-NN on the backbone's features --------------------------------------------------

@torch.no_grad()
def knn_accuracy(features, data, k: int = 20, temperature: float = 0.07) -> float:
    """The test accuracy of a k-NN classifier on ``features(images)`` (L2-normalized, cosine
    similarity; the k nearest training images vote with weights exp(similarity / temperature),
    as in DINO's evaluation). ``features`` is called on every rank (FSDP2 gathers collectively)."""
    train_x, train_y, test_x, test_y = data
    train_f = F.normalize(features(train_x), dim=-1)
    test_f = F.normalize(features(test_x), dim=-1)
    similarity, nearest = (test_f @ train_f.T).topk(k, dim=-1)
    votes = torch.zeros(len(test_x), 10, device=test_f.device)
    votes.scatter_add_(1, train_y[nearest], (similarity / temperature).exp())
    return (votes.argmax(-1) == test_y).float().mean().item()


def plot(history: dict, baselines: dict[str, float], out: str) -> None:
    """Two PNGs in ``out``: k-NN accuracy over training, and the loss and collapse diagnostics."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from png_plot import LinePlot  # the docs' dependency-free PNG writer

    steps, grey = history["eval_step"], (140, 140, 140)
    lo, hi = min(baselines["random init"], *history["teacher"]), max(*history["student"],
                                                                      *history["teacher"])
    knn = LinePlot(720, 400, x_label="step", y_label="k-nn accuracy",
                   legend_y=lo + 0.55 * (hi - lo),
                   title="dino on digits, 2 ranks: k-nn test accuracy (k=20)")
    knn.series(steps, history["teacher"], color=(214, 39, 40), label="teacher (the ema)")
    knn.series(steps, history["student"], color=(31, 119, 180), label="student")
    knn.hline(baselines["random init"], color=grey, label="random init")
    knn.hline(baselines["raw pixels"], color=(44, 160, 44), label="raw pixels")
    knn.save(os.path.join(out, "self_distillation_knn.png"))
    curves = LinePlot(720, 400, x_label="step", y_label="nats", legend_y=3.2,
                      title="loss and the teacher entropies")
    curves.series(history["step"], history["loss"], color=(31, 119, 180), label="loss")
    curves.series(history["step"], history["entropy"], color=(214, 39, 40),
                  label="entropy per image")
    curves.series(history["step"], history["mean_entropy"], color=(44, 160, 44),
                  label="entropy of the mean")
    curves.hline(math.log(PROTOTYPES), color=grey, label="ln k (uniform)")
    curves.save(os.path.join(out, "self_distillation_entropy.png"))


# --- training -------------------------------------------------------------------------------------

def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 0 (DINO's learning-rate schedule), from the step alone:
    nothing to save for a resume."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def save(out: str, step: int, student, optimizer, ema, loss_fn, history) -> None:
    """The training state after ``step`` steps, in ``out/step-NNNNNN`` (collective)."""
    fsdp_ema.save_training_state(os.path.join(out, f"step-{step:06d}"), model=student,
                                 optimizer=optimizer, ema=ema, overwrite=True,
                                 extra={"step": step, "center": loss_fn.center.cpu(),
                                        "history": history})


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=64, help="images per rank and step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--momentum", type=float, default=0.99, help="the EMA's first momentum")
    parser.add_argument("--local-views", type=int, default=0, help="DINO's local crops")
    parser.add_argument("--head-bn", action=argparse.BooleanOptionalAction, default=True,
                        help="the head's BatchNorms (--no-head-bn: to see a collapse)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out", default="self_distillation_run")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--png", default="", help="a folder to draw the curves into")
    return parser.parse_args()


def build(args, device: torch.device):
    """The student sharded with FSDP2, a copy of its initial weights (the random baseline), the
    optimizer, the loss, the EMA and the teacher."""
    torch.manual_seed(0)  # the same initial weights on every rank
    student = Student(use_bn=args.head_bn).to(device)
    random_net = copy.deepcopy(student)  # the baseline: these weights, never trained
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in (student.backbone, student.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(student, mesh=mesh)
    register_fsdp_forward_method(student, "features")  # the teacher gets it too
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.04)

    # The teacher: the EMA of the student, run as a model. No second copy, no update loop.
    ema = fsdp_ema.ShardedEMA(student, schedule=fsdp_ema.CosineMomentum(
        args.momentum, 1.0, total_steps=args.steps))
    teacher = ema.module()
    return student, random_net, optimizer, DINOLoss().to(device), ema, teacher


def train_step(views, student, teacher, optimizer, loss_fn, ema):
    """One DINO step: the teacher's targets on the global views, the student on every view, the
    optimizer, the center, then the teacher (``ema.update()``). Returns the loss and targets."""
    with torch.no_grad():
        teacher_out = teacher(torch.cat(views[:2])).chunk(2)  # the global views only
        targets = loss_fn.targets(teacher_out)
    loss = loss_fn(student(torch.cat(views)).chunk(len(views)), targets)  # one forward
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    loss_fn.update_center(teacher_out)
    ema.update()                                             # the whole teacher update
    return loss, targets


def teacher_is_the_ema(student, teacher, ema, probe: torch.Tensor) -> bool:
    """The teacher's parameters are the EMA's shards, and its forward is the EMA's."""
    same = all(p.to_local().data_ptr() == ema.state_dict()[n].to_local().data_ptr()
               for n, p in teacher.named_parameters())
    with torch.no_grad():
        got = teacher(probe)
        with ema.swap():
            want = student(probe)
    return same and len(ema.shapes) == len(list(teacher.parameters())) and torch.equal(got, want)


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device(
        "cpu")
    if cuda:
        torch.cuda.set_device(device)
    data = load_digits()
    train_images = data[0]
    data = tuple(t.to(device) for t in data)
    student, random_net, optimizer, loss_fn, ema, teacher = build(args, device)

    start, history = 0, {k: [] for k in ("step", "loss", "entropy", "mean_entropy",
                                          "eval_step", "student", "teacher")}
    checkpoint = fsdp_ema.latest_checkpoint(args.out) if args.resume else None
    if checkpoint is not None:
        extra = fsdp_ema.load_training_state(checkpoint, model=student, optimizer=optimizer,
                                             ema=ema)
        start, history = extra["step"], extra["history"]
        loss_fn.center.copy_(extra["center"])
        if rank == 0:
            print(f"resumed from {checkpoint} at step {start}")
    baselines = {"random init": knn_accuracy(random_net.features, data),
                 "raw pixels": knn_accuracy(lambda images: images.flatten(1), data)}

    def evaluate(step: int) -> None:
        history["eval_step"].append(step)
        for name, model in (("student", student), ("teacher", teacher)):
            history[name].append(knn_accuracy(model.features, data))
        if rank == 0:
            print(f"step {step:4d}  k-NN accuracy: student {history['student'][-1]:.3f}  "
                  f"teacher {history['teacher'][-1]:.3f}")

    began = time.perf_counter()
    if start == 0:
        evaluate(0)
    g = torch.Generator()
    for step in range(start, args.steps):
        g.manual_seed(1 + rank + 1000 * step)  # each rank its own data; a resume sees the same
        batch = train_images[torch.randint(len(train_images), (args.batch,), generator=g)]
        views = [v.to(device) for v in multi_view(batch, g, args.local_views)]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=args.steps // 10)
        loss, targets = train_step(views, student, teacher, optimizer, loss_fn, ema)

        entropy, mean_entropy = collapse_diagnostics(targets)
        for key, value in (("step", step), ("loss", loss.item()), ("entropy", entropy),
                           ("mean_entropy", mean_entropy)):
            history[key].append(value)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  teacher entropy {entropy:.3f}, "
                  f"of the mean {mean_entropy:.3f} (ln K {math.log(PROTOTYPES):.3f})  "
                  f"momentum {ema.decay_at(step):.6f}", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evaluate(step + 1)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save(args.out, step + 1, student, optimizer, ema, loss_fn, history)
    seconds = time.perf_counter() - began

    ok = teacher_is_the_ema(student, teacher, ema, data[2][:4])
    save(args.out, args.steps, student, optimizer, ema, loss_fn, history)
    if rank == 0:
        print(f"trained {args.steps - start} steps in {seconds:.1f} s on {world} ranks")
        print(f"k-NN accuracy (k=20) on the {len(data[3])} test digits: random init "
              f"{baselines['random init']:.3f}, student {history['student'][-1]:.3f}, teacher "
              f"{history['teacher'][-1]:.3f} (the raw pixels: {baselines['raw pixels']:.3f})")
        print(f"teacher entropy {history['entropy'][-1]:.3f} nats per image, "
              f"{history['mean_entropy'][-1]:.3f} of the mean (ln K = "
              f"{math.log(PROTOTYPES):.3f})")
        print(f"teacher == EMA: {'OK' if ok else 'FAILED'} ({ema.nbytes} bytes of EMA on rank 0, "
              f"which is all the teacher holds)")
        if args.png:
            plot(history, baselines, args.png)
            print(f"wrote {args.png}/self_distillation_knn.png and self_distillation_entropy.png")
    fsdp_ema.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
