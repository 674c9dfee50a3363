"""How many bytes of full parameters ZeRO-3 holds gathered: now, at the peak, in the cache tier.

The unit storage (``unit.py``) reports each gather and free here; the memory budget
(``runtime/budget.py``) and ``memory_stats`` read the figures."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

import torch

__all__ = ["GatherMeter", "MeteredUnit"]


class MeteredUnit(Protocol):
    """What the meter reads of a unit (``unit.UnitStorage``)."""

    @property
    def tag(self) -> int: ...
    @property
    def full_bytes(self) -> int: ...
    @property
    def persistent(self) -> bool: ...


U = TypeVar("U", bound=MeteredUnit)


class GatherMeter(Generic[U]):
    """Bytes of full parameters gathered right now, the peak since the last reset, the gathers
    issued with their full bytes (ever), and the gathered units that are not persistent (the
    cache tier's contents, ``cache.py``) with their bytes and peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.gathers = 0
        self.gathered_bytes = 0
        self.cached: dict[int, U] = {}  # tag -> a gathered unit that is not persistent
        self.cached_bytes = 0
        self.cached_peak = 0
        # a CUDA device whose allocator is read at each gather and free (the memory budget sets
        # it), and the most it held there: this engine's peak where an earlier one hides it
        self.device: torch.device | None = None
        self.device_peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        if self.device is not None:  # the caching allocator's counter: a host read, no device wait
            self.device_peak = max(self.device_peak, int(torch.cuda.memory_allocated(self.device)))

    def gathered(self, u: U) -> None:
        """``u``'s gather buffer exists from now on."""
        self.add(u.full_bytes)
        self.gathers += 1
        self.gathered_bytes += u.full_bytes
        if not u.persistent:
            self.cached[u.tag] = u
            self.cached_bytes += u.full_bytes
            self.cached_peak = max(self.cached_peak, self.cached_bytes)

    def freed(self, u: U) -> None:
        """``u``'s full parameters are gone."""
        self.add(-u.full_bytes)
        if self.cached.pop(u.tag, None) is not None:
            self.cached_bytes -= u.full_bytes
