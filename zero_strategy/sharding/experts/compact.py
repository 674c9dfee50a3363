"""Compact expert gathers: the selected experts' rows in tensors of shape ``[U, ...]``.

A selective gather (``selective.py``) moves only the rows of the union ``U`` of the experts the
ranks selected. Without this module it writes them into zeroed full-size parameters
``[E, ...]``, so a layer's gathered memory is that of a whole gather whatever the union. With it
(``moe_compact_gather``, on by default), the gathered parameters hold the union's rows only.

- **Placement.** Each stacked parameter ``[E, ...]`` becomes ``[U, ...]`` for the call: slot
  ``k`` holds the ``k``-th expert of the union, in ascending order. The rows live in one storage
  per parameter that is resized, not replaced, so the views that autograd saved in the forward
  see the backward's gather of the same union (``ExpertRows.backward_gather`` places as the
  forward did: compactly, or full-size for a forward that ran on full-size parameters).
- **The call.** The experts module sees its selection argument remapped, expert ``e`` to its
  slot and any value outside ``[0, E)`` to ``U``, the "no expert" value of transformers' experts.
  It also sees ``num_experts = U`` for the call, restored after it (also when it raises).
  transformers' eager, ``batched_mm`` and ``grouped_mm`` experts forwards size their
  ``one_hot``/``histc`` by ``num_experts`` and index the weights by the selection, so all three
  run unchanged on the compact weights. A module is compacted only when it has an integer
  ``num_experts`` attribute and no buffer with a first dimension of ``E``: a per-expert buffer
  would be indexed with slots. Any other module keeps the full-size gather.
- **Autograd.** A parameter's gradient accumulator keeps the shape the parameter had when the
  accumulator was made, and a graph still referenced (the previous step's ``loss``) keeps it
  alive. Each placement therefore resets it. ``Tensor.data`` set to another dtype drops it
  (torch's ``set_data``), so the next use makes one of the new shape
  (``tests/unit/test_expert_compact.py`` guards this).
- **Gradients.** A backward pass leaves ``p.grad`` of its placement's shape ``[U_k, ...]``.
  Before another placement, or another pass's gradients, can meet it, :meth:`CompactRows.fold`
  adds it into an accumulator over the union of the slots of every pass since the last
  reduction. The reduction (:class:`CompactPlan`) packs from that accumulator, over the union
  the ranks agreed on (so every rank issues the same collective), or from a full-size copy
  where a whole reduction needs one (top-k compression). The gradient shard is the same as the
  full-size path's.
- **Spans, not positions.** Which rows a rank sends, receives and reduces are flat ranges
  ``[a, b)`` of the full parameter (:func:`span_segments`: the union's experts inside the rank's
  piece, neighbours merged), copied slice by slice. Two experts next to each other in the union
  are in neighbouring slots too, so a merged range is one compact range as well. An index tensor
  of every element would take twice the union's bytes per rank (64-bit positions).

Memory. A layer's gathered parameters take ``U/E`` of a whole gather; the selective gather's
receive buffer takes the padded rows of the union; the accumulated gradient takes the union of
the window. ``memory_stats()["moe_peak_layer_bytes"]`` is the most one layer held placed at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zero_strategy.sharding.group import ReducePlan
from zero_strategy.sharding.layout import ShardLayout
from zero_strategy.storage.uploads import to_device

__all__ = ["CompactPlan", "CompactRows", "Spans", "compactable", "reattach", "span_segments", "spans_of"]

Spans = list[tuple[int, list[tuple[int, int]]]]  # per parameter: flat ranges [a, b) of the full parameter


def spans_of(union: Sequence[int], r: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The flat ranges ``[a, b)`` of the experts in ``union`` (ascending) of ``r`` elements each
    that fall into ``[lo, hi)``, neighbours merged."""
    spans: list[tuple[int, int]] = []
    for e in union:
        a, b = max(lo, e * r), min(hi, (e + 1) * r)
        if a >= b:
            continue
        if spans and spans[-1][1] == a:
            spans[-1] = (spans[-1][0], b)
        else:
            spans.append((a, b))
    return spans


def span_segments(layout: ShardLayout, rows: Sequence[int], union: Sequence[int], rank: int) -> Spans:
    """The ranges of ``union``'s experts that ``rank`` holds, per parameter of ``rows[i]``
    elements per expert, in parameter order."""
    out = []
    for i, r in enumerate(rows):
        spans = spans_of(union, r, *layout.local_range(i, rank))
        if spans:
            out.append((i, spans))
    return out


def span_numel(segs: Spans) -> int:
    return sum(b - a for _, spans in segs for a, b in spans)


def compact_start(a: int, r: int, at: Mapping[int, int]) -> int:
    """Where full flat position ``a`` (of an expert in ``at``, ``r`` elements each) is compactly."""
    e = a // r
    return a - (e - at[e]) * r


def compactable(module: nn.Module, num_experts: int) -> bool:
    """Whether the experts module's forward can run on compact weights (see the module doc)."""
    if not isinstance(getattr(module, "num_experts", None), int):
        return False
    return not any(b.dim() > 0 and b.shape[0] == num_experts for b in module.buffers())


def reattach(p: nn.Parameter, data: torch.Tensor) -> None:
    """``p.data = data`` with a fresh gradient accumulator: the next graph that uses ``p`` makes
    one of ``data``'s shape (``set_data`` drops the old one when the dtype changes)."""
    other = torch.float64 if data.dtype != torch.float64 else torch.float32
    p.data = torch.empty(0, dtype=other, device=data.device)
    p.data = data


def _ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host integers on ``device`` without a host sync: on a GPU a non-blocking copy from pinned
    memory (the caching host allocator keeps the source until the copy has run)."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


def _slot_positions(slots: Sequence[int], within: Sequence[int], device: torch.device) -> torch.Tensor:
    """Where each expert of ``slots`` sits in ``within`` (a superset, ascending)."""
    where = {e: k for k, e in enumerate(within)}
    return _ints([where[e] for e in slots], device)


class CompactRows:
    """The compact placement of one experts unit's parameters, and their compact gradients.

    ``params``: the unit's parameters (trainable first); ``shapes``: their full shapes
    ``[E, ...]``; ``rows``: elements per expert of each."""

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[nn.Parameter],
        shapes: Sequence[torch.Size],
        rows: Sequence[int],
        num_experts: int,
        device: torch.device,
    ) -> None:
        self.module, self.params, self.shapes, self.rows = module, list(params), list(shapes), list(rows)
        self.num_experts = num_experts
        self.device = device
        # one storage per parameter, resized per placement (0 bytes while nothing is placed)
        self.holders = [torch.empty(0, dtype=p.dtype, device=device) for p in self.params]
        self.slots: tuple[int, ...] | None = None  # experts placed now, ascending; None: none placed
        self._lut: torch.Tensor | None = None  # expert -> slot, E + 1 entries (the last: "no expert")
        self.grad_slots: tuple[int, ...] | None = None  # the slots of what ``p.grad`` holds now
        self.acc: list[torch.Tensor | None] = [None] * len(self.params)  # folded gradients, flat
        self.acc_slots: tuple[int, ...] = ()

    # -- placement -------------------------------------------------------------------------
    def nbytes(self, count: int) -> int:
        return sum(count * r * h.element_size() for r, h in zip(self.rows, self.holders))

    def place(self, slots: tuple[int, ...]) -> list[torch.Tensor]:
        """Give every parameter ``len(slots)`` rows; their flat views, to be written whole.
        ``p.grad`` from an earlier placement is folded first."""
        self.fold()
        u = len(slots)
        flats = []
        with torch.no_grad():
            for p, h, shape, r in zip(self.params, self.holders, self.shapes, self.rows):
                storage = h.untyped_storage()
                nbytes = u * r * h.element_size()
                if storage.nbytes() != nbytes:
                    storage.resize_(nbytes)
                size = (u, *shape[1:])
                h.set_(storage, 0, size, torch.empty(size, device="meta").stride())  # contiguous
                flats.append(h.view(-1))
                reattach(p, h)
        self.slots, self.grad_slots = slots, slots
        self._lut = self.lut(slots)
        return flats

    def holds(self, params: Sequence[nn.Parameter]) -> bool:
        """Whether ``params`` are the placed rows now (not replaced by a reshard or a whole gather)."""
        return all(
            p.shape[0] == len(self.slots or ()) and p.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
            for p, h in zip(params, self.holders)
        )

    def placed_whole(self) -> None:
        """The unit was gathered whole (the cost switch, or a call without a selection): the
        parameters are full-size, their gradients cover every expert."""
        self.fold()
        for p in self.params:
            reattach(p, p.data)
        self.slots, self._lut = None, None
        self.grad_slots = tuple(range(self.num_experts))

    def free(self) -> None:
        """The unit was resharded: the compact rows go, the parameters are placeholders again."""
        for p, h in zip(self.params, self.holders):
            reattach(p, p.data)  # the placeholder: the next graph's accumulator takes its shape
            h.untyped_storage().resize_(0)
        self.slots, self._lut = None, None

    def lut(self, slots: Sequence[int]) -> torch.Tensor:
        """Expert -> slot for ``slots`` (``E + 1`` entries; the others, and the last: ``len(slots)``)."""
        lut = [len(slots)] * (self.num_experts + 1)
        for k, e in enumerate(slots):
            lut[e] = k
        return _ints(lut, self.device)

    def ids(self, experts: Sequence[int]) -> torch.Tensor:
        """``experts`` as a tensor on the device."""
        return _ints(list(experts), self.device)

    # -- the call --------------------------------------------------------------------------
    def remap(self, selection: torch.Tensor) -> torch.Tensor:
        """``selection`` with each expert's slot (values outside ``[0, E)``: ``U``)."""
        if self._lut is None:
            raise AssertionError("a selection remapped with nothing placed")
        e = self.num_experts
        idx = selection if selection.device == self._lut.device else selection.to(self._lut.device)
        idx = torch.where((idx >= 0) & (idx < e), idx, torch.full_like(idx, e))
        slots = self._lut[idx.long()].to(dtype=selection.dtype)
        return slots if slots.device == selection.device else slots.to(selection.device)

    def enter(self) -> None:
        self.module.num_experts = len(self.slots or ())  # type: ignore[assignment]

    def exit(self) -> None:
        self.module.num_experts = self.num_experts  # type: ignore[assignment]

    # -- gradients -------------------------------------------------------------------------
    def fold(self, target: Sequence[int] = ()) -> None:
        """Move ``p.grad`` (of ``grad_slots``; full-shaped ones, of a unit used whole without a
        placement here, cover every expert) into the accumulator, over the union of its slots,
        the gradients' and ``target``."""
        slots, self.grad_slots = self.grad_slots, None
        grads = [p.grad for p in self.params]
        if all(g is None for g in grads):
            slots = ()
        elif slots is None:
            if any(g is not None and g.shape != shape for g, shape in zip(grads, self.shapes)):
                raise AssertionError("compact gradients whose placement is unknown")
            slots = tuple(range(self.num_experts))
        union = tuple(sorted(set(self.acc_slots) | set(slots) | set(target)))
        if union != self.acc_slots:
            where = _slot_positions(self.acc_slots, union, self.device)
            for i, a in enumerate(self.acc):
                if a is not None:
                    wider = a.new_zeros(len(union) * self.rows[i])
                    wider.view(len(union), -1).index_copy_(0, where, a.view(len(self.acc_slots), -1))
                    self.acc[i] = wider
            self.acc_slots = union
        if not slots:
            return
        at = _slot_positions(slots, union, self.device)
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            p.grad = None
            flat = g.detach().reshape(-1)
            if self.acc[i] is None and slots == union:
                self.acc[i] = flat  # the common case, one pass per reduction: no copy
                continue
            acc = self.acc[i]
            if acc is None:
                acc = self.acc[i] = flat.new_zeros(len(union) * self.rows[i])
            acc.view(len(union), -1).index_add_(0, at, flat.view(len(slots), -1))

    def take(self, target: Sequence[int] = ()) -> tuple[tuple[int, ...], list[torch.Tensor | None]]:
        """The accumulated gradients (flat, over the returned slots: at least ``target``), emptied."""
        self.fold(target)
        slots, acc = self.acc_slots, self.acc
        self.acc, self.acc_slots = [None] * len(self.params), ()
        return slots, acc

    def take_full(self) -> list[torch.Tensor | None]:
        """The accumulated gradients as full-size flat tensors (zeros outside their slots), emptied."""
        slots, acc = self.take()
        out: list[torch.Tensor | None] = []
        where = _slot_positions(slots, range(self.num_experts), self.device)
        for a, r in zip(acc, self.rows):
            if a is None:
                out.append(None)
                continue
            full = a.new_zeros(self.num_experts * r)
            full.view(self.num_experts, -1).index_copy_(0, where, a.view(len(slots), -1))
            out.append(full)
        return out

    def drop(self, only: Sequence[int] | None = None) -> None:
        """Forget the accumulated gradients (of the parameters ``only``, or all)."""
        for i in range(len(self.params)) if only is None else only:
            self.acc[i] = None
        if all(a is None for a in self.acc):
            self.acc_slots = ()


def with_selection(found: Any, args: tuple[Any, ...], kwargs: dict[str, Any], value: torch.Tensor) -> tuple[Any, Any]:
    """The call's ``(args, kwargs)`` with its selection argument replaced by ``value``."""
    if found.position is not None and len(args) > found.position:
        args = (*args[: found.position], value, *args[found.position + 1 :])
    else:
        kwargs = {**kwargs, found.argument: value}
    return args, kwargs


@dataclass(frozen=True)
class CompactPlan(ReducePlan):
    """The reduction of compactly held gradients (``grads``, flat over ``slots``): every rank's
    ranges of them (``spans[rank]``, of the trainable layout) packed side by side, reduce-scattered,
    and this rank's added into its gradient shard. ``segments`` stays empty per rank."""

    spans: list[Spans] = field(default_factory=list, kw_only=True)
    at: Mapping[int, int] = field(default_factory=dict, kw_only=True)  # expert -> slot in ``grads``
    per_expert: tuple[int, ...] = field(default=(), kw_only=True)  # elements per expert of each parameter

    def pack(self, grads: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
        rows = out.view(len(self.spans), self.width)
        rows.zero_()
        for r, segs in enumerate(self.spans):
            pos = 0
            for i, spans in segs:
                g = grads[i]
                for a, b in spans:
                    if g is not None:  # None: no rank had a gradient for it (zeros)
                        c = compact_start(a, self.per_expert[i], self.at)
                        rows[r, pos : pos + b - a].copy_(g[c : c + b - a])  # cast to the reduce dtype
                    pos += b - a

    def add_into(self, layout: ShardLayout, shard: torch.Tensor, mine: torch.Tensor, rank: int, *, fresh: bool) -> None:
        if fresh:
            shard.zero_()
        pos = 0
        for i, spans in self.spans[rank]:
            lo = layout.local_range(i, rank)[0]
            piece = layout.local_view(shard, i)  # on the host with an offloaded optimizer
            for a, b in spans:
                piece[a - lo : b - lo].add_(mine[pos : pos + b - a].to(piece.device))
                pos += b - a
