"""Which committed training-state checkpoints a root directory holds: ``latest_checkpoint`` (where
a run resumes) and the ``keep_last`` rotation of ``save_training_state``. The directory work is
format/'s (``committed_checkpoints``, ``remove_checkpoint``); this module only picks the names.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import _ops
from . import checkpoint as _ckpt
from .training_doc import META_TENSOR


def _is_training_state(path: str) -> bool:
    try:
        return META_TENSOR in _ckpt.info(path)["tensors"]
    except Exception:  # noqa: BLE001 (unreadable: not a checkpoint we may count or remove)
        return False


def _committed(root: str, follow_links: bool) -> list[str]:
    return [name for name in _ops.committed_checkpoints(root, follow_links)
            if _is_training_state(os.path.join(root, name))]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The last (in name order) committed training-state checkpoint directory in ``root``, or
    None. Directories without an index (a save that did not finish) are skipped."""
    committed = _committed(os.fspath(root), follow_links=True)
    return Path(root) / committed[-1] if committed else None


def rotate(new: str, keep_last: int) -> None:
    """Removes committed checkpoints beside ``new`` beyond the last ``keep_last`` (name order),
    never ``new`` itself. Only real directories directly in the root count and are removed: a
    symbolic link (to a checkpoint elsewhere, say) is neither followed nor touched
    (``remove_checkpoint`` opens everything without following links, so nothing outside the root
    is ever changed). Each goes index first, so an interrupted removal leaves an incomplete
    directory, never a committed one with missing files. Raises on the first failure (the caller
    warns: the new checkpoint is committed by then)."""
    new = os.path.abspath(new)
    root, new_name = os.path.dirname(new), os.path.basename(new)
    for name in _committed(root, follow_links=False)[:-keep_last]:
        if name != new_name:
            _ops.remove_checkpoint(os.path.join(root, name))
