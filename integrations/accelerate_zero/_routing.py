"""What the start-up hook's ``Accelerator.prepare`` does (``accelerate_zero._autostart``).

Kept apart from the hook so that the line Python runs at start-up imports nothing heavy: this
module imports torch and the plugin, and is loaded at the first ``prepare`` call only.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from accelerate_zero.plugin import CONFIG_ENV as REQUEST_ENV
from accelerate_zero.plugin import ZeroPlugin
from zero_strategy.runtime.optimizer import engine_of

__all__ = ["TRAINER_ATTR", "prepare_for_evaluation", "prepare_routed", "refuse_ddp"]

_PLUGIN_ATTR = "_zero_autostart_plugin"
TRAINER_ATTR = "_zero_trainer"  # a weak reference to the Trainer that built the Accelerator (accelerate_zero.trainer)


def _ddp_inside(model: Any) -> nn.parallel.DistributedDataParallel | None:
    """The DDP module inside ``model``, also under ``torch.compile``'s wrapper (``_orig_mod``)."""
    for _ in range(4):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model
        model = getattr(model, "_orig_mod", None)
        if model is None:
            return None
    return None


def refuse_ddp(result: Any, call: str) -> None:
    """Raise if ``result`` is a model Accelerate wrapped in DDP although ZeRO was asked for."""
    ddp = _ddp_inside(result)
    if ddp is not None:
        inner = type(ddp.module).__name__
        raise RuntimeError(
            f"{call}: {REQUEST_ENV} asks for the ZeRO engine, but Accelerate wrapped {inner} in "
            "DistributedDataParallel (plain DDP, no sharding). Prepare the model with its optimizer through "
            "accelerator.prepare(model, optimizer, ...), which the ZeRO start-up hook routes to the engine, "
            f"or unset {REQUEST_ENV} to train with DDP"
        )


# Models the engine took without an optimizer (evaluation models): an optimizer built
# elsewhere that steps their parameters would train nothing at ZeRO-3 and everything
# unsharded at ZeRO-1/2, so its step raises.
_WITHOUT_OPTIMIZER: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_STEP_HOOK: list[Any] = []


def _refuse_foreign_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _WITHOUT_OPTIMIZER:
        return
    try:
        engine_of(optimizer)
        return  # the engine's own optimizer
    except ValueError:
        pass
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model in list(_WITHOUT_OPTIMIZER):
        if any(id(p) in ids for p in model.parameters()):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(): it updates parameters of {type(model).__name__}, which "
                f"{REQUEST_ENV} gave to the ZeRO engine without an optimizer (accelerator.prepare(model) alone), so "
                "this step would not train it as sharded. Prepare both in one call: "
                "accelerator.prepare(model, optimizer, ...)"
            )


def _watch_models_without_optimizer(accelerator: Any) -> None:
    binding = getattr(accelerator, "_zero_binding", None)
    for model, optimizers in getattr(binding, "entries", ()):
        if not optimizers:  # the binding keeps a list of optimizers per model
            _WITHOUT_OPTIMIZER.add(model)
    if _WITHOUT_OPTIMIZER and not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_refuse_foreign_step))


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


def _attach_late_optimizers(accelerator: Any, objects: tuple[Any, ...]) -> tuple[Any, ...]:
    """Optimizers whose model the engine took earlier without one (``prepare(model)``, then
    ``prepare(optimizer)``: legal in Accelerate) are bound to that model's engine; ``objects``
    with them replaced by their wrappers. An optimizer over a model that has its optimizers is
    refused (the engine would step the parameters twice)."""
    binding = getattr(accelerator, "_zero_binding", None)
    if binding is None:
        return objects
    late: dict[int, tuple[nn.Module, list[torch.optim.Optimizer]]] = {}
    for opt in objects:
        if not isinstance(opt, torch.optim.Optimizer) or getattr(opt, "_is_accelerate_prepared", False):
            continue
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        for model, own in binding.entries:
            if not any(id(p) in ids for p in model.parameters()):
                continue
            if own:
                raise ValueError(
                    f"accelerator.prepare(optimizer): {type(model).__name__} was prepared by the ZeRO engine "
                    f"({REQUEST_ENV} is set) with its optimizer(s) already; this optimizer would step its parameters "
                    "a second time. Prepare one optimizer per set of parameters"
                )
            late.setdefault(id(model), (model, []))[1].append(opt)
    if not late:
        return objects
    from accelerate_zero.binding import attach_optimizers

    swapped: dict[int, Any] = {}
    for model, opts in late.values():
        for opt, wrapped in zip(opts, attach_optimizers(accelerator, model, opts)):
            swapped[id(opt)] = wrapped
            _WITHOUT_OPTIMIZER.discard(model)
    return tuple(swapped.get(id(o), o) for o in objects)


def _take_back_evaluation_only(objects: tuple[Any, ...]) -> None:
    """A model that Accelerate prepared for evaluation alone (``prepare_model(model,
    evaluation_mode=True)``: the Hugging Face ``Trainer``'s ``evaluate()`` before ``train()``)
    is a plain module with Accelerate's marks, and no DDP. Passed again with its optimizer, it
    must go to the engine like a fresh one (Accelerate would hand it back as it is, and the
    ranks would train it without reducing the gradients): its marks and autocast wrapper go."""
    ids = {id(p) for o in objects if isinstance(o, torch.optim.Optimizer) for g in o.param_groups for p in g["params"]}
    for model in objects:
        if (
            isinstance(model, nn.Module)
            and not isinstance(model, nn.parallel.DistributedDataParallel)
            and getattr(model, "_is_accelerate_prepared", False)
            and getattr(model, "_zero_engine", None) is None
            and any(id(p) in ids for p in model.parameters())
        ):
            model.__dict__.pop("_is_accelerate_prepared", None)
            if (
                "_original_forward" in model.__dict__
            ):  # Accelerate's autocast around forward: the engine applies its own
                model.__dict__.pop("forward", None)
                model.__dict__.pop("_original_forward", None)


def prepare_for_evaluation(accelerator: Any, model: Any) -> bool:
    """``accelerator.prepare_model(model, evaluation_mode=True)`` under the hook: at ZeRO-3 a
    fresh model that is not a ``Trainer``'s own goes to the engine without an optimizer
    (``zero_strategy.initialize(model, None)``), so each rank holds only its shards, and True is
    returned. TRL prepares its ``ref_model`` (and reward models) so outside DeepSpeed and FSDP;
    under DeepSpeed it builds an inference ZeRO-3 engine at stage 3 and keeps the model whole
    below (stage 0), which this follows. A ``Trainer``'s own model (``evaluate()`` before
    ``train()``) is trained later: it keeps Accelerate's plain prepare (False), and so does any
    model below ZeRO-3, or one already prepared, wrapped or on another engine."""
    if not isinstance(model, nn.Module) or getattr(model, "_is_accelerate_prepared", False):
        return False
    if getattr(model, "_zero_engine", None) is not None or _ddp_inside(model) is not None:
        return False
    trainer_ref = accelerator.__dict__.get(TRAINER_ATTR)
    trainer = trainer_ref() if trainer_ref is not None else None
    own = getattr(trainer, "model", None)
    if own is not None and (model is own or model in set(own.modules())):
        return False
    plugin = _plugin(accelerator)
    if int(plugin.config.stage) != 3:
        return False
    plugin.prepare(accelerator, model)
    _watch_models_without_optimizer(accelerator)
    return True


def prepare_routed(
    accelerator: Any, objects: tuple[Any, ...], device_placement: Any, original: Callable[..., Any]
) -> Any:
    """``Accelerator.prepare`` under the hook, with ZeRO asked for: fresh models (with their optimizers) go to the
    engine through ``ZeroPlugin.from_env()``; anything else goes to Accelerate."""
    _take_back_evaluation_only(objects)
    fresh = [o for o in objects if isinstance(o, nn.Module) and not getattr(o, "_is_accelerate_prepared", False)]
    if not fresh:
        objects = _attach_late_optimizers(accelerator, objects)
        return original(accelerator, *objects, device_placement=device_placement)
    for model in fresh:
        if _ddp_inside(model) is not None:
            raise ValueError(
                f"accelerator.prepare({type(model).__name__}): the model is already wrapped in "
                f"DistributedDataParallel; with {REQUEST_ENV} set the ZeRO engine replaces DDP: pass the plain model"
            )
    if device_placement is not None:
        raise ValueError(
            f"accelerator.prepare(..., device_placement={device_placement!r}): with {REQUEST_ENV} set the models go "
            "to the ZeRO engine, which places them on the Accelerator's device itself; drop device_placement"
        )
    prepared = _plugin(accelerator).prepare(accelerator, *objects)
    _watch_models_without_optimizer(accelerator)
    return prepared
