"""Mixture-of-experts at ZeRO-3: gather only the experts the router selected.

Detection (:func:`find_expert_modules`, no per-model list). An *experts module* holds the
weights of all experts stacked along dimension 0 and receives the router's selection as an
argument. Hugging Face transformers 5 stores experts this way (``MixtralExperts``,
``Qwen3MoeExperts``, ``DeepseekV3Experts``, ``GptOssExperts``: ``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``, ``forward(hidden_states, top_k_index, top_k_weights)``). A module is
one when every parameter's first dimension is its number of experts ``E`` (``num_experts`` or
its config's ``num_local_experts``/``num_experts``/``n_routed_experts``) and its ``forward``
takes the selection: an argument named in :data:`SELECTION_ARGUMENTS`, or, for classes marked by
transformers' ``use_experts_implementation`` decorator, the argument after the hidden states.

Storage. Each detected experts module is a ZeRO-3 unit of its own (inside its block's unit).
Its rows use the ordinary flat layout (``layout.py``), so checkpoints, exports, loads and
resharding see ordinary parameters; expert ``e`` of a parameter with ``R`` elements per expert
is its flat range ``[e*R, (e+1)*R)``, and each rank holds the parts of those ranges that fall
into its piece (whole experts when ``world_size`` divides ``E``: the expert dimension is
sharded).

Selective gather (:class:`ExpertRows`). Before the module's forward every rank marks the experts
its tokens selected and one all-reduce (MAX) of that ``E``-element mask gives the union over the
ranks. Each rank then sends the parts of the union's ranges it holds, padded to the longest
rank's, in one all-gather (with the unit's tag, so a diverged gather is still caught), and the
union's rows are written into the full parameters; the other rows are zeros that the experts'
forward never reads. The backward gathers the same union again. Gradients: the experts' forward
only reads selected rows, so a rank's gradient is zero outside its selection, and the reduction
reduce-scatters exactly the union's ranges (the union of every forward since the last reduction,
for accumulation): the other rows of the gradient shard are zeros, as DDP's. Nothing depends on
a gradient hook of an idle expert.

Cost switch. When the padded selective gather would move at least ``full_share`` of a whole
gather's bytes, the whole unit is gathered (and reduced) in one collective instead.

The experts' cache (``moe_expert_cache``, ``experts/cache.py``): rows gathered by a step's earlier
passes are kept per layer under a cap in bytes until the parameters change, and a later pass
gathers only its union minus the kept experts (nothing at all when every one is kept).

Compact gathers (``moe_compact_gather``, ``experts/compact.py``): the union's rows are placed in
parameters of shape ``[U, ...]`` and the module's call sees slots instead of expert indices, so a
layer's gathered memory follows the union too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zero_strategy.comm import collectives as C
from zero_strategy.sharding.experts.cache import ExpertCache
from zero_strategy.sharding.experts.compact import (
    CompactPlan,
    CompactRows,
    Spans,
    compact_start,
    compactable,
    span_numel,
    span_segments,
    spans_of,
    with_selection,
)
from zero_strategy.sharding.experts.detect import (
    SELECT_HOOK,
    SELECTION_ARGUMENTS,
    ExpertsModule,
    declare_experts,
    find_expert_modules,
    select_experts,
)
from zero_strategy.sharding.gather_checks import TAG, UnitDivergence, write_tag
from zero_strategy.sharding.group import ReducePlan
from zero_strategy.sharding.layout import ShardLayout
from zero_strategy.sharding.states import ShardedState
from zero_strategy.sharding.unit import UnitStorage

__all__ = [
    "SELECT_HOOK",
    "SELECTION_ARGUMENTS",
    "declare_experts",
    "select_experts",
    "ExpertRows",
    "ExpertsModule",
    "MoeStats",
    "find_expert_modules",
    "row_segments",
]

# forward arguments that carry the router's selection (expert indices per token)
FULL_SHARE = 0.2  # default cost switch, measured: bench/bench_moe.py part 1, bench/RESULTS.md


def row_segments(
    layout: ShardLayout,
    rows: Sequence[int],
    union: Sequence[int],
    rank: int,
    device: torch.device,
    owners: Sequence[int | None] | None = None,
) -> list[tuple[int, torch.Tensor]]:
    """The flat positions of the experts in ``union`` (sorted) that ``rank`` holds, per
    parameter of ``rows[i]`` elements per expert: ``(parameter, positions)`` in parameter order
    (positions ascending, so every rank packs and unpacks them alike). A parameter with an
    ``owners[i]`` belongs to that expert whole (a ModuleList member's)."""
    wanted = set(union)
    out = []
    for i, r in enumerate(rows):
        lo, hi = layout.local_range(i, rank)
        if owners is not None and owners[i] is not None:
            if owners[i] in wanted and lo < hi:
                out.append((i, torch.arange(lo, hi, device=device)))
            continue
        spans = spans_of(sorted(wanted), r, lo, hi)
        if spans:  # built on the device from host integers: no copy, no value-sized output
            parts = [torch.arange(a, b, device=device) for a, b in spans]
            out.append((i, parts[0] if len(parts) == 1 else torch.cat(parts)))
    return out


def _width(segments: Sequence[Sequence[tuple[int, torch.Tensor]]]) -> int:
    return max(sum(idx.numel() for _, idx in s) for s in segments)


class MoeStats:
    """Counters of the selective expert fetches since the engine started (``memory_stats()``)."""

    def __init__(self) -> None:
        self.gathers = 0  # expert gathers (selective or whole)
        self.full_gathers = 0  # of them, whole ones chosen by the cost switch
        self.gathered_bytes = 0  # bytes the expert gathers moved (received, with padding)
        self.peak_gather_bytes = 0  # the most one expert gather moved
        self.peak_layer_bytes = 0  # the most one experts layer held gathered at once (full-size or compact)
        self.compact_gathers = 0  # selective gathers placed compactly ([U, ...]: experts/compact.py)
        self.full_bytes = 0  # bytes whole gathers of the same units would have moved
        self.union_experts = 0  # experts in the agreed unions, summed over the forwards
        self.experts_seen = 0  # experts of the modules, summed over the same forwards
        self.reduced_bytes = 0  # gradient bytes the expert reductions moved
        self.full_reduce_bytes = 0  # bytes whole reductions would have moved
        # the experts' cache (experts/cache.py)
        self.cache_hits = 0  # experts of a pass's union found kept: not gathered
        self.cache_misses = 0  # experts of a pass's union gathered
        self.cache_passes = 0  # passes whose whole union was kept: no gather at all
        self.bytes_not_moved = 0  # gather bytes (with padding) the kept rows saved
        self.caches: list[ExpertCache] = []  # every layer's: evictions, bytes kept now, peak

    def moved(self, nbytes: int) -> None:
        """One expert gather received ``nbytes``."""
        self.gathered_bytes += nbytes
        self.peak_gather_bytes = max(self.peak_gather_bytes, nbytes)

    def placed(self, nbytes: int) -> None:
        """One experts layer holds ``nbytes`` of gathered parameters now."""
        self.peak_layer_bytes = max(self.peak_layer_bytes, nbytes)

    def entries(self) -> dict[str, int]:
        return {
            "moe_gathers": self.gathers,
            "moe_full_gathers": self.full_gathers,
            "moe_gathered_bytes": self.gathered_bytes,
            "moe_peak_gather_bytes": self.peak_gather_bytes,
            "moe_peak_layer_bytes": self.peak_layer_bytes,
            "moe_compact_gathers": self.compact_gathers,
            "moe_full_bytes": self.full_bytes,
            "moe_union_experts": self.union_experts,
            "moe_experts_seen": self.experts_seen,
            "moe_reduced_bytes": self.reduced_bytes,
            "moe_full_reduce_bytes": self.full_reduce_bytes,
            "moe_cache_hits": self.cache_hits,
            "moe_cache_misses": self.cache_misses,
            "moe_cache_evictions": sum(c.evictions for c in self.caches),
            "moe_cache_passes": self.cache_passes,
            "moe_bytes_not_moved": self.bytes_not_moved,
            "moe_cache_bytes": sum(c.bytes for c in self.caches),  # kept now, every layer
            "moe_cache_peak": max((c.peak for c in self.caches), default=0),  # the most one layer kept
        }


class ExpertRows:
    """The selective fetch of one detected experts module's unit (see the module doc)."""

    def __init__(
        self,
        found: ExpertsModule,
        unit: UnitStorage,
        stats: MoeStats,
        full_share: float,
        cache_cap: int = 0,
        compact: bool = False,
    ) -> None:
        self.found, self.unit, self.stats, self.full_share = found, unit, stats, full_share
        self.num_experts = found.num_experts
        if found.members:  # a ModuleList: each parameter belongs to one expert, named by its index
            cut = len(found.fqn) + 1
            self.owners: list[int | None] | None = [int(f[cut:].split(".", 1)[0]) for f in unit.fqns]
            self.rows = [p.numel() for p in unit.params]
        else:
            self.owners = None
            self.rows = [p.numel() // found.num_experts for p in unit.params]
        self.ctx = unit.ctx
        self.current: tuple[int, ...] | None = None  # the union gathered now (None: whole, or nothing)
        self.passes: list[tuple[int, ...]] = []  # unions of forwards whose backward is to come
        self.kinds: list[bool] = []  # per pass: whether its forward's rows were placed compactly
        self.open_call = False  # the module's call gathered its rows and has not returned yet
        self._pushed = False  # the latest forward gather left a pass for its backward
        self.pending: set[int] = set()  # experts of every forward since the last reduction
        self.pending_full = False  # some forward since the last reduction did not say its selection
        self.current_union: tuple[int, ...] = ()  # the union being gathered
        self._segments: dict[tuple[int, ...], list[list[tuple[int, torch.Tensor]]]] = {}  # by union
        self._spans: dict[tuple[int, ...], tuple[list[Spans], int]] = {}  # the same as ranges (compact)
        if unit.group is not None:
            unit.group.experts = self
        self.cache: ExpertCache | None = None  # the experts' cache (moe_expert_cache), or none
        if cache_cap > 0 and unit.params:
            slices: list[list[tuple[int, int, int]]] = [[] for _ in range(self.num_experts)]
            for i, r in enumerate(self.rows):
                owner = None if self.owners is None else self.owners[i]
                for e in range(self.num_experts) if owner is None else (owner,):
                    if 0 <= e < self.num_experts:
                        lo = 0 if owner is not None else e * r
                        slices[e].append((i, lo, lo + r))
            self.cache = ExpertCache(cache_cap, slices, unit.full[0].element_size())
            stats.caches.append(self.cache)
        # compact gathers (experts/compact.py): stacked experts whose call can run on [U, ...] rows
        self.compact: CompactRows | None = None
        if compact and not found.members and unit.params and compactable(found.module, found.num_experts):
            shapes = [f.shape for f in unit.full]
            self.compact = CompactRows(found.module, unit.params, shapes, self.rows, found.num_experts, self.ctx.device)

    @property
    def name(self) -> str:
        return self.unit.name

    # -- agreement -------------------------------------------------------------------------
    def agree(self, selection: torch.Tensor | None, step: str) -> tuple[int, ...] | None:
        """The union over the ranks of the experts selected in this call: one all-reduce of an
        ``E``-element mask (an element past the experts means "all": a rank that cannot say).
        None: every expert. Collective."""
        e = self.num_experts
        mask = torch.zeros(e + 1, dtype=torch.int32, device=self.ctx.device)
        self._mark(selection, mask)
        C.all_reduce(self.ctx, mask, op="max", what=f"expert selection of {self.name} ({step})").wait()
        values = mask.tolist()
        return self._counted(None if values[e] else tuple(k for k in range(e) if values[k]))

    def _mark(self, selection: torch.Tensor | None, mask: torch.Tensor) -> None:
        """Set ``mask``'s elements (``E + 1``) of the experts in ``selection``; None sets the last,
        "all": a rank that cannot say."""
        e = self.num_experts
        if selection is None:
            mask[e:].fill_(1)
        else:
            idx = selection.detach().reshape(-1).long()
            if idx.device != mask.device:
                idx = idx.to(mask.device)
            # integer indices, those out of range sent to a spare element: no value-sized output,
            # and the 1 a kernel argument (no host number copied into the device)
            hit = torch.zeros(e + 1, dtype=mask.dtype, device=mask.device)
            hit.index_fill_(0, torch.where((idx >= 0) & (idx < e), idx, e), 1)
            torch.maximum(mask[:e], hit[:e], out=mask[:e])

    def _counted(self, union: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """``union`` (None: every expert), counted in the union share."""
        self.stats.experts_seen += self.num_experts
        self.stats.union_experts += self.num_experts if union is None else len(union)
        return union

    def forget(self) -> None:
        """A backward was abandoned: no pass waits for its backward, nothing is pending."""
        self.clear_passes()
        self.pending, self.pending_full = set(), False

    def clear_passes(self) -> None:
        """No forward's backward is to come (the backward ended)."""
        self.passes.clear()
        self.kinds.clear()

    def forward_gather(self, union: Any, step: str) -> None:
        """A forward's gather of ``union``; one with gradients remembers it, and how its rows
        were placed, for its backward and the reduction. Collective."""
        grad = torch.is_grad_enabled()
        self._pushed = False
        if grad:
            self.remember(union)
        self.gather(union, step)
        if grad:
            self.kinds.append(self.placed_compactly())
            self._pushed = True

    def backward_gather(self, step: str) -> None:
        """The gather for the backward of the latest forward not yet backpropagated: its union
        again, placed as the forward placed it, since the views autograd saved are of that
        placement. A forward that ran on full-size parameters (gathered whole without a
        selection, or inside ``gathered_parameters``) gets a whole gather. Collective."""
        union = self.passes.pop() if self.passes else None
        compact = self.kinds.pop() if self.kinds else True
        self.gather(union if compact or self.compact is None else None, step)

    def placed_compactly(self) -> bool:
        """Whether the parameters are this unit's compact rows now (not full-size, not sharded)."""
        c = self.compact
        return c is not None and c.slots is not None and c.holds(self.unit.params)

    def remember(self, union: tuple[int, ...] | None) -> None:
        """A forward with gradients used ``union``: its backward gathers it, the reduction covers it."""
        self.passes.append(union if union is not None else tuple(range(self.num_experts)))
        if union is None:
            self.pending_full = True
        else:
            self.pending.update(union)

    # -- gathers ---------------------------------------------------------------------------
    def _whole(self, union: Sequence[int]) -> tuple[bool, list[Any], int]:
        """Whether the cost switch gathers ``union`` whole, every rank's segments of its rows
        (ranges for a compact placement, positions otherwise) and the padded width."""
        lay, n = self.unit.layout, self.ctx.world_size
        if self.compact is not None:  # the forward's union again in the backward: kept a while
            key = tuple(union)
            if key not in self._spans:
                if len(self._spans) > 4:
                    self._spans.clear()
                spans = [span_segments(lay, self.rows, union, r) for r in range(n)]
                self._spans[key] = spans, max(span_numel(s) for s in spans)
            spans, width = self._spans[key]
            return width >= self.full_share * lay.shard_numel, spans, width
        key = tuple(union)
        if key not in self._segments:  # the backward asks for its forward's union again
            if len(self._segments) > 4:
                self._segments.clear()
            self._segments[key] = [
                row_segments(lay, self.rows, union, r, self.ctx.device, self.owners) for r in range(n)
            ]
        segs = self._segments[key]
        width = _width(segs)
        return width >= self.full_share * lay.shard_numel, segs, width

    def _gathering(self, union: object) -> int | None:
        """Before a gather of ``union``: its whole gather's bytes, counted; None when nothing is
        to gather (gathered already, whole or this union, or held whole by
        ``gathered_parameters``: a superset)."""
        u = self.unit
        if self._sharded() and self.compact is not None and self.compact.slots is not None:
            self.compact.free()  # resharded by someone else (the end of the backward, a load)
        if u.state is ShardedState.UNSHARDED and (self.current is None or self.current == union):
            return None
        if not self._sharded():
            self.release(force=True)
            if not self._sharded():
                return None
        full_bytes = self.ctx.world_size * u.layout.shard_numel * u.full[0].element_size()
        self.stats.gathers += 1
        self.stats.full_bytes += full_bytes
        return full_bytes

    def _gather_whole(self, full_bytes: int, step: str, union: tuple[int, ...] | None = None) -> None:
        """The whole unit in one collective (the cost switch, or no selection). With compact
        gathers and a ``union``, only its rows stay: placed as ``[U, ...]``, the full ones freed."""
        self.stats.full_gathers += 1
        self.stats.moved(full_bytes)
        self.current = None
        c = self.compact
        if c is not None:
            c.fold()  # gradients of a compact placement leave p.grad before the parameters change shape
        self.unit.unshard_async(step)
        self.unit.wait_unshard(self.unit.checks.names)
        if c is not None and union is not None:
            self._compact_from_full(c, union)
            return
        self.stats.placed(self.unit.full_bytes)
        if c is not None:
            c.placed_whole()

    def _compact_from_full(self, c: CompactRows, union: tuple[int, ...]) -> None:
        """After a whole gather: the union's rows into ``[U, ...]`` parameters, the full ones freed."""
        u = self.unit
        self.current_union = union
        with torch.no_grad():
            flats = c.place(union)
            ids = c.ids(union)
            for f, flat in zip(u.full, flats):
                torch.index_select(f.view(self.num_experts, -1), 0, ids, out=flat.view(len(union), -1))
            for f in u.full:
                f.untyped_storage().resize_(0)
        self.stats.placed(c.nbytes(len(union)))
        self.stats.compact_gathers += 1
        self.current = union

    def gather(self, union: tuple[int, ...] | None, step: str) -> None:
        """Gather ``union``'s rows (None: the whole unit). Collective."""
        u = self.unit
        full_bytes = self._gathering(union)
        if full_bytes is None:
            return
        cache = self.cache if union is not None else None
        kept = cache.lookup(union or (), u.version) if cache is not None else ()
        fetch = None if union is None else tuple(e for e in union if e not in kept)  # sorted, as union
        whole, segs, width = (True, [], 0) if fetch is None else self._whole(fetch)
        if whole:
            self._gather_whole(full_bytes, step, union)
            if cache is not None and union is not None:  # every row came: keep the union's
                self.stats.cache_misses += len(union)
                flats, at = self._placement()
                cache.keep(flats, union, self.passes[::-1], at)
            return
        self.current_union = union or ()
        self._gather_rows(segs, width, step, kept)
        size = self.ctx.world_size * u.full[0].element_size()
        self.stats.moved(size * width)
        if cache is not None and union is not None:
            self.stats.cache_hits += len(kept)
            self.stats.cache_misses += len(fetch or ())
            if kept:  # what the gather of the whole union would have moved, less what moved
                whole_union, _, union_width = self._whole(union)
                self.stats.bytes_not_moved += (full_bytes if whole_union else size * union_width) - size * width
            flats, at = self._placement()
            cache.keep(flats, fetch or (), self.passes[::-1], at)
        self.current = union

    def _gather_rows(self, segs: list[Any], width: int, step: str, kept: Sequence[int] = ()) -> None:
        """Gather ``segs``' rows (each rank's positions, or ranges for a compact placement; none:
        no collective, every expert of the union is ``kept``) and write them, with the experts'
        cache's ``kept`` rows, into the parameters (compact, or zeroed full-size ones)."""
        u, ctx = self.unit, self.ctx
        n, s = ctx.world_size, width + TAG
        if not any(segs[r] for r in range(n)):  # every selected expert is in the experts' cache
            u._to(ShardedState.UNSHARDING, "rows from the experts' cache")
            self._meter_placed()
            self._fill([], [], kept)
            self.stats.cache_passes += 1
            return
        buf = ctx.pool.get(n * s, u.dtype, ctx.device)
        slot = buf.view(n, s)[ctx.rank]
        with u.resident():
            pos = (
                self._pack(segs[ctx.rank], slot, 0) if self.compact is None else self._pack_spans(segs[ctx.rank], slot)
            )
        slot[pos : s - TAG].zero_()
        self._tag(slot, s - TAG)
        u._to(ShardedState.UNSHARDING, "a selective expert gather")
        C.all_gather(ctx, buf, slot, what=f"selected experts of {u.name} ({step})").wait()
        rows = buf.view(n, s)
        self._check_tags(rows[:, -TAG:], step, buf)
        self._gathered(n * width)
        self._fill(list(rows), segs, kept)
        ctx.pool.put(buf)

    def _pack(self, segs: Sequence[tuple[int, torch.Tensor]], out: torch.Tensor, pos: int) -> int:
        """This rank's rows at the flat positions ``segs`` into ``out`` from ``pos``; the position
        after them. Inside ``unit.resident()`` (offloaded pieces are on the host)."""
        u = self.unit
        for i, idx in segs:
            b = u.layout.local_range(i)[0]
            piece = u.piece(i)
            out[pos : pos + idx.numel()].copy_(piece.index_select(0, (idx - b).to(piece.device)))
            pos += idx.numel()
        return pos

    def _pack_spans(self, segs: Spans, out: torch.Tensor) -> int:
        """:meth:`_pack` of ranges (a compact placement's segments); the position after them."""
        u, pos = self.unit, 0
        for i, spans in segs:
            lo = u.layout.local_range(i)[0]
            piece = u.piece(i)
            for a, b in spans:
                out[pos : pos + b - a].copy_(piece[a - lo : b - lo])
                pos += b - a
        return pos

    def _tag(self, out: torch.Tensor, pos: int) -> None:
        """The unit's tag in ``TAG`` elements at ``pos`` (digits that 16-bit floats carry exactly)."""
        write_tag(out, pos, self.unit.tag)

    def _check_tags(self, digits: torch.Tensor, step: str, *buffers: torch.Tensor) -> None:
        """Every rank's tag digits (``[ranks, TAG]``, ``GatherChecks``); on a divergence the ``buffers`` go back to the
        pool and the unit stays sharded."""
        u = self.unit
        try:
            u.checks.gathered(u, digits, step)
        except UnitDivergence:
            for b in buffers:
                self.ctx.pool.put(b)
            u._to(ShardedState.SHARDED, "a diverged expert gather")
            raise

    def _gathered(self, numel: int) -> None:
        """The meter's count of a gather that received ``numel`` elements."""
        u = self.unit
        self._meter_placed()  # the gathered parameters exist from here on
        u.meter.gathers += 1
        u.meter.gathered_bytes += numel * u.full[0].element_size()
        u.gathers += 1

    def _meter_placed(self) -> None:
        """The meter's and the stats' count of the parameters a selective gather places. The
        meter counts a whole layer either way (an upper bound that never drifts, whoever
        reshards the unit); ``moe_peak_layer_bytes`` counts what was placed."""
        c, u = self.compact, self.unit
        u.meter.add(u.full_bytes)
        self.stats.placed(c.nbytes(len(self.current_union)) if c is not None else u.full_bytes)

    def _placement(self) -> tuple[list[torch.Tensor], dict[int, int] | None]:
        """The flat parameters a selective gather wrote, and each expert's slot in them (None:
        full-size, expert ``e`` at ``e``)."""
        c = self.compact
        if c is None or c.slots is None:
            return [f.view(-1) for f in self.unit.full], None
        return [h.view(-1) for h in c.holders], {e: k for k, e in enumerate(c.slots)}

    def _fill(
        self,
        chunks: Sequence[torch.Tensor],
        segs: Sequence[Any],
        kept: Sequence[int] = (),
    ) -> None:
        """Allocate the full parameters, zeroed, and write each source rank's gathered ``chunks``
        (the rows of its ``segs``, side by side) and the kept rows."""
        u = self.unit
        if self.compact is not None:
            self._fill_compact(chunks, segs, kept)
            return
        wanted = set(self.current_union)
        with torch.no_grad():
            flats = []
            for i, (p, f) in enumerate(zip(u.params, u.full)):
                flats.append(f.view(-1))
                if self.owners is not None and self.owners[i] not in wanted:
                    continue  # an idle ModuleList expert: its parameters stay placeholders
                f.untyped_storage().resize_(f.numel() * f.element_size())
                f.zero_()
                p.data = f
            for chunk, per_rank in zip(chunks, segs):
                pos = 0
                for i, idx in per_rank:
                    flats[i].index_copy_(0, idx, chunk[pos : pos + idx.numel()])
                    pos += idx.numel()
            if kept and self.cache is not None:
                self.cache.fill(flats, kept)
        u._to(ShardedState.UNSHARDED, "a selective expert gather")

    def _fill_compact(self, chunks: Sequence[torch.Tensor], segs: Sequence[Spans], kept: Sequence[int]) -> None:
        """:meth:`_fill` into ``[U, ...]`` parameters, range by range: every slot is written (each
        expert's rows are the pieces of every rank, or kept rows), so nothing is zeroed."""
        c, u = self.compact, self.unit
        if c is None:
            raise AssertionError("a compact fill without a compact placement")
        union = tuple(self.current_union)
        at = {e: k for k, e in enumerate(union)}
        with torch.no_grad():
            flats = c.place(union)
            for chunk, per_rank in zip(chunks, segs):
                pos = 0
                for i, spans in per_rank:
                    for a, b in spans:
                        start = compact_start(a, self.rows[i], at)
                        flats[i][start : start + b - a].copy_(chunk[pos : pos + b - a])
                        pos += b - a
            if kept and self.cache is not None:
                self.cache.fill(flats, kept, at)
        self.stats.compact_gathers += 1
        u._to(ShardedState.UNSHARDED, "a selective expert gather")

    # -- the experts module's call -------------------------------------------------------------
    def call_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
        """The call's arguments with the selection remapped to slots, when the rows are placed
        compactly (``num_experts`` is the union's size until :meth:`call_done`); None: unchanged."""
        c = self.compact
        if c is None or self.unit.state is not ShardedState.UNSHARDED or not self.placed_compactly():
            return None
        selection = self.found.selection(args, kwargs)
        if selection is None:
            raise AssertionError(
                f"rank {self.ctx.rank}: {self.name} is placed compactly for a call without a selection"
            )
        c.enter()
        return with_selection(self.found, args, kwargs, c.remap(selection))

    def call_done(self) -> None:
        """After the module's call (also when it raised): its ``num_experts`` is ``E`` again."""
        if self.compact is not None:
            self.compact.exit()

    def abandon(self) -> None:
        """The call raised after its gather (a pre-hook registered after the engine's, the
        module's forward): no backward comes for it, and the selected rows go now, since the
        parameters hold a selection (compact rows, or full-size ones zero outside it) that a
        later reader (``gathered_parameters``, a checkpoint) would take for the whole. The
        union stays in the next reduction's (rows of zero gradient)."""
        self.open_call = False
        if self._pushed and self.passes and self.kinds:
            self.passes.pop()
            self.kinds.pop()
        self._pushed = False
        self.release(force=True)

    # -- compact gradients, for the reducer ------------------------------------------------------
    def full_grads(self) -> list[torch.Tensor | None] | None:
        """The gradients a compact placement accumulated, full-size and flat, for a whole
        reduction (emptied); None: they are in ``p.grad`` (no compact placement)."""
        g = self.unit.group
        if self.compact is None or g is None:
            return None
        return self.compact.take_full()[: len(g.params)]

    def holds_grad(self, i: int) -> bool:
        """Whether trainable parameter ``i`` has a gradient held outside ``p.grad``."""
        return self.compact is not None and self.compact.acc[i] is not None

    def drop_grads(self, only: Sequence[int] | None = None) -> None:
        """``zero_grad``: forget the held gradients (of the parameters ``only``, or all)."""
        if self.compact is not None:
            self.compact.drop(only)

    def _sharded(self) -> bool:
        return self.unit.state is ShardedState.SHARDED

    def release(self, *, force: bool = False) -> None:
        """Free the gathered rows (unless persistent, or held by ``gathered_parameters``; with
        ``force`` a selective gather goes even then, since it is not the whole parameter)."""
        u, c = self.unit, self.compact
        if not self._sharded():
            if self.current is not None and force:
                u.reshard()
            else:
                u.release()
        if self._sharded():
            self.current = None
            if c is not None and c.slots is not None:  # also when the unit was resharded elsewhere
                c.free()

    # -- reduction -------------------------------------------------------------------------
    def reduce_plan(self) -> ReducePlan | None:
        """The segments of this reduction (the union of every forward since the last one), or
        None for a whole reduction (the cost switch, or a forward that named no selection).
        Resets the union: each reduction covers the forwards before it."""
        union, every = sorted(self.pending), self.pending_full
        full = every or not self.pending
        self.pending, self.pending_full = set(), False
        g = self.unit.group
        if self.compact is not None and g is not None:
            return self._compact_plan(g, None if every else union)
        if full or g is None:
            if g is not None:
                self._count_reduce(g.layout.shard_numel, g)
            return None
        n = self.ctx.world_size
        rows, owners = self.rows[: len(g.params)], None if self.owners is None else self.owners[: len(g.params)]
        segs = [row_segments(g.layout, rows, union, r, self.ctx.device, owners) for r in range(n)]
        width = _width(segs)
        if width >= self.full_share * g.layout.shard_numel:
            self._count_reduce(g.layout.shard_numel, g)
            return None
        self._count_reduce(width, g)
        return ReducePlan(segs, width, frozenset(i for per_rank in segs for i, _ in per_rank))

    def _compact_plan(self, g: Any, union: Sequence[int] | None) -> ReducePlan | None:
        """The reduction of compactly accumulated gradients over the agreed ``union`` (None:
        every expert), the same on every rank whatever gradients this rank holds: the rows of
        its experts, packed from the accumulator (zeros where this rank has none). No cost
        switch: a selective reduction never moves more than a whole one. None: no forward since
        the last reduction (a whole reduction of zeros, as the full-size path's)."""
        c = self.compact
        if c is None:
            raise AssertionError("a compact plan without a compact placement")
        target = tuple(range(self.num_experts)) if union is None else tuple(union)
        slots, acc = c.take(target)
        k = len(g.params)
        if not slots:
            self._count_reduce(g.layout.shard_numel, g)
            return None
        n = self.ctx.world_size
        spans = [span_segments(g.layout, self.rows[:k], slots, r) for r in range(n)]
        width = max(span_numel(s) for s in spans)
        self._count_reduce(width, g)
        at = {e: j for j, e in enumerate(slots)}
        covered = frozenset(i for per_rank in spans for i, _ in per_rank)
        return CompactPlan(
            [[] for _ in range(n)],
            width,
            covered,
            grads=tuple(acc[:k]),
            spans=spans,
            at=at,
            per_expert=tuple(self.rows[:k]),
        )

    def _count_reduce(self, width: int, g: Any) -> None:
        size = self.ctx.world_size * torch.empty(0, dtype=g.reduce_dtype).element_size()
        self.stats.reduced_bytes += width * size
        self.stats.full_reduce_bytes += g.layout.shard_numel * size
