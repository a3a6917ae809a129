"""``fsdp_ema.power_ema``: the public path of ``fsdp_ema.ema.power``, the same module."""

import sys

from .ema import power as _module

sys.modules[__name__] = _module
