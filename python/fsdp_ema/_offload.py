"""An EMA kept in host memory (``ShardedEMA(..., device="cpu")`` for a model on an accelerator).

Each ``update()`` copies the tensors this rank holds (FSDP2: the local shards, plain tensors, so
nothing pins a DTensor) into staging buffers in pinned host memory, in their own dtype (bf16
stays bf16 over the bus), on a side stream, and hands the fused CPU ``update_`` to a worker
thread, which waits for the copy and updates the EMA while the next step runs. The training's
stream waits for the copy (on the device, not the host) before it runs anything after
``update()``, so the optimizer's next in-place write cannot race the copy.

One update is in flight at a time: the next ``update()``, ``synchronize()`` and every read of the
EMA wait for it (the staging buffers are reused). For a model on the CPU the same path (staging
snapshot, worker thread, synchronize) runs when forced, so that the logic is tested without a
device.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import torch


class HostOffload:
    """Staging buffers and the worker of one offloaded EMA."""

    def __init__(self, model_tensors: Sequence[torch.Tensor], average: Sequence[bool]):
        self.average = list(average)
        self.staging = [self._buffer(t) for t in model_tensors]
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="fsdp_ema-offload")
        self._pending: concurrent.futures.Future | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @staticmethod
    def _buffer(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu",
                           pin_memory=t.device.type == "cuda")

    @staticmethod
    def host_ema(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The EMA tensor of model tensor ``t``: host memory (pinned when ``t`` is on CUDA),
        holding ``t``'s value."""
        out = torch.empty(t.shape, dtype=dtype, device="cpu", pin_memory=t.device.type == "cuda")
        out.copy_(t.detach())
        return out

    def rebind(self, model_tensors: Sequence[torch.Tensor]) -> None:
        self.synchronize()
        for i, t in enumerate(model_tensors):
            s = self.staging[i]
            if s.shape != t.shape or s.dtype != t.dtype:
                self.staging[i] = self._buffer(t)

    def _stage(self, model_tensors: Sequence[torch.Tensor], which: Sequence[int]):
        cpu_dst = [self.staging[i] for i in which if model_tensors[i].device.type == "cpu"]
        cpu_src = [model_tensors[i] for i in which if model_tensors[i].device.type == "cpu"]
        if cpu_dst:
            torch._foreach_copy_(cpu_dst, [t.detach() for t in cpu_src])
        events = []
        by_device: dict[torch.device, list[int]] = {}
        for i in which:
            if model_tensors[i].device.type == "cuda":
                by_device.setdefault(model_tensors[i].device, []).append(i)
        for device, idx in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            main = torch.cuda.current_stream(device)
            stream.wait_stream(main)  # the weights as the step left them
            with torch.cuda.stream(stream):
                torch._foreach_copy_([self.staging[i] for i in idx],
                                     [model_tensors[i].detach() for i in idx], non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # the worker's wait sleeps, not spins
            event.record(stream)
            main.wait_event(event)  # later in-place writes come after the copy (device-side)
            events.append(event)
        return events

    def update(self, ema: Sequence[torch.Tensor], model_tensors: Sequence[torch.Tensor],
               decay: torch.Tensor, average_now: bool) -> None:
        """Stages and submits one update. ``average_now`` False (``update_every`` skips this
        step): only the copied tensors (buffers) are staged and copied."""
        self.synchronize()  # the staging buffers are free again
        which = [i for i, avg in enumerate(self.average) if avg and average_now or not avg]
        if not which:
            return
        events = self._stage(model_tensors, which)
        avg_ema = [ema[i] for i in which if self.average[i]]
        avg_src = [self.staging[i] for i in which if self.average[i]]
        copy_ema = [ema[i] for i in which if not self.average[i]]
        copy_src = [self.staging[i] for i in which if not self.average[i]]
        decay = decay.detach().to("cpu")

        def job() -> None:
            for event in events:
                event.synchronize()
            if avg_ema:
                torch.ops.fsdp_ema.update_(avg_ema, avg_src, decay)
            if copy_ema:
                torch._foreach_copy_(copy_ema, copy_src)

        self._pending = self._executor.submit(job)

    def synchronize(self) -> None:
        """Waits for the update in flight; re-raises its error (once)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.synchronize()
        self._executor.shutdown(wait=True)
