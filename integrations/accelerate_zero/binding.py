"""What ``ZeroPlugin.prepare`` does to one Accelerator instance.

Accelerate 1.15 has no hook for another data-parallel engine, and several of its plain-path
methods would give wrong results for a ZeRO model, so ``prepare`` binds replacements onto that
Accelerator *instance* (the class is untouched, other Accelerators are unaffected):

- The model is initialized by ``zero_strategy`` and flagged ``_is_accelerate_prepared``, so
  Accelerate tracks it without DDP and without its autocast wrapper (the engine runs the
  forward under autocast itself in bf16/fp16).
- ``backward``: divides by ``gradient_accumulation_steps`` (as Accelerate does) and scales by
  the engine's fp16 loss scale; Accelerate's ``GradScaler`` is turned off (it would scale
  again and check overflows per rank; the engine checks on every rank at once).
- ``clip_grad_norm_``: the global norm over all ranks' shards (Accelerate's plain path runs
  ``torch.nn.utils.clip_grad_norm_`` over ``p.grad``: a local or zero norm at ZeRO-2/3). It
  clips at the micro-step that synchronises; on the others it returns None.
- ``clip_grad_value_`` clips this rank's averaged gradient pieces; ``unscale_gradients`` is a
  no-op (gradients are unscaled as they are reduced).
- ``get_state_dict``: the full weights gathered to rank 0 (other ranks get ``{}``), for
  ``save_pretrained``.
- ``save_state``/``load_state``: save and load pre-hooks write the model and optimizer shards
  through ``zero_strategy.save_checkpoint`` (subdirectory ``zero_strategy_model``), which
  loads at any number of processes; Accelerate itself saves a small marker for the optimizer
  (its own code would write rank 0's shard only) and no full model weights.
"""

from __future__ import annotations

import contextlib
import os
from types import MethodType
from typing import Any, Callable, Iterator

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType, convert_outputs_to_fp32
from torch import nn

import zero_strategy as zs

from accelerate_zero.plugin import ZeroPlugin, find_model_and_optimizer

__all__ = ["CHECKPOINT_DIR", "OPTIMIZER_MARKER", "ZeroAcceleratedOptimizer", "prepare_with_zero"]

CHECKPOINT_DIR = "zero_strategy_model"
OPTIMIZER_MARKER = "zero_strategy_sharded_optimizer"
_SUPPORTED_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper (``step``/``zero_grad`` act only on the micro-step that
    synchronises) around the engine's optimizer. ``step_was_skipped`` reports an fp16 overflow
    found by the engine; ``state_dict()`` is a marker, because this rank's state is only a
    shard: checkpoints go through ``accelerator.save_state`` or ``zero_strategy.save_checkpoint``."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._zero_model = model

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if not self.gradient_state.sync_gradients:
            return  # accumulating: as AcceleratedOptimizer, step on the synchronising micro-step only
        # (no scaler, no XLA: what AcceleratedOptimizer.step does reduces to this)
        self.optimizer.step(closure)
        self._is_overflow = self.optimizer.step_was_skipped

    def state_dict(self) -> dict[str, Any]:
        return {OPTIMIZER_MARKER: True, "saved_in": CHECKPOINT_DIR}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if isinstance(state_dict, dict) and state_dict.get(OPTIMIZER_MARKER):
            return  # the shards were loaded by the load_state pre-hook
        raise ValueError(
            "ZeroAcceleratedOptimizer.load_state_dict(): this is a full (non-ZeRO) optimizer state; the ZeRO "
            "optimizer loads sharded state only. Load a checkpoint written by accelerator.save_state with "
            "ZeroPlugin, or by zero_strategy.save_checkpoint"
        )


class _Marker(dict):
    """The model's entry in the weights list during ``save_state`` (removed by the pre-hook)."""


class _Binding:
    """The state shared by the functions bound onto one Accelerator."""

    def __init__(self, accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.saving = False
        self.marker = _Marker()
        self.loaded_step: int | None = None

    def owns(self, model: Any) -> bool:
        return model is self.model or self.accelerator.unwrap_model(model) is self.model

    # -- bound methods -----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        kwargs.pop("learning_rate", None)  # LOMO's argument; not a ZeRO optimizer
        zs.backward(loss / self.accelerator.gradient_accumulation_steps, model=self.model, **kwargs)

    def _check_whole_model(self, parameters: Any, call: str) -> None:
        given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ids = {id(p) for p in given}
        every = {id(p) for p in self.model.parameters()}
        trainable = {id(p) for p in self.model.parameters() if p.requires_grad}
        if not (trainable <= ids <= every):
            raise ValueError(
                f"accelerator.{call}(parameters=<{len(given)} tensors>): with ZeroPlugin the gradients are "
                "sharded across processes, so clip the whole model: pass model.parameters() of the model "
                "prepared by ZeroPlugin.prepare"
            )

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor | None:
        self._check_whole_model(parameters, "clip_grad_norm_")
        if not self.accelerator.sync_gradients:
            return None  # gradients are still accumulating: they are clipped at the synchronising micro-step
        return zs.clip_grad_norm_(self.model, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self._check_whole_model(parameters, "clip_grad_value_")
        if not self.accelerator.sync_gradients:
            return
        self.optimizer.clip_grad_value_(clip_value)  # element-wise on this rank's averaged pieces

    def unscale_gradients(self, optimizer: Any = None) -> None:
        return None  # the engine unscales fp16 gradients as it reduces them

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        if not self.owns(model):
            return Accelerator.get_state_dict(self.accelerator, model, unwrap=unwrap)
        if self.saving:
            return self.marker  # save_state: the shards are written by the pre-hook instead
        return zs.full_state_dict(self.model)  # collective; rank 0 gets the weights, others {}

    # -- save_state / load_state -------------------------------------------------------------
    def save_hook(self, models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        weights[:] = [w for w in weights if w is not self.marker]
        # keep_last=1: saving again into the same directory replaces it, as plain Accelerate does
        zs.save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), self.model, self.optimizer, extra=self._extra(), keep_last=1)

    def load_hook(self, models: list[nn.Module], input_dir: str) -> None:
        models[:] = [m for m in models if m is not self.model]
        root = os.path.join(input_dir, CHECKPOINT_DIR)
        if not os.path.isdir(root):
            raise FileNotFoundError(
                f"accelerator.load_state({input_dir!r}): no {CHECKPOINT_DIR}/ inside; the directory was not written "
                "by accelerator.save_state with ZeroPlugin, so it holds no ZeRO shards to load"
            )
        extra = zs.load_checkpoint(root, self.model, self.optimizer)
        self.loaded_step = extra.get("accelerate_step")

    def _extra(self) -> dict[str, Any]:
        # lr and the other param-group settings are restored by zero_strategy.load_checkpoint
        return {"accelerate_step": int(self.accelerator.step)}


def _check_accelerator(accelerator: Any) -> None:
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"ZeroPlugin.prepare(accelerator=...): expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    if accelerator.distributed_type not in _SUPPORTED_TYPES:
        raise ValueError(
            f"ZeroPlugin.prepare(): the Accelerator runs {accelerator.distributed_type}; ZeroPlugin replaces DDP and works "
            "with plain data parallelism only (distributed_type NO, MULTI_CPU or MULTI_GPU). Remove the DeepSpeed/FSDP/"
            "Megatron settings from the accelerate config"
        )
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and (getattr(pc, "tp_enabled", False) or getattr(pc, "cp_enabled", False)):
        raise ValueError("ZeroPlugin.prepare(): tensor or context parallelism is not supported; remove parallelism_config")
    if getattr(accelerator, "_zero_binding", None) is not None:
        raise RuntimeError(
            "ZeroPlugin.prepare(): this Accelerator already has a ZeroPlugin model; prepare one ZeRO model per "
            "Accelerator (its backward, clip_grad_norm_ and save_state are bound to that model)"
        )


@contextlib.contextmanager
def _flag(binding: _Binding) -> Iterator[None]:
    binding.saving = True
    try:
        yield
    finally:
        binding.saving = False


def _bind(accelerator: Accelerator, binding: _Binding) -> None:
    save_state, load_state = accelerator.save_state, accelerator.load_state

    def bound_save_state(output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        with _flag(binding):
            return save_state(output_dir, safe_serialization, **kwargs)

    def bound_load_state(input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        binding.loaded_step = None
        load_state(input_dir, load_kwargs, **kwargs)
        if binding.loaded_step is not None:  # the same on every rank, also ranks the save did not have
            accelerator.step = binding.loaded_step

    for name in ("backward", "clip_grad_norm_", "clip_grad_value_", "unscale_gradients", "get_state_dict"):
        setattr(accelerator, name, getattr(binding, name))
    accelerator.save_state = bound_save_state  # type: ignore[method-assign]
    accelerator.load_state = bound_load_state  # type: ignore[method-assign]
    accelerator.register_save_state_pre_hook(binding.save_hook)
    accelerator.register_load_state_pre_hook(binding.load_hook)
    accelerator._zero_binding = binding  # type: ignore[attr-defined]


def prepare_with_zero(plugin: ZeroPlugin, accelerator: Any, objects: tuple[Any, ...]) -> Any:
    _check_accelerator(accelerator)
    model, optimizer = find_model_and_optimizer(objects)
    if getattr(model, "_is_accelerate_prepared", False) or getattr(optimizer, "_is_accelerate_prepared", False):
        raise ValueError(
            "ZeroPlugin.prepare(): the model or optimizer was already passed to accelerator.prepare (DDP-wrapped); "
            "pass the plain model and optimizer to ZeroPlugin.prepare instead"
        )
    config = plugin.resolved_config(accelerator)
    steps = config.gradient_accumulation_steps
    if steps not in (None, 1) and accelerator.gradient_accumulation_steps == 1:
        accelerator.gradient_accumulation_steps = steps  # the file's setting, which accumulate() runs
    # The Accelerator owns accumulation (loss division, no_sync, skipped steps); the engine
    # only needs to agree with it, which resolved_config checked.
    engine_config = config.replace(gradient_accumulation_steps=None)
    if accelerator.device_placement:
        model.to(accelerator.device)
    model, optimizer = zs.initialize(model, optimizer, config=engine_config, policy=plugin.policy)
    if config.precision.param_dtype is not None:
        # as Accelerate's own mixed precision: the engine autocasts inside forward, the outputs
        # come back in fp32 (a loss computed from them outside forward is computed in fp32)
        model._original_forward = model.forward
        model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)
    wrapped = ZeroAcceleratedOptimizer(optimizer, model)
    model._is_accelerate_prepared = True  # tracked by the Accelerator, not wrapped in DDP or autocast
    wrapped._is_accelerate_prepared = True
    accelerator.scaler = None  # the engine's loss scaler replaces Accelerate's GradScaler
    _bind(accelerator, _Binding(accelerator, model, optimizer))
    swapped = tuple(wrapped if o is optimizer else o for o in objects)
    return accelerator.prepare(*swapped)
