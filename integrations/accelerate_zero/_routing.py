"""What the start-up hook's ``Accelerator.prepare`` does (``accelerate_zero._autostart``).

Kept apart from the hook so that the line Python runs at start-up imports nothing heavy: this
module imports torch and the plugin, and is loaded at the first ``prepare`` call only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accelerate_zero.plugin import CONFIG_ENV as REQUEST_ENV
from accelerate_zero.plugin import ZeroPlugin

__all__ = ["prepare_routed", "refuse_ddp"]

_PLUGIN_ATTR = "_zero_autostart_plugin"


def refuse_ddp(result: Any, call: str) -> None:
    """Raise if ``result`` is a model Accelerate wrapped in DDP although ZeRO was asked for."""
    if isinstance(result, nn.parallel.DistributedDataParallel):
        inner = type(result.module).__name__
        raise RuntimeError(
            f"{call}: {REQUEST_ENV} asks for the ZeRO engine, but Accelerate wrapped {inner} in "
            "DistributedDataParallel (plain DDP, no sharding). Prepare the model with its optimizer through "
            "accelerator.prepare(model, optimizer, ...), which the ZeRO start-up hook routes to the engine, "
            f"or unset {REQUEST_ENV} to train with DDP"
        )


def _plugin(accelerator: Any) -> ZeroPlugin:
    """One plugin per Accelerator, read from the environment at its first ``prepare``."""
    plugin = accelerator.__dict__.get(_PLUGIN_ATTR)
    if plugin is None:
        plugin = ZeroPlugin.from_env()
        setattr(accelerator, _PLUGIN_ATTR, plugin)
        if accelerator.is_main_process:  # one line, as DeepSpeed and FSDP announce themselves
            print(
                f"zero-strategy: accelerator.prepare runs models on the ZeRO-{plugin.config.stage} engine "
                f"({REQUEST_ENV}={os.environ.get(REQUEST_ENV)})",
                file=sys.stderr,
                flush=True,
            )
    return plugin


def _refuse_late_optimizer(accelerator: Any, objects: tuple[Any, ...]) -> None:
    """An optimizer whose model was prepared earlier, without it, by the engine."""
    binding = getattr(accelerator, "_zero_binding", None)
    if binding is None:
        return
    for opt in objects:
        if not isinstance(opt, torch.optim.Optimizer) or getattr(opt, "_is_accelerate_prepared", False):
            continue
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        for model, own in binding.entries:
            if own is None and any(id(p) in ids for p in model.parameters()):
                raise ValueError(
                    f"accelerator.prepare(optimizer): {type(model).__name__} was prepared by the ZeRO engine "
                    f"({REQUEST_ENV} is set) in an earlier call without this optimizer; the engine shards the "
                    "optimizer as it takes the model, so prepare both in one call: "
                    "accelerator.prepare(model, optimizer, ...)"
                )


def prepare_routed(
    accelerator: Any, objects: tuple[Any, ...], device_placement: Any, original: Callable[..., Any]
) -> Any:
    """``Accelerator.prepare`` under the hook, with ZeRO asked for: fresh models (with their optimizers) go to the
    engine through ``ZeroPlugin.from_env()``; anything else goes to Accelerate."""
    fresh = [o for o in objects if isinstance(o, nn.Module) and not getattr(o, "_is_accelerate_prepared", False)]
    if not fresh:
        _refuse_late_optimizer(accelerator, objects)
        return original(accelerator, *objects, device_placement=device_placement)
    if device_placement is not None:
        raise ValueError(
            f"accelerator.prepare(..., device_placement={device_placement!r}): with {REQUEST_ENV} set the models go "
            "to the ZeRO engine, which places them on the Accelerator's device itself; drop device_placement"
        )
    return _plugin(accelerator).prepare(accelerator, *objects)
