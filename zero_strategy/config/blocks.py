"""The config's building blocks: the dtype and precision-name tables that the core and both
front-ends read, and the sub-configs that ``ZeroConfig`` nests (``PrecisionConfig``,
``LossScaleConfig``, ``OffloadConfig``), each validated on construction like the config itself.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from zero_strategy.config.values import (
    Reader,
    apply_rule,
    coerce_fields,
    float_rule,
    in_source,
    int_rule,
    read_block,
    setting,
    settings_of,
    to_bool,
    to_choice,
    to_float,
)

__all__ = [
    "DTYPES",
    "FRONTEND_PRECISION",
    "PRECISION_NAMES",
    "LossScaleConfig",
    "OffloadConfig",
    "PrecisionConfig",
    "frontend_precision",
]

# --------------------------------------------------------------------------- dtypes

# dtype names -> dtype: one table, read by the dtype fields here and the CLI's ``export --dtype``.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}  # fmt: skip
_DTYPE_NAMES = {dtype: name for name, dtype in reversed(DTYPES.items())}  # dtype -> its first (short) name
# Precision names -> (param_dtype, autocast_dtype): one table, read by the core and both
# front-ends. "mixed" keeps fp32 parameters and runs the forward under autocast (what DDP does
# with Lightning's "*-mixed" and Accelerate's mixed_precision); the 16-bit names store the
# parameters the model computes with in 16 bits, with fp32 master shards (DeepSpeed's
# bf16/fp16.enabled, Lightning's "*-true"), and autocast too.
PRECISION_NAMES: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "fp32": (None, None), "float32": (None, None), "32-true": (None, None), "32": (None, None),
    "bf16-mixed": (None, torch.bfloat16), "16-mixed": (None, torch.float16),
    "bf16": (torch.bfloat16, torch.bfloat16), "bfloat16": (torch.bfloat16, torch.bfloat16),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16), "float16": (torch.float16, torch.float16),
    "half": (torch.float16, torch.float16), "16-true": (torch.float16, torch.float16),
}  # fmt: skip
# Each front-end's precision flag -> a name above; None: the flag's default, "not given" (the
# config file decides). Accelerate's "bf16"/"fp16" mean autocast over fp32 parameters.
FRONTEND_PRECISION: dict[str, dict[str, str | None]] = {
    "lightning": {"32-true": None, "32": None, "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed",
                  "bf16-true": "bf16-true", "16-true": "16-true"},
    "accelerate": {"no": None, "bf16": "bf16-mixed", "fp16": "16-mixed"},
}  # fmt: skip
_PRECISION_HINT = (
    "use 'fp32', 'bf16-mixed' or '16-mixed' (fp32 parameters under autocast, as DDP), or 'bf16'/'bf16-true' or "
    "'fp16'/'16-true' (16-bit parameters with fp32 master shards, as DeepSpeed's bf16/fp16.enabled)"
)


def frontend_precision(frontend: str, flag: str) -> str | None:
    """The precision name for a front-end's flag (None: not given); unknown flags raise."""
    table = FRONTEND_PRECISION[frontend]
    if flag not in table:
        raise ValueError(f"precision={flag!r} is not supported by the zero strategies; use one of {sorted(table)}")
    return table[flag]


def _to_dtype16(value: Any, where: str) -> torch.dtype | None:
    """A 16-bit dtype (bf16/fp16) or None for fp32, from a dtype or a dtype name."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value == torch.float32:
            return None
        if value in (torch.bfloat16, torch.float16):
            return value
        raise ValueError(f"{where}: {value} is not supported; use torch.bfloat16, torch.float16 or None (fp32)")
    if isinstance(value, str):
        key = value.strip().lower()
        if key in DTYPES:
            dtype = DTYPES[key]
            return None if dtype == torch.float32 else dtype
        if key in PRECISION_NAMES:
            raise ValueError(
                f"{where}: {value!r} is a precision mode, not a dtype; pass it as precision={value!r}, "
                "or give this field 'bf16', 'fp16' or 'fp32'"
            )
        raise ValueError(f"{where}: unknown dtype {value!r}; use 'bf16', 'fp16' or 'fp32'")
    raise TypeError(f"{where}: expected a dtype name or torch.dtype, got {type(value).__name__} {value!r}")


def _precision_pair(value: Any, where: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, autocast_dtype)`` for a precision name, or a torch.dtype (16-bit parameters)."""
    if isinstance(value, torch.dtype) or value is None:
        dtype = _to_dtype16(value, where)
        return dtype, dtype
    if isinstance(value, int) and not isinstance(value, bool) and value == 32:
        value = "32"
    if isinstance(value, str):
        key = value.strip().lower()
        if key in PRECISION_NAMES:
            return PRECISION_NAMES[key]
        raise ValueError(f"{where}: unknown precision {value!r}; {_PRECISION_HINT}")
    raise TypeError(f"{where}: expected a precision name or torch.dtype, got {type(value).__name__} {value!r}")


def _to_reduce_dtype(value: Any, where: str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _DTYPE_NAMES:
        return value
    if isinstance(value, str) and value.strip().lower() in DTYPES:
        return DTYPES[value.strip().lower()]
    raise ValueError(f"{where}: {value!r} is not a supported reduction dtype; use 'fp32', 'bf16' or 'fp16'")


def _precision_name(cfg: PrecisionConfig) -> str:
    for name, pair in PRECISION_NAMES.items():
        if pair == (cfg.param_dtype, cfg.autocast_dtype):
            return name
    return f"param_dtype={cfg.param_dtype}, autocast_dtype={cfg.autocast_dtype}"


# --------------------------------------------------------------------------- sub-configs

_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _to_offload_device(value: Any, where: str) -> str:
    return "none" if value is None else to_choice(value, where, _OFFLOAD_DEVICES)


def _to_ratio(value: Any, where: str) -> float | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return to_float(value, where, ge=0.0, le=1.0)
    except ValueError as e:  # the one choice that is not a number
        raise ValueError(f"{e}; or 'auto' (with zero_strategy.memory: the smallest offload that fits)") from None


def _to_path(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{where}: expected a path string, got {type(value).__name__} {value!r}")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Where optimizer state or parameters live between uses (DeepSpeed's offload blocks).

    ``nvme_path`` is not required here for ``device="nvme"``: DeepSpeed files may omit
    it, and the engine checks it when it builds the offload.
    """

    device: str = setting("none", _to_offload_device)
    nvme_path: str | None = setting(None, _to_path)
    pin_memory: bool = setting(False, to_bool)
    buffer_count: int = setting(5, int_rule(1))
    buffer_size: int = setting(100_000_000, int_rule(1))
    max_in_cpu: int = setting(1_000_000_000, int_rule(0))
    fast_init: bool = setting(False, to_bool)
    pipeline_read: bool = setting(False, to_bool)
    pipeline_write: bool = setting(False, to_bool)
    # a fraction, or "auto": the smallest that fits the memory budget's persistent tier (runtime/placement.py)
    ratio: float | str = setting(1.0, _to_ratio, keeps_auto=True)

    def __post_init__(self) -> None:
        coerce_fields(self, "OffloadConfig")

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Training precision, three dtypes:

    - ``param_dtype``: the dtype the model computes with (None: the parameters' own, fp32).
      16 bits: full parameters (ZeRO-1/2) or gathered ones (ZeRO-3) are 16-bit, and each rank
      keeps fp32 master pieces of its shard, which the optimizer updates.
    - ``autocast_dtype``: the forward runs under ``torch.autocast`` with it (None: no autocast).
    - ``reduce_dtype``: gradients are reduced in it (fp32 by default).

    Built from a name (:data:`PRECISION_NAMES`: "bf16-mixed" is fp32 parameters under bf16
    autocast, as DDP; "bf16"/"bf16-true" is 16-bit parameters, as DeepSpeed), a torch.dtype
    (16-bit parameters) or the fields themselves.
    """

    param_dtype: torch.dtype | None = setting(None, _to_dtype16)
    reduce_dtype: torch.dtype = setting(torch.float32, _to_reduce_dtype)
    autocast_dtype: torch.dtype | None = setting(None, _to_dtype16)

    def __post_init__(self) -> None:
        coerce_fields(self, "PrecisionConfig")
        p, a = self.param_dtype, self.autocast_dtype
        if p is not None and a is not None and p != a:
            raise ValueError(
                f"PrecisionConfig: param_dtype={_DTYPE_NAMES[p]} with autocast_dtype={_DTYPE_NAMES[a]}; "
                "autocast to the parameters' dtype (or leave autocast_dtype unset)"
            )

    @classmethod
    def from_name(
        cls, name: Any, reduce_dtype: torch.dtype = torch.float32, where: str = "precision"
    ) -> PrecisionConfig:
        param, autocast = _precision_pair(name, where)
        return cls(param_dtype=param, reduce_dtype=reduce_dtype, autocast_dtype=autocast)

    @property
    def enabled(self) -> bool:
        """Whether a 16-bit training dtype was chosen (a reduce dtype alone does not count)."""
        return self.param_dtype is not None or self.autocast_dtype is not None

    @property
    def low_dtype(self) -> torch.dtype | None:
        """The 16-bit dtype in use (parameters or autocast), or None for fp32."""
        return self.param_dtype or self.autocast_dtype


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """fp16 loss scaling. ``loss_scale`` 0 means dynamic scaling; a positive value is a static scale.

    DeepSpeed writes these fields, under their own names, in its ``fp16`` block.
    """

    initial_scale_power: int = setting(16, int_rule(0, 64))  # 2**64: fp16's whole range and more
    loss_scale: float = setting(0.0, float_rule(ge=0.0))
    loss_scale_window: int = setting(1000, int_rule(1))
    # DeepSpeed's default hysteresis is 2 (tolerate one overflow before halving). Ours is 1:
    # halve the scale on every overflow, as torch.amp.GradScaler does. An explicit
    # ``hysteresis`` in a DeepSpeed file is honoured.
    hysteresis: int = setting(1, int_rule(1))
    min_loss_scale: float = setting(1.0, float_rule(gt=0.0))
    consecutive_hysteresis: bool = setting(False, to_bool)
    # zero_strategy's: this many overflowing (skipped) steps in a row raise instead of training
    # on in silence; so does an overflow at min_loss_scale once the scale cannot fall further
    max_consecutive_skips: int = setting(50, int_rule(1))

    def __post_init__(self) -> None:
        coerce_fields(self, "LossScaleConfig")

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0.0


def _nested(
    cls: type, shorthand: str = "", scalars: tuple[type, ...] = (), scalar: Callable[..., Any] | None = None
) -> Reader:
    """Reader for a sub-config field: an instance, None (defaults), a mapping, or a scalar of type
    ``scalars`` that sets field ``shorthand`` (``offload_optimizer="cpu"``) or is read by
    ``scalar(value, where=...)`` (``precision="bf16-mixed"``)."""

    def read(value: Any, where: str, source: str | None = None) -> Any:
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if isinstance(value, Mapping):
            return cls(**read_block(value, where, source, cls))
        if not isinstance(value, scalars) or isinstance(value, bool):
            raise TypeError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}{in_source(source)}")
        if scalar is not None:
            return apply_rule(lambda v, w: scalar(v, where=w), value, where, source)
        return cls(**{shorthand: settings_of(cls)[shorthand].metadata["read"](value, where, source)})

    return read
