"""What the Trainer and Fabric strategies share: the registered names, the precision map and
how the Lightning arguments meet the config file (the rules every front-end follows are in
``zero_strategy.frontend``). No Lightning import here."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch

from zero_strategy import ZeroConfig, resolve_overrides
from zero_strategy.config import frontend_precision
from zero_strategy.frontend import apply_frontend_settings

ConfigArg = Union[ZeroConfig, Mapping[str, Any], str, os.PathLike, None]


@dataclass(frozen=True)
class RegisteredName:
    name: str
    stage: int
    offload: Mapping[str, Any]
    description: str


NAMES: tuple[RegisteredName, ...] = (
    RegisteredName("zero1", 1, {}, "ZeRO stage 1: optimizer state partitioned (zero_strategy)"),
    RegisteredName("zero2", 2, {}, "ZeRO stage 2: + gradients reduce-scattered (zero_strategy)"),
    RegisteredName("zero2_offload", 2, {"offload_optimizer": {"device": "cpu"}}, "ZeRO stage 2 + optimizer state offloaded to CPU memory (zero_strategy)"),
    RegisteredName("zero3", 3, {}, "ZeRO stage 3: + parameters partitioned (zero_strategy)"),
    RegisteredName("zero3_offload", 3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, "ZeRO stage 3 + optimizer state and parameter shards offloaded to CPU memory (zero_strategy)"),
    RegisteredName("zero3_offload_nvme", 3, {"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}, "ZeRO stage 3 + optimizer state and parameter shards offloaded to NVMe (zero_strategy)"),
)  # fmt: skip


def training_dtype(flag: str) -> str | None:
    """The engine's precision name for Lightning's flag (None for "32-true": the config decides).
    "*-mixed" keeps DDP's meaning (fp32 parameters under autocast); "*-true" gives 16-bit
    parameters with fp32 master shards. The table lives in the core."""
    return frontend_precision("lightning", flag)


def strategy_config(config: ConfigArg, stage: int | None, offload: Mapping[str, Any] | None, caller: str) -> ZeroConfig:
    """The config given to the strategy, with its ``stage`` argument applied (conflicts raise)."""
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    try:
        cfg = ZeroConfig.coerce(config)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{caller}(config=...): {exc}") from None
    explicit: dict[str, Any] = {"stage": stage}
    for key, value in (offload or {}).items():
        explicit[key] = value
    return resolve_overrides(cfg, source=f"{caller}(stage={stage})", **explicit)


def apply_lightning_arguments(
    cfg: ZeroConfig,
    *,
    precision: str,
    gradient_clip_val: float | None,
    gradient_clip_algorithm: str | None,
    accumulate_grad_batches: int,
    source: str,
) -> ZeroConfig:
    """Lightning's own arguments win over the file; a conflicting value in the file raises.

    Lightning's defaults ("32-true", no clipping, accumulation 1) count as "not given", so a
    file's bf16 / gradient_clipping / gradient_accumulation_steps then applies."""
    clip = None
    if (
        gradient_clip_val is not None
        and lightning_clips(gradient_clip_val)
        and (gradient_clip_algorithm or "norm") == "norm"
    ):
        clip = float(gradient_clip_val)
    return apply_frontend_settings(
        cfg,
        source=source,
        precision=training_dtype(precision),
        accumulation=accumulate_grad_batches,
        gradient_clipping=clip,
    )


def lightning_clips(gradient_clip_val: float | None) -> bool:
    """Whether Lightning clips itself (``gradient_clip_val`` set, by norm or by value): the engine
    then must not clip again on a step the user's ``configure_gradient_clipping`` skipped. A
    file's ``gradient_clipping`` without a Lightning value is applied by the engine at step."""
    return gradient_clip_val is not None and float(gradient_clip_val) > 0


def autocast_dtype(cfg: ZeroConfig) -> torch.dtype | None:
    return cfg.precision.autocast_dtype
