"""Accelerate front-end for zero_strategy: ``ZeroPlugin``.

``ZeroPlugin`` is not an Accelerate ``*Plugin`` (``Accelerator(...)`` does not accept it):
build the Accelerator as usual, then let the plugin prepare the model and optimizer::

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    plugin = ZeroPlugin.from_env()            # ZERO_STRATEGY_CONFIG=zero3.yaml
    model, optimizer, loader, scheduler = plugin.prepare(accelerator, model, optimizer, loader, scheduler)
"""

from accelerate_zero.plugin import CONFIG_ENV, ENV_PREFIX, ZeroPlugin

__all__ = ["CONFIG_ENV", "ENV_PREFIX", "ZeroPlugin"]
