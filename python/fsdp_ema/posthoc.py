"""``fsdp_ema.posthoc``: the public path of ``fsdp_ema.store.posthoc``, the same module."""

import sys

from .store import posthoc as _module

sys.modules[__name__] = _module
