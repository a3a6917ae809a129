"""Adapters that keep a sharded EMA in the trainers people use (docs/INTEGRATIONS.md).

- ``fsdp_ema.integrations.lightning.ShardedEMA``: a Lightning ``Callback``
  (``pip install "fsdp-ema[lightning]"``);
- ``fsdp_ema.integrations.transformers.ShardedEMACallback``: a Hugging Face ``TrainerCallback``,
  which also serves Accelerate loops (``pip install "fsdp-ema[transformers]"``).
- ``fsdp_ema.integrations.diffusers.EMAModel``: a drop-in for diffusers' ``EMAModel`` in its
  training scripts (``pip install "fsdp-ema[diffusers]"``); its schedule is
  ``diffusers_schedule``'s, the folders it writes ``diffusers_files``'.

Each module imports its framework when it is imported (and raises one ``ImportError`` naming the
extra when the framework is missing); this package imports neither. The adapters only translate
the trainer's events into ``fsdp_ema.ShardedEMA`` calls: the averaging, the layouts and the files
are ShardedEMA's and fsdp_ema's, the options one ``fsdp_ema.EMAConfig``, and what both adapters
hold, check and do alike is ``common``'s (``CallbackCore``, the base of both). The Hugging Face
adapter's policy on the Trainer's checkpoint folders (which one a resume restored, the rotation
and the order it removes a folder in) is ``hf_checkpoints``'s, its evaluation with the EMA
weights ``hf_eval``'s.
"""

from .common import HeldSwap, missing_framework

__all__ = ["HeldSwap", "missing_framework"]
