"""ZeRO-3 parameter storage: where the full parameters are and are not.

Two policies, chosen by type:

- :class:`ReplicatedParams` (ZeRO-1/2): every rank holds full parameters; after the optimizer
  step each group's updated pieces are all-gathered into them.
- :class:`ShardedParams` (ZeRO-3): every rank holds only its flat row of each unit (its pieces
  of every parameter, side by side). A unit moves SHARDED -> UNSHARDING -> UNSHARDED ->
  SHARDED; the full parameters exist only while UNSHARDED (outside, each parameter keeps its
  shape but is a placeholder that holds no memory).

Every ZeRO-3 gather carries a two-element tag naming the unit on each rank. If ranks gather
different units (a unit that ran on some ranks and not others), every rank raises the same
error naming the units and the ranks, instead of swapping data silently.
"""

from __future__ import annotations

import contextlib
from enum import Enum, auto
from typing import TYPE_CHECKING, Iterator, Sequence

import torch
from torch import nn

from zero_strategy import collectives as C
from zero_strategy.group import ShardGroup
from zero_strategy.init import check_placeholder, piece_of, placeholder

if TYPE_CHECKING:
    from zero_strategy.engine import ZeroEngine

__all__ = ["ReplicatedParams", "ShardedParams", "ShardedState", "UnitDivergence"]

TAG = 2  # tag elements appended to every rank's row


class ShardedState(Enum):
    SHARDED = auto()
    UNSHARDING = auto()
    UNSHARDED = auto()


class UnitDivergence(RuntimeError):
    """Ranks gathered different ZeRO-3 units: a unit ran on some ranks and not on others."""


class ReplicatedParams:
    """ZeRO-1/2: full parameters everywhere; refreshed by an all-gather after each step."""

    sharded = False

    @contextlib.contextmanager
    def gathered(self, engine: "ZeroEngine", groups: Sequence[ShardGroup], modifier_rank: int | None) -> Iterator[None]:
        """Parameters are full already; with a modifier rank, its values are broadcast and
        the masters refreshed."""
        yield
        if modifier_rank is not None:
            params = [p.detach() for g in groups for p in g.params]
            C.broadcast_coalesced(engine.ctx, params, src=modifier_rank, what="gathered_parameters(modifier_rank=...)")
            with torch.no_grad():
                for g in groups:
                    refresh_masters(g)

    def load_full(self, engine: "ZeroEngine", p: torch.Tensor, full: torch.Tensor) -> None:
        p.copy_(full)
        g, i = engine.reducer.locate(p)
        m = g.masters[i]
        if m.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
            m.data.copy_(full.reshape(-1)[slice(*g.layout.local_range(i))])

    def after_step(self, engine: "ZeroEngine") -> None:
        n, ctx = engine.ctx.world_size, engine.ctx
        pending: list[tuple[ShardGroup, C.Handle, torch.Tensor]] = []

        def complete(entry: tuple[ShardGroup, C.Handle, torch.Tensor]) -> None:
            g, h, buf = entry
            h.wait()
            with torch.no_grad():
                g.layout.unpack_full(buf, [p.detach().view(-1) for p in g.params])
            ctx.pool.put(buf)

        for g in engine.groups:
            lay = g.layout
            buf = ctx.pool.get(n * lay.shard_numel, g.params[0].dtype, g.grad_shard.device)
            row = buf.view(n, lay.shard_numel)[ctx.rank]
            with torch.no_grad():
                lay.pack_local([m.detach() for m in g.masters], row)
            pending.append((g, C.all_gather(ctx, buf, row, what=f"parameters of {g.name} (step {engine.step_count})"), buf))
            if len(pending) > engine.reducer.max_in_flight:
                complete(pending.pop(0))
        for entry in pending:
            complete(entry)


def refresh_masters(g: ShardGroup) -> None:
    """Copy this rank's pieces of ``g``'s full parameters into masters that are not views."""
    for i, (p, m) in enumerate(zip(g.params, g.masters)):
        piece = p.detach().reshape(-1)[slice(*g.layout.local_range(i))]
        if m.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
            m.data.copy_(piece)


class GatherMeter:
    """Bytes of full parameters gathered right now, and the peak since the last reset."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)


class UnitStorage:
    """One ZeRO-3 unit's persistent row and the full parameters' storages."""

    def __init__(self, group: ShardGroup, ctx: C.CommContext, tag: int, meter: GatherMeter, persistent: bool = False) -> None:
        self.meter = meter
        # a small unit stays gathered from its first use until the optimizer step changes it
        self.persistent = persistent
        self.group = group
        self.ctx = ctx
        self.tag = tag
        lay = group.layout
        dtype = group.params[0].dtype
        self.row = torch.empty(lay.shard_numel, dtype=dtype, device=ctx.device)
        with torch.no_grad():
            pieces = [piece_of(p, *lay.local_range(i)) for i, p in enumerate(group.params)]
            lay.pack_local(pieces, self.row)
        # Each parameter gets a full-shaped tensor with a storage of its own that is resized to
        # 0 bytes while sharded; ``p.data`` points at it only while the unit is gathered and is
        # a memory-less placeholder otherwise (reads give zeros, writes raise), so touching a
        # sharded parameter never reads freed memory. Views autograd saved in forward keep the storage object and see the data
        # again when the unit is gathered for backward.
        self.full = [torch.empty(p.shape, dtype=dtype, device=ctx.device) for p in group.params]
        for p, f in zip(group.params, self.full):
            f.untyped_storage().resize_(0)
            p.data = placeholder(p.shape, dtype, ctx.device)
        self.state = ShardedState.SHARDED
        self._numel_bytes = [p.numel() * p.element_size() for p in group.params]
        self._handle: C.Handle | None = None
        self._buf: torch.Tensor | None = None
        self._step = ""

    @property
    def full_bytes(self) -> int:
        return sum(self._numel_bytes)

    def _expect(self, what: str, *states: ShardedState) -> None:
        if self.state not in states:
            raise AssertionError(
                f"rank {self.ctx.rank}: {what} of {self.group.name} needs state "
                f"{' or '.join(s.name for s in states)}, but it is {self.state.name}"
            )

    def unshard_async(self, step: str) -> None:
        if self.state is not ShardedState.SHARDED:
            return
        n, s = self.ctx.world_size, self.group.layout.shard_numel + TAG
        buf = self.ctx.pool.get(n * s, self.row.dtype, self.row.device)
        row = buf.view(n, s)[self.ctx.rank]
        row[:-TAG].copy_(self.row)
        row[-TAG] = self.tag % 128
        row[-1] = self.tag // 128
        self._buf, self._step = buf, step
        self._handle = C.all_gather(self.ctx, buf, row, what=f"parameters of {self.group.name} ({step})")
        self.state = ShardedState.UNSHARDING
        self.meter.add(self.full_bytes)  # counted from the moment its gather buffer exists

    def wait_unshard(self, names: dict[int, str]) -> None:
        if self.state is ShardedState.UNSHARDED:
            return
        self._expect("wait_unshard", ShardedState.UNSHARDING)
        if self._handle is None or self._buf is None:
            raise AssertionError(f"rank {self.ctx.rank}: {self.group.name} is UNSHARDING without a gather in flight")
        self._handle.wait()
        n, s = self.ctx.world_size, self.group.layout.shard_numel + TAG
        rows = self._buf.view(n, s)
        tags = (rows[:, -TAG] + 128 * rows[:, -1]).round().long().tolist()
        if any(t != self.tag for t in tags):
            self.ctx.pool.put(self._buf)
            raise UnitDivergence(_divergence_message(self.group.name, self.tag, tags, names, self._step))
        lay = self.group.layout
        for p, fqn in zip(self.group.params, self.group.fqns):
            check_placeholder(p.data, fqn)
        with torch.no_grad():
            for p, f, nbytes in zip(self.group.params, self.full, self._numel_bytes):
                f.untyped_storage().resize_(nbytes)
                p.data = f
            flats = [f.view(-1) for f in self.full]
            # copy the rank rows (without their tags) into the parameters
            lay.unpack_full(rows, flats)
        self.ctx.pool.put(self._buf)
        self._handle, self._buf = None, None
        self.state = ShardedState.UNSHARDED

    @property
    def numel(self) -> int:
        return sum(self.group.layout.numels)

    def release(self) -> None:
        """Done with the parameters for now: free them unless the unit is persistent."""
        if not self.persistent:
            self.reshard()

    def reshard(self) -> None:
        if self.state is ShardedState.SHARDED:
            return
        if self.state is ShardedState.UNSHARDING:  # a prefetch nobody used
            self.wait_unshard({})
        for p, f in zip(self.group.params, self.full):
            p.data = placeholder(p.shape, f.dtype, f.device)
            f.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED
        self.meter.add(-self.full_bytes)


def _divergence_message(unit: str, tag: int, tags: list[int], names: dict[int, str], step: str) -> str:
    by_unit: dict[int, list[int]] = {}
    for rank, t in enumerate(tags):
        by_unit.setdefault(t, []).append(rank)
    parts = [f"ranks {ranks} gathered {names.get(t, f'unit #{t}')}" for t, ranks in sorted(by_unit.items())]
    return (
        f"ZeRO-3 ranks diverged at {step}: {'; '.join(parts)}. A unit ran on some ranks and not on "
        f"others (data-dependent routing such as MoE, or a branch only some ranks take), while gathering "
        f"{unit} here. Fix: make the module that owns the conditional branch one unit, so all of it is "
        "gathered together on every rank: decorate its class with @zero_auto_partition or pass it in "
        "initialize(policy={...})."
    )


class ShardedParams:
    """ZeRO-3: persistent rows per unit, full parameters only while a unit is gathered."""

    sharded = True

    def __init__(self, engine: "ZeroEngine", *, masters_in_rows: bool) -> None:
        self.meter = GatherMeter()
        small = engine.config.stage3_param_persistence_threshold
        self.units = [
            UnitStorage(g, engine.ctx, tag=g.index + 1, meter=self.meter, persistent=sum(g.layout.numels) <= small)
            for g in engine.groups
        ]
        self.names = {g.index + 1: g.name for g in engine.groups}
        if masters_in_rows:  # fp32: the optimizer updates the rows in place, no extra copy
            for u in self.units:
                lay = u.group.layout
                u.group.masters = [nn.Parameter(lay.local_view(u.row, i)) for i in range(len(u.group.params))]

    @contextlib.contextmanager
    def gathered(self, engine: "ZeroEngine", groups: Sequence[ShardGroup], modifier_rank: int | None) -> Iterator[None]:
        units = [self.units[g.index] for g in groups]
        was = [u.state for u in units]
        where = f"gathered_parameters (step {engine.step_count})"
        for u in units:
            u.unshard_async(where)
        for u in units:
            u.wait_unshard(self.names)
        try:
            yield
        finally:
            if modifier_rank is not None:
                params = [p.detach() for u in units for p in u.group.params]
                C.broadcast_coalesced(engine.ctx, params, src=modifier_rank, what="gathered_parameters(modifier_rank=...)")
                with torch.no_grad():
                    for u in units:
                        lay = u.group.layout
                        lay.pack_local([p.detach().view(-1)[slice(*lay.local_range(i))] for i, p in enumerate(u.group.params)], u.row)
                        refresh_masters(u.group)
            for u, state in zip(units, was):
                if state is ShardedState.SHARDED:
                    u.reshard()

    def load_full(self, engine: "ZeroEngine", p: torch.Tensor, full: torch.Tensor) -> None:
        g, i = engine.reducer.locate(p)
        lay = g.layout
        piece = full.reshape(-1)[slice(*lay.local_range(i))]
        row = self.units[g.index].row
        lay.local_view(row, i).copy_(piece)
        m = g.masters[i]
        if m.untyped_storage().data_ptr() != row.untyped_storage().data_ptr():
            m.data.copy_(piece)

    def after_step(self, engine: "ZeroEngine") -> None:
        # In fp32 the masters are views of the rows: already updated. Otherwise copy them in.
        with torch.no_grad():
            for u in self.units:
                u.reshard()  # persistent units hold the old values: gather them again when used
                g = u.group
                if g.masters and g.masters[0].untyped_storage().data_ptr() != u.row.untyped_storage().data_ptr():
                    g.layout.pack_local([m.detach() for m in g.masters], u.row)
