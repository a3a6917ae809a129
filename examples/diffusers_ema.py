"""diffusers' ``--use_ema`` training flow, sharded: Accelerate, FSDP2, save, resume, export.

    python examples/diffusers_ema.py --steps 40 --out /tmp/diffusers_ema      # spawns 2 ranks
    python examples/diffusers_ema.py --steps 60 --out /tmp/diffusers_ema \\
        --resume-from /tmp/diffusers_ema/checkpoint-40                          # goes on
    torchrun --nproc-per-node 2 examples/diffusers_ema.py ...                  # or launched:
    accelerate launch --cpu --num_processes 2 examples/diffusers_ema.py ...   # either way

The EMA part of diffusers' examples/text_to_image/train_text_to_image.py, on a tiny
``UNet2DModel`` and synthetic images (DDPM noise, MSE on the noise, as its scripts train): the
EMA is made from the prepared model and registered for checkpointing, so that Accelerate's
``save_state`` / ``load_state`` carry it (each rank its shards, in each ``checkpoint-N``);
``ema_unet.step`` follows each optimizer step, validation runs between ``store`` / ``copy_to``
and ``restore``, and at the end ``save_pretrained`` writes the EMA as a folder
``UNet2DModel.from_pretrained`` loads.

gloo on the CPU (2 ranks, spawned here unless torchrun or accelerate launched the script); NCCL
with one GPU per rank where CUDA is available. Accelerate 1.15 makes FSDP of an FSDP plugin only on
accelerators: on the CPU it trains DDP and drops the plugin, so ``fsdp2_accelerator`` sets its
distributed type to FSDP there (two attribute writes; prepare, save_state and load_state then do
on the CPU what they do on GPUs: ``fully_shard`` and torch.distributed.checkpoint).
"""

from __future__ import annotations

import argparse
import os
import re
import warnings

import torch
import torch.nn.functional as F

SIZE = 16  # images of SIZE x SIZE, 3 channels
TIMESTEPS = 100


def tiny_unet(seed: int):
    from diffusers import UNet2DModel

    torch.manual_seed(seed)  # the same initial weights on every rank
    return UNet2DModel(sample_size=SIZE, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(8, 16), down_block_types=("DownBlock2D",) * 2,
                       up_block_types=("UpBlock2D",) * 2, norm_num_groups=4)


def images(count: int, seed: int) -> torch.Tensor:
    """Smooth random images in [-1, 1]: noise at 4 x 4, upsampled."""
    low = torch.randn(count, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    return torch.tanh(F.interpolate(low, size=SIZE, mode="bilinear", align_corners=False))


def noised(clean: torch.Tensor, scheduler, seed: int):
    """The scripts' DDPM training pair. The noise and timesteps are drawn from ``seed`` (the step
    and rank), not the global generator, so a resumed run draws what the straight one drew."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(clean.shape, generator=g)
    t = torch.randint(0, TIMESTEPS, (clean.shape[0],), generator=g)
    return scheduler.add_noise(clean, noise, t), t, noise


def fsdp2_accelerator():
    """An Accelerator that shards the model with FSDP2 (``fully_shard`` on each ``ResnetBlock2D``
    and the root) and saves it with torch.distributed.checkpoint, on GPUs and on the CPU."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["ResnetBlock2D"], state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), fsdp_plugin=plugin)
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        # Accelerate kept DDP (see the module's note); every AcceleratorState re-reads the
        # PartialState's distributed type, so both are set.
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    return accelerator


@torch.no_grad()
def validation_loss(unet, scheduler, device) -> float:
    """The mean noise-prediction MSE over 16 held-out images, the same noise on every call."""
    clean = images(16, seed=12345)
    x, t, noise = noised(clean, scheduler, seed=54321)
    return F.mse_loss(unet(x.to(device), t.to(device)).sample, noise.to(device)).item()


def train(args: argparse.Namespace) -> dict:
    """One rank's run: the trained model, its optimizer, the EMA and the validation losses."""
    from diffusers import DDPMScheduler, UNet2DModel

    from fsdp_ema.integrations.diffusers import EMAModel

    warnings.filterwarnings("ignore", module="accelerate|torch.distributed")
    accelerator = fsdp2_accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    unet = tiny_unet(args.seed)
    scheduler = DDPMScheduler(num_train_timesteps=TIMESTEPS)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr)
    data = torch.utils.data.DataLoader(images(args.batch * world * 8, seed=args.seed + 1),
                                       batch_size=args.batch)
    unet, optimizer, data = accelerator.prepare(unet, optimizer, data)

    # train_text_to_image.py's EMA, made from the prepared (sharded) UNet: each rank keeps its
    # shards of the average. save_state writes them (each rank its own) beside the model's, and
    # load_state reads them back, at any number of ranks.
    ema_unet = EMAModel(unet, decay=args.decay, use_ema_warmup=True, foreach=True,
                        model_cls=UNet2DModel, model_config=unet.config)
    accelerator.register_for_checkpointing(ema_unet)

    global_step = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        global_step = int(re.search(r"checkpoint-(\d+)$", args.resume_from.rstrip("/"))[1])
        if rank == 0:
            print(f"resumed from {args.resume_from} at step {global_step} "
                  f"(EMA optimization_step {ema_unet.optimization_step})", flush=True)

    per_epoch = len(data)
    unet.train()
    while global_step < args.steps:
        epoch_data = data
        if global_step % per_epoch:
            epoch_data = accelerator.skip_first_batches(data, global_step % per_epoch)
        for clean in epoch_data:
            x, t, noise = noised(clean, scheduler, seed=args.seed + 1000 * global_step + rank)
            loss = F.mse_loss(unet(x, t).sample, noise)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                ema_unet.step(unet.parameters())
                global_step += 1
                if rank == 0 and (global_step % 10 == 0 or global_step == args.steps):
                    print(f"step {global_step:4d}  loss {loss.item():.4f}  "
                          f"ema decay {ema_unet.cur_decay_value:.4f}", flush=True)
                if args.save_every and global_step % args.save_every == 0:
                    accelerator.save_state(os.path.join(args.out, f"checkpoint-{global_step}"))
            if global_step >= args.steps:
                break

    unet.eval()
    raw = validation_loss(unet, scheduler, accelerator.device)
    ema_unet.store(unet.parameters())       # the scripts' validation with the EMA weights
    ema_unet.copy_to(unet.parameters())
    averaged = validation_loss(unet, scheduler, accelerator.device)
    ema_unet.restore(unet.parameters())
    export = os.path.join(args.out, "unet_ema")
    ema_unet.save_pretrained(export)         # every rank; rank 0 writes the folder
    accelerator.wait_for_everyone()
    if rank == 0:
        print(f"validation loss: EMA {averaged:.6f}  raw weights {raw:.6f}  "
              f"({'EMA lower' if averaged < raw else 'raw lower'}; {global_step} steps, "
              f"{world} ranks)\nexported: {export} (UNet2DModel.from_pretrained loads it)",
              flush=True)
    return {"unet": unet, "optimizer": optimizer, "ema": ema_unet, "raw": raw,
            "ema_loss": averaged, "step": global_step}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps in all")
    p.add_argument("--batch", type=int, default=4, help="images per rank and step")
    p.add_argument("--save-every", type=int, default=20, help="save_state every N steps (0: never)")
    p.add_argument("--resume-from", default=None, help="a checkpoint-N folder of --out")
    p.add_argument("--out", default="diffusers_ema_run")
    p.add_argument("--decay", type=float, default=0.999)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=2, help="ranks to spawn when not launched")
    return p.parse_args(argv)


def _spawned(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks),
                      LOCAL_WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    train(args)


def main() -> None:
    args = parse()
    if "RANK" in os.environ:  # torchrun, accelerate launch
        train(args)
    else:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(args, port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
