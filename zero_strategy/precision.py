"""Precision policies and the fp16 dynamic loss scaler.

- :class:`FullPrecision`: parameters, gradients and optimizer in fp32 (or whatever dtype the
  model has, float64 included). No autocast.
- :class:`MixedPrecision`: the model's parameters are stored in ``param_dtype`` (bf16 or fp16);
  each rank keeps an fp32 master copy of its shard only. The forward runs under
  ``torch.autocast(dtype=param_dtype)``, so the casts are exactly the ones autocast makes.
  Gradients are reduced in ``reduce_dtype`` (fp32 by default).

The loss scaler is used for fp16 only. ``scale_loss`` multiplies the loss; gradients are
unscaled as they are reduced; an overflow on any rank makes every rank skip the step, and the
scale is multiplied by 0.5 (after ``hysteresis`` overflows) and doubled after
``loss_scale_window`` good steps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch

from zero_strategy.config import LossScaleConfig, PrecisionConfig

__all__ = ["FullPrecision", "LossScaler", "MixedPrecision", "PrecisionPolicy", "select_precision"]


@dataclass(frozen=True)
class FullPrecision:
    reduce_dtype: torch.dtype | None = None  # None: the parameter's own dtype

    def param_dtype_for(self, p: torch.Tensor) -> torch.dtype:
        return p.dtype

    def master_dtype_for(self, p: torch.Tensor) -> torch.dtype:
        return p.dtype

    def grad_reduce_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.reduce_dtype or p.dtype

    def forward_context(self, device_type: str) -> ContextManager[None]:
        return contextlib.nullcontext()

    @property
    def uses_loss_scaling(self) -> bool:
        return False


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32

    def param_dtype_for(self, p: torch.Tensor) -> torch.dtype:
        return self.param_dtype if p.is_floating_point() else p.dtype

    def master_dtype_for(self, p: torch.Tensor) -> torch.dtype:
        return self.master_dtype if p.is_floating_point() else p.dtype

    def grad_reduce_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.reduce_dtype

    def forward_context(self, device_type: str) -> ContextManager[None]:
        return torch.autocast(device_type=device_type, dtype=self.param_dtype)

    @property
    def uses_loss_scaling(self) -> bool:
        return self.param_dtype == torch.float16


PrecisionPolicy = FullPrecision | MixedPrecision


def select_precision(cfg: PrecisionConfig) -> PrecisionPolicy:
    if cfg.param_dtype is None:
        explicit_reduce = cfg.reduce_dtype if cfg.reduce_dtype != torch.float32 else None
        return FullPrecision(reduce_dtype=explicit_reduce)
    return MixedPrecision(param_dtype=cfg.param_dtype, reduce_dtype=cfg.reduce_dtype)


class LossScaler:
    """Dynamic (or static, when ``loss_scale > 0``) loss scale for fp16, with DeepSpeed's
    semantics: an overflow halves the scale once ``hysteresis`` overflows have been absorbed
    (the allowance refills when the scale grows, or after every good step with
    ``consecutive_hysteresis``); ``loss_scale_window`` good steps in a row double it."""

    def __init__(self, cfg: LossScaleConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.dynamic = cfg.dynamic
        self.scale = float(cfg.loss_scale if cfg.loss_scale > 0 else 2.0**cfg.initial_scale_power) if enabled else 1.0
        self._cfg = cfg
        self._good_steps = 0
        self._hysteresis_left = cfg.hysteresis
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        """Called once per optimizer step, on every rank with the same ``found_inf``."""
        if not self.enabled:
            return
        cfg = self._cfg
        if found_inf:
            self.skipped_steps += 1
            self._good_steps = 0
            if not self.dynamic:
                return
            if self._hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, cfg.min_loss_scale)
            else:
                self._hysteresis_left -= 1
            return
        self._good_steps += 1
        if cfg.consecutive_hysteresis:
            self._hysteresis_left = cfg.hysteresis
        if self.dynamic and self._good_steps % cfg.loss_scale_window == 0:
            self._hysteresis_left = cfg.hysteresis
            self.scale *= 2.0
