"""An EMA kept in host memory (``ShardedEMA(..., device="cpu")`` for a model on an accelerator).

Each ``update()`` copies the tensors this rank holds (FSDP2: the local shards, plain tensors, so
nothing pins a DTensor) into staging buffers in pinned host memory, in their own dtype (bf16
stays bf16 over the bus), on a side stream, and hands the fused CPU ``update_`` to a worker
thread, which waits for the copy and updates the EMA while the next step runs. The copy overlaps
the next forward and backward (they only read the weights): the training's stream waits for it
(on the device, not the host) at the next optimizer step (a global optimizer step pre-hook),
so the optimizer's in-place write cannot race it; ``synchronize()`` and the next ``update()``
wait for it on the host. Code that writes the weights some other way between ``update()`` and
the next ``update()`` calls ``synchronize()`` first.

One update is in flight at a time: the next ``update()``, ``synchronize()`` and every read of the
EMA wait for it (the staging buffers are reused). For a model on the CPU the same path (staging
snapshot, worker thread, synchronize) runs when forced (``forced_for_cpu_models()``, a test hook
outside the public API), so that the logic is tested without a device.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch

from .. import _ops

_forced = False


@contextlib.contextmanager
def forced_for_cpu_models() -> Iterator[None]:
    """Tests and benchmarks: an EMA made inside with ``device="cpu"`` takes the host-memory path
    (staging, worker thread) for a model on the CPU too."""
    global _forced
    before, _forced = _forced, True
    try:
        yield
    finally:
        _forced = before


class HostOffload:
    """Staging buffers and the worker of one offloaded EMA."""

    def __init__(self, model_tensors: Sequence[torch.Tensor], average: Sequence[bool]):
        self.average = list(average)
        self.staging = [self._buffer(t) for t in model_tensors]
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="fsdp_ema-offload")
        self._pending: concurrent.futures.Future | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # Copies the training's stream has not waited for yet: waited for on the device at the
        # next optimizer step, or done once the host has waited for the update.
        self._device_waits: list[tuple[torch.device, torch.cuda.Event]] = []
        self._hook = None

    @staticmethod
    def wanted(device, model_tensors: Sequence[torch.Tensor]) -> bool:
        """Whether an EMA of ``device`` (``EMAConfig.device``) over ``model_tensors`` lives in host
        memory: ``"cpu"`` for weights on an accelerator (or forced, for tests)."""
        return device is not None and (_forced or any(t.device.type != "cpu"
                                                      for t in model_tensors))

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
            self._device_waits.append((device, event))
            events.append(event)
        if events and self._hook is None:
            self._hook = _register_step_wait(self)
        return events

    def wait_on_device(self) -> None:
        """Makes each device's current stream wait for the copies in flight (no host wait)."""
        waits, self._device_waits = self._device_waits, []
        for device, event in waits:
            torch.cuda.current_stream(device).wait_event(event)

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
                _ops.update_(avg_ema, avg_src, decay)
            if copy_ema:
                torch._foreach_copy_(copy_ema, copy_src)

        self._pending = self._executor.submit(job)

    def synchronize(self) -> None:
        """Waits for the update in flight; re-raises its error (once)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            finally:
                # The job waited for the copies' events before running (or failed): the
                # device's streams need no wait for them any more.
                self._device_waits = []

    def close(self) -> None:
        self.synchronize()
        self._executor.shutdown(wait=True)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _register_step_wait(offload: HostOffload):
    """A global optimizer step pre-hook that makes the training's stream wait for ``offload``'s
    copies in flight before any optimizer writes the weights; removed with ``offload``."""
    ref = weakref.ref(offload)

    @torch._dynamo.disable  # stream waits run eagerly even under a compiled optimizer step
    def before_step(optimizer, args, kwargs):
        me = ref()
        if me is not None and me._device_waits:
            me.wait_on_device()

    handle = torch.optim.optimizer.register_optimizer_step_pre_hook(before_step)
    weakref.finalize(offload, handle.remove)
    return handle
