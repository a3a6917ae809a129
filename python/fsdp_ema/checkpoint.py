"""``fsdp_ema.checkpoint``: the public path of ``fsdp_ema.store.checkpoint``, the same module."""

import sys

from .store import checkpoint as _module

sys.modules[__name__] = _module
