"""The communication counters: what every collective of this process moved, per kind and per
link class, the optimizer steps' wall time, and the ZeRO-3 cache tier's events.

Counting follows the ZeRO paper: a reduce-scatter of a Psi-element tensor counts Psi, an
all-gather producing Psi elements counts Psi, an all-reduce of Psi counts 2 Psi, a broadcast
of Psi counts Psi, an all-to-all of Psi (every rank's input) counts Psi. The counts are this
process's calls (every rank of a group counts the same collective once).

**Link classes.** Each communication context carries a ``link`` label, decided once from its
ranks when it is made (:func:`link_of`): ``"intra"`` when all its ranks lie in one node (the
fast link: NVLink), ``"inter"`` when they span nodes (the network). Nodes are blocks of
``node_size()`` contiguous global ranks: ``ZERO_STRATEGY_NODE_SIZE`` where set (a bench that
emulates several nodes on one machine sets it), else the launcher's ``LOCAL_WORLD_SIZE``
(torchrun, Accelerate, Lightning set it), else one node. So with shard groups that fit in a
node the shard group's context is intra and the replica group's inter; a flat layout over more
than one node is inter. :func:`comm_stats_by_link` gives the counters per (link, kind);
:func:`comm_report` adds ``bytes_intra`` and ``bytes_inter`` per step.

Nothing here calls ``torch.distributed``; :mod:`zero_strategy.comm.collectives` counts into it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CACHE_COUNTERS",
    "LINKS",
    "comm_report",
    "comm_stats",
    "comm_stats_by_link",
    "count",
    "count_cache",
    "link_of",
    "mark_step",
    "node_size",
    "reset_comm_stats",
]

LINKS = ("intra", "inter")
NODE_SIZE_ENV = "ZERO_STRATEGY_NODE_SIZE"


@dataclass
class _Counter:
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    seconds: float = 0.0
    exposed_seconds: float = 0.0

    def add(self, elements: int, element_size: int, seconds: float, exposed: float) -> None:
        self.calls += 1
        self.elements += elements
        self.bytes += elements * element_size
        self.seconds += seconds
        self.exposed_seconds += exposed


_STATS: dict[str, _Counter] = {}
_BY_LINK: dict[tuple[str, str], _Counter] = {}  # (link, kind)


@dataclass
class _StepClock:
    """Optimizer steps marked since the last reset, and their wall time."""

    steps: int = 0
    seconds: float = 0.0
    last: float | None = None


_STEPS = _StepClock()


def node_size() -> int | None:
    """Ranks per node: ``ZERO_STRATEGY_NODE_SIZE``, else ``LOCAL_WORLD_SIZE``, else None (one node)."""
    for name in (NODE_SIZE_ENV, "LOCAL_WORLD_SIZE"):
        text = os.environ.get(name, "").strip()
        if text:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{name}={text!r}: set it to the number of ranks per node (an integer)") from None
            if value < 1:
                raise ValueError(f"{name}={text!r}: set it to the number of ranks per node (>= 1)")
            return value
    return None


def link_of(global_ranks: Sequence[int], per_node: int | None = None) -> str:
    """``"intra"`` when every rank of ``global_ranks`` is in one node of ``per_node`` contiguous
    ranks (default :func:`node_size`; None: one node), else ``"inter"``."""
    size = node_size() if per_node is None else per_node
    if size is None or len(global_ranks) <= 1:
        return "intra"
    return "intra" if len({r // size for r in global_ranks}) == 1 else "inter"


def count(kind: str, link: str, elements: int, element_size: int, seconds: float, exposed: float) -> None:
    """One completed collective of ``kind`` over a ``link`` context (called by ``Handle.wait``)."""
    _STATS.setdefault(kind, _Counter()).add(elements, element_size, seconds, exposed)
    _BY_LINK.setdefault((link, kind), _Counter()).add(elements, element_size, seconds, exposed)


def comm_stats() -> dict[str, dict[str, float]]:
    """Per collective kind: ``calls``, ``elements`` and ``bytes`` (ZeRO-paper convention),
    ``seconds`` spent issuing and waiting in this process, and of them ``exposed_seconds``: the
    host blocked in ``wait`` (communication not hidden behind compute), since the last reset."""
    return {k: dict(vars(v)) for k, v in _STATS.items()}


def comm_stats_by_link() -> dict[str, dict[str, dict[str, float]]]:
    """:func:`comm_stats` split by link class: ``{"intra": {kind: {...}}, "inter": {...}}``
    (both keys always present), since the last reset."""
    out: dict[str, dict[str, dict[str, float]]] = {link: {} for link in LINKS}
    for (link, kind), c in _BY_LINK.items():
        out.setdefault(link, {})[kind] = dict(vars(c))
    return out


def mark_step() -> None:
    """An optimizer step ended (the engine calls it): the time since the previous mark is one step."""
    now = time.perf_counter()
    if _STEPS.last is not None:
        _STEPS.steps += 1
        _STEPS.seconds += now - _STEPS.last
    _STEPS.last = now


CACHE_COUNTERS = ("cache_hits", "cache_misses", "cache_evictions", "gathers_avoided", "bytes_not_moved")
_CACHE = dict.fromkeys(CACHE_COUNTERS, 0)


def count_cache(kind: str, nbytes: int = 0) -> None:
    """The ZeRO-3 cache tier (``sharding/cache.py``) served a use (``"hit"``: a gather avoided,
    ``nbytes`` not moved), needed a gather (``"miss"``) or evicted a unit (``"eviction"``)."""
    _CACHE[f"cache_{kind}es" if kind == "miss" else f"cache_{kind}s"] += 1
    if kind == "hit":
        _CACHE["gathers_avoided"] += 1
        _CACHE["bytes_not_moved"] += nbytes


def comm_report() -> dict[str, float]:
    """Per optimizer step since the last reset (call it right before the steps to measure):
    ``step_seconds``, ``exposed_seconds`` (the host blocked on collectives), ``issue_seconds``,
    ``exposed_pct`` (communication overhead: exposed against step time), ``bytes`` and of them
    ``bytes_intra`` / ``bytes_inter`` (by link class, see the module's docstring); and the
    ZeRO-3 cache tier's ``cache_hits``, ``cache_misses``, ``cache_evictions``,
    ``gathers_avoided`` and ``bytes_not_moved`` (of all engines in this process)."""
    steps = _STEPS.steps
    per = 1.0 / steps if steps else float("nan")
    step_s = _STEPS.seconds
    exposed = sum(c.exposed_seconds for c in _STATS.values())
    issued = sum(c.seconds - c.exposed_seconds for c in _STATS.values())
    by_link = {f"bytes_{link}": sum(c.bytes for (lk, _), c in _BY_LINK.items() if lk == link) * per for link in LINKS}
    return {
        "steps": steps,
        "step_seconds": step_s * per,
        "exposed_seconds": exposed * per,
        "issue_seconds": issued * per,
        "exposed_pct": 100.0 * exposed / step_s if step_s else float("nan"),
        "bytes": sum(c.bytes for c in _STATS.values()) * per,
        **by_link,
    } | {k: v * per for k, v in _CACHE.items()}


def reset_comm_stats() -> None:
    _STATS.clear()
    _BY_LINK.clear()
    _CACHE.update(dict.fromkeys(CACHE_COUNTERS, 0))
    _STEPS.steps, _STEPS.seconds, _STEPS.last = 0, 0.0, time.perf_counter()  # the clock starts here
