"""``zero-strategy check FILE``: every problem of a config file in one run, or the config it
resolves to, with where each setting came from.

A file is read as ``ZeroConfig.from_file`` reads it (the same rules, every problem collected),
then the resolved config's own conflicts are added (:meth:`ZeroConfig.conflicts`), including
those with a setting left at its default, which a front-end could still change: ``--stage``
applies a front-end's stage first, and ``--world-size`` checks what depends on the number of
ranks (``load_balance.scores``: one per rank). For a clean file the report lists every field
with its value and the key it came from (or "default"), the DeepSpeed keys honoured, those
read but not applied, those left ``"auto"``, and those ignored, with the reason.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from zero_strategy.config.blocks import _DTYPE_NAMES, PrecisionConfig, _precision_name
from zero_strategy.config.memory import MemoryConfig, format_bytes
from zero_strategy.config.overrides import not_applied_settings, resolve_overrides
from zero_strategy.config.values import ConfigError, collecting
from zero_strategy.config.zero_config import (
    _DS_TOP_KEYS,
    _FIELD_NAMES,
    IGNORED_WHY,
    _DeepSpeedReader,
    _read_native,
    load_file,
)

__all__ = ["CheckReport", "check_file"]


@dataclasses.dataclass
class CheckReport:
    """What ``zero-strategy check`` found in one file."""

    source: str
    problems: list[str] = dataclasses.field(default_factory=list)
    resolved: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (field, value, from)
    honoured: dict[str, str] = dataclasses.field(default_factory=dict)  # key -> field
    not_applied: list[str] = dataclasses.field(default_factory=list)
    auto: list[str] = dataclasses.field(default_factory=list)
    ignored: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (key, why)
    notes: list[str] = dataclasses.field(default_factory=list)
    memory: list[str] = dataclasses.field(default_factory=list)  # the budget's bytes per tier

    @property
    def ok(self) -> bool:
        return not self.problems

    def format(self) -> str:
        if self.problems:
            count = f"{len(self.problems)} problem{'s' if len(self.problems) > 1 else ''}"
            return "\n".join([f"{self.source}: {count}", *(f"  - {p}" for p in self.problems)]) + "\n"
        left, width = (max(len(row[i]) for row in self.resolved) for i in (0, 1))
        out = [f"{self.source}: OK", "", "resolved config (field, value, from):"]
        out += [f"  {name:<{left}}  {value:<{width}}  {origin}" for name, value, origin in self.resolved]
        sections = (
            ("DeepSpeed keys honoured (key -> field)", [f"{k} -> {f}" for k, f in self.honoured.items()]),
            ("memory budget (bytes per tier)", self.memory),
            ("read but not applied", self.not_applied),
            ('left "auto" (the default, or what the front-end sets)', self.auto),
            ("ignored", [f"{key}: {why}" for key, why in self.ignored]),
            ("notes", self.notes),
        )
        for title, lines in sections:
            if lines:
                out += ["", f"{title}:", *(f"  {line}" for line in lines)]
        return "\n".join(out) + "\n"


def _show(value: Any) -> str:
    """A field's value in one word: sub-configs as their non-default fields."""
    if isinstance(value, PrecisionConfig):
        reduce = _DTYPE_NAMES[value.reduce_dtype]
        return _precision_name(value) + ("" if reduce == "fp32" else f",reduce={reduce}")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                   if getattr(value, f.name) != f.default}  # fmt: skip
        return "{" + ",".join(f"{k}:{v}" for k, v in changed.items()) + "}" if changed else "(defaults)"
    return str(value)


def check_file(path: str | os.PathLike[str], *, stage: int | None = None, world_size: int | None = None) -> CheckReport:
    """Read ``path`` and report every problem, or the resolved config (see the module docstring)."""
    source = os.fspath(path)
    report = CheckReport(source)
    reader = _DeepSpeedReader(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            data = load_file(path)
            with collecting(source):
                keys = set(data)
                if keys and keys <= set(_FIELD_NAMES) and not keys <= _DS_TOP_KEYS:  # the flat form
                    cfg = _read_native(data, source)
                    reader.where = reader.honoured = {key: key for key in data}
                else:
                    cfg = reader.read(data, warn=False)
            if stage is not None:
                cfg = resolve_overrides(cfg, source="--stage", stage=stage)
                reader.where["stage"] = "--stage"
            report.problems = cfg.conflicts(world_size)
        except ConfigError as exc:
            report.problems = exc.problems
        except (ValueError, TypeError, OSError) as exc:
            report.problems = [str(exc)]
    report.notes = [str(w.message) for w in caught]
    if report.problems:
        if "stage" not in reader.where:  # a front-end could still set it
            hint = (" (zero_optimization.stage is not set: the default 2 applies unless a front-end sets it; "
                    "check with --stage N)")  # fmt: skip
            report.problems = [p + hint if "needs stage 3 (got stage 2)" in p else p for p in report.problems]
        return report
    report.resolved = [(name, _show(getattr(cfg, name)), reader.where.get(name, "default")) for name in _FIELD_NAMES]
    report.honoured = reader.honoured
    report.memory = _memory_lines(cfg.memory)
    report.not_applied = not_applied_settings(cfg)
    report.auto = reader.auto
    report.ignored = [(key, IGNORED_WHY.get(key, "not implemented by zero_strategy")) for key in reader.ignored]
    owned = {"optimizer": reader.optimizer_note} if reader.optimizer_note else {}
    report.ignored += [(key, owned.get(key, "the training loop / front-end owns it")) for key in reader.frontend]
    report.ignored += [(key, "fp16.enabled is false: the loss scale applies to fp16 only") for key in reader.unused]
    return report


# When the cache tier is used (docs/memory_budget.md, "Which units the cache holds").
CACHE_CONDITION = (
    "the cache holds only units that are not persistent: after the first optimizer step the persistent tier's "
    "room (persistent less this rank's rows, gradient shards, masters and optimizer state) is filled with "
    "persistent units, gathered once per step; a model that fits that room is all persistent, and from then on "
    "the cache changes nothing (memory_stats()['persistent_units']). To measure the cache, set persistent: 0"
)


def _memory_lines(memory: MemoryConfig) -> list[str]:
    """The budget's tiers in bytes, or how they will be resolved (a fraction of the device),
    and when the cache tier is used."""
    if not memory.enabled:
        return []
    if isinstance(memory.budget, int):
        tiers = memory.resolve(None)
        lines = [
            f"{name}: {format_bytes(getattr(tiers, name))}" for name in ("budget", "persistent", "cache", "working")
        ]
        return lines + ([f"note: {CACHE_CONDITION}"] if tiers.cache and tiers.persistent else [])
    shares = ", ".join(f"{name} {getattr(memory, name)}" for name in ("persistent", "cache", "working"))
    return [
        f"budget: {memory.budget} of the device's memory ({shares}); resolved to bytes at start on the device "
        "(logged once); on a CPU device give bytes",
        *([f"note: {CACHE_CONDITION}"] if memory.cache and memory.persistent else []),
    ]
