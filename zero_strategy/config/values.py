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

Problems are *reported*, not simply raised: inside :func:`collecting` (every read of a
mapping, a file or keyword arguments opens one) each unknown key, bad value and conflict is
recorded and the read goes on, so that one run names them all; at the end one problem raises
as its own error and several as one :class:`ConfigError`. Outside it a report raises at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "FAILED",
    "ConfigError",
    "Reader",
    "Rule",
    "apply_rule",
    "attempt",
    "bucket_rule",
    "check_keys",
    "collecting",
    "coerce_fields",
    "float_rule",
    "in_source",
    "int_rule",
    "is_auto",
    "optional",
    "read_block",
    "report",
    "report_all",
    "setting",
    "settings_of",
    "to_bool",
    "to_choice",
    "to_float",
    "to_int",
    "warn_once",
]

Rule = Callable[[Any, str], Any]  # (raw value, "where" label for errors) -> coerced value

_WARNED: set[str] = set()


def warn_once(message: str, stacklevel: int = 2) -> None:
    """A config warning said once per job: by rank 0 only (the process group's rank, else the
    launcher's ``RANK`` or ``LOCAL_RANK``; a process with none says it), and once per process,
    however often the file is read (the plugin, the ``Trainer`` and each engine read it again)."""
    if message in _WARNED or _rank() != 0:
        return
    _WARNED.add(message)
    warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")  # read only if imported: this module imports no torch
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or 0)


Reader = Callable[[Any, str, "str | None"], Any]  # (raw value, where, source file or None) -> value

# --------------------------------------------------------------------------- problems


class ConfigError(ValueError):
    """Several problems found in one read of a config; ``problems`` holds each message, in the
    order they were found. (A read with exactly one problem raises that problem's own
    ``ValueError``/``TypeError``.)

    Built from one string, as callers that add context do (``type(exc)(f"{where}: {exc}")``),
    it reads the problems back from the ``  - `` lines of that text."""

    def __init__(self, problems: Sequence[str] | str, source: str | None = None) -> None:
        self.source = source
        if isinstance(problems, str):
            self.problems = [line[4:] for line in problems.splitlines() if line.startswith("  - ")] or [problems]
            super().__init__(problems)
            return
        self.problems = list(problems)
        where = f" in {source}" if source else ""
        super().__init__(f"{len(self.problems)} problems{where}:\n" + "\n".join(f"  - {p}" for p in self.problems))


_SINK: contextvars.ContextVar[list[Exception] | None] = contextvars.ContextVar("zero_strategy_config", default=None)
FAILED: Any = type("Failed", (), {"__repr__": lambda self: "FAILED"})()  # a read that reported a problem


def report(exc: Exception) -> None:
    """Raise ``exc``, or record it when a :func:`collecting` read is open (the read goes on)."""
    sink = _SINK.get()
    if sink is None:
        raise exc
    sink.append(exc)


def report_all(problems: Sequence[Exception], source: str | None = None) -> None:
    """Report each problem: recorded inside :func:`collecting`, else raised together."""
    if _SINK.get() is not None:
        for exc in problems:
            report(exc)
    elif problems:
        _raise_together(problems, source)


def attempt(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; a ``ValueError``/``TypeError`` is reported and gives :data:`FAILED`."""
    try:
        return fn(*args)
    except (ValueError, TypeError) as exc:
        report(exc)
        return FAILED


def _raise_together(problems: Sequence[Exception], source: str | None) -> None:
    if len(problems) == 1:
        exc = problems[0]
        if source and source not in str(exc) and not isinstance(exc, ConfigError):
            raise type(exc)(f"{exc}{in_source(source)}") from None
        raise exc
    messages = [m for exc in problems for m in (exc.problems if isinstance(exc, ConfigError) else [str(exc)])]
    raise ConfigError(messages, source)


@contextlib.contextmanager
def collecting(source: str | None = None) -> Iterator[None]:
    """Collect every problem reported inside and raise them together at the end. Nested
    blocks add to the outermost one, which raises."""
    if _SINK.get() is not None:
        yield
        return
    sink: list[Exception] = []
    token = _SINK.set(sink)
    try:
        yield
    except (ValueError, TypeError) as exc:  # a problem that stopped the read: reported with the rest
        sink.append(exc)
    finally:
        _SINK.reset(token)
    if sink:
        _raise_together(sink, source)


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
    """true/false, or the integers 0 and 1 (DeepSpeed's pydantic model takes them too)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    hint = "; write true or false without quotes" if isinstance(value, str) else ""
    raise TypeError(f"{where}: expected true or false (or 0/1), got {type(value).__name__} {value!r}{hint}")


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


def bucket_rule(what: str) -> Rule:
    """A bucket size in elements, at least 1; DeepSpeed's 0 is read as 1 (``what`` one element
    per bucket means), said once per read of a 0."""

    def rule(value: Any, where: str) -> int:
        result = to_int(value, where, minimum=0)
        if result == 0:
            warnings.warn(f"{where}: 0 (DeepSpeed's 'no bucketing') is read as 1: {what}", UserWarning, stacklevel=2)
            return 1
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
    keeps_auto: bool = False,
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
        keeps_auto: "auto" is a value of this field (read by ``rule``), not "not set".
    """
    reader: Reader
    if rule is not None and read is None:
        reader = functools.partial(apply_rule, rule)
    elif read is not None and rule is None:
        reader = read
    else:
        raise TypeError("setting(): give exactly one of rule= or read=")
    ds_read = reader if ds_rule is None else functools.partial(apply_rule, ds_rule)
    metadata = {"read": reader, "ds": ds, "aliases": aliases, "ds_read": ds_read, "not_applied": not_applied,
                "keeps_auto": keeps_auto}  # fmt: skip
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def settings_of(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of a config class that :func:`setting` declared, by name, in declaration order
    (cached: treat the result as read-only)."""
    return {f.name: f for f in dataclasses.fields(cls) if "read" in f.metadata}


def coerce_fields(obj: Any, prefix: str) -> None:
    """Replace each declared field of a frozen config by its value read with the field's rule
    (every bad field is reported; one that failed keeps its default)."""
    cls: type = type(obj)
    with collecting():
        for name, spec in settings_of(cls).items():
            value = attempt(spec.metadata["read"], getattr(obj, name), f"{prefix}.{name}", None)
            object.__setattr__(obj, name, spec.default if value is FAILED else value)


# --------------------------------------------------------------------------- mappings


def check_keys(
    block: Any,
    path: str,
    source: str | None,
    valid: Iterable[str],
    ignored: Iterable[str] = (),
    moved: Mapping[str, str] | None = None,
) -> list[str]:
    """Report each key that is neither valid nor ignored; return the dotted paths of ignored keys."""
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
        report(ValueError(f"unknown key '{full}'{where}; {hint}"))
    return [f"{path}.{key}" if path else key for key in block if key in ignored]


def read_block(block: Any, path: str, source: str | None, cls: type) -> dict[str, Any]:
    """Validate a flat block whose keys are exactly the declared fields of ``cls``; skip "auto"
    (and, inside :func:`collecting`, the keys that reported a problem)."""
    specs = settings_of(cls)
    check_keys(block, path, source, specs)
    values = {
        key: attempt(specs[key].metadata["read"], raw, f"{path}.{key}", source)
        for key, raw in block.items()
        if key in specs and (not is_auto(raw) or specs[key].metadata["keeps_auto"])
    }
    return {key: value for key, value in values.items() if value is not FAILED}
