"""Value rules and settings declarations for the config classes in :mod:`zero_strategy.config`.

A *rule* turns a raw value (from keyword arguments, YAML, JSON or a DeepSpeed mapping) into
the field's type or raises ``ValueError``/``TypeError`` naming where the value came from:
``rule(value, where) -> value``.  A *reader* is a rule that also knows the source file, so
that errors can name it: ``read(value, where, source) -> value``.

Each config field is declared once, with :func:`setting`: its default, its rule and, for
``ZeroConfig``, where DeepSpeed writes it and whether it is read but not applied.  Everything
else (coercion on construction, validation of mappings, the DeepSpeed key tables) is derived
from those declarations with :func:`settings_of`.  This module is a leaf: it imports nothing
from the package.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = [
    "Reader",
    "Rule",
    "apply_rule",
    "check_keys",
    "coerce_fields",
    "float_rule",
    "in_source",
    "int_rule",
    "is_auto",
    "optional",
    "read_block",
    "setting",
    "settings_of",
    "to_bool",
    "to_choice",
    "to_float",
    "to_int",
]

Rule = Callable[[Any, str], Any]  # (raw value, "where" label for errors) -> coerced value
Reader = Callable[[Any, str, "str | None"], Any]  # (raw value, where, source file or None) -> value

# --------------------------------------------------------------------------- value parsing


def in_source(source: str | None) -> str:
    return f" (in {source})" if source else ""


def is_auto(value: Any) -> bool:
    """Hugging Face writes ``"auto"`` for values it fills in itself: read it as "not set"."""
    return isinstance(value, str) and value.strip().lower() == "auto"


def _parse_number(value: Any, where: str) -> numbers.Real | float:
    if isinstance(value, bool):
        raise TypeError(f"{where}: expected a number, got the bool {value!r}")
    if isinstance(value, numbers.Real):
        return value
    if isinstance(value, str):
        text = value.strip()
        for parse in (int, float):  # "1e9" is a string in YAML 1.1; int() first keeps big ints exact
            try:
                return parse(text)
            except ValueError:
                pass
        raise ValueError(f"{where}: could not parse {value!r} as a number")
    raise TypeError(f"{where}: expected a number, got {type(value).__name__} {value!r}")


def to_int(value: Any, where: str, *, minimum: int | None = 0) -> int:
    number = _parse_number(value, where)
    if isinstance(number, numbers.Integral):
        result = int(number)
    else:
        as_float = float(number)
        if not (math.isfinite(as_float) and as_float.is_integer()):
            raise ValueError(f"{where}: expected a whole number, got {value!r}")
        result = int(as_float)
    if minimum is not None and result < minimum:
        bound = "> 0" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{where}: must be {bound}, got {result}")
    return result


def to_float(
    value: Any, where: str, *, gt: float | None = None, ge: float | None = None, le: float | None = None
) -> float:
    result = float(_parse_number(value, where))
    if not math.isfinite(result):
        raise ValueError(f"{where}: must be a finite number, got {value!r}")
    checks = (
        (">", gt, gt is None or result > gt),
        (">=", ge, ge is None or result >= ge),
        ("<=", le, le is None or result <= le),
    )
    for op, bound, ok in checks:
        if not ok:
            raise ValueError(f"{where}: must be {op} {bound}, got {result}")
    return result


def to_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    hint = "; write true or false without quotes" if isinstance(value, str) else ""
    raise TypeError(f"{where}: expected true or false, got {type(value).__name__} {value!r}{hint}")


def to_choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    options = ", ".join(repr(c) for c in choices)
    raise ValueError(f"{where}: {value!r} is not one of {options}")


def int_rule(minimum: int | None, maximum: int | None = None) -> Rule:
    """A whole number in ``[minimum, maximum]`` (None: unbounded on that side)."""

    def rule(value: Any, where: str) -> int:
        result = to_int(value, where, minimum=minimum)
        if maximum is not None and result > maximum:
            raise ValueError(f"{where}: must be <= {maximum}, got {result}")
        return result

    return rule


def float_rule(*, gt: float | None = None, ge: float | None = None, le: float | None = None) -> Rule:
    """A finite number within the given bounds."""
    return lambda value, where: to_float(value, where, gt=gt, ge=ge, le=le)


def optional(rule: Rule) -> Rule:
    """``rule``, with None passed through (the field's "not set")."""
    return lambda value, where: None if value is None else rule(value, where)


def apply_rule(rule: Rule, value: Any, where: str, source: str | None) -> Any:
    """``rule(value, where)``, with the source file added to its error message."""
    try:
        return rule(value, where)
    except (ValueError, TypeError) as exc:
        if not source:
            raise
        raise type(exc)(f"{exc}{in_source(source)}") from None


# --------------------------------------------------------------------------- declarations


def setting(
    default: Any,
    rule: Rule | None = None,
    *,
    read: Reader | None = None,
    ds: str | None = None,
    aliases: tuple[str, ...] = (),
    ds_rule: Rule | None = None,
    not_applied: tuple[Any, str] | None = None,
) -> Any:
    """A config field, declared once with everything the readers need to know about it.

    Args:
        default: the field's default value.
        rule: how a raw value becomes the field's value (``rule(value, where)``).
        read: instead of ``rule``, a reader that also gets the source (``read(value, where,
            source)``), for sub-config fields whose errors name keys inside the source file.
        ds: the DeepSpeed block holding the field under its own name ("zero_optimization",
            "zero_strategy", "" for the top level), or None when DeepSpeed has no such key.
        aliases: older DeepSpeed names of the same key in that block.
        ds_rule: the rule for the DeepSpeed key when it differs from ``rule``.
        not_applied: for settings read but not acted on: the value that changes nothing here
            (None: any explicit value is reported) and what DeepSpeed does with the setting.
    """
    reader: Reader
    if rule is not None and read is None:
        reader = functools.partial(apply_rule, rule)
    elif read is not None and rule is None:
        reader = read
    else:
        raise TypeError("setting(): give exactly one of rule= or read=")
    ds_read = reader if ds_rule is None else functools.partial(apply_rule, ds_rule)
    metadata = {"read": reader, "ds": ds, "aliases": aliases, "ds_read": ds_read, "not_applied": not_applied}
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def settings_of(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of a config class that :func:`setting` declared, by name, in declaration order
    (cached: treat the result as read-only)."""
    return {f.name: f for f in dataclasses.fields(cls) if "read" in f.metadata}


def coerce_fields(obj: Any, prefix: str) -> None:
    """Replace each declared field of a frozen config by its value read with the field's rule."""
    cls: type = type(obj)
    for name, spec in settings_of(cls).items():
        object.__setattr__(obj, name, spec.metadata["read"](getattr(obj, name), f"{prefix}.{name}", None))


# --------------------------------------------------------------------------- mappings


def check_keys(
    block: Any,
    path: str,
    source: str | None,
    valid: Iterable[str],
    ignored: Iterable[str] = (),
    moved: Mapping[str, str] | None = None,
) -> list[str]:
    """Raise on keys that are neither valid nor ignored; return the dotted paths of ignored keys."""
    if not isinstance(block, Mapping):
        label = path or "config"
        raise TypeError(f"{label}: expected a mapping, got {type(block).__name__} {block!r}{in_source(source)}")
    valid, ignored = frozenset(valid), frozenset(ignored)
    for key in block:
        if key in valid or key in ignored:
            continue
        full = f"{path}.{key}" if path else str(key)
        where = f" in {source}" if source else ""
        candidates = sorted(valid | ignored)
        close = difflib.get_close_matches(str(key), candidates, n=1)
        if moved and key in moved:
            hint = f"did you mean '{moved[key]}'? (it belongs inside that block)"
        elif close:
            hint = f"did you mean '{close[0]}'?"
        else:
            scope = f"under '{path}'" if path else "at the top level"
            hint = f"valid keys {scope} are: {', '.join(candidates)}"
        raise ValueError(f"unknown key '{full}'{where}; {hint}")
    return [f"{path}.{key}" if path else key for key in block if key in ignored]


def read_block(block: Any, path: str, source: str | None, cls: type) -> dict[str, Any]:
    """Validate a flat block whose keys are exactly the declared fields of ``cls``; skip "auto"."""
    specs = settings_of(cls)
    check_keys(block, path, source, specs)
    return {
        key: specs[key].metadata["read"](raw, f"{path}.{key}", source) for key, raw in block.items() if not is_auto(raw)
    }
