"""The secondary partition (ZeRO++ hpZ, ``zero_hpz_partition_size: k``): the backward's
ZeRO-3 gathers stay inside groups of ``k`` ranks.

A ZeRO-3 unit is cut into ``n`` rows, one per rank of the shard group (``engine.ctx``: all
ranks when flat, the shard group with ``shard_size``), and every gather is an all-gather over
those ``n`` ranks: once for the unit's forward, once again for its backward. With hpZ the ranks
of the shard group also form groups of ``k`` contiguous ranks (``k`` divides ``n``; made with
``split_groups``). When a unit's forward gather arrives, the rank at position ``j`` of its
``k``-group keeps rows ``[j*n/k, (j+1)*n/k)`` of the gathered buffer (tags included): its
*secondary shard*, a copy taken from the gathered tensor, with no extra communication. The
full parameters are freed after the forward as usual. The unit's next gather (its backward,
or the recomputation of an activation checkpoint in the backward, and the backward's
prefetch) is an all-gather of the secondary shards within the ``k``-group, which rebuilds the
same buffer, row for row, so everything after the gather (the tag checks, the unpacking) is
unchanged and the numbers are the same. The gather consumes the secondary shard: it is freed
as soon as that gather is issued (DeepSpeed instead keeps it allocated until the step).

Which gathers keep one: the forward gathers of a forward that may have a backward (the model's
forward with gradients enabled; a reentrant checkpoint's no-grad forward inside it counts), for
units freed after use; not the root unit or the units gathered with it (they stay gathered
until the end of the backward), not persistent units, not MoE experts units (gathered by
selection), not an evaluation or no-grad forward, not a call outside the model's forward.
What is left is dropped at the end of the backward (a unit whose backward never gathered it),
at a no-grad forward with no backward pending, and at the optimizer step (the primary rows
changed: a secondary shard kept past it would be stale; the next forward takes new ones). A
secondary shard also carries the version of the rows it was taken from and is used only
while they are unchanged (a load, ``gathered_parameters(modifier_rank=...)``). Every rank
holds secondary shards of the same units at the same points (the scheduler's decisions are the
same on every rank), so the ranks of a ``k``-group always issue the same gather.

A backward gather that finds ranks of the group gathering different units raises the usual
``UnitDivergence`` (each row carries the tag of the unit its forward gathered); its ranks are
then the rows' positions in the shard group (``n/k`` rows per member of the ``k``-group).

Memory per rank: between a unit's forward and its backward, ``1/k`` of the unit's gathered
bytes (``n/k`` rows of ``numel/n`` elements, in the gather dtype); at the end of a forward,
``1/k`` of every unit freed after use (``peak``). Saving: the backward's gathers move no byte
across groups of ``k`` (a ``k`` of one node's GPUs keeps them on NVLink). ``k == n``: the
secondary group is the shard group itself, so nothing is kept (a no-op); ``k == 1`` is
DeepSpeed's default, off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from zero_strategy.comm import collectives as C

if TYPE_CHECKING:
    from zero_strategy.comm.policy import CommPolicy

__all__ = ["SecondaryShards", "secondary_context"]


class UnitStorage(Protocol):
    """What the secondary shards read of a unit (``unit.UnitStorage``)."""

    @property
    def tag(self) -> int: ...
    @property
    def version(self) -> int: ...


def secondary_context(ctx: C.CommContext, k: int, comm: CommPolicy, *, grouped: bool) -> C.CommContext | None:
    """This rank's ``k``-group (the gather policy's ``hpz_size``, ``zero_hpz_partition_size``)
    inside ``ctx``'s group (the shard group; ``grouped``: one smaller than the world), or None
    where hpZ changes nothing (``k`` 1, or the group's size; the config refuses ``k > 1`` below
    stage 3). Refuses a ``k`` that does not divide the group's size, naming the valid sizes.
    Collective over ``ctx``'s group when it makes groups; call it before the model is touched."""
    n = ctx.world_size
    if k == 1 or k == n:
        return None
    if n % k:
        where = f"the shard group's {n} ranks (shard_size={n})" if grouped else f"the world size {n}"
        sizes = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        raise ValueError(
            f"initialize(): zero_hpz_partition_size={k} does not divide {where}; use one of the valid sizes: "
            f"{sizes} (1: off; {n}: the whole group, which keeps no secondary shard)"
        )
    group, _ = C.split_groups(ctx, k)
    return comm.context(group, ctx.device)


class SecondaryShards:
    """The secondary shards of one engine's ZeRO-3 units (see the module docstring): taken from
    a forward gather's buffer (:meth:`want` before it arrives, :meth:`keep` when it does),
    consumed by the unit's next gather (:meth:`gather`), dropped (:meth:`drop_all`). ``live``
    and ``peak``: bytes held now and at most."""

    def __init__(self, ctx: C.CommContext) -> None:
        self.ctx = ctx  # the k-rank group
        self._held: dict[int, tuple[torch.Tensor, int]] = {}  # unit tag -> (its secondary shard, rows version)
        self._wanted: set[int] = set()
        self.live = 0
        self.peak = 0
        self.gathers = 0  # gathers served from secondary shards

    def want(self, u: UnitStorage) -> None:
        """Keep a secondary shard of ``u`` when its gather in flight arrives."""
        self._wanted.add(u.tag)

    def keep(self, u: UnitStorage, gathered: torch.Tensor) -> None:
        """``u``'s gather arrived in ``gathered`` (the flat buffer of every rank's row): keep this
        rank's block of rows if :meth:`want` asked for it."""
        if u.tag not in self._wanted:
            return
        self._wanted.discard(u.tag)
        self._drop(u.tag)
        with torch.no_grad(), torch.inference_mode(False):
            block = gathered.view(self.ctx.world_size, -1)[self.ctx.rank].clone()
        self._held[u.tag] = (block, u.version)
        self.live += block.numel() * block.element_size()
        self.peak = max(self.peak, self.live)

    def gather(self, u: UnitStorage, out: torch.Tensor, what: str) -> C.Handle | None:
        """The all-gather of ``u``'s secondary shards into ``out`` (the same buffer as a gather
        from the rows) within the ``k``-group, or None when this rank holds none that is current
        (then the caller gathers from the rows; every rank of the group decides alike)."""
        held = self._held.get(u.tag)
        self._wanted.discard(u.tag)
        if held is None:
            return None
        self._drop(u.tag)
        block, version = held
        if version != u.version:  # the rows changed since: stale
            return None
        if block.dtype != out.dtype or block.numel() * self.ctx.world_size != out.numel():
            return None  # another wire format than the forward gather's (every rank alike)
        self.gathers += 1
        # the block is copied into ``out``'s own row before the call returns, so it may go now
        return C.all_gather(self.ctx, out, block, what=f"{what}, from the secondary shards")

    def _drop(self, tag: int) -> None:
        held = self._held.pop(tag, None)
        if held is not None:
            self.live -= held[0].numel() * held[0].element_size()

    def drop_all(self) -> None:
        for tag in list(self._held):
            self._drop(tag)
        self._wanted.clear()
