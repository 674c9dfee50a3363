"""Precision policy and the fp16 loss scaler.

One policy, :class:`Precision`, from the config's three dtypes (see ``PrecisionConfig``):

- fp32: parameters, gradients and optimizer in the model's own dtype (float64 included).
- mixed (``autocast_dtype`` only, Lightning's "bf16-mixed", Accelerate's "bf16"): parameters,
  masters, gathers and reductions stay fp32; the forward runs under ``torch.autocast``. The
  numbers are DDP's under the same autocast.
- 16-bit parameters (``param_dtype``, DeepSpeed's bf16/fp16.enabled, Lightning's "*-true"):
  the parameters the model computes with are 16-bit and each rank keeps an fp32 master copy
  of its shard only. At ZeRO-3 the persistent shard *is* the fp32 master and a gather casts
  it to 16 bits (FSDP2's ``param_dtype``), so no separate 16-bit shard is stored.

Gradients are reduced in ``reduce_dtype`` (fp32 unless ``communication_data_type`` says
otherwise) and accumulated into shards of the master dtype.

The loss scaler is used when fp16 is involved. ``scale_loss`` multiplies the loss; gradients
are unscaled as they are reduced; an overflow on any rank makes every rank skip the step.
Its schedule follows what the front-end's reference path does: DeepSpeed's (``hysteresis``,
``loss_scale_window``, ``min_loss_scale``) for 16-bit parameters or an explicit fp16 block;
``torch.amp.GradScaler``'s (halve on overflow, double after 2000 good steps, no floor) in mixed
mode, so that "16-mixed" equals DDP with a GradScaler.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass

import torch

from zero_strategy.config import LossScaleConfig, PrecisionConfig

__all__ = ["DeepSpeedSchedule", "GradScalerSchedule", "LossScaler", "Precision", "select_precision", "select_scaler"]


@dataclass(frozen=True)
class Precision:
    param_dtype: torch.dtype | None = None  # 16-bit compute dtype of floating parameters, None: their own
    reduce_dtype: torch.dtype | None = None  # None: the master dtype
    autocast_dtype: torch.dtype | None = None

    def param_dtype_for(self, p: torch.Tensor) -> torch.dtype:
        """The dtype ``p`` is computed in (full parameters at ZeRO-1/2, gathered at ZeRO-3)."""
        return self.param_dtype if self.param_dtype is not None and p.is_floating_point() else p.dtype

    def master_dtype_for(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.param_dtype is not None and p.is_floating_point() else p.dtype

    def grad_reduce_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.reduce_dtype or self.master_dtype_for(p)

    @property
    def low_params(self) -> bool:
        """Whether parameters are computed in 16 bits (masters are then separate fp32 copies)."""
        return self.param_dtype is not None

    def forward_context(self, device_type: str) -> ContextManager[None]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    @property
    def uses_loss_scaling(self) -> bool:
        return torch.float16 in (self.param_dtype, self.autocast_dtype)


def select_precision(cfg: PrecisionConfig) -> Precision:
    reduce = cfg.reduce_dtype if (cfg.reduce_dtype != torch.float32 or cfg.param_dtype is not None) else None
    return Precision(param_dtype=cfg.param_dtype, reduce_dtype=reduce, autocast_dtype=cfg.autocast_dtype)


@dataclass(frozen=True)
class DeepSpeedSchedule:
    """DeepSpeed's dynamic (or static, ``loss_scale > 0``) schedule: an overflow halves the
    scale once ``hysteresis`` overflows have been absorbed (the allowance refills when the
    scale grows, or after every good step with ``consecutive_hysteresis``), never below
    ``min_loss_scale``; ``loss_scale_window`` good steps in a row double it."""

    cfg: LossScaleConfig

    @property
    def initial(self) -> float:
        return float(self.cfg.loss_scale if self.cfg.loss_scale > 0 else 2.0**self.cfg.initial_scale_power)


@dataclass(frozen=True)
class GradScalerSchedule:
    """``torch.amp.GradScaler``'s defaults: start at 2**16, multiply by 0.5 on an overflow,
    by 2 after ``growth_interval`` good steps in a row."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    @property
    def initial(self) -> float:
        return self.init_scale


class LossScaler:
    """The fp16 loss scale and its schedule (one of the two above, chosen by type)."""

    def __init__(
        self, schedule: DeepSpeedSchedule | GradScalerSchedule, enabled: bool, max_consecutive_skips: int = 50
    ) -> None:
        self.enabled = enabled
        self.schedule = schedule
        self.scale = schedule.initial if enabled else 1.0
        self._good_steps = 0
        self._hysteresis_left = schedule.cfg.hysteresis if isinstance(schedule, DeepSpeedSchedule) else 1
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.max_consecutive_skips = max_consecutive_skips

    def counters(self) -> torch.Tensor:
        """The schedule's position, saved in checkpoints next to the scale (as GradScaler saves
        its growth tracker): good steps in the window, hysteresis left, skips."""
        return torch.tensor(
            [self._good_steps, self._hysteresis_left, self.consecutive_skips, self.skipped_steps], dtype=torch.int64
        )

    def load_counters(self, t: torch.Tensor) -> None:
        self._good_steps, self._hysteresis_left, self.consecutive_skips, self.skipped_steps = (
            int(v) for v in t.tolist()
        )

    def _refuse_endless_skipping(self, at_floor: bool = False) -> None:
        if self.consecutive_skips >= self.max_consecutive_skips or at_floor:
            raise RuntimeError(
                f"fp16: {self.consecutive_skips} optimizer steps in a row were skipped because the gradients overflowed, "
                f"and the loss scale is {self.scale:g}{' (min_loss_scale: it cannot fall further)' if at_floor else ''}. "
                "The gradients are inf/NaN at any scale: the model has diverged or the data holds inf/NaN. Lower the "
                "learning rate, check the inputs, or train in bf16 (max_consecutive_skips sets how many skips are tolerated)"
            )

    def update(self, found_inf: bool) -> None:
        """Called once per optimizer step, on every rank with the same ``found_inf``."""
        if not self.enabled:
            return
        self.consecutive_skips = self.consecutive_skips + 1 if found_inf else 0
        if found_inf:
            self.skipped_steps += 1
        s = self.schedule
        if isinstance(s, GradScalerSchedule):
            if found_inf:
                self.scale *= s.backoff_factor
                self._good_steps = 0
                self._refuse_endless_skipping()
                return
            self._good_steps += 1
            if self._good_steps == s.growth_interval:
                self.scale *= s.growth_factor
                self._good_steps = 0
            return
        cfg = s.cfg
        if found_inf:
            self._good_steps = 0
            if not cfg.dynamic:
                self._refuse_endless_skipping()
                return
            # an overflow at min_loss_scale with no hysteresis left: the scale cannot fall further
            at_floor = self.scale <= cfg.min_loss_scale and self._hysteresis_left <= 1
            if self._hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, cfg.min_loss_scale)
            else:
                self._hysteresis_left -= 1
            self._refuse_endless_skipping(at_floor)
            return
        self._good_steps += 1
        if cfg.consecutive_hysteresis:
            self._hysteresis_left = cfg.hysteresis
        if cfg.dynamic and self._good_steps % cfg.loss_scale_window == 0:
            self._hysteresis_left = cfg.hysteresis
            self.scale *= 2.0


def select_scaler(config_loss_scale: LossScaleConfig, precision: Precision, *, explicit: bool) -> LossScaler:
    """DeepSpeed's schedule for 16-bit parameters or an explicit fp16 block, GradScaler's in mixed mode."""
    mixed = not precision.low_params
    schedule = GradScalerSchedule() if mixed and not explicit else DeepSpeedSchedule(config_loss_scale)
    return LossScaler(
        schedule, enabled=precision.uses_loss_scaling, max_consecutive_skips=config_loss_scale.max_consecutive_skips
    )
