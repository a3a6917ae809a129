"""CUDA test helpers. ``side_stream_behind_a_sleep()``: a current stream whose work runs late.
A one-rank NCCL process group in the test process (one GPU is enough for NCCL's code paths):
``nccl_group()`` yields the group to use: a new NCCL subgroup when another test already set up a
default group in this process, otherwise a default group of world size 1 ("cpu:gloo,cuda:nccl",
so FSDP2 and DeviceMesh find it) that is destroyed afterwards.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile

import torch


@contextlib.contextmanager
def side_stream_behind_a_sleep(cycles: int = 200_000_000):
    """A new stream, made current, that starts behind the work already queued on the current one
    and then ~0.1 s of GPU sleep: what the block queues runs late, so an op that used any other
    stream than the current one would see the values from before it. Synchronized on exit."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        yield side
    side.synchronize()


@contextlib.contextmanager
def nccl_group():
    import torch.distributed as dist

    if not dist.is_nccl_available():
        import pytest

        pytest.skip("this torch has no NCCL")
    torch.cuda.set_device(0)
    owner = not dist.is_initialized()
    with tempfile.TemporaryDirectory(prefix="fsdp_ema_nccl_") as tmp:
        if owner:
            dist.init_process_group("cpu:gloo,cuda:nccl",
                                    init_method=f"file://{os.path.join(tmp, 'init')}", rank=0,
                                    world_size=1, timeout=datetime.timedelta(seconds=60),
                                    device_id=torch.device("cuda", 0))
            group = dist.group.WORLD
        else:
            group = dist.new_group([0], backend="nccl")
        try:
            yield group
        finally:
            if owner:
                dist.destroy_process_group()
            else:
                dist.destroy_process_group(group)
