"""Placement by budget: ``offload_optimizer: {device: cpu, ratio: auto}`` and ``offload_param:
{device: cpu, ratio: auto}`` pick the smallest offload fraction whose device bytes fit the
persistent tier of the memory budget (``zero_strategy.memory``, ``budget.py``).

The footprint is computed per ZeRO-3 unit from this rank's row (its pieces of the unit's
parameters, padding included, as ``ShardLayout`` lays them out), before anything is built:

- on the device: the trainable row in the master dtype (the masters are views of it), the
  frozen row in the compute dtype, the gradient shard in the master dtype, and the optimizer
  state, assumed to be two master-dtype values per element (Adam's moments: the common case;
  an optimizer with less state is over-counted, so it fits too);
- optimizer offloaded (``offload_optimizer``): only the rows stay, in the compute dtype;
  masters, gradient shards and state are on the host;
- parameters offloaded (``offload_param``): nothing of the unit between steps.

Units are offloaded in the order the engine builds them (the units, then the root unit), as a
fixed ``ratio`` does. With both set to auto, the parameters are offloaded only if the
optimizer alone does not fit. Every rank takes the largest count any rank needs (rows can
differ by padding), so every rank places alike. After the first step the budget measures
the real bytes (``Budget.check``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch
from torch import nn

from zero_strategy.comm import collectives as C
from zero_strategy.config.memory import MemoryConfig, format_bytes
from zero_strategy.runtime.budget import device_total
from zero_strategy.sharding.layout import ShardLayout
from zero_strategy.sharding.precision import Precision
from zero_strategy.storage.offload import OffloadPolicy, OnHost, StoragePolicy

__all__ = ["UnitBytes", "auto_offload", "resolve_ratios", "unit_bytes"]

log = logging.getLogger(__name__)

STATE_VALUES = 2  # optimizer state per element, in master-dtype values (Adam's two moments)


@dataclass(frozen=True)
class UnitBytes:
    """One unit's trainable elements and its device bytes between steps, by placement."""

    trainable: int  # elements (full size): what a ratio counts
    on_device: int
    optimizer_offloaded: int
    param_offloaded: int = 0


def unit_bytes(
    members: Sequence[tuple[str, Sequence[tuple[str, nn.Parameter]]]], precision: Precision, ctx: C.CommContext,
    fractions: tuple[float, ...] | None, cuts: Mapping[str, tuple[int, ...]] | None = None,
) -> list[UnitBytes]:  # fmt: skip
    """The footprint of each unit (``partition.unit_members``) on this rank; ``cuts``: the expert
    owners' boundaries by unit label (``experts/owners.py``), whose rows are padded to the largest
    owner's."""
    out = []
    for label, params in members:
        trainable = [p for _, p in params if p.requires_grad]
        ordered = trainable + [p for _, p in params if not p.requires_grad]
        numels = tuple(p.numel() for p in ordered)
        lay = ShardLayout(numels, ctx.world_size, ctx.rank, fractions, (cuts or {}).get(label))
        t = sum(lay.chunks[: len(trainable)])
        f = lay.shard_numel - t
        size = ordered[0].new_empty((), dtype=precision.param_dtype_for(ordered[0])).element_size()
        master = torch.empty((), dtype=precision.master_dtype_for(ordered[0])).element_size() if trainable else size
        on_device = t * master * (2 + STATE_VALUES) + f * size  # row, gradient shard, state; frozen row
        out.append(UnitBytes(sum(p.numel() for p in trainable), on_device, (t + f) * size))
    return out


def _fraction(units: Sequence[UnitBytes], k: int) -> float:
    """The ratio that offloads exactly the first ``k`` units with trainable elements."""
    total = sum(u.trainable for u in units)
    done = sum(u.trainable for u in [u for u in units if u.trainable][:k])
    return 1.0 if done >= total else max(0.0, (done - 0.5) / total)


def _device_bytes(units: Sequence[UnitBytes], optimizer: OffloadPolicy, param: OffloadPolicy) -> int:
    """Device bytes between steps under these policies, deciding unit by unit as
    ``ShardedParams`` does (rows on the host: nothing; optimizer side on the host: the rows)."""
    total = sum(u.trainable for u in units)
    n, p_done, o_done = 0, 0, 0
    for u in units:
        row_host = param.offloads(p_done, total)
        opt_host = bool(u.trainable) and optimizer.offloads(o_done, total)
        p_done += u.trainable if row_host else 0
        o_done += u.trainable if opt_host else 0
        n += 0 if row_host else u.optimizer_offloaded if opt_host else u.on_device
    return n


def auto_offload(
    units: Sequence[UnitBytes], optimizer: OffloadPolicy, param: OffloadPolicy, opt_auto: bool, param_auto: bool,
    room: int, ctx: C.CommContext,
) -> tuple[OffloadPolicy, OffloadPolicy]:  # fmt: skip
    """The policies (``OnHost``) with ``ratio: auto`` resolved against ``room`` (the persistent
    tier's bytes): the first that fits of, in order, each optimizer ratio with the rows on the
    device, then each parameter ratio with the whole optimizer side on the host. Raises when
    even the last does not fit."""
    n = len([u for u in units if u.trainable])
    fractions = [_fraction(units, k) for k in range(n + 1)]
    # the optimizer side first (the rows stay on the device), then the rows too
    choices = [(optimizer if not opt_auto else replace(cast(OnHost, optimizer), ratio=r), param if not param_auto else
                replace(cast(OnHost, param), ratio=0.0)) for r in (fractions if opt_auto else [0.0])]  # fmt: skip
    if param_auto:
        host_opt = replace(cast(OnHost, optimizer), ratio=1.0) if opt_auto else optimizer
        choices += [(host_opt, replace(cast(OnHost, param), ratio=r)) for r in fractions[1:]]
    need = [_device_bytes(units, o, p) for o, p in choices]
    fit = next((i for i, b in enumerate(need) if b <= room), len(choices))
    agreed = torch.tensor([fit], dtype=torch.int64, device=ctx.device)
    C.all_reduce(ctx, agreed, op="max", what="the offload ratio (ratio: auto)").wait()
    fit = int(agreed.item())
    if fit == len(choices):
        what = " and ".join(k for k, on in (("offload_optimizer", opt_auto), ("offload_param", param_auto)) if on)
        raise ValueError(
            f"rank {ctx.rank}: {what}: {{ratio: auto}} does not fit zero_strategy.memory's persistent tier of "
            f"{format_bytes(room)}: even with everything it may move on the host, the device keeps "
            f"{format_bytes(need[-1])} between steps"
            + (" (the parameter rows in the compute dtype)" if not param_auto else "")
            + f". Raise memory.persistent (or memory.budget) to at least {need[-1]} bytes, use more ranks"
            + (", or add offload_param: {device: cpu, ratio: auto}" if not param_auto else "")
        )
    optimizer, param = choices[fit]
    if ctx.rank == 0:
        log.info(
            "zero_strategy: ratio auto: offload_optimizer.ratio %.6g, offload_param.ratio %.6g; the device keeps %s "
            "between steps (persistent tier %s)", getattr(optimizer, "ratio", 0.0), getattr(param, "ratio", 0.0),
            format_bytes(need[fit]), format_bytes(room),
        )  # fmt: skip
    return optimizer, param


def resolve_ratios(
    storage: StoragePolicy, memory: MemoryConfig, members: Sequence[tuple[str, Sequence[tuple[str, nn.Parameter]]]],
    precision: Precision, ctx: C.CommContext, fractions: tuple[float, ...] | None,
    cuts: Mapping[str, tuple[int, ...]] | None = None,
) -> StoragePolicy:  # fmt: skip
    """The storage policy with any ``ratio: auto`` resolved against the persistent tier of the
    ``memory`` budget (``members``: ``unit_members``; ``cuts``: the expert owners' boundaries by
    unit label)."""
    if not (storage.auto_optimizer or storage.auto_params):
        return storage
    room = memory.resolve(device_total(ctx.device)).persistent
    units = unit_bytes(members, precision, ctx, fractions, cuts)
    optimizer, param = auto_offload(
        units, storage.optimizer, storage.params, storage.auto_optimizer, storage.auto_params, room, ctx
    )
    return StoragePolicy(optimizer, param)
