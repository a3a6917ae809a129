"""``fsdp_ema.config``: the public path of ``fsdp_ema.ema.config``, the same module."""

import sys

from .ema import config as _module

sys.modules[__name__] = _module
