"""The experts' cache: the rows of experts gathered in a step's earlier passes, kept per MoE
layer under a cap in bytes (``moe_expert_cache``), so that a later pass gathers only the union
of its selected experts minus the kept ones.

Without it, each pass of an experts unit (``selective.py``) gathers the union of the experts its
tokens selected: the forward, the backward of the same micro-step (which needs the forward's
union again), the next micro-step under accumulation, an evaluation forward. Offloading MoE
systems (mixtral-offloading, MoE-Infinity) keep an LRU cache of experts per layer; this is
that cache for gathered rows.

- **What is kept**: a copy of expert ``e``'s rows of every parameter of the unit (for stacked
  parameters the flat range ``[e*R, (e+1)*R)``, for a ModuleList the parameters of member
  ``e``), taken from the full parameters right after a gather. It is separate from the
  gathered parameters, which are freed after each pass as before: the cache's memory is the kept
  rows only, at most ``cap`` bytes per layer (an expert larger than the cap is never kept).
- **Valid until the parameters change**: the unit's ``version`` counts the writes of its rows
  (an optimizer step, a load, ``load_full_state_dict``, ``gathered_parameters(modifier_rank=...)``:
  ``unit.py``); a pass that finds another version drops every kept row first.
- **Eviction**: :class:`~zero_strategy.sharding.cache.EvictionPolicy` over experts: the kept
  expert whose next use is farthest goes first, the next uses being the unions of the forwards
  whose backward is still to come; without one (evaluation, the last backward), the least
  recently used. A newly gathered expert whose next use is farther than every kept one's is not
  kept.
- **The same on every rank**: what is kept depends only on the agreed unions (one all-reduce per
  pass, ``ExpertRows.agree``), the unit's version and deterministic eviction, so every rank keeps
  the same experts and gathers the same rest, and a pass whose union is all kept issues no
  gather at all. The reduction of gradients is unchanged: it covers every forward's union.

Counters (``memory_stats()``): ``moe_cache_hits``/``moe_cache_misses`` (experts of a pass's union
found kept or gathered), ``moe_cache_evictions``, ``moe_cache_passes`` (passes whose whole union
was kept: no gather), ``moe_bytes_not_moved`` (the gather bytes the
kept rows saved), ``moe_cache_bytes`` (kept now, all layers) and ``moe_cache_peak`` (the most any
one layer kept at once: never above the cap).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from zero_strategy.sharding.cache import EvictionPolicy

__all__ = ["ExpertCache"]


def _rows(flat: torch.Tensor, e: int, a: int, b: int, at: Mapping[int, int] | None) -> torch.Tensor:
    """Expert ``e``'s rows ``[a, b)`` of a full-size flat parameter (``a = e * (b - a)``: stacked),
    or of a compact one with ``e`` in slot ``at[e]``."""
    shift = 0 if at is None else (at[e] - e) * (b - a)
    return flat[a + shift : b + shift]


class ExpertCache:
    """The kept rows of one experts unit. ``slices[e]``: expert ``e``'s ``(parameter, start,
    stop)`` ranges in the flat full parameters; ``element_size``: bytes per element."""

    def __init__(self, cap: int, slices: list[list[tuple[int, int, int]]], element_size: int) -> None:
        self.cap, self.slices = cap, slices
        self.sizes = [sum(b - a for _, a, b in s) * element_size for s in slices]
        self.kept: dict[int, list[torch.Tensor]] = {}
        self.bytes = 0  # kept now
        self.peak = 0  # the most kept at once
        self.evictions = 0
        self.version: int | None = None  # the unit's version the kept rows have
        self.policy: EvictionPolicy[int] = EvictionPolicy()

    def lookup(self, union: Sequence[int], version: int) -> tuple[int, ...]:
        """The experts of ``union`` that are kept (after dropping rows of an older version)."""
        if version != self.version:
            for e in list(self.kept):
                self._drop(e)
            self.version = version
        for e in union:
            self.policy.used(e)
        return tuple(e for e in union if e in self.kept)

    def fill(self, flats: Sequence[torch.Tensor], experts: Sequence[int], at: Mapping[int, int] | None = None) -> None:
        """Write the kept rows of ``experts`` into the flat parameters (full-size, or compact with
        expert ``e`` in slot ``at[e]``: ``experts/compact.py``)."""
        for e in experts:
            for (i, a, b), rows in zip(self.slices[e], self.kept[e]):
                _rows(flats[i], e, a, b, at).copy_(rows)

    def keep(
        self,
        flats: Sequence[torch.Tensor],
        experts: Sequence[int],
        upcoming: Sequence[Sequence[int]],
        at: Mapping[int, int] | None = None,
    ) -> None:
        """Keep copies of ``experts``' rows just gathered into ``flats`` (placed as for
        :meth:`fill`), evicting by the next uses in ``upcoming`` (unions in the order they will
        be gathered; empty: LRU)."""
        order = [e for union in upcoming for e in union]
        self.policy.set_order(order)
        position = -1 if order else None
        for e in experts:
            size = self.sizes[e]
            if e in self.kept or size > self.cap:
                continue
            while self.bytes + size > self.cap:
                victim = self.policy.victim([*self.kept, e], position)
                if victim is None or victim == e:
                    break
                self._drop(victim)
                self.evictions += 1
            if self.bytes + size > self.cap:
                continue
            self.kept[e] = [_rows(flats[i], e, a, b, at).clone() for i, a, b in self.slices[e]]
            self.bytes += size
            self.peak = max(self.peak, self.bytes)

    def _drop(self, e: int) -> None:
        del self.kept[e]
        self.bytes -= self.sizes[e]
