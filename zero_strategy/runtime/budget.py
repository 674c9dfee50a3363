"""The memory budget of one ZeRO-3 engine (``zero_strategy.memory``, ``config/memory.py``):
its tiers resolved to bytes on the device, the checks that the model fits, and what
``memory_stats()`` reports about it.

At ``initialize`` the budget is resolved (a fraction of the device's memory, or bytes) and
logged once. The persistent tier is measured (the rows, gradient shards and masters that
exist by then), the gathered parameters need at least the root unit plus the largest unit,
and working memory is its share. If those three do not fit the budget, ``initialize`` raises
naming each tier's bytes and the nearest setting that fits (a larger budget, more ranks,
offload). If they fit but leave less than the cache share, the cache shrinks, with one
warning.

After each optimizer's first step its state exists (with several optimizers, each one's at
its own first step): the persistent units are chosen to fill what the persistent tier leaves
(:func:`choose_persistent`: gathers avoided per byte, a greedy knapsack; with a budget
``stage3_param_persistence_threshold`` is not applied), and the check runs again, on an
accelerator with the working memory measured: the allocator's peak when it was set since
``initialize`` (else, hidden by an earlier peak, the most it held at this engine's gathers and
frees), less model state, cached parameters, communication buffers and the other live
engines' state on the device (a reference model, a teacher). The allocator's peak is read,
never reset: it is the user's and the other engines' too. On a CPU device the working tier
stays its share: the process has no allocator peak to read.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zero_strategy.comm import collectives as C
from zero_strategy.config.memory import MemoryConfig, TierBytes, format_bytes
from zero_strategy.sharding.cache import GatherCache
from zero_strategy.sharding.states import ShardedState
from zero_strategy.sharding.unit import ShardedParams, UnitStorage

__all__ = ["Budget", "cache_stats", "choose_persistent", "device_total", "uses_per_step"]

log = logging.getLogger(__name__)


def device_total(device: torch.device) -> int | None:
    """The device's memory in bytes; None for a CPU device (which has none of its own)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        return None
    mod = getattr(torch, device.type, None)  # xpu, mps, ...: their own query when they have one
    props = getattr(mod, "get_device_properties", None)
    return int(props(device).total_memory) if props is not None else None


def uses_per_step(units: Sequence[UnitStorage], order: Sequence[int] | None) -> dict[int, int]:
    """Gathers a unit needs per training step without a cache, by tag: from the recorded
    forward order, its forward uses and as many backward ones; the root unit, gathered once
    for the whole forward and backward, 1. Without an order (no step recorded yet) 2 each."""
    count = {u.tag: 0 for u in units} if order else {u.tag: 2 for u in units}
    for tag in order or ():
        count[tag] = count.get(tag, 0) + 2
    return count | {u.tag: 1 for u in units if u.label == "<root>"}


def choose_persistent(candidates: Sequence[tuple[int, int, int]], room: int) -> list[int]:
    """The units to keep gathered between uses: ``candidates`` are (tag, full bytes, gathers
    avoided per step). The benefit of keeping a unit is the bytes it would move per step (gathers
    avoided x its full bytes); its cost, the full bytes it holds; so the benefit per byte is the
    gathers avoided. Greedy knapsack: by benefit per byte, ties to the smaller unit (each
    collective has a fixed cost too, so small gathers cost the most per byte), then the tag; a
    unit that does not fit what is left is passed over. Depends only on its arguments, which
    are equal on every rank (``room`` is agreed first), so every rank chooses alike."""
    ranked = sorted((c for c in candidates if c[1] > 0 and c[2] > 0), key=lambda c: (-c[2], c[1], c[0]))
    chosen: list[int] = []
    for tag, nbytes, _ in ranked:
        if nbytes <= room:
            chosen.append(tag)
            room -= nbytes
    return sorted(chosen)


class Budget:
    """The resolved tiers of one engine and the cache cap it sets (``cache``)."""

    def __init__(self, memory: MemoryConfig, ctx: C.CommContext, storage: ShardedParams) -> None:
        self.ctx = ctx
        self.storage = storage
        self.tiers: TierBytes = memory.resolve(device_total(ctx.device))
        self._set_min_gathered()
        self.cache = self.tiers.cache
        if 0 < self.cache < self.min_gathered:
            raise ValueError(
                f"zero_strategy.memory.cache resolves to {format_bytes(self.cache)}, less than the units that must be "
                f"gathered at once ({format_bytes(self.min_gathered)}: the root unit and the largest unit); set "
                f"cache to 0 (free each unit after use) or to at least {self.min_gathered} bytes"
            )
        self.working = self.tiers.working  # measured after the first step on an accelerator
        self.expert_caches = 0  # bytes the MoE experts' caches may keep: part of the cache tier
        self.persistent = 0
        self.persistent_room = 0  # what the persistent tier leaves for persistent units (agreed by all ranks)
        self._warned = False
        self._measured = False  # working memory measured (an accelerator)
        self.pending = False  # a persistent choice waits for a step outside a forward
        self._chosen: list[int] | None = None  # tags of the persistent units last chosen
        if ctx.rank == 0:
            log.info("zero_strategy: memory %s (per rank)", self.tiers.describe())
        # device bytes of the other live engines' state on this device (the engine sets it): a
        # policy's reference model or a teacher is not this engine's working memory
        self.others: Callable[[], int] = lambda: 0
        self._peak_before = 0  # the device's peak at initialize; never reset (it is the user's too)
        if ctx.device.type == "cuda":  # the working tier is measured from here on
            self._peak_before = int(torch.cuda.max_memory_allocated(ctx.device))
            storage.meter.device = ctx.device

    def reserve_expert_caches(self, per_layer: int, layers: int) -> None:
        """The experts' caches (``moe_expert_cache`` bytes per experts layer, ``sharding/
        experts/cache.py``) keep gathered expert rows: they take their bytes from the cache tier,
        and the cache of whole units gets what is left."""
        reserved = per_layer * layers
        if not reserved:
            return
        left = self.tiers.cache - reserved
        if left < 0 or 0 < left < self.min_gathered:  # 0: the units are freed after use
            raise ValueError(
                f"zero_strategy.moe_expert_cache: {format_bytes(per_layer)} per experts layer x {layers} layers = "
                f"{format_bytes(reserved)} come out of zero_strategy.memory's cache tier "
                f"({format_bytes(self.tiers.cache)}), which must keep at least the units gathered at once "
                f"({format_bytes(self.min_gathered)}); lower moe_expert_cache to at most "
                f"{max(self.tiers.cache - self.min_gathered, 0) // layers} bytes, or raise memory.cache"
            )
        self.expert_caches = reserved
        self.cache = left

    def _set_min_gathered(self) -> None:
        """What must be gathered at once in the cache: the root unit (all step long) and the
        running unit, persistent units aside (they are the persistent tier's)."""
        units = [u for u in self.storage.units if not u.persistent]
        root = sum(u.full_bytes for u in units if u.label == "<root>")
        self.min_gathered = root + max((u.full_bytes for u in units if u.label != "<root>"), default=0)

    def check(self, stats: dict[str, int], cache: GatherCache, *, when: str) -> None:
        """Raise if the model does not fit; shrink the cache (warned once) if it does only with
        a smaller one. ``stats``: ``memory_stats()`` now."""
        # persistent units' gathered parameters stay until the step: the persistent tier's too
        kept = self._kept()
        self.persistent = stats["tier_device"] - stats["params"] - stats["full_grads"] + kept
        # every rank decides alike (the largest rank's tiers: uneven shards, per-device working
        # memory), or one rank raises while the others go on, or their caches evict differently
        agreed = torch.tensor([self.persistent, self.working], dtype=torch.int64, device=self.ctx.device)
        C.all_reduce(self.ctx, agreed, op="max", what="the memory budget's tiers (the largest rank's)").wait()
        self.persistent, self.working = (int(v) for v in agreed.tolist())
        budget, need = self.tiers.budget, self.persistent + self.working + self.min_gathered + self.expert_caches
        if need > budget:
            raise RuntimeError(self._does_not_fit(stats, need, when))
        room = budget - self.persistent - self.working - self.expert_caches
        tier = self.tiers.cache - self.expert_caches  # the experts' caches take theirs first
        if cache.cap is not None and cache.cap != min(room, tier):
            # shrink to the room, or grow back toward the configured cache (a new persistent
            # choice may have left more room, or raised the units that must be gathered at once)
            if room < tier and not self._warned:
                self._warned = True
                warnings.warn(
                    f"zero_strategy.memory: persistent {format_bytes(self.persistent)} + cache "
                    f"{format_bytes(cache.cap)} + working {format_bytes(self.working)} exceed the budget "
                    f"{format_bytes(budget)} ({when}); the cache shrinks to {format_bytes(room)}",
                    UserWarning,
                    stacklevel=3,
                )
            cache.cap = self.cache = min(room, tier)

    def _kept(self) -> int:
        """Bytes of the persistent units' gathered parameters (the persistent tier's)."""
        return sum(u.full_bytes for u in self.storage.units if u.persistent and u.state is not ShardedState.SHARDED)

    def after_new_state(
        self,
        stats: Callable[[], dict[str, int]],
        cache: GatherCache,
        order: Sequence[int] | None,
        step: str,
        *,
        can_change: bool,
    ) -> None:
        """An optimizer stepped for the first time: its state exists now (each optimizer's, when
        there are several). Measure working memory (an accelerator), choose the persistent units
        that fit what the persistent tier leaves (``can_change`` False, inside a forward:
        ``pending``, and the engine calls again after its next step) and check again.
        ``stats``: ``memory_stats()``."""
        now = stats()
        if self.ctx.device.type == "cuda":
            # the device's peak when it was set since initialize; else (an earlier, higher peak hides
            # it) the most the allocator held at this engine's gathers and frees
            peak = int(torch.cuda.max_memory_allocated(self.ctx.device))
            peak = peak if peak > self._peak_before else self.storage.meter.device_peak
            # model state (persistent units' gathered parameters included: they are not working
            # memory), and the other engines' state
            held = now["tier_device"] - now["params"] + self._kept() + cache.peak + now["comm_scratch_peak"]
            held += self.others()
            self.working = max(self.working if self._measured else 0, peak - held)  # the share, then the most seen
            self._measured = True
        self.pending = not can_change
        if can_change:
            self._choose_persistent(now, order, step)
            now = stats()
        self.check(now, cache, when="after an optimizer's first step, with its state")

    def _choose_persistent(self, stats: dict[str, int], order: Sequence[int] | None, step: str) -> None:
        """Keep gathered the units with the most gathers avoided per byte that fit the persistent
        tier's room (:func:`choose_persistent`); the others are freed after use (or cached).
        Collective: every rank agrees on the room (the smallest), then chooses alike."""
        units = self.storage.units
        state = stats["tier_device"] - stats["params"] - stats["full_grads"]  # rows, gradient shards, masters, state
        room = torch.tensor([state - self.tiers.persistent], dtype=torch.int64, device=self.ctx.device)
        C.all_reduce(self.ctx, room, op="max", what="the persistent tier's room (memory budget)").wait()
        self.persistent_room = max(0, -int(room.item()))
        uses = uses_per_step(units, order)
        chosen = choose_persistent([(u.tag, u.full_bytes, uses[u.tag]) for u in units], self.persistent_room)
        if chosen == self._chosen:
            return
        self._chosen = chosen
        for u in units:
            if u.persistent != (u.tag in chosen) and not u.holds:  # a held unit keeps its role until released
                u.reshard()  # between steps: nothing uses it (the step freed the others already)
                u.persistent = u.tag in chosen
        self.storage.refresh_persistent(step)
        self._set_min_gathered()
        if self.ctx.rank == 0:
            names = [u.label for u in units if u.persistent]
            unused = self.cache > 0 and len(names) == len(units)  # the cache holds units that are not persistent
            log.info(
                "zero_strategy: persistent units (most gathers avoided per byte that fit the persistent tier's room "
                "of %s): %s, %s%s", format_bytes(self.persistent_room), names or "none",
                format_bytes(sum(u.full_bytes for u in units if u.persistent)),
                f"; every unit is persistent, so the cache tier ({format_bytes(self.cache)}) holds nothing (set "
                "memory.persistent lower to use it)" if unused else "",
            )  # fmt: skip

    def _does_not_fit(self, stats: dict[str, int], need: int, when: str) -> str:
        budget, world = self.tiers.budget, self.ctx.world_size
        fixed = self.working + self.min_gathered + self.expert_caches
        hints = [f"memory.budget of at least {format_bytes(need)}"]
        if budget > fixed and self.persistent:
            ranks = math.ceil(self.persistent * world / (budget - fixed))
            hints.append(f"{ranks} ranks or more (the persistent tier is divided among them; now {world})")
        off_device = stats["masters"] + stats["optimizer_state"] + stats["grad_shards"]
        if off_device and self.persistent - off_device + fixed <= budget:
            hints.append("offload_optimizer: {device: cpu} (masters, gradient shards and optimizer state on the host)")
        elif self.persistent and fixed <= budget:
            hints.append("offload_param: {device: cpu} with offload_optimizer: {device: cpu} (only gathered "
                         "parameters on the device)")  # fmt: skip
        return (
            f"rank {self.ctx.rank}: the model does not fit zero_strategy.memory's budget of {format_bytes(budget)} "
            f"({when}): persistent {format_bytes(self.persistent)} (parameter rows, gradient shards, masters, "
            f"optimizer state{' once the first step made it' if 'initialize' in when else ''}) + gathered at least {format_bytes(self.min_gathered)} (the root unit and the largest "
            f"unit) + working {format_bytes(self.working)}"
            + (f" + the experts' caches {format_bytes(self.expert_caches)}" if self.expert_caches else "")
            + f" = {format_bytes(need)}. Nearest settings that fit: "
            + "; or ".join(hints)
        )

    def stats(self, cache: GatherCache, units: Sequence[UnitStorage]) -> dict[str, Any]:
        """The budget's entries of ``memory_stats()``."""
        return {
            "budget": self.tiers.budget,
            "budget_persistent": self.tiers.persistent,
            "budget_cache": self.tiers.cache,
            "budget_working": self.tiers.working,
            "persistent": self.persistent,
            "cache_cap": self.cache,
            "budget_expert_caches": self.expert_caches,  # moe_expert_cache x experts layers, from the cache tier
            "working": self.working,
            "persistent_room": self.persistent_room,
            # units whose optimizer side (masters, gradient shards, state) and whose rows are on the host
            "optimizer_offload_units": sum(g.tier != "device" for g in self.storage.groups),
            "param_offload_units": sum(u.row_tier != "device" for u in self.storage.units),
        } | _cache_entries(cache, units)


def _cache_entries(cache: GatherCache, units: Sequence[UnitStorage]) -> dict[str, int]:
    s = cache.stats
    persistent = [u for u in units if u.persistent]
    return {
        "persistent_units": len(persistent),
        "persistent_unit_bytes": sum(u.full_bytes for u in persistent),
        "cache": cache.live(),
        "cache_peak": cache.peak,
        "cache_hits": s.hits,
        "cache_misses": s.misses,
        "cache_evictions": s.evictions,
        "cache_overflows": s.overflows,
        "gathers_avoided": s.hits,
        "bytes_not_moved": s.bytes_not_moved,
    }


def cache_stats(cache: GatherCache, budget: Budget | None, units: Sequence[UnitStorage]) -> dict[str, int]:
    """What ``memory_stats()`` adds at ZeRO-3: the persistent units and the cache counters, and
    the budget's tiers when one is set."""
    return budget.stats(cache, units) if budget is not None else _cache_entries(cache, units)
