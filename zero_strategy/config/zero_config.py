"""Configuration for the ZeRO engine: typed, frozen, validated on construction.

``ZeroConfig`` is built from keyword arguments, from a DeepSpeed-style mapping or
file (``zero_optimization``, ``bf16``, ``fp16``, ... as DeepSpeed and Hugging Face
write them), or from the flat form that ``ZeroConfig.to_dict`` produces.  Every
user error raises ``ValueError``/``TypeError`` naming the key, the bad value and
how to fix it.  DeepSpeed keys that this engine accepts but does not act on are
reported once per read with a ``UserWarning``; any other unknown key is an error.

Each field is declared once, with :func:`~zero_strategy.config.values.setting`: its
default, its rule, the DeepSpeed block (and legacy aliases) it is read from, and whether
it is read but not applied.  The coercion on construction, the flat and DeepSpeed readers,
their key tables and :func:`not_applied_settings` are all derived from those declarations.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from zero_strategy.config.comm import CompressionConfig, LoadBalanceConfig
from zero_strategy.config.values import (
    Reader,
    Rule,
    apply_rule,
    check_keys,
    coerce_fields,
    float_rule,
    in_source,
    int_rule,
    is_auto,
    optional,
    read_block,
    setting,
    settings_of,
    to_bool,
    to_choice,
    to_float,
    to_int,
)

__all__ = [
    "DTYPES",
    "FRONTEND_PRECISION",
    "PRECISION_NAMES",
    "LossScaleConfig",
    "OffloadConfig",
    "PrecisionConfig",
    "ZeroConfig",
    "frontend_precision",
    "not_applied_settings",
    "resolve_overrides",
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
    ratio: float = setting(1.0, float_rule(ge=0.0, le=1.0))

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


# --------------------------------------------------------------------------- ZeroConfig


def _to_stage(value: Any, where: str) -> int:
    stage = to_int(value, where, minimum=None)
    if stage == 0:
        raise ValueError(
            f"{where}: stage 0 is plain data parallelism; use torch DDP "
            "(DistributedDataParallel) for it, or choose stage 1, 2 or 3"
        )
    if stage not in (1, 2, 3):
        raise ValueError(f"{where}: {stage} is not a ZeRO stage; use 1, 2 or 3")
    return stage


def _ds_clip(value: Any, where: str) -> float | None:
    """DeepSpeed's gradient_clipping: 0 is its default, "off", and is read as "not set"."""
    clip = to_float(value, where, ge=0.0)
    return None if clip == 0.0 else clip


_ZO, _OWN, _TOP = "zero_optimization", "zero_strategy", ""  # DeepSpeed blocks ("": the top level)
_OFFLOAD = _nested(OffloadConfig, "device", (str,))
_COLLECTIVE_IMPLS = ("auto", "native", "p2p")
_GATHER_CHECKS = ("auto", "immediate", "deferred")


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """Settings of the ZeRO engine. Field names follow DeepSpeed's ``zero_optimization`` keys.

    Nested fields accept mappings (and ``precision`` a name such as ``"bf16"``); numbers
    accept integral floats and numeric strings such as ``"1e9"``.

    ``_explicit`` records the fields a file or mapping set (``from_dict`` fills it). When it
    is empty, as for plain keyword construction, whether a field was set is unknown and
    ``explicitly_set`` falls back to "differs from the default". For ``precision``, "set"
    means the training dtype was chosen (bf16/fp16 enabled); ``reduce_dtype`` alone does
    not count.

    Each field's ``setting(default, rule, ds=block, ...)`` says where DeepSpeed writes it;
    ``precision`` and ``loss_scale`` are read from DeepSpeed's ``bf16``/``fp16`` blocks and
    ``communication_data_type`` (see ``_DeepSpeedReader._precision``).
    """

    stage: int = setting(2, _to_stage, ds=_ZO)
    # elements (16 MB fp32: gloo is fastest at or below ~32 MB)
    reduce_bucket_size: int = setting(4_000_000, int_rule(1), ds=_ZO)
    # ZeRO-1/2 gather each reduction bucket in one piece: a bucket is at most this too
    allgather_bucket_size: int = setting(4_000_000, int_rule(1), ds=_ZO)
    overlap_comm: bool = setting(True, to_bool, ds=_ZO)
    contiguous_gradients: bool = setting(
        True,
        to_bool,
        ds=_ZO,
        not_applied=(True, "false keeps gradients out of one contiguous buffer (here shards are always contiguous)"),
    )
    reduce_scatter: bool = setting(
        True,
        to_bool,
        ds=_ZO,
        not_applied=(True, "false averages gradients with all-reduce (here they are always reduce-scattered)"),
    )
    allgather_partitions: bool = setting(
        True,
        to_bool,
        ds=_ZO,
        not_applied=(True, "false broadcasts partitions instead of all-gathering them (here always all-gathered)"),
    )
    offload_optimizer: OffloadConfig = setting(OffloadConfig(), read=_OFFLOAD, ds=_ZO)
    offload_param: OffloadConfig = setting(OffloadConfig(), read=_OFFLOAD, ds=_ZO)
    stage3_max_live_parameters: int = setting(1_000_000_000, int_rule(0), ds=_ZO)
    stage3_max_reuse_distance: int = setting(1_000_000_000, int_rule(0), ds=_ZO)
    # elements gathered ahead of use at ZeRO-3 (whole units, at most `prefetch` of them; 0: no prefetch)
    stage3_prefetch_bucket_size: int = setting(50_000_000, int_rule(0), ds=_ZO)
    stage3_param_persistence_threshold: int = setting(100_000, int_rule(0), ds=_ZO)
    stage3_gather_16bit_weights_on_model_save: bool = setting(
        False,
        to_bool,
        ds=_ZO,
        aliases=("stage3_gather_fp16_weights_on_model_save",),
        not_applied=(
            False,
            "gathers 16-bit weights for save_16bit_model (here use zero_strategy.full_state_dict or export_full)",
        ),
    )
    sub_group_size: int = setting(
        1_000_000_000,
        int_rule(1),
        ds=_ZO,
        not_applied=(
            None,
            "steps the optimizer over sub-groups of this many elements (here one step over the rank's shard)",
        ),
    )
    precision: PrecisionConfig = setting(
        PrecisionConfig(),
        read=_nested(PrecisionConfig, scalar=PrecisionConfig.from_name, scalars=(str, torch.dtype, int)),
    )
    loss_scale: LossScaleConfig = setting(LossScaleConfig(), read=_nested(LossScaleConfig))
    gradient_clipping: float | None = setting(None, optional(float_rule(gt=0.0)), ds=_TOP, ds_rule=_ds_clip)
    gradient_accumulation_steps: int | None = setting(None, optional(int_rule(1)), ds=_TOP)
    # zero_strategy's own knobs. comm_timeout: seconds; None: the process group's own timeout;
    # at most about 31 years (timedelta's range is larger)
    comm_timeout: float | None = setting(None, optional(float_rule(gt=0.0, le=1e9)), ds=_OWN)
    prefetch: int = setting(1, int_rule(0), ds=_OWN)  # units gathered ahead of use
    check_unit_order: bool = setting(True, to_bool, ds=_OWN)
    # ZeRO-3's per-gather checks once the unit order is known: "immediate" (a host read per
    # gather; every rank raises UnitDivergence), "deferred" (compared on the device, read with
    # the step's gradient flags: no host sync per gather), "auto": deferred on an accelerator
    gather_checks: str = setting("auto", lambda value, where: to_choice(value, where, _GATHER_CHECKS), ds=_OWN)
    collective_impl: str = setting("auto", lambda value, where: to_choice(value, where, _COLLECTIVE_IMPLS), ds=_OWN)
    # top-k gradient compression with error feedback, ZeRO-1/2 (compression.py)
    compression: CompressionConfig = setting(
        CompressionConfig(), read=_nested(CompressionConfig, "type", (str,)), ds=_OWN
    )
    # uneven shards by rank score, ZeRO-1/2 (balance.py)
    load_balance: LoadBalanceConfig = setting(
        LoadBalanceConfig(), read=_nested(LoadBalanceConfig, "preset", (str,)), ds=_OWN
    )
    _explicit: frozenset[str] = dataclasses.field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        coerce_fields(self, "ZeroConfig")
        explicit = frozenset(self._explicit)
        unknown = sorted(explicit - set(_FIELD_NAMES))
        if unknown:
            raise ValueError(f"ZeroConfig._explicit: unknown field names {unknown}; use names of ZeroConfig fields")
        object.__setattr__(self, "_explicit", explicit)

    # -- queries ----------------------------------------------------------------------

    def explicitly_set(self, name: str) -> bool:
        """Whether ``name`` was set by the user (see the class docstring for the rule)."""
        _check_field_name(name, ValueError, "ZeroConfig.explicitly_set()")
        if self._explicit:
            return name in self._explicit
        if name == "precision":
            return self.precision.enabled
        return getattr(self, name) != _DEFAULTS[name]

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with ``changes`` applied; the changed fields count as explicitly set."""
        for name in changes:
            _check_field_name(name, TypeError, "ZeroConfig.replace()")
        base = self._explicit or {n for n in _FIELD_NAMES if self.explicitly_set(n)}
        return dataclasses.replace(self, _explicit=frozenset(base) | frozenset(changes), **changes)

    def to_dict(self) -> dict[str, Any]:
        """A flat, JSON-serialisable dict of the fields; ``from_dict`` reads it back."""
        out: dict[str, Any] = {}
        for name in _FIELD_NAMES:
            value = getattr(self, name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = {k: _DTYPE_NAMES.get(v, v) for k, v in dataclasses.asdict(value).items()}
            out[name] = value
        return out

    # -- readers ----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "<dict>") -> ZeroConfig:
        """Read a DeepSpeed-style mapping, or the flat form written by ``to_dict``."""
        if not isinstance(d, Mapping):
            raise TypeError(f"ZeroConfig.from_dict: expected a mapping, got {type(d).__name__} (from {source})")
        keys = set(d)
        if keys and keys <= set(_FIELD_NAMES) and not keys <= _DS_TOP_KEYS:
            return _read_native(d, source)
        return _DeepSpeedReader(source).read(d)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ZeroConfig:
        """Read a ``.yaml``/``.yml`` or ``.json`` file (DeepSpeed-style or flat)."""
        file = Path(path)
        source = os.fspath(path)
        if not file.is_file():
            raise FileNotFoundError(f"zero_strategy config file not found: {source}")
        suffix = file.suffix.lower()
        text = file.read_text(encoding="utf-8")
        try:
            if suffix in (".yaml", ".yml"):
                yaml = _yaml(source)
                data = yaml.safe_load(text)
            elif suffix == ".json":
                data = json.loads(text)
            else:
                raise ValueError(
                    f"{source}: unsupported config file type {suffix or '(none)'!r}; use .yaml, .yml or .json"
                )
        except (_yaml_error(), json.JSONDecodeError) as exc:
            raise ValueError(f"could not parse {source}: {exc}") from None
        if not isinstance(data, Mapping):
            got = "an empty file" if data is None else f"a {type(data).__name__}"
            raise ValueError(f"{source}: the top level must be a mapping of config keys, got {got}")
        return cls.from_dict(data, source=source)

    @classmethod
    def coerce(cls, obj: Any) -> ZeroConfig:
        """A ZeroConfig from a ZeroConfig, a mapping, a file path, or None (defaults)."""
        if isinstance(obj, ZeroConfig):
            return obj
        if obj is None:
            return cls()
        if isinstance(obj, Mapping):
            return cls.from_dict(obj)
        if isinstance(obj, (str, os.PathLike)):
            return cls.from_file(obj)
        raise TypeError(
            f"cannot build a ZeroConfig from {type(obj).__name__} {obj!r}; pass a ZeroConfig, a mapping, "
            "a path to a .yaml/.json file, or None for the defaults"
        )


_SETTINGS: dict[str, dataclasses.Field] = settings_of(ZeroConfig)
_FIELD_NAMES: tuple[str, ...] = tuple(_SETTINGS)
_DEFAULTS: dict[str, Any] = {name: spec.default for name, spec in _SETTINGS.items()}


def _check_field_name(name: str, error: type[Exception], caller: str) -> None:
    if name in _FIELD_NAMES:
        return
    close = difflib.get_close_matches(name, _FIELD_NAMES, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"ZeroConfig fields are: {', '.join(_FIELD_NAMES)}"
    raise error(f"{caller}: unknown setting {name!r}; {hint}")


def _read_native(d: Mapping[str, Any], source: str) -> ZeroConfig:
    values = {key: _SETTINGS[key].metadata["read"](raw, key, source) for key, raw in d.items() if not is_auto(raw)}
    return ZeroConfig(**values, _explicit=frozenset(values))


# --------------------------------------------------------------------------- DeepSpeed reader


def _ds_keys() -> dict[str, dict[str, str]]:
    """DeepSpeed block ("": the top level) -> {key in that block: ZeroConfig field}, from the
    fields' ``ds`` and ``aliases`` declarations."""
    table: dict[str, dict[str, str]] = {_ZO: {}, _OWN: {}, _TOP: {}}
    for name, spec in _SETTINGS.items():
        block = spec.metadata["ds"]
        if block is not None:
            table[block].update(dict.fromkeys((name, *spec.metadata["aliases"]), name))
    return table


_DS_KEYS = _ds_keys()
_ZERO_BLOCK_LEGACY = ("cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory")  # read by _zero_block
_ZERO_BLOCK_IGNORED = (
    "round_robin_gradients", "ignore_unused_parameters", "elastic_checkpoint", "load_from_fp32_weights",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights", "mics_shard_size", "mics_hierarchical_params_gather",
    "memory_efficient_linear", "stage3_module_granularity_threshold", "use_multi_rank_bucket_allreduce",
    "log_trace_cache_warnings",
    "legacy_stage1", "pipeline_loading_checkpoint", "override_module_apply", "use_all_reduce_for_fetch_params",
)  # fmt: skip
# Where DeepSpeed (and zero_strategy's own block) write the gradient reduction dtype: read by _precision.
_REDUCE_DTYPE_KEYS = ((_TOP, "communication_data_type"), (_OWN, "reduce_dtype"))
_BF16_KEYS = ("enabled",)
_BF16_IGNORED = ("immediate_grad_update", "check_grad_overflow")
_FP16_KEYS = ("enabled", *settings_of(LossScaleConfig))
_FP16_IGNORED = ("auto_cast", "fp16_master_weights_and_grads")
# Top-level keys owned by the training loop or front-end: accepted, ignored, reported.
_FRONTEND_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print", "wall_clock_breakdown",
    "dump_state", "optimizer", "scheduler", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "amp", "activation_checkpointing",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger", "data_types", "memory_breakdown",
    "checkpoint", "aio", "compression_training", "data_efficiency", "elasticity", "autotuning",
    "seq_parallel_communication_data_type",
)  # fmt: skip
_DS_TOP_KEYS = frozenset(
    [*(block for block in _DS_KEYS if block), *_DS_KEYS[_TOP], "bf16", "fp16",
     *(key for block, key in _REDUCE_DTYPE_KEYS if block == _TOP), *_FRONTEND_KEYS]
)  # fmt: skip


class _DeepSpeedReader:
    """One pass over a DeepSpeed-style mapping, collecting ZeroConfig fields and ignored keys."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.values: dict[str, Any] = {}
        self.where: dict[str, str] = {}
        self.ignored: list[str] = []

    def put(self, name: str, value: Any, where: str) -> None:
        if name in self.values and self.values[name] != value:
            raise ValueError(
                f"{where}={value!r} conflicts with {self.where[name]}={self.values[name]!r} in {self.source}; "
                "set only one of them"
            )
        self.values[name], self.where[name] = value, where

    def leaf(self, block: Mapping[str, Any], key: str, path: str, rule: Rule) -> Any:
        """The coerced value of ``block[key]``, or None when it is missing or "auto"."""
        raw = block.get(key)
        if raw is None or is_auto(raw):
            return None
        return apply_rule(rule, raw, f"{path}.{key}" if path else key, self.source)

    def block(self, d: Mapping[str, Any], key: str, valid: Iterable[str], ignored: Iterable[str] = ()) -> Mapping:
        raw = d.get(key)
        if raw is None or is_auto(raw):
            return {}
        self.ignored += check_keys(raw, key, self.source, valid, ignored)
        return raw

    def read(self, d: Mapping[str, Any]) -> ZeroConfig:
        moved = {key: f"{_ZO}.{key}" for key in _DS_KEYS[_ZO]}
        frontend = check_keys(d, "", self.source, _DS_TOP_KEYS, _FRONTEND_KEYS, moved=moved)
        zero = self.block(d, _ZO, (*_DS_KEYS[_ZO], *_ZERO_BLOCK_LEGACY), _ZERO_BLOCK_IGNORED)
        self._legacy_offload(zero)
        own = self.block(d, _OWN, (*_DS_KEYS[_OWN], *(key for block, key in _REDUCE_DTYPE_KEYS if block == _OWN)))
        for path, block in ((_ZO, zero), (_OWN, own), (_TOP, d)):
            self.put_fields(block, path)
        precision = self._precision(d, own)  # may set loss_scale
        explicit = set(self.values)
        if precision is not None:
            self.values["precision"] = precision
            if precision.enabled:
                explicit.add("precision")
        cfg = ZeroConfig(**self.values, _explicit=frozenset(explicit))
        self._warn(frontend)
        return cfg

    def put_fields(self, block: Mapping[str, Any], path: str) -> None:
        """Set the ZeroConfig fields that DeepSpeed block ``path`` holds, skipping missing and "auto" ones."""
        table = _DS_KEYS[path]
        for key, raw in block.items():
            name = table.get(key)
            if name is None or raw is None or is_auto(raw):
                continue
            where = f"{path}.{key}" if path else key
            value = _SETTINGS[name].metadata["ds_read"](raw, where, self.source)
            if value is not None:  # e.g. gradient_clipping 0: DeepSpeed's "off"
                self.put(name, value, where)

    def _legacy_offload(self, block: Mapping[str, Any]) -> None:
        # DeepSpeed's legacy switches: offload to the CPU
        for key, name in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param")):
            if self.leaf(block, key, _ZO, to_bool):
                pin = self.leaf(block, "cpu_offload_use_pin_memory", _ZO, to_bool)
                self.put(name, OffloadConfig(device="cpu", pin_memory=bool(pin)), f"{_ZO}.{key}")

    def _precision(self, d: Mapping[str, Any], own: Mapping[str, Any]) -> PrecisionConfig | None:
        bf16 = self.block(d, "bf16", _BF16_KEYS, _BF16_IGNORED)
        fp16 = self.block(d, "fp16", _FP16_KEYS, _FP16_IGNORED)
        bf16_on = self.leaf(bf16, "enabled", "bf16", to_bool) is True
        fp16_on = self.leaf(fp16, "enabled", "fp16", to_bool) is True
        if bf16_on and fp16_on:
            raise ValueError(f"bf16.enabled and fp16.enabled are both true in {self.source}; enable at most one")
        scale = {}
        for key, spec in settings_of(LossScaleConfig).items():
            raw = fp16.get(key)
            if raw is not None and not is_auto(raw):
                scale[key] = spec.metadata["read"](raw, f"fp16.{key}", self.source)
        if scale:
            self.put("loss_scale", LossScaleConfig(**scale), "fp16")
        reduce = {}
        for path, key in _REDUCE_DTYPE_KEYS:
            value = self.leaf(own if path else d, key, path, _to_reduce_dtype)
            if value is not None:
                reduce[f"{path}.{key}" if path else key] = value
        if len(set(reduce.values())) > 1:
            (first, a), (second, b) = reduce.items()
            raise ValueError(
                f"{first}={_DTYPE_NAMES[a]} conflicts with {second}={_DTYPE_NAMES[b]} in {self.source}; "
                "set only one of them"
            )
        if not (bf16_on or fp16_on or reduce):
            return None
        param = torch.bfloat16 if bf16_on else torch.float16 if fp16_on else None  # DeepSpeed: 16-bit parameters
        return PrecisionConfig(
            param_dtype=param, autocast_dtype=param, reduce_dtype=next(iter(reduce.values()), torch.float32)
        )

    def _warn(self, frontend: list[str]) -> None:
        reasons = (
            (self.ignored, f"zero_strategy does not implement these DeepSpeed options and ignores them "
                           f"(in {self.source})"),
            (frontend, f"zero_strategy ignores these top-level DeepSpeed keys in {self.source} because the "
                       "training loop / front-end owns them"),
        )  # fmt: skip
        for keys, reason in reasons:
            if keys:
                warnings.warn(f"{reason}: {', '.join(keys)}", UserWarning, stacklevel=4)


# --------------------------------------------------------------------------- engine-facing helpers


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
    return out


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


def _yaml(source: str) -> Any:
    """PyYAML, imported when a YAML file is read (the core imports with torch alone)."""
    try:
        import yaml
    except ImportError:
        raise ImportError(f"reading {source} needs PyYAML: pip install pyyaml (or give the config as .json)") from None
    return yaml


def _yaml_error() -> type[Exception]:
    try:
        import yaml
    except ImportError:
        return json.JSONDecodeError  # no YAML was parsed
    return yaml.YAMLError
