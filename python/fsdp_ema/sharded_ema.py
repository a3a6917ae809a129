"""``fsdp_ema.sharded_ema``: the public path of ``fsdp_ema.ema.sharded``, the same module."""

import sys

from .ema import sharded as _module

sys.modules[__name__] = _module
