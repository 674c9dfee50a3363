"""Settings given outside the config file: a front-end's flags applied over a config without
silent conflicts (``resolve_overrides``), and the DeepSpeed settings that are read but not acted
on, reported once (``not_applied_settings``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zero_strategy.config.blocks import _DTYPE_NAMES, PrecisionConfig, _precision_name
from zero_strategy.config.values import warn_once
from zero_strategy.config.zero_config import _SETTINGS, ZeroConfig, _check_field_name

__all__ = ["not_applied_settings", "resolve_overrides", "warn_not_applied"]

# Settings read with DeepSpeed's names but not acted on (their ``not_applied`` declarations):
# name -> (the value that would change nothing here, None: any explicit value is reported; what
# DeepSpeed does with it). Those without a neutral value come first, each group in field order.
_NOT_APPLIED: dict[str, tuple[Any, str]] = dict(
    sorted(
        ((name, spec.metadata["not_applied"]) for name, spec in _SETTINGS.items() if spec.metadata["not_applied"]),
        key=lambda item: item[1][0] is not None,
    )
)


def not_applied_settings(cfg: ZeroConfig) -> list[str]:
    """One message per setting the config sets that this engine does not act on."""
    out = []
    for name, (neutral, what) in _NOT_APPLIED.items():
        if not cfg.explicitly_set(name) or (neutral is not None and getattr(cfg, name) == neutral):
            continue
        out.append(f"{name}={getattr(cfg, name)!r} is read but not applied by zero_strategy; in DeepSpeed it {what}")
    if cfg.stage3_gather_16bit_weights_on_model_save:
        out.append(
            "stage3_gather_16bit_weights_on_model_save=True needs no switch here: every full-weight save gathers the "
            "full weights (the Trainer's save_model, accelerator.get_state_dict, zero_strategy.full_state_dict and "
            "export_full), in the parameters' dtype: 16-bit when the file enables bf16 or fp16, fp32 under a "
            "front-end's mixed precision (the Trainer's --bf16 with \"auto\"), where DeepSpeed writes 16-bit"
        )
    if cfg.stage != 3:  # the MoE experts' knobs act on ZeRO-3's gathers (sharding/experts/selective.py)
        for name in _ZERO3_MOE:
            if cfg.explicitly_set(name):
                out.append(
                    f"{name}={getattr(cfg, name)!r} is not applied at stage {cfg.stage}: stages 1 and 2 keep every "
                    "expert whole on every rank, so nothing is gathered by selection; use stage 3, or remove it"
                )
    if cfg.memory.enabled:  # the budget's cache cap governs ZeRO-3's gathered parameters (memory.py)
        for name in _GOVERNED_BY_BUDGET:
            if cfg.explicitly_set(name):
                out.append(
                    f"{name}={getattr(cfg, name)!r} is not applied: zero_strategy.memory is set, and its cache cap "
                    "governs how many gathered parameters stay (prefetch included); remove one of the two"
                )
        if cfg.explicitly_set("stage3_param_persistence_threshold"):
            out.append(
                f"stage3_param_persistence_threshold={cfg.stage3_param_persistence_threshold!r} is not applied: "
                "zero_strategy.memory is set, and the units kept gathered are chosen by gathers avoided per byte "
                "under its persistent tier (docs/memory_budget.md); remove one of the two"
            )
    return out


def warn_not_applied(cfg: ZeroConfig, stacklevel: int = 4) -> None:
    """``not_applied_settings`` as warnings, each once per job (``warn_once``), at initialize."""
    for message in not_applied_settings(cfg):
        warn_once(message, stacklevel=stacklevel)


# zero_strategy's MoE knobs, which only ZeRO-3 applies
_ZERO3_MOE = ("moe_full_gather_share", "moe_expert_cache", "moe_expert_layout", "moe_compact_gather")

# DeepSpeed's element-count knobs that a memory budget replaces
_GOVERNED_BY_BUDGET = ("stage3_max_live_parameters", "stage3_max_reuse_distance")


def _show(name: str, value: Any) -> str:
    if name == "precision":
        if isinstance(value, PrecisionConfig):
            return _precision_name(value)
        return value if isinstance(value, str) else _DTYPE_NAMES.get(value, "fp32")
    return repr(value)


def resolve_overrides(cfg: ZeroConfig, *, source: str, **explicit: Any) -> ZeroConfig:
    """Apply settings given outside the config (e.g. by a front-end), refusing silent conflicts.

    Each keyword is a ZeroConfig field name; None means "not given". A value that differs
    from one the config set explicitly raises ValueError naming both places; otherwise the
    value is applied. ``precision`` takes a name or dtype ("bf16-mixed", torch.float16, ...)
    and changes only the training dtype, keeping the config's reduce dtype. Callers pass
    None for settings the user left at their own defaults (e.g. Lightning's "32-true").
    """
    if not isinstance(cfg, ZeroConfig):
        raise TypeError(f"resolve_overrides: expected a ZeroConfig, got {type(cfg).__name__}")
    changes: dict[str, Any] = {}
    for name, value in explicit.items():
        _check_field_name(name, TypeError, "resolve_overrides()")
        if value is None:
            continue
        try:
            if name != "precision":
                applied = getattr(dataclasses.replace(cfg, **{name: value}), name)
                old, new = getattr(cfg, name), applied
            elif isinstance(value, (PrecisionConfig, Mapping)):
                raise TypeError("precision: pass a name such as 'bf16-mixed' or a torch.dtype, not a config")
            else:
                applied = PrecisionConfig.from_name(value, cfg.precision.reduce_dtype)
                # only the 16-bit dtype can conflict: with the same dtype, a config that chose
                # 16-bit parameters (DeepSpeed's bf16.enabled) keeps them under a "*-mixed" flag
                old, new = cfg.precision.low_dtype, applied.low_dtype
                if old == new and cfg.explicitly_set(name):
                    continue
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{exc} (from {source})") from None
        if old != new and cfg.explicitly_set(name):
            raise ValueError(
                f"{name}={_show(name, cfg.precision if name == 'precision' else old)} from the config conflicts "
                f"with {name}={_show(name, value)} "
                f"from {source}; set it in one place only"
            )
        changes[name] = applied
    return cfg.replace(**changes) if changes else cfg
