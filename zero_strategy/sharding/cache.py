"""The cache tier: full ZeRO-3 parameters kept gathered after use, under a hard cap in bytes.

Without a cache a unit is freed after its forward and gathered again for its backward, the
next micro-step and every evaluation forward. With one (``zero_strategy.memory``, see
``config/memory.py``) a unit's gathered parameters stay after use while the cache has room,
and a later use finds them: no all-gather. The cap counts every gathered byte of units that
are not persistent (persistent units belong to the persistent tier); a gather that would go
over it first evicts. Units in use cannot be evicted (the root unit during a step, the unit
whose forward or backward runs, units held by ``gathered_parameters``), so a cap smaller than
what must be live at once is exceeded by that much (``overflows``, warned once); the engine
refuses a cache smaller than the root unit plus the largest unit at start.

Which unit goes: :class:`EvictionPolicy`, Belady's choice over the recorded order of uses
(the unit whose next use is farthest away; the order repeats every step), least recently used
when no order is valid (the first step, a step that took another path, evaluation). The policy
knows nothing of units: keys, a cyclic order, a position; the MoE expert cache reuses it.

The counters (hits, misses, evictions, gathers avoided, bytes not moved) are in
``memory_stats()``, per step in ``zs.comm_report()``, and marked in ``zs.profile`` traces.

Gradients are not the cache's business: a unit's gradients are reduce-scattered when its
backward ends whether its parameters stay or go. The optimizer step changes every unit's
values, so the engine frees every gathered unit after it (``ShardedParams.after_step``):
with a cache as large as the model each unit is gathered once per step (FSDP2's
``reshard_after_forward=False``).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

from zero_strategy.comm import collectives as C
from zero_strategy.comm import profiling as P
from zero_strategy.sharding.gather_meter import GatherMeter
from zero_strategy.sharding.states import ShardedState
from zero_strategy.sharding.unit import UnitStorage

__all__ = ["CacheStats", "EvictionPolicy", "GatherCache"]

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
NEVER = float("inf")


def _record(kind: str, u: UnitStorage, nbytes: int = 0, *, trace: bool = True) -> None:
    """With ``trace`` (a cache is set): count a cache event for ``zs.comm_report`` and, inside
    ``zs.profile``, mark it in the trace: an instant range ``zero: cache hit unit 'blocks.3'
    (4096 bytes not moved)``, ``zero: cache miss unit ...`` or ``zero: cache eviction unit ...``."""
    if not trace:
        return  # no cache tier: nothing to report (a gather is not a cache miss)
    C.count_cache(kind, nbytes)
    if P.enabled():
        P.close_range(P.open_range("zero: cache", kind, u.name, *([f"({nbytes} bytes not moved)"] if nbytes else [])))


class EvictionPolicy(Generic[K]):
    """Which of the resident keys to evict: the one whose next use in the recorded cyclic order
    is farthest from ``position`` (Belady); without an order or a position, the least recently
    used (ties: the smaller key position in first-use order, so every rank chooses alike)."""

    def __init__(self) -> None:
        self._uses: dict[K, list[int]] = {}  # key -> its indices in the order
        self._length = 0
        self._clock = 0
        self._last: dict[K, int] = {}  # key -> clock of its last use
        self._first: dict[K, int] = {}  # key -> order of its first use ever (deterministic ties)

    @property
    def has_order(self) -> bool:
        return self._length > 0

    def set_order(self, order: Sequence[K] | None) -> None:
        """The recorded sequence of uses that repeats (None or empty: none is valid)."""
        self._uses, self._length = {}, len(order or ())
        for i, key in enumerate(order or ()):
            self._uses.setdefault(key, []).append(i)

    def used(self, key: K) -> None:
        self._clock += 1
        self._last[key] = self._clock
        self._first.setdefault(key, len(self._first))

    def distance(self, key: K, position: int | None) -> float:
        """Uses from ``position`` until ``key``'s next use after it (cyclic); inf: never used
        again or no valid order."""
        uses = self._uses.get(key)
        if position is None or not uses:
            return NEVER
        i = bisect.bisect_right(uses, position)
        nxt = uses[i] if i < len(uses) else uses[0] + self._length
        return nxt - position

    def victim(self, candidates: Iterable[K], position: int | None) -> K | None:
        """The key to evict among ``candidates`` (None if there is none)."""
        keys = list(candidates)
        if not keys:
            return None
        lru = {k: (self._last.get(k, 0), self._first.get(k, -1)) for k in keys}
        if position is None or not self.has_order:
            return min(keys, key=lambda k: lru[k])
        # farthest next use first; among the never-again, the least recently used
        return max(keys, key=lambda k: (self.distance(k, position), -lru[k][0], -lru[k][1]))


class CacheStats:
    """Counters of the cache tier since the engine started (``memory_stats()``)."""

    def __init__(self) -> None:
        self.hits = 0  # uses that found the unit gathered by an earlier use: a gather avoided
        self.misses = 0  # uses that needed a gather (on demand or prefetched)
        self.evictions = 0
        self.bytes_not_moved = 0  # full bytes of the gathers avoided
        self.overflows = 0  # gathers that went over the cap: only units in use were left


class GatherCache:
    """The ZeRO-3 cache tier of one engine: ``cap`` bytes of gathered parameters (None: no
    cache, each unit freed after use as without a budget)."""

    def __init__(self, meter: GatherMeter[UnitStorage], cap: int | None) -> None:
        self.meter = meter
        self.cap = cap
        self.policy: EvictionPolicy[int] = EvictionPolicy()
        self.stats = CacheStats()
        self._served: dict[int, int] = {}  # unit tag -> the gather count that served its last use
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.cap is not None and self.cap > 0

    def live(self) -> int:
        """Bytes of gathered (or gathering) units that are not persistent: the cache's contents."""
        return self.meter.cached_bytes

    def used(self, u: UnitStorage) -> None:
        """``u`` is used (its forward or backward starts); a hit if an earlier use's gather still
        holds it. Call before gathering it: a gather issued now counts as a miss."""
        if u.persistent:
            return
        if u.state is not ShardedState.SHARDED and self._served.get(u.tag) == u.gathers:
            self.stats.hits += 1
            self.stats.bytes_not_moved += u.full_bytes
            _record("hit", u, u.full_bytes, trace=self.enabled)
        else:
            self.stats.misses += 1
            self._served[u.tag] = u.gathers + (u.state is ShardedState.SHARDED)
            _record("miss", u, trace=self.enabled)
        self.policy.used(u.tag)

    def make_room(self, need: int, busy: set[int], position: int | None, *, before: float | None = None) -> bool:
        """Evict until ``need`` more bytes fit under the cap; units in ``busy`` (tags) stay.
        With ``before`` (a prefetch), only units whose next use is farther than ``before`` may
        go. Returns whether the bytes fit now."""
        if not self.enabled or self.cap is None:
            return True
        live = self.live()
        while live + need > self.cap:
            candidates = {tag: u for tag, u in self.meter.cached.items() if tag not in busy and not u.holds}
            tag = self.policy.victim(candidates, position)
            if tag is None or (before is not None and self.policy.distance(tag, position) <= before):
                return False
            candidates[tag].reshard()
            self.stats.evictions += 1
            _record("eviction", candidates[tag])
            live -= candidates[tag].full_bytes
        return True

    def gathering(self, u: UnitStorage, busy: set[int], position: int | None) -> None:
        """An on-demand gather of ``u`` is about to be issued: make room, or note the overflow."""
        if not self.enabled or u.persistent or u.state is not ShardedState.SHARDED:
            return
        if not self.make_room(u.full_bytes, busy | {u.tag}, position):
            self.stats.overflows += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "zero_strategy: the ZeRO-3 cache cap of %d bytes is smaller than the units that must be gathered "
                    "at once (%s: %d bytes, with the units in use); it is exceeded by that much (logged once). "
                    "Raise memory.cache.",
                    self.cap,
                    u.name,
                    self.live() + u.full_bytes,
                )

    @property
    def peak(self) -> int:
        """The most cached bytes at once."""
        return self.meter.cached_peak
