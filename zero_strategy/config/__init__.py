"""Layer 1, configuration: :class:`ZeroConfig` with DeepSpeed's key names, its sub-blocks
(precision, loss scale, offload, compression, load balance) and the value rules every field is
declared with. Typed, frozen and validated on construction.

May import: nothing of zero_strategy but its own modules (the bottom layer, with ``_swap`` and
``_version``). The public names are re-exported here, so ``zero_strategy.config.ZeroConfig``
stays a valid import path.
"""

from zero_strategy.config.blocks import (
    DTYPES,
    FRONTEND_PRECISION,
    PRECISION_NAMES,
    LossScaleConfig,
    OffloadConfig,
    PrecisionConfig,
    frontend_precision,
)
from zero_strategy.config.overrides import not_applied_settings, resolve_overrides, warn_not_applied
from zero_strategy.config.values import ConfigError
from zero_strategy.config.zero_config import ZeroConfig, preset_names

__all__ = [
    "DTYPES",
    "ConfigError",
    "FRONTEND_PRECISION",
    "PRECISION_NAMES",
    "LossScaleConfig",
    "OffloadConfig",
    "PrecisionConfig",
    "ZeroConfig",
    "frontend_precision",
    "not_applied_settings",
    "preset_names",
    "resolve_overrides",
    "warn_not_applied",
]
