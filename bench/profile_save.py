"""Where a 1 GiB save's time goes (issue 29, step 1): one method per process, so that
`strace -c -f` and `perf stat` around it count that method alone.

    python bench/profile_save.py METHOD [--dir /dev/shm/x] [--repeat 3] [--fsync]
    strace -c -f -o trace.txt python bench/profile_save.py ours --fsync
    perf stat -e task-clock,page-faults,context-switches python bench/profile_save.py ours

METHOD: ours (fsdp_ema.checkpoint.save), safetensors (save_file), torch (torch.save), raw (one
write of the same bytes). The state is bench_checkpoint.py's: 1 GiB in 300 fp32 tensors of a
GPT-like size spread. It prints, per save, the wall and CPU seconds and the page faults of the
save itself (resource.getrusage around it), so the setup (making the state) is told apart from
the save in the counts the wrappers print for the whole process.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import make_state  # noqa: E402
from rawio import raw_write, synced  # noqa: E402


def saver(method: str, state: dict, work: Path, fsync: bool):
    if method == "ours":
        import fsdp_ema.checkpoint as ckpt

        return lambda: ckpt.save(work / "ours", state, fsync=fsync)
    if method == "safetensors":
        from safetensors.torch import save_file

        path = work / "m.safetensors"
        save = lambda: save_file(state, str(path))  # noqa: E731
        return synced(save, path) if fsync else save
    if method == "torch":
        path = work / "m.pt"
        save = lambda: torch.save(state, path)  # noqa: E731
        return synced(save, path) if fsync else save
    if method == "raw":
        flat = torch.cat([t.reshape(-1) for t in state.values()])
        return lambda: raw_write(work / "raw.bin", flat)
    raise SystemExit(f"profile_save.py: unknown method {method!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", choices=("ours", "safetensors", "torch", "raw"))
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm/fsdp_ema_profile_save"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--fsync", action="store_true")
    args = parser.parse_args()
    state = make_state(args.gigabytes, 300)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    save = saver(args.method, state, args.dir, args.fsync)
    try:
        for i in range(args.repeat):
            before = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            save()
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            sys_s = after.ru_stime - before.ru_stime
            print(f"{args.method} save {i}: wall {wall:.3f} s, cpu {cpu:.3f} s (sys {sys_s:.3f}), "
                  f"minor faults {after.ru_minflt - before.ru_minflt}, "
                  f"major {after.ru_majflt - before.ru_majflt}", flush=True)
            shutil.rmtree(args.dir)  # every save writes new files, as in bench_checkpoint.py
            args.dir.mkdir()
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
