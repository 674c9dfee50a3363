"""Accelerate front-end for zero_strategy.

Two ways in:

- **No code change**: ``zero-strategy launch --zero-config zero3 train.py`` (or
  ``ZERO_STRATEGY_CONFIG=zero3 accelerate launch train.py``) runs an unmodified
  script's ``accelerator.prepare(model, optimizer, ...)`` on the engine, through a start-up hook
  installed with the package (``accelerate_zero._autostart``).
- **In code**: ``ZeroPlugin`` is not an Accelerate ``*Plugin`` (``Accelerator(...)`` does not
  accept it): build the Accelerator as usual, then let the plugin prepare the model and optimizer::

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    plugin = ZeroPlugin.from_env()            # ZERO_STRATEGY_CONFIG=zero3.yaml
    model, optimizer, loader, scheduler = plugin.prepare(accelerator, model, optimizer, loader, scheduler)

The names are imported on first use, so the start-up hook (``accelerate_zero._autostart``)
loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CONFIG_ENV", "ENV_PREFIX", "ZeroPlugin"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("accelerate_zero.plugin"), name)
    raise AttributeError(f"module 'accelerate_zero' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
