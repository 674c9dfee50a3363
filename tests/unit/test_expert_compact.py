"""Compact expert placements (``sharding/experts/compact.py``), one process: the slots, the
remapped selection, the folding of gradients of different placements, and the torch behaviour
the placement relies on (a dtype change through ``.data`` drops the gradient accumulator)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_strategy.sharding.experts.compact import CompactRows, compactable, reattach


class _Experts(nn.Module):
    def __init__(self, e: int = 6, buffer: bool = False) -> None:
        super().__init__()
        self.num_experts = e
        self.w = nn.Parameter(torch.zeros(e, 3, 2))
        self.b = nn.Parameter(torch.zeros(e, 3))
        if buffer:
            self.register_buffer("scale", torch.ones(e))


def _rows(module: _Experts) -> CompactRows:
    params = [module.w, module.b]
    shapes = [p.shape for p in params]
    return CompactRows(module, params, shapes, [6, 3], module.num_experts, torch.device("cpu"))


def test_accumulator_reset_by_reattach() -> None:
    """The placement's premise: a graph that is still referenced keeps the parameter's gradient
    accumulator, with its shape; ``reattach`` makes the next graph use one of the new shape."""
    p = nn.Parameter(torch.randn(4, 3))
    kept = (p * 2).sum()  # its graph (and the accumulator of shape [4, 3]) stays alive
    kept.backward()
    p.grad = None
    p.data = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="invalid gradient"):
        (p * 2).sum().backward()
    p.grad = None
    reattach(p, torch.randn(2, 3))
    (p * 3).sum().backward()
    assert p.grad is not None and p.grad.shape == (2, 3) and torch.equal(p.grad, torch.full((2, 3), 3.0))
    assert kept.grad_fn is not None


def test_compactable() -> None:
    assert compactable(_Experts(), 6)
    assert not compactable(_Experts(buffer=True), 6)  # a per-expert buffer would be read by slot
    m = _Experts()
    del m.num_experts
    assert not compactable(m, 6)  # the call could not be told the union's size


def test_place_remap_and_positions() -> None:
    m = _Experts()
    c = _rows(m)
    flats = c.place((1, 4))
    assert m.w.shape == (2, 3, 2) and m.b.shape == (2, 3) and [f.numel() for f in flats] == [12, 6]
    sel = torch.tensor([[4, 1], [6, -1], [1, 3]])  # 6 and -1: no expert; 3: not placed (no rank selected it)
    assert c.remap(sel).tolist() == [[1, 0], [2, 2], [0, 2]]
    c.enter()
    assert m.num_experts == 2
    c.exit()
    assert m.num_experts == 6
    # expert 4's rows of w (flat [24, 30)) go to slot 1 ([6, 12))
    assert c.lut((1, 4)).tolist()[:6] == [2, 0, 2, 2, 1, 2]
    assert c.nbytes(2) == (12 + 6) * 4 and c.holds([m.w, m.b])
    c.free()
    assert c.holders[0].untyped_storage().nbytes() == 0 and c.slots is None


def test_fold_over_different_placements() -> None:
    """Gradients of passes with different unions add up per expert, as full-size ones would."""
    m = _Experts()
    c = _rows(m)
    full = torch.zeros(6, 3, 2)
    for slots, value in (((1, 4), 1.0), ((0, 4), 10.0), ((4,), 100.0)):
        c.place(slots)
        m.w.grad = torch.full((len(slots), 3, 2), value)  # as a backward of this placement leaves it
        for e in slots:
            full[e] += value
    got = c.take_full()
    assert got[1] is None  # b never had a gradient
    assert got[0] is not None and torch.equal(got[0].view(6, 3, 2), full)
    assert m.w.grad is None and all(a is None for a in c.acc)


def test_fold_one_pass_takes_the_gradient_without_a_copy() -> None:
    m = _Experts()
    c = _rows(m)
    c.place((2, 5))
    g = torch.randn(2, 3, 2)
    m.w.grad = g
    slots, acc = c.take()
    assert slots == (2, 5) and acc[0] is not None and acc[0].data_ptr() == g.data_ptr()


def test_spans_of_merge_neighbours_and_map_to_one_compact_range() -> None:
    from zero_strategy.sharding.experts.compact import compact_start, spans_of

    # experts of 4 elements; this rank holds [6, 22): part of expert 1, experts 2-4, part of 5
    assert spans_of((1, 2, 4, 5), 4, 6, 22) == [(6, 12), (16, 22)]
    at = {1: 0, 2: 1, 4: 2, 5: 3}
    # 6..12 (expert 1 from element 2, then expert 2) -> slots 0..1 from element 2: one compact range
    assert compact_start(6, 4, at) == 2 and compact_start(16, 4, at) == 8


def test_compact_plan_packs_every_rank_and_adds_this_ranks_rows() -> None:
    """Two ranks, one parameter of 4 experts x 2 elements, cut at element 3; gradients held
    for experts (0, 2): each rank's ranges are packed from the compact gradient, and this
    rank's reduced rows land at their full positions of its piece."""
    from zero_strategy.sharding.experts.compact import CompactPlan, span_segments

    class _Layout:
        bounds = [[0, 3, 8]]

        def local_range(self, i: int, rank: int | None = None) -> tuple[int, int]:
            r = 1 if rank is None else rank
            return self.bounds[i][r], self.bounds[i][r + 1]

        def local_view(self, row: torch.Tensor, i: int) -> torch.Tensor:
            return row[:5]

    lay = _Layout()
    slots = (0, 2)
    spans = [span_segments(lay, [2], slots, r) for r in range(2)]  # type: ignore[arg-type]
    assert spans == [[(0, [(0, 2)])], [(0, [(4, 6)])]]
    grad = torch.tensor([1.0, 2.0, 5.0, 6.0])  # expert 0's rows, then expert 2's
    plan = CompactPlan([[], []], 2, frozenset({0}), grads=(grad,), spans=spans, at={0: 0, 2: 1}, per_expert=(2,))
    out = torch.full((4,), float("nan"))
    plan.pack([grad], out)
    assert out.tolist() == [1.0, 2.0, 5.0, 6.0]
    shard = torch.full((5,), 7.0)  # rank 1's piece: elements 3..7
    plan.add_into(lay, shard, torch.tensor([10.0, 20.0]), 1, fresh=True)  # type: ignore[arg-type]
    assert shard.tolist() == [0.0, 10.0, 20.0, 0.0, 0.0]
