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

After the first optimizer step the optimizer state exists: the check runs again with it, and
on an accelerator with the working memory measured (the allocator's peak since ``initialize``,
less model state, cached parameters and communication buffers). On a CPU device the working
tier stays its share: the process has no allocator peak to read.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch

from zero_strategy.comm import collectives as C
from zero_strategy.config.memory import MemoryConfig, TierBytes, format_bytes
from zero_strategy.sharding.cache import GatherCache
from zero_strategy.sharding.states import ShardedState
from zero_strategy.sharding.unit import ShardedParams

__all__ = ["Budget", "cache_stats", "device_total"]

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


class Budget:
    """The resolved tiers of one engine and the cache cap it sets (``cache``)."""

    def __init__(self, memory: MemoryConfig, ctx: C.CommContext, storage: ShardedParams) -> None:
        self.ctx = ctx
        self.tiers: TierBytes = memory.resolve(device_total(ctx.device))
        units = [u for u in storage.units if not u.persistent]
        self.persistent_units = [u for u in storage.units if u.persistent]
        root = sum(u.full_bytes for u in units if u.label == "<root>")
        # what must be gathered at once: the root unit (all step long) and the running unit
        self.min_gathered = root + max((u.full_bytes for u in units if u.label != "<root>"), default=0)
        self.cache = self.tiers.cache
        if 0 < self.cache < self.min_gathered:
            raise ValueError(
                f"zero_strategy.memory.cache resolves to {format_bytes(self.cache)}, less than the units that must be "
                f"gathered at once ({format_bytes(self.min_gathered)}: the root unit and the largest unit); set "
                f"cache to 0 (free each unit after use) or to at least {self.min_gathered} bytes"
            )
        self.working = self.tiers.working  # measured after the first step on an accelerator
        self.persistent = 0
        self._measured = False
        self._warned = False
        if ctx.rank == 0:
            log.info("zero_strategy: memory %s (per rank)", self.tiers.describe())
        if ctx.device.type == "cuda":  # the working tier is measured from here on
            torch.cuda.reset_peak_memory_stats(ctx.device)

    def check(self, stats: dict[str, int], cache: GatherCache, *, when: str) -> None:
        """Raise if the model does not fit; shrink the cache (warned once) if it does only with
        a smaller one. ``stats``: ``memory_stats()`` now."""
        # persistent units' gathered parameters stay until the step: the persistent tier's too
        kept = sum(u.full_bytes for u in self.persistent_units if u.state is not ShardedState.SHARDED)
        self.persistent = stats["tier_device"] - stats["params"] - stats["full_grads"] + kept
        budget, need = self.tiers.budget, self.persistent + self.working + self.min_gathered
        if need > budget:
            raise RuntimeError(self._does_not_fit(stats, need, when))
        room = budget - self.persistent - self.working
        if cache.cap is not None and cache.cap > room:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"zero_strategy.memory: persistent {format_bytes(self.persistent)} + cache "
                    f"{format_bytes(cache.cap)} + working {format_bytes(self.working)} exceed the budget "
                    f"{format_bytes(budget)} ({when}); the cache shrinks to {format_bytes(room)}",
                    UserWarning,
                    stacklevel=3,
                )
            cache.cap = self.cache = room

    def after_first_step(self, stats: dict[str, int], cache: GatherCache) -> None:
        """The optimizer state exists now: measure working memory (an accelerator) and check again."""
        if self._measured:
            return
        self._measured = True
        if self.ctx.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.ctx.device))
            held = stats["tier_device"] - stats["params"] + cache.peak + stats["comm_scratch_peak"]
            self.working = max(0, peak - held)
        self.check(stats, cache, when="after the first step, with the optimizer state")

    def _does_not_fit(self, stats: dict[str, int], need: int, when: str) -> str:
        budget, world = self.tiers.budget, self.ctx.world_size
        fixed = self.working + self.min_gathered
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
            f"unit) + working {format_bytes(self.working)} = {format_bytes(need)}. Nearest settings that fit: "
            + "; or ".join(hints)
        )

    def stats(self, cache: GatherCache) -> dict[str, Any]:
        """The budget's entries of ``memory_stats()``."""
        return {
            "budget": self.tiers.budget,
            "budget_persistent": self.tiers.persistent,
            "budget_cache": self.tiers.cache,
            "budget_working": self.tiers.working,
            "persistent": self.persistent,
            "cache_cap": self.cache,
            "working": self.working,
        } | _cache_entries(cache)


def _cache_entries(cache: GatherCache) -> dict[str, int]:
    s = cache.stats
    return {
        "cache": cache.live(),
        "cache_peak": cache.peak,
        "cache_hits": s.hits,
        "cache_misses": s.misses,
        "cache_evictions": s.evictions,
        "cache_overflows": s.overflows,
        "gathers_avoided": s.hits,
        "bytes_not_moved": s.bytes_not_moved,
    }


def cache_stats(cache: GatherCache, budget: Budget | None) -> dict[str, int]:
    """What ``memory_stats()`` adds at ZeRO-3: the cache counters, and the budget's tiers when one is set."""
    return budget.stats(cache) if budget is not None else _cache_entries(cache)
