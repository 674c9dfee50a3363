"""Configuration for the ZeRO engine: typed, frozen, validated on construction.

``ZeroConfig`` is built from keyword arguments, from a DeepSpeed-style mapping or
file (``zero_optimization``, ``bf16``, ``fp16``, ... as DeepSpeed and Hugging Face
write them), or from the flat form that ``ZeroConfig.to_dict`` produces.  Every
user error raises ``ValueError``/``TypeError`` naming the key, the bad value and
how to fix it; a read reports every problem at once (see ``values.collecting``).
DeepSpeed keys that this engine accepts but does not act on are reported once per read
with a ``UserWarning``; any other unknown key is an error.

Settings that conflict with each other (``offload_param`` below stage 3, top-k compression
at stage 3, ...) fail on construction when the config sets both sides; a conflict with a
side left at its default (a file without ``stage``, which a front-end may still set) is
reported by :meth:`ZeroConfig.conflicts` on the resolved config, which ``initialize`` and
``zero-strategy check`` run.

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
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from zero_strategy.config.blocks import (
    _DTYPE_NAMES,
    LossScaleConfig,
    OffloadConfig,
    PrecisionConfig,
    _nested,
    _to_dtype16,
    _to_reduce_dtype,
)
from zero_strategy.config.comm import CompressionConfig, LoadBalanceConfig
from zero_strategy.config.conflicts import conflicts_of
from zero_strategy.config.ds_optimizer import muon_note
from zero_strategy.config.memory import MemoryConfig, to_size
from zero_strategy.config.values import (
    FAILED,
    Rule,
    apply_rule,
    attempt,
    bucket_rule,
    check_keys,
    coerce_fields,
    collecting,
    float_rule,
    int_rule,
    is_auto,
    optional,
    report,
    report_all,
    setting,
    settings_of,
    to_bool,
    to_choice,
    to_float,
    to_int,
    warn_once,
)

__all__ = ["ZeroConfig"]

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


def _layer_bytes(value: Any, where: str) -> int:
    """Bytes (an integer, or a size such as '64MiB'); 0: none."""
    n = to_size(value, where)
    if isinstance(n, float) and n != 0:
        raise ValueError(
            f"{where}: bytes per MoE experts layer are needed, got {value!r} (a number up to 1 reads as a fraction, "
            "of which there is no whole here); give an integer above 1 or a size such as '64MiB', or 0 for no cache"
        )
    return int(n)


NODE_SHARD_SIZE = "node"  # shard_size: one shard group per node (LOCAL_WORLD_SIZE; runtime/shard_layout.py)


def _to_shard_size(value: Any, where: str) -> int | str | None:
    """Ranks per shard group (runtime/shard_groups.py); None or -1 (DeepSpeed's "off"): one group of all
    ranks; "node": one group per node of the launcher's layout (resolved by initialize)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == NODE_SHARD_SIZE:
        return NODE_SHARD_SIZE
    if type(value).__name__ == "DeviceMesh":  # not a config value: it holds process groups
        raise TypeError(
            f"{where}: a DeviceMesh is not a config value (a config is a file or a dict); pass it to "
            "zero_strategy.initialize(model, optimizer, mesh=mesh) (or shard_size=mesh there, or to the front-end)"
        )
    n = to_int(value, where, minimum=None)
    if n == -1:
        return None
    if n < 1:
        raise ValueError(
            f"{where}: {n} is not a shard size; give the number of ranks in each shard group (a divisor of the "
            f"world size), {NODE_SHARD_SIZE!r} for one group per node, or -1 / None to shard over all ranks"
        )
    return n


_GATHER_CHECKS = ("auto", "immediate", "deferred")
_EXPERT_LAYOUTS = ("sharded", "owners")  # sharding/experts/owners.py


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
    reduce_bucket_size: int = setting(4_000_000, bucket_rule("each parameter is reduced on its own"), ds=_ZO)
    # ZeRO-1/2 gather each reduction bucket in one piece: a bucket is at most this too
    allgather_bucket_size: int = setting(4_000_000, bucket_rule("each parameter is gathered on its own"), ds=_ZO)
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
    # elements gathered ahead of use at ZeRO-3 beyond the next unit, which is prefetched whatever its
    # size (whole units, at most `prefetch` of them; 0: no prefetch)
    stage3_prefetch_bucket_size: int = setting(50_000_000, int_rule(0), ds=_ZO)
    stage3_param_persistence_threshold: int = setting(100_000, int_rule(0), ds=_ZO)
    stage3_gather_16bit_weights_on_model_save: bool = setting(
        False,
        to_bool,
        ds=_ZO,
        aliases=("stage3_gather_fp16_weights_on_model_save",),
    )  # nothing to switch on: every full-weight save gathers (overrides.not_applied_settings says so)
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
    # ZeRO-3 MoE experts units (sharding/experts/selective.py): a selective gather that would move at least
    # this share of a whole gather's bytes gathers (and reduces) the whole unit instead
    moe_full_gather_share: float = setting(0.2, float_rule(gt=0.0, le=1.0), ds=_OWN)
    # the experts' cache: bytes of selected experts' rows each experts unit keeps between the
    # passes of a step (0: none); an integer or a size such as "64MiB"
    moe_expert_cache: int = setting(0, lambda value, where: _layer_bytes(value, where), ds=_OWN)
    # where a stacked experts unit's experts live: "sharded" (cut like any parameter; the union of
    # the selections is gathered) or "owners" (each expert whole on one rank, fetched from it)
    moe_expert_layout: str = setting("sharded", lambda value, where: to_choice(value, where, _EXPERT_LAYOUTS), ds=_OWN)
    # the sharded layout's selective gathers place the union's rows as [U, ...] parameters and
    # call the experts module with slots (sharding/experts/compact.py); false: zeroed full-size ones
    moe_compact_gather: bool = setting(True, to_bool, ds=_OWN)
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
    # shard groups (hybrid sharding, runtime/shard_groups.py): ranks per group that shards the model
    # state, replicated across groups; None: one group of all ranks; "node": one group per node (the
    # launcher's LOCAL_WORLD_SIZE, runtime/shard_layout.py). DeepSpeed: mics_shard_size
    shard_size: int | str | None = setting(None, _to_shard_size, ds=_OWN)
    # ZeRO++ hpZ (sharding/secondary.py): after a unit's forward gather each rank keeps a secondary
    # shard within groups of this many contiguous ranks, and the backward gathers from it; 1: off
    zero_hpz_partition_size: int = setting(1, int_rule(1), ds=_ZO)
    # ZeRO-3's forward and backward gathers: fp32 parameters gathered in this 16-bit dtype (half
    # the bytes; mixed precision, docs/precision.md); None: the compute dtype. sharding/gather_codec.py
    gather_dtype: torch.dtype | None = setting(None, _to_dtype16, ds=_OWN)
    # ZeRO++ qwZ: those gathers block-quantized to int8 (comm/quantize.py), dequantized on arrival
    zero_quantized_weights: bool = setting(False, to_bool, ds=_ZO)
    # ZeRO++ qgZ: the gradients' reduce-scatters as int8 blocks in one all-to-all (reduction/quantized.py)
    zero_quantized_gradients: bool = setting(False, to_bool, ds=_ZO)
    # the memory budget and its three tiers, ZeRO-3 (memory.py; its cache: sharding/cache.py)
    memory: MemoryConfig = setting(MemoryConfig(), read=_nested(MemoryConfig, "budget", (str, int, float)), ds=_OWN)
    _explicit: frozenset[str] = dataclasses.field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        explicit = frozenset(self._explicit)
        unknown = sorted(explicit - set(_FIELD_NAMES))
        if unknown:
            raise ValueError(f"ZeroConfig._explicit: unknown field names {unknown}; use names of ZeroConfig fields")
        object.__setattr__(self, "_explicit", explicit)
        with collecting():
            coerce_fields(self, "ZeroConfig")
            # conflicts between settings the user gave both sides of (see the module docstring)
            report_all([ValueError(m) for m in conflicts_of(self, None, self.explicitly_set)])

    def conflicts(self, world_size: int | None = None) -> list[str]:
        """Every conflict between the settings of this config as it stands (defaults count),
        and with ``world_size`` when given (``load_balance.scores``: one per rank)."""
        return conflicts_of(self, world_size, lambda name: True)

    def check(self, world_size: int | None = None, *, caller: str = "") -> None:
        """Raise :meth:`conflicts`, all of them (prefixed by ``caller``, e.g. ``"initialize()"``)."""
        prefix = f"{caller}: " if caller else ""
        report_all([ValueError(prefix + m) for m in self.conflicts(world_size)])

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
            elif isinstance(value, torch.dtype):
                value = _DTYPE_NAMES[value]
            out[name] = value
        return out

    # -- readers ----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "<dict>") -> ZeroConfig:
        """Read a DeepSpeed-style mapping, or the flat form written by ``to_dict``."""
        if not isinstance(d, Mapping):
            raise TypeError(f"ZeroConfig.from_dict: expected a mapping, got {type(d).__name__} (from {source})")
        keys = set(d)
        with collecting(source):
            if keys and keys <= set(_FIELD_NAMES) and not keys <= _DS_TOP_KEYS:
                return _read_native(d, source)
            return _DeepSpeedReader(source).read(d)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ZeroConfig:
        """Read a ``.yaml``/``.yml`` or ``.json`` file (DeepSpeed-style or flat), or a built-in
        preset by name (``"zero3"``; :func:`preset_names`)."""
        return cls.from_dict(load_file(path), source=os.fspath(path))

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


PRESETS_DIR = Path(__file__).with_name("presets")  # shipped in the package (package data)


def preset_names() -> tuple[str, ...]:
    """The built-in configs' names (``zero1`` ... ``zero3_offload_nvme``), usable wherever a
    config file is taken: ``initialize(config="zero3")``, ``zero-strategy check zero3``,
    ``--zero-config zero3``, ``ZERO_STRATEGY_CONFIG=zero3``."""
    return tuple(sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))


def resolve_config_path(path: str | os.PathLike[str]) -> Path:
    """A config file: ``path`` when it exists, else the built-in preset of that name; a missing
    one raises ``FileNotFoundError`` naming the working directory and the presets."""
    file = Path(path)
    if file.is_file():
        return file
    preset = PRESETS_DIR / f"{os.fspath(path)}.yaml"
    if os.sep not in os.fspath(path) and preset.is_file():
        return preset
    raise FileNotFoundError(
        f"zero_strategy config file not found: {os.fspath(path)} (relative paths are read from {os.getcwd()!r}); "
        f"give the path of a .yaml/.json file or a built-in name: {', '.join(preset_names())}"
    )


def load_file(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """The mapping in a ``.yaml``/``.yml`` or ``.json`` config file, or a built-in preset by
    name (:func:`preset_names`); errors name the file."""
    file = resolve_config_path(path)
    source = os.fspath(path)
    suffix = file.suffix.lower()
    text = file.read_text(encoding="utf-8")
    try:
        if suffix in (".yaml", ".yml"):
            yaml = _yaml(source)
            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"{source}: unsupported config file type {suffix or '(none)'!r}; use .yaml, .yml or .json")
    except (_yaml_error(), json.JSONDecodeError) as exc:
        raise ValueError(f"could not parse {source}: {exc}") from None
    if not isinstance(data, Mapping):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        raise ValueError(f"{source}: the top level must be a mapping of config keys, got {got}")
    return data


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
    read = {
        key: attempt(_SETTINGS[key].metadata["read"], raw, key, source) for key, raw in d.items() if not is_auto(raw)
    }
    values = {key: value for key, value in read.items() if value is not FAILED}
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
_MICS = "mics_shard_size"  # DeepSpeed's name of shard_size (read by _DeepSpeedReader.read)
_ZERO_BLOCK_LEGACY = ("cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory")  # read by _zero_block
_ZERO_BLOCK_IGNORED = (
    "round_robin_gradients", "ignore_unused_parameters", "elastic_checkpoint", "load_from_fp32_weights",
    "zero_quantized_nontrainable_weights", "mics_hierarchical_params_gather",
    "memory_efficient_linear", "stage3_module_granularity_threshold", "use_multi_rank_bucket_allreduce",
    "log_trace_cache_warnings",
    "legacy_stage1", "pipeline_loading_checkpoint", "override_module_apply", "use_all_reduce_for_fetch_params",
    "zenflow", "leaf_module",
)  # fmt: skip
# DeepSpeed's Superchip offload (offload_config.py), inside offload_optimizer: read by _offload_ignored
_OFFLOAD_OPTIMIZER_IGNORED = ("super_offload", "cpuadam_cores_perc")
# DeepSpeed features at the top level that are not implemented here: accepted, ignored, reported.
_TOP_IGNORED = ("torch_autocast", "compile", "tensor_parallel", "expert_parallel")
# What an ignored key's report says where "not implemented" alone would not say enough.
IGNORED_WHY = {
    f"{_ZO}.zenflow": "not implemented (ZenFlow's stale-gradient offloaded step); offload_optimizer: {device: cpu} "
    "steps every gradient on the host",
    f"{_ZO}.leaf_module": "not implemented: zero_strategy finds MoE experts modules itself (stacked experts' weights "
    "and a forward that takes the router's selection), makes each one a ZeRO-3 unit and gathers only the selected "
    "experts, so no list of leaf modules is needed (docs/moe.md)",
    f"{_ZO}.offload_optimizer.super_offload": "not implemented (DeepSpeed's Superchip offload); offload_optimizer: "
    "{device: cpu} offloads as usual",
    f"{_ZO}.offload_optimizer.cpuadam_cores_perc": "not implemented (a setting of super_offload)",
    "torch_autocast": "not implemented as a block: its mode (fp32 parameters, the forward under autocast) is the "
    "precision 'bf16-mixed' or '16-mixed': initialize(..., precision='bf16-mixed') or the front-end's mixed "
    "precision (docs/precision.md); bf16: {enabled: true} gives 16-bit parameters instead",
    f"{_ZO}.mics_hierarchical_params_gather": "not implemented (MiCS's two-hop parameter all-gather, within the "
    "node first and then across nodes); with mics_shard_size each ZeRO-3 gather stays inside its shard group "
    "already (docs/advanced.md, shard groups)",
    "compile": "not implemented (DeepCompile); torch.compile the model, before or after initialize (docs/advanced.md)",
    "tensor_parallel": "not implemented (AutoTP): zero_strategy shards data parallel only",
    "expert_parallel": "not implemented (AutoEP); zero_strategy gathers only the selected experts at ZeRO-3 "
    "(docs/moe.md)",
}
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
     *(key for block, key in _REDUCE_DTYPE_KEYS if block == _TOP), *_FRONTEND_KEYS, *_TOP_IGNORED]
)  # fmt: skip


class _DeepSpeedReader:
    """One pass over a DeepSpeed-style mapping, collecting ZeroConfig fields and, for
    ``zero-strategy check``, which key went where."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.values: dict[str, Any] = {}
        self.where: dict[str, str] = {}  # field -> the key that set it
        self.honoured: dict[str, str] = {}  # every key read -> its field
        self.auto: list[str] = []  # keys left "auto" (not set)
        self.ignored: list[str] = []  # DeepSpeed features not implemented here
        self.frontend: list[str] = []  # top-level keys the training loop owns
        self.optimizer_note: str | None = None  # optimizer: {type: Muon}: the line that builds it
        self.unused: list[str] = []  # keys of a block its own "enabled": false turns off (fp16's loss scale)

    def put(self, name: str, value: Any, where: str) -> None:
        if name in self.values and self.values[name] != value:
            report(ValueError(
                f"{where}={value!r} conflicts with {self.where[name]}={self.values[name]!r} in {self.source}; "
                "set only one of them"
            ))  # fmt: skip
            return
        self.values[name], self.where[name] = value, where
        self.honoured[where] = name

    def leaf(self, block: Mapping[str, Any], key: str, path: str, rule: Rule) -> Any:
        """The coerced value of ``block[key]``, or None when it is missing or "auto"."""
        raw = block.get(key)
        if raw is None or is_auto(raw):
            return None
        value = attempt(apply_rule, rule, raw, f"{path}.{key}" if path else key, self.source)
        return None if value is FAILED else value

    def block(self, d: Mapping[str, Any], key: str, valid: Iterable[str], ignored: Iterable[str] = ()) -> Mapping:
        raw = d.get(key)
        if raw is None or is_auto(raw):
            return {}
        ignored_keys = attempt(check_keys, raw, key, self.source, valid, ignored)
        if ignored_keys is FAILED:  # not a mapping
            return {}
        self.ignored += ignored_keys
        return raw

    def read(self, d: Mapping[str, Any], *, warn: bool = True) -> ZeroConfig:
        moved = {key: f"{_ZO}.{key}" for key in _DS_KEYS[_ZO]}
        top = check_keys(d, "", self.source, _DS_TOP_KEYS, (*_FRONTEND_KEYS, *_TOP_IGNORED), moved=moved)
        self.frontend = [key for key in top if key in _FRONTEND_KEYS]
        self.optimizer_note = muon_note(d.get("optimizer"), self.source)
        self.ignored += [key for key in top if key in _TOP_IGNORED]
        zero = self._offload_ignored(
            self.block(d, _ZO, (*_DS_KEYS[_ZO], *_ZERO_BLOCK_LEGACY, _MICS), _ZERO_BLOCK_IGNORED)
        )
        self._legacy_offload(zero)
        if zero.get(_MICS) is not None and not is_auto(zero[_MICS]):  # MiCS's shard groups: our shard_size
            size = attempt(apply_rule, _to_shard_size, zero[_MICS], f"{_ZO}.{_MICS}", self.source)
            self.put("shard_size", None if size is FAILED else size, f"{_ZO}.{_MICS}")
        own = self.block(d, _OWN, (*_DS_KEYS[_OWN], *(key for block, key in _REDUCE_DTYPE_KEYS if block == _OWN)))
        for path, block in ((_ZO, zero), (_OWN, own), (_TOP, d)):
            self.put_fields(block, path)
        precision = attempt(self._precision, d, own)  # may set loss_scale
        explicit = set(self.values)
        if precision is not None and precision is not FAILED:
            self.values["precision"] = precision
            self.where["precision"] = ",".join(k for k, name in self.honoured.items() if name == "precision")
            if precision.enabled:
                explicit.add("precision")
        cfg = ZeroConfig(**self.values, _explicit=frozenset(explicit))
        if warn:
            self._warn(self.frontend)
        return cfg

    def put_fields(self, block: Mapping[str, Any], path: str) -> None:
        """Set the ZeroConfig fields that DeepSpeed block ``path`` holds, skipping missing and "auto" ones."""
        table = _DS_KEYS[path]
        for key, raw in block.items():
            name = table.get(key)
            where = f"{path}.{key}" if path else key
            if name is not None and is_auto(raw):
                self.auto.append(where)
            if name is None or raw is None or is_auto(raw):
                continue
            value = attempt(_SETTINGS[name].metadata["ds_read"], raw, where, self.source)
            if value is not None and value is not FAILED:  # None: e.g. gradient_clipping 0, DeepSpeed's "off"
                self.put(name, value, where)

    def _offload_ignored(self, zero: Mapping[str, Any]) -> Mapping[str, Any]:
        """``zero`` without the ignored keys of its ``offload_optimizer`` block (recorded)."""
        block = zero.get("offload_optimizer")
        if not isinstance(block, Mapping) or not any(key in block for key in _OFFLOAD_OPTIMIZER_IGNORED):
            return zero
        self.ignored += [f"{_ZO}.offload_optimizer.{key}" for key in _OFFLOAD_OPTIMIZER_IGNORED if key in block]
        kept = {key: value for key, value in block.items() if key not in _OFFLOAD_OPTIMIZER_IGNORED}
        return {**zero, "offload_optimizer": kept}

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
        fp16_enabled = self.leaf(fp16, "enabled", "fp16", to_bool)
        fp16_on = fp16_enabled is True
        if bf16_on and fp16_on:
            raise ValueError(f"bf16.enabled and fp16.enabled are both true in {self.source}; enable at most one")
        for name, block in (("bf16", bf16), ("fp16", fp16)):  # "auto": the front-end's precision decides
            if "enabled" not in block:
                continue
            if is_auto(block["enabled"]):
                self.auto.append(f"{name}.enabled")
            else:
                self.honoured[f"{name}.enabled"] = "precision"
        fp16_auto, fp16_off = is_auto(fp16.get("enabled")), fp16_enabled is False
        scale = {}
        for key, spec in settings_of(LossScaleConfig).items():
            raw = fp16.get(key)
            if raw is not None and not is_auto(raw):
                if fp16_off:  # DeepSpeed reads a disabled block's loss scale no more than we do
                    self.unused.append(f"fp16.{key}")
                    continue
                value = attempt(spec.metadata["read"], raw, f"fp16.{key}", self.source)
                if value is not FAILED:
                    scale[key], self.honoured[f"fp16.{key}"] = value, "loss_scale"
        if scale:
            where = 'fp16 (only if fp16.enabled "auto" turns fp16 on)' if fp16_auto else "fp16"
            self.put("loss_scale", LossScaleConfig(**scale), where)
            self.honoured.pop(where, None)  # listed key by key above
        reduce = {}
        for path, key in _REDUCE_DTYPE_KEYS:
            value = self.leaf(own if path else d, key, path, _to_reduce_dtype)
            if value is not None:
                reduce[f"{path}.{key}" if path else key] = value
        self.honoured.update(dict.fromkeys(reduce, "precision"))
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
        if self.optimizer_note is not None:  # said on its own, with the line that builds it
            frontend = [key for key in frontend if key != "optimizer"]
            warn_once(self.optimizer_note, stacklevel=4)
        reasons = (
            (self.ignored, f"zero_strategy does not implement these DeepSpeed options and ignores them "
                           f"(in {self.source})"),
            (frontend, f"zero_strategy ignores these top-level DeepSpeed keys in {self.source} because the "
                       "training loop / front-end owns them"),
        )  # fmt: skip
        for keys, reason in reasons:
            if keys:
                warn_once(f"{reason}: {', '.join(keys)}", stacklevel=4)


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
