"""Counting the bytes a rank holds, by kind and by memory tier (``memory_stats()``).

Kinds: full parameters (at ZeRO-3 only while gathered), ZeRO-3 parameter rows (the persistent
shards), gradient shards, master pieces that are not views (and the whole matrices an owner
steps for Muon-like optimizers), optimizer state, full gradients
still in ``p.grad``, and top-k compression's residuals (full size on every rank,
``compression.py``). Each storage is counted once, however many views of it there are.

Tiers: the same bytes by where the offload policy placed them (``offload.py``):
``tier_device``, ``tier_host_pinned``, ``tier_host_pageable``, ``tier_disk``. On a machine
without a GPU, where host and device are the same RAM, the split still shows what moved.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from zero_strategy.sharding.group import ShardGroup
from zero_strategy.sharding.pieces import is_placeholder
from zero_strategy.sharding.unit import UnitStorage

__all__ = ["KINDS", "TIERS", "model_state_bytes"]

KINDS = ("params", "param_shards", "grad_shards", "masters", "optimizer_state", "full_grads", "residuals")
TIERS = ("tier_device", "tier_host_pinned", "tier_host_pageable", "tier_disk")


def model_state_bytes(
    params: Iterable[torch.Tensor],
    units: Sequence[UnitStorage],
    groups: Sequence[ShardGroup],
    optimizers: Sequence[torch.optim.Optimizer],
    disk_bytes: Mapping[str, int] | None = None,
    compute: torch.device | None = None,
    residuals: Iterable[torch.Tensor] = (),
    whole: Sequence[tuple[torch.Tensor, str]] = (),
) -> dict[str, int]:
    """Bytes per kind, ``model_state`` (their sum) and the same per tier. ``disk_bytes``: bytes
    in swap files by kind (optimizer state, ZeRO-3 parameter rows), counted on disk. ``whole``:
    the whole matrices an owner rank steps for an optimizer that needs whole parameters
    (``runtime/whole_params.py``) with the tier of their masters; counted as masters, their
    state as optimizer state, and their bytes also as ``whole_masters`` (not part of the sum). With an accelerator as
    ``compute`` device a tensor's tier is where it actually is (a misplaced one shows); on a
    CPU-only machine, where both tiers are the same memory, it is where the policy put it."""
    on_cpu_only = compute is None or compute.type == "cpu"
    seen: set[int] = set()
    tiers = dict.fromkeys(TIERS, 0)

    def nbytes(t: torch.Tensor | None, tier: str = "device") -> int:
        if t is None or is_placeholder(t):  # a row or master on disk: nothing in memory
            return 0
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        n = t.untyped_storage().nbytes()
        if not on_cpu_only:
            tier = "host" if t.device.type == "cpu" else "device"
        if tier != "device":  # host, or disk-tier tensors while they are read back
            tiers["tier_host_pinned" if t.is_pinned() else "tier_host_pageable"] += n
        else:
            tiers["tier_device"] += n
        return n

    out = dict.fromkeys(KINDS, 0)
    for u in units:  # rows first: an offloaded row's masters are views of it
        out["param_shards"] += nbytes(u.row, u.row_tier) + nbytes(u.frozen_row, u.row_tier)
    for p in params:
        out["params"] += nbytes(p)
        out["full_grads"] += nbytes(p.grad)
    tier_of: dict[int, str] = {}
    for g in groups:
        out["grad_shards"] += nbytes(g.grad_shard_if_allocated, g.tier)
        for m in g.masters:
            out["masters"] += nbytes(m, g.tier)
            tier_of[id(m)] = g.tier
    before = out["masters"]
    for proxy, tier in whole:
        out["masters"] += nbytes(proxy, tier)
        tier_of[id(proxy)] = tier
    whole_bytes = out["masters"] - before
    for optimizer in optimizers:
        for master, st in optimizer.state.items():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    out["optimizer_state"] += nbytes(v, tier_of.get(id(master), "device"))
    for r in residuals:
        out["residuals"] += nbytes(r)
    for kind, n in (disk_bytes or {}).items():
        out[kind] += n
        tiers["tier_disk"] += n
    out["model_state"] = sum(out.values())
    out.update(tiers)
    out["whole_masters"] = whole_bytes
    return out
