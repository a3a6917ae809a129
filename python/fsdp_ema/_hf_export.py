"""A streaming writer of consolidated Hugging Face safetensors directories.

``ShardedEMA.export`` knows every tensor's name, shape and dtype before it gathers anything, so
the whole layout (which file each tensor goes to, its byte range, every header) is planned up
front and the data of each tensor is written at its planned offset whenever its bucket arrives.
Nothing is held beyond one bucket, and tensors need not arrive in file order.

Each file is a plain safetensors file: 8-byte little-endian header length, a JSON header
(``"__metadata__": {"format": "pt"}``, padded with spaces so the data starts 64-byte aligned),
then the tensors' bytes back to back. Within a file tensors are ordered by element size, largest
first, so every tensor's data is naturally aligned (mmap-usable in place), as in our shard files.
We write the format ourselves because the ``safetensors`` package's writer takes the whole
state dict at once.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_HEADER_ALIGN = 64

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def file_name(k: int, n: int) -> str:
    return SINGLE_NAME if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def is_export_file(name: str) -> bool:
    """A weight file or index of the layout we write (what an overwrite replaces)."""
    if name in (SINGLE_NAME, INDEX_NAME):
        return True
    parts = name.removesuffix(".safetensors").split("-")
    return (name.endswith(".safetensors") and len(parts) == 4 and parts[0] == "model"
            and parts[2] == "of" and parts[1].isdigit() and parts[3].isdigit())


class Entry(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


class Plan:
    """Which file holds each tensor and where: tensors go to files in the order given, a new
    file starts when the next tensor would take the current one past ``max_file_bytes`` of
    tensor data (a tensor larger than that gets a file of its own)."""

    def __init__(self, entries: Sequence[Entry], max_file_bytes: int):
        for e in entries:
            if e.dtype not in _DTYPES:
                raise TypeError(f"export: {e.name!r} has dtype {e.dtype}, which safetensors "
                                f"cannot store")
        files: list[list[Entry]] = [[]]
        size = 0
        for e in entries:
            if files[-1] and size + e.nbytes > max_file_bytes:
                files.append([])
                size = 0
            files[-1].append(e)
            size += e.nbytes
        n = len(files)
        self.names = [file_name(k, n) for k in range(n)]
        self.where: dict[str, tuple[int, int]] = {}  # tensor -> (file, absolute byte offset)
        self.headers: list[bytes] = []
        self.sizes: list[int] = []
        self.total_size = sum(e.nbytes for e in entries)
        for k, members in enumerate(files):
            members = sorted(members, key=lambda e: -torch.empty((), dtype=e.dtype).element_size())
            header: dict = {"__metadata__": {"format": "pt"}}
            pos = 0
            for e in members:
                header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape),
                                  "data_offsets": [pos, pos + e.nbytes]}
                pos += e.nbytes
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-(8 + len(text)) % _HEADER_ALIGN)
            start = 8 + len(text)
            self.headers.append(len(text).to_bytes(8, "little") + text)
            self.sizes.append(start + pos)
            for e in members:
                self.where[e.name] = (k, start + header[e.name]["data_offsets"][0])

    def weight_map(self) -> dict[str, str]:
        return {name: self.names[k] for name, (k, _) in sorted(self.where.items())}


class Writer:
    """Writes a ``Plan`` into ``directory``: temporary hidden files first, every tensor at its
    offset, then (``commit``) fsync, rename into place, index last."""

    def __init__(self, directory: str, plan: Plan):
        if sys.byteorder != "little":
            raise NotImplementedError("export: safetensors data is little-endian; this host is not")
        self.directory, self.plan = directory, plan
        self._tmp = [os.path.join(directory, f".{name}.tmp-{os.getpid()}") for name in plan.names]
        self._files = []
        for path, header, size in zip(self._tmp, plan.headers, plan.sizes):
            f = open(path, "wb")
            self._files.append(f)
            f.write(header)
            f.truncate(size)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        k, offset = self.plan.where[name]
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        f = self._files[k]
        f.seek(offset)
        f.write(memoryview(data.numpy()))

    def commit(self) -> None:
        for f in self._files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        # Renames only, in an order that shows a reader the earlier export, none, or this one,
        # never a mix (as format/export.cpp does): the earlier index first (its numbered files
        # are then no export), then the earlier files this export does not rename over, then
        # the new weight files, the new index last.
        index_path = os.path.join(self.directory, INDEX_NAME)
        if os.path.lexists(index_path):
            os.remove(index_path)
            _fsync_dir(self.directory)
        for stale in os.listdir(self.directory):
            if is_export_file(stale) and stale not in self.plan.names and stale != INDEX_NAME:
                os.remove(os.path.join(self.directory, stale))
        for tmp, name in zip(self._tmp, self.plan.names):
            os.replace(tmp, os.path.join(self.directory, name))
        if len(self.plan.names) > 1:
            index = {"metadata": {"total_size": self.plan.total_size},
                     "weight_map": self.plan.weight_map()}
            tmp = os.path.join(self.directory, f".{INDEX_NAME}.tmp-{os.getpid()}")
            with open(tmp, "w") as f:
                json.dump(index, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.directory, INDEX_NAME))
        _fsync_dir(self.directory)

    def abort(self) -> None:
        for f, path in zip(self._files, self._tmp):
            f.close()
            if os.path.exists(path):
                os.remove(path)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
