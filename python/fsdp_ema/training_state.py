"""``fsdp_ema.training_state``: the public path of ``fsdp_ema.store.training_state``."""

import sys

from .store import training_state as _module

sys.modules[__name__] = _module
