"""Expert owners: each expert of a stacked experts module lives whole on one rank.

The default layout of an experts unit (``selective.py``) gathers, for every rank, the *union* of
the experts that some rank selected, and reduce-scatters that union's gradient rows. With
``moe_expert_layout: owners`` (under ``zero_strategy`` in the config) each expert instead has
an owner:

- **Layout.** Rank ``r`` owns experts ``cuts[r]:cuts[r + 1]``, contiguous and whole, as many
  per rank as the world size allows evenly (the first ``E % world_size`` ranks one more), or in
  proportion to the load-balancing fractions. The unit's :class:`~zero_strategy.sharding.layout.ShardLayout`
  carries the ``cuts``: an uneven but ordinary layout, so checkpoints record the real offsets,
  and resharding to another world size, stage or layout, exports and ``load_full_state_dict``
  work as for any parameter. The owner holds the expert's optimizer state and steps it.
- **Agreement.** One all-gather of the ``E``-element selection masks per experts layer per
  pass (instead of the all-reduce of the union): every rank learns what every rank selected.
- **Fetch.** Rank ``r`` receives from each owner only the experts that *its own* tokens
  selected, in one all-to-all with uneven chunks: nothing for the experts that only other
  ranks selected, and nothing for those it owns. Each chunk ends with the unit's tag, checked
  like any gather's (ranks that ran different layers disagree on the chunk sizes first, and
  the exchange fails as a named collective). The backward fetches the same experts again. The
  rows a rank did not select are zeros in its parameters: its selection must cover what its
  forward runs, as the Hugging Face experts modules do.
- **Gradients back to the owners.** A rank's gradient is zero outside its selections, so it
  sends the rows of the experts it selected since the last reduction to their owners (one
  all-to-all); the owner sums the contributions in rank order, as a reduce-scatter would, and
  steps them. Rows that no rank selected stay zeros, as in DDP's gradient.
- **Cost switch** (``moe_full_gather_share``, as for the default layout): when the busiest rank
  would send or receive at least that share of what a whole gather moves per rank (an owner of
  popular experts sends them to many ranks), the unit is gathered (or reduced) whole in one
  collective.

The experts' cache (``moe_expert_cache``) works with the default layout only; a declared
``ModuleList`` of experts keeps the default layout (each member's parameters cut evenly).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zero_strategy.comm import collectives as C
from zero_strategy.sharding.experts.selective import ExpertRows, ExpertsModule, MoeStats, row_segments
from zero_strategy.sharding.gather_checks import TAG
from zero_strategy.sharding.group import ReducePlan
from zero_strategy.sharding.layout import ShardLayout
from zero_strategy.sharding.pieces import sharded_init_piece
from zero_strategy.sharding.states import ShardedState
from zero_strategy.sharding.unit import UnitStorage

__all__ = ["EXPERT_LAYOUTS", "OwnedExperts", "OwnerPick", "OwnerPlan", "owner_cuts", "unit_cuts"]

EXPERT_LAYOUTS = ("sharded", "owners")

Segments = list[tuple[int, torch.Tensor]]


def owner_cuts(num_experts: int, world_size: int, fractions: Sequence[float] | None, *, where: str) -> tuple[int, ...]:
    """The ``world_size + 1`` expert boundaries of the owners: even counts (the first
    ``E % world_size`` ranks one more), or with load balancing's ``fractions`` the largest
    remainders of ``E * fraction``, each rank at least one expert."""
    e, n = num_experts, world_size
    if e < n:
        raise ValueError(
            f"moe_expert_layout 'owners': {where} has {e} experts for {n} ranks, so some rank would own none; "
            "use moe_expert_layout 'sharded' (the default) for it, or fewer ranks"
        )
    if fractions is None:
        counts = [e // n + (r < e % n) for r in range(n)]
    else:
        raw = [f * e for f in fractions]
        counts = [max(1, int(x)) for x in raw]
        while sum(counts) > e:  # take from the rank furthest above its share
            r = max((r for r in range(n) if counts[r] > 1), key=lambda r: (counts[r] - raw[r], -r))
            counts[r] -= 1
        while sum(counts) < e:  # give to the rank furthest below its share
            r = max(range(n), key=lambda r: (raw[r] - counts[r], -r))
            counts[r] += 1
    cuts = [0]
    for c in counts:
        cuts.append(cuts[-1] + c)
    return tuple(cuts)


def unit_cuts(
    experts: Sequence[ExpertsModule], layout: str, world_size: int, fractions: Sequence[float] | None
) -> dict[str, tuple[int, ...]]:
    """The owners' boundaries of each stacked experts unit, by label, for ``moe_expert_layout``
    ``layout`` (nothing for "sharded"; a declared ``ModuleList`` keeps the sharded layout)."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"moe_expert_layout={layout!r} is not one of {EXPERT_LAYOUTS}")
    if layout == "sharded":
        return {}
    out = {}
    for f in experts:
        if f.members:
            continue
        cuts = owner_cuts(f.num_experts, world_size, fractions, where=f"experts module '{f.fqn}'")
        numels = tuple(p.numel() for p in f.module.parameters())
        built = [p for p in f.module.parameters() if sharded_init_piece(p) is not None]
        if built and ShardLayout(numels, world_size, 0, cuts=cuts).bounds != ShardLayout(numels, world_size, 0).bounds:
            raise ValueError(
                f"moe_expert_layout 'owners': experts module '{f.fqn}' was built under sharded_init, which cut even "
                f"pieces, but its {f.num_experts} experts on {world_size} ranks give owners uneven ones; build the "
                "model without sharded_init, or use moe_expert_layout 'sharded'"
            )
        out[f.fqn] = cuts
    return out


@dataclass(frozen=True)
class OwnerPick:
    """What one pass selected: the union over the ranks and each rank's own experts (sorted)."""

    union: tuple[int, ...]
    ranks: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class _Fetch:
    send: list[Segments]  # per destination: the rows of my experts it selected (my positions)
    recv: list[Segments]  # per source: the rows of its experts I selected (full positions)
    send_sizes: list[int]
    recv_sizes: list[int]
    moved: int  # elements this rank receives (its own rows included)


def _numel(segs: Segments) -> int:
    return sum(idx.numel() for _, idx in segs)


@dataclass(frozen=True)
class OwnerPlan(ReducePlan):
    """One reduction of an owned experts unit: gradient rows go to their owners (all-to-all),
    which sum them in rank order into their shard. ``segments[rank]`` are this rank's rows of
    the reduced experts (``width`` elements), as for :class:`ReducePlan`."""

    send: tuple[Segments, ...] = ()  # per destination: (parameter, full positions) of my gradient
    recv_sizes: tuple[int, ...] = ()  # per source
    places: tuple[torch.Tensor, ...] = ()  # per source: where its rows go in this rank's ``width`` buffer

    @property
    def send_numel(self) -> int:
        return sum(_numel(s) for s in self.send)

    def pack(self, grads: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
        pos = 0
        for segs in self.send:
            for i, idx in segs:
                g, k = grads[i], idx.numel()
                if g is None:  # this rank did not run it since the last reduction
                    out[pos : pos + k].zero_()
                else:
                    out[pos : pos + k].copy_(g.index_select(0, idx))
                pos += k

    def exchange(self, ctx: C.CommContext, inp: torch.Tensor, what: str) -> tuple[torch.Tensor, C.Handle]:
        out = ctx.pool.get(sum(self.recv_sizes), inp.dtype, inp.device)
        sizes = [_numel(s) for s in self.send]
        return out, C.all_to_all_v(ctx, out, inp, sizes, list(self.recv_sizes), what=f"{what} to their owners")

    def combine(self, ctx: C.CommContext, out: torch.Tensor) -> torch.Tensor:
        """Sum every source's rows (in rank order) into this rank's ``width`` elements."""
        mine = ctx.pool.get(self.width, out.dtype, out.device)
        mine.zero_()
        pos = 0
        for k, place in zip(self.recv_sizes, self.places):
            if k:
                mine.index_add_(0, place, out[pos : pos + k])
            pos += k
        ctx.pool.put(out)
        return mine


class OwnedExperts(ExpertRows):
    """The owners' fetch of one stacked experts module's unit (see the module doc)."""

    def __init__(self, found: ExpertsModule, unit: UnitStorage, stats: MoeStats, full_share: float) -> None:
        super().__init__(found, unit, stats, full_share, 0)
        cuts = unit.layout.cuts
        if cuts is None or found.members:
            raise AssertionError(f"{unit.name}: expert owners need a stacked experts unit with expert cuts")
        self.cuts = cuts
        self.owner = [r for r in range(len(cuts) - 1) for _ in range(cuts[r + 1] - cuts[r])]
        self.pending_ranks: list[set[int]] = [set() for _ in range(self.ctx.world_size)]
        self._fetches: dict[OwnerPick, _Fetch | None] = {}

    # -- agreement -------------------------------------------------------------------------
    def agree(self, selection: torch.Tensor | None, step: str) -> OwnerPick | None:  # type: ignore[override]
        """Every rank's selection: one all-gather of the ``E``-element masks (an element past
        the experts means "all"). None: gather whole. Collective."""
        e, n = self.num_experts, self.ctx.world_size
        masks = torch.zeros(n * (e + 1), dtype=torch.int32, device=self.ctx.device)
        mine = masks.view(n, e + 1)[self.ctx.rank]
        self._mark(selection, mine)
        C.all_gather(self.ctx, masks, mine, what=f"expert selections of {self.name} ({step})").wait()
        values = masks.view(n, e + 1).tolist()
        if any(v[e] for v in values):
            self._counted(None)
            return None
        ranks = tuple(tuple(k for k in range(e) if v[k]) for v in values)
        union = self._counted(tuple(sorted(set().union(*ranks))))
        return OwnerPick(union or (), ranks)

    def forget(self) -> None:
        super().forget()
        self.pending_ranks = [set() for _ in self.pending_ranks]

    def remember(self, union: OwnerPick | None) -> None:  # type: ignore[override]
        self.passes.append(union)  # type: ignore[arg-type]
        if union is None:
            self.pending_full = True
            return
        for r, chosen in enumerate(union.ranks):
            self.pending_ranks[r].update(chosen)

    # -- the fetch -------------------------------------------------------------------------
    def _per_expert(self, count: int) -> int:
        return sum(self.rows[:count])

    def _fetch(self, pick: OwnerPick) -> _Fetch | None:
        """The exchange of ``pick`` (None: gathering whole is cheaper). The same on every rank."""
        if pick in self._fetches:
            return self._fetches[pick]
        if len(self._fetches) > 4:
            self._fetches.clear()
        lay, n, me, dev = self.unit.layout, self.ctx.world_size, self.ctx.rank, self.ctx.device
        per = self._per_expert(len(self.rows))
        plan: _Fetch | None = None
        if not self._switch_whole(pick.ranks, per, lay.shard_numel):
            send = [row_segments(lay, self.rows, self._owned_by(pick.ranks[d], me), me, dev) for d in range(n)]
            recv = [row_segments(lay, self.rows, self._owned_by(pick.ranks[me], s), s, dev) for s in range(n)]
            plan = _Fetch(
                send, recv, [_numel(s) + TAG for s in send], [_numel(s) + TAG for s in recv], len(pick.ranks[me]) * per
            )
        self._fetches[pick] = plan
        return plan

    def _owned_by(self, experts: Sequence[int], rank: int) -> list[int]:
        return [e for e in experts if self.owner[e] == rank]

    def _switch_whole(self, chosen: Sequence[Sequence[int]], per: int, shard_numel: int) -> bool:
        """The cost switch: gather (or reduce) the whole unit when the busiest rank would send or
        receive at least ``full_share`` of what a whole gather moves per rank (every rank
        computes it from the same selections)."""
        n = self.ctx.world_size
        if n == 1:
            return True  # nothing moves either way: the whole unit is one copy
        recv = [sum(self.owner[e] != r for e in chosen[r]) for r in range(n)]
        send = [0] * n
        for r, experts in enumerate(chosen):
            for e in experts:
                if self.owner[e] != r:
                    send[self.owner[e]] += 1
        return max(max(recv), max(send)) * per >= self.full_share * (n - 1) * shard_numel

    def gather(self, union: OwnerPick | None, step: str) -> None:  # type: ignore[override]
        """Fetch this rank's selected experts of ``union`` from their owners (None: the whole
        unit). Collective."""
        full_bytes = self._gathering(union)
        if full_bytes is None:
            return
        fetch = None if union is None else self._fetch(union)
        if fetch is None:
            self._gather_whole(full_bytes, step)
            return
        self._exchange(fetch, step)
        self.stats.moved(fetch.moved * self.unit.full[0].element_size())
        self.current = union  # type: ignore[assignment]

    def _exchange(self, fetch: _Fetch, step: str) -> None:
        u, ctx = self.unit, self.ctx
        n = ctx.world_size
        inp = ctx.pool.get(sum(fetch.send_sizes), u.dtype, ctx.device)
        out = ctx.pool.get(sum(fetch.recv_sizes), u.dtype, ctx.device)
        pos = 0
        with u.resident():
            for segs in fetch.send:
                pos = self._pack(segs, inp, pos)
                self._tag(inp, pos)
                pos += TAG
        u._to(ShardedState.UNSHARDING, "an expert fetch from the owners")
        C.all_to_all_v(
            ctx, out, inp, fetch.send_sizes, fetch.recv_sizes, what=f"experts of {u.name} from their owners ({step})"
        ).wait()
        starts = [sum(fetch.recv_sizes[:s]) for s in range(n)]
        tags = torch.stack([out[a + k - TAG : a + k] for a, k in zip(starts, fetch.recv_sizes)])  # no host copy
        self._check_tags(tags, step, inp, out)
        self._gathered(fetch.moved)
        # every source's chunk, its tag left out; rows this rank did not select stay zeros
        self._fill([out[a : a + k - TAG] for a, k in zip(starts, fetch.recv_sizes)], fetch.recv)
        ctx.pool.put(inp)
        ctx.pool.put(out)

    # -- reduction -------------------------------------------------------------------------
    def reduce_plan(self) -> ReducePlan | None:
        """Each rank's gradient rows of the experts it selected since the last reduction go to
        their owners; None: a whole reduction (the cost switch, or a pass that named no
        selection). Resets the selections."""
        chosen = [sorted(s) for s in self.pending_ranks]
        full = self.pending_full or not any(chosen)
        self.pending_ranks = [set() for _ in chosen]
        self.pending, self.pending_full = set(), False
        g = self.unit.group
        if g is None:
            return None
        n, me, dev, lay = self.ctx.world_size, self.ctx.rank, self.ctx.device, g.layout
        rows = self.rows[: len(g.params)]
        per = sum(rows)
        if full or self._switch_whole(chosen, per, lay.shard_numel):
            self._count_reduce(lay.shard_numel, g)
            return None
        mine = sorted({e for c in chosen for e in c if self.owner[e] == me})
        segments: list[Segments] = [[] for _ in range(n)]
        segments[me] = row_segments(lay, rows, mine, me, dev)
        starts, at = {}, 0  # where each parameter's rows begin in this rank's buffer
        for i, idx in segments[me]:
            starts[i] = (at, idx)
            at += idx.numel()
        places = []
        for s in range(n):
            parts = []
            for i, idx in row_segments(lay, rows, self._owned_by(chosen[s], me), me, dev):
                base, all_idx = starts[i]
                parts.append(base + torch.searchsorted(all_idx, idx))
            places.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=dev))
        send = tuple(row_segments(lay, rows, self._owned_by(chosen[me], d), d, dev) for d in range(n))
        recv_sizes = tuple(int(p.numel()) for p in places)
        size = torch.empty(0, dtype=g.reduce_dtype).element_size()
        self.stats.reduced_bytes += sum(_numel(s) for s in send) * size
        self.stats.full_reduce_bytes += n * lay.shard_numel * size
        return OwnerPlan(segments, at, frozenset(range(len(g.params))), send, recv_sizes, tuple(places))
