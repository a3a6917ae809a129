"""``fsdp_ema.momentum``: the public path of ``fsdp_ema.ema.momentum``, the same module."""

import sys

from .ema import momentum as _module

sys.modules[__name__] = _module
