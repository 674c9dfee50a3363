"""The memory budget (``zero_strategy: {memory: {...}}``): the device memory one rank may use,
split in three tiers (design notes, section 2.1).

- **persistent**: what stays between steps: this rank's parameter rows (shards), gradient
  shards, masters that are not views, optimizer state;
- **cache**: full ZeRO-3 parameters gathered from the other ranks, kept after use while they
  fit, evicted by farthest next use (``sharding/cache.py``); a hard cap on gathered bytes;
- **working**: forward and backward temporaries (activations, buffers), on demand.

``budget`` is a fraction of the device's memory (``0.9``) or bytes (``"60GB"``, ``"512MiB"``, or
an integer above 1). On a CPU device, which has no memory of its own to take a fraction of,
it must be bytes. Each tier is a fraction of the budget or bytes; together they are at most
the budget. A number at most 1 is a fraction; bytes are a string with a unit or an integer
above 1. KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024.

The shares are the plan: at start the engine replaces the persistent and working shares by
what it measures, shrinks the cache (with one warning) when the three do not fit, and raises
when the model does not fit even with no cache (``runtime/budget.py``). Without a budget
(the default) nothing changes: DeepSpeed's ``stage3_max_live_parameters`` and
``stage3_max_reuse_distance`` govern ZeRO-3's gathered parameters. With one, the cache cap
governs and those two are not applied (reported once, see ``overrides.py``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import Any

from zero_strategy.config.values import coerce_fields, setting

__all__ = ["MemoryConfig", "TierBytes", "format_bytes", "to_size"]

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_HINT = "give a fraction in (0, 1] or bytes such as '60GB', '512MiB' or an integer above 1"


def to_size(value: Any, where: str, *, zero: bool = True) -> float | int:
    """A fraction (float in [0, 1]; (0, 1] without ``zero``) or a byte count (int above 1)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise TypeError(f"{where}: expected a fraction or a size, got {type(value).__name__} {value!r}; {_HINT}")
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m is None or m.group(2).lower() not in _UNITS | {"": 1}:
            raise ValueError(f"{where}: could not read {value!r} as a size; {_HINT}")
        number, unit = float(m.group(1)), m.group(2).lower()
        if unit:
            return int(number * _UNITS[unit])
        value = number
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero):
        raise ValueError(f"{where}: must be {'>= 0' if zero else '> 0'}, got {value!r}; {_HINT}")
    if number <= 1:
        return number
    if not number.is_integer():
        raise ValueError(f"{where}: {value!r} is above 1, so it is read as bytes, which must be whole; {_HINT}")
    return int(number)


def format_bytes(n: int) -> str:
    """``n`` bytes for people: '1.50 GiB (1610612736 B)'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n} B)"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class TierBytes:
    """A budget resolved to bytes on one device."""

    budget: int
    persistent: int
    cache: int
    working: int

    def describe(self) -> str:
        return (
            f"budget {format_bytes(self.budget)}: persistent {format_bytes(self.persistent)}, "
            f"cache {format_bytes(self.cache)}, working {format_bytes(self.working)}"
        )


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """``memory: {budget: 0.9, persistent: 0.3, cache: 0.5, working: 0.2}`` in the
    ``zero_strategy`` block (or ``ZeroConfig(memory=...)``; ``memory: "60GB"`` sets the budget
    alone). Floats are fractions, ints above 1 and strings with a unit are bytes (see the
    module docstring). ``budget`` None (the default): no budget."""

    budget: float | int | None = setting(
        None, lambda value, where: None if value is None else to_size(value, where, zero=False)
    )
    persistent: float | int = setting(0.3, to_size)
    cache: float | int = setting(0.5, to_size)
    working: float | int = setting(0.2, to_size)

    def __post_init__(self) -> None:
        coerce_fields(self, "MemoryConfig")
        shares = [getattr(self, name) for name in ("persistent", "cache", "working")]
        if all(isinstance(s, float) for s in shares) and sum(shares) > 1 + 1e-9:
            raise ValueError(
                f"zero_strategy.memory: the tier shares persistent {self.persistent} + cache {self.cache} + working "
                f"{self.working} = {sum(shares):g} are more than the whole budget (1); lower them so they sum to at most 1"
            )
        if isinstance(self.budget, int):
            self.resolve(None)  # bytes everywhere: the sum is checked now

    @property
    def enabled(self) -> bool:
        return self.budget is not None

    def resolve(self, device_total: int | None) -> TierBytes:
        """The budget and tiers in bytes; ``device_total`` is the device's memory (None: a CPU
        device, where the budget must be bytes)."""
        if self.budget is None:
            raise ValueError("zero_strategy.memory: no budget is set; give memory: {budget: 0.9} or {budget: '60GB'}")
        if isinstance(self.budget, float):
            if device_total is None:
                raise ValueError(
                    f"zero_strategy.memory.budget={self.budget} is a fraction of the device's memory, but the device "
                    "is the CPU, which has no memory of its own to take a fraction of; give bytes, e.g. "
                    "memory: {budget: '8GB'}"
                )
            budget = int(self.budget * device_total)
        else:
            budget = self.budget
        tiers = {
            name: int(share * budget) if isinstance(share, float) else share
            for name in ("persistent", "cache", "working")
            for share in (getattr(self, name),)
        }
        if sum(tiers.values()) > budget:
            raise ValueError(
                f"zero_strategy.memory: the tiers ({', '.join(f'{k} {format_bytes(v)}' for k, v in tiers.items())}) "
                f"add up to more than the budget {format_bytes(budget)}; lower a tier or raise the budget"
            )
        return TierBytes(budget=budget, **tiers)
