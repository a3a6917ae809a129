"""Small collective and dtype helpers shared by ShardedEMA, its FSDP1 layout code and the
training-state code (the row rule ``chunk_rows`` is in ``model.layouts``)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def check_dtype_kind(name: str, saved: torch.dtype, here: torch.dtype) -> None:
    """Raises TypeError unless ``saved`` and ``here`` are of one kind (floating, integer, bool,
    complex). Floating precision may change on a load (a float32 checkpoint into bfloat16);
    an integer into a float (an optimizer's step, say) or back would be a silent cast."""
    def kind(d: torch.dtype) -> str:
        if d == torch.bool:
            return "bool"
        if d.is_complex:
            return "complex"
        return "floating" if d.is_floating_point else "integer"

    if kind(saved) != kind(here):
        raise TypeError(f"{name!r} is {saved} in the checkpoint but {here} here (no silent "
                        f"{kind(saved)}-to-{kind(here)} cast)")


def comm_device(group: dist.ProcessGroup | None, preferred: torch.device) -> torch.device:
    """A device ``group``'s backend can run collectives on, ``preferred`` when it can."""
    backend = str(dist.get_backend(group)).lower()
    if preferred.type == "cpu" and "gloo" not in backend and "cpu" not in backend:
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    if preferred.type != "cpu" and "gloo" in backend and preferred.type not in backend:
        return torch.device("cpu")
    return preferred


def raise_if_any_rank_failed(error: BaseException | None, group: dist.ProcessGroup | None,
                             what: str, device: torch.device) -> None:
    """Collective: every rank raises if any rank passes an error, naming the ranks that failed.

    Call it where every rank arrives whether or not its own part succeeded, so that one rank's
    failure cannot leave the others waiting in a later collective.
    """
    if group is None:
        if error is not None:
            raise error
        return
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32,
                        device=comm_device(group, device))
    flags[dist.get_rank(group)] = int(error is not None)
    dist.all_reduce(flags, group=group)
    failed = flags.nonzero().flatten().tolist()
    if not failed:
        return
    if error is not None:
        raise RuntimeError(f"{what} failed on rank(s) {failed}; here: {error}") from error
    raise RuntimeError(f"{what} failed on rank(s) {failed} (their errors say why)")


def default_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """``group``; when None, the default group if torch.distributed is initialized, else None (a
    single process): the group every collective of the library runs over unless told."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without one (a single process)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def broadcast_int(value: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """Collective: ``value`` of rank 0 of ``group``, on every rank."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=comm_device(group, device))
    dist.broadcast(t, group=group, group_src=0)
    return int(t.item())
