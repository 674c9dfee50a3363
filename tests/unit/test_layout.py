"""Shard layout math: pieces are torch.chunk pieces of the flattened parameter, padded."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from zero_strategy.sharding.layout import ShardLayout


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pieces_are_torch_chunk_pieces(world: int) -> None:
    numels = (1, 2, 3, 5, 7, 8, 12, 13)
    for rank in range(world):
        lay = ShardLayout(numels, world, rank)
        for i, n in enumerate(numels):
            flat = torch.arange(n, dtype=torch.float32)
            chunks = torch.chunk(flat, world)
            expected = chunks[rank] if rank < len(chunks) else flat[:0]
            lo, hi = lay.local_range(i)
            assert torch.equal(flat[lo:hi], expected), (world, rank, n)
        assert lay.shard_numel == sum(-(-n // world) for n in numels)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pack_unpack_round_trip_and_padding(world: int) -> None:
    numels = (5, 4, 1, 9)
    lay = ShardLayout(numels, world, 0)
    flats = [torch.randn(n) for n in numels]
    buf = torch.full((world * lay.shard_numel,), float("nan"))
    lay.pack_full(flats, buf)
    assert not torch.isnan(buf).any(), "padding must be written (zeros), never left uninitialised"
    rows = buf.view(world, lay.shard_numel)
    # every rank's row holds exactly that rank's pieces, zero-padded
    for r in range(world):
        lr = ShardLayout(numels, world, r)
        for i, f in enumerate(flats):
            lo, hi = lr.local_range(i)
            piece = lr.local_view(rows[r], i)
            assert torch.equal(piece, f[lo:hi])
            pad = rows[r, lr.offsets[i] + piece.numel() : lr.offsets[i] + lr.chunks[i]]
            assert torch.equal(pad, torch.zeros_like(pad))
    out = [torch.empty(n) for n in numels]
    lay.unpack_full(buf, out)
    assert all(torch.equal(a, b) for a, b in zip(out, flats))


def test_pack_none_is_zeros_and_pack_local() -> None:
    lay = ShardLayout((3, 2), 2, 1)
    buf = torch.ones(2 * lay.shard_numel)
    lay.pack_full([None, torch.tensor([1.0, 2.0])], buf)
    assert torch.equal(buf.view(2, -1)[:, :2], torch.zeros(2, 2))
    row = torch.full((lay.shard_numel,), 7.0)
    lay.pack_local([torch.tensor([4.0]), torch.tensor([5.0])], row)
    assert row.tolist() == [4.0, 0.0, 5.0]


def test_bad_layout_is_an_invariant_error() -> None:
    with pytest.raises(AssertionError, match="rank 3"):
        ShardLayout((4,), 2, 3)


@pytest.mark.parametrize("fractions", [(0.75, 0.25), (0.2, 0.3, 0.5), (0.1, 0.4, 0.4, 0.1)])
def test_uneven_pieces_follow_the_fractions_and_round_trip(fractions: tuple[float, ...]) -> None:
    """Load balancing: contiguous pieces in proportion to the fractions, every element owned
    once, rows padded to the largest piece, and pack/unpack/pack_local still inverse."""
    world = len(fractions)
    numels = (1, 3, 10, 101, 4096)
    layouts = [ShardLayout(numels, world, r, fractions) for r in range(world)]
    flats = [torch.randn(n) for n in numels]
    buf = torch.full((world * layouts[0].shard_numel,), float("nan"))
    layouts[0].pack_full(flats, buf)
    assert not torch.isnan(buf).any()
    rows = buf.view(world, -1)
    for i, n in enumerate(numels):
        ranges = [lay.local_range(i) for lay in layouts]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(ranges[r][1] == ranges[r + 1][0] for r in range(world - 1)), ranges  # contiguous, no gap
        assert layouts[0].chunks[i] == max(hi - lo for lo, hi in ranges)
        if n >= 1000:  # large enough that rounding is a small part of each share
            for (lo, hi), f in zip(ranges, fractions):
                assert abs((hi - lo) / n - f) < 2 / n + 1e-9, (ranges, fractions)
        for r, lay in enumerate(layouts):
            lo, hi = ranges[r]
            assert torch.equal(lay.local_view(rows[r], i), flats[i][lo:hi])
    out = [torch.full((n,), float("nan")) for n in numels]
    layouts[1].unpack_full(buf, out)
    for a, b in zip(out, flats):
        assert torch.equal(a, b)
    row = torch.full((layouts[1].shard_numel,), float("nan"))
    layouts[1].pack_local([f[slice(*layouts[1].local_range(i))] for i, f in enumerate(flats)], row)
    assert torch.equal(row, rows[1])
    assert not layouts[0].even and ShardLayout(numels, world, 0).even


@pytest.mark.parametrize("fractions", [None, (0.75, 0.25), (0.2, 0.3, 0.5), (0.1, 0.4, 0.4, 0.1), (0.7, 0.3)])
def test_every_ranks_range_is_the_cut_computed_independently(fractions: tuple[float, ...] | None) -> None:
    """Each rank's range, recomputed without the layout: even, torch.chunk's pieces; uneven, the
    exact cumulative fractions (as decimals) times numel, rounded down. So the ranks' ranges
    are disjoint, in rank order and cover every element; the padded chunk is the largest."""
    world = 3 if fractions is None else len(fractions)
    numels = (1, 2, 3, 7, 10, 101, 4096)
    layouts = [ShardLayout(numels, world, r, fractions) for r in range(world)]
    for i, n in enumerate(numels):
        if fractions is None:
            sizes = [len(c) for c in torch.chunk(torch.arange(n), world)]
            sizes += [0] * (world - len(sizes))
        else:
            cuts = [0] + [math.floor(n * sum(Fraction(str(f)) for f in fractions[:r])) for r in range(1, world)] + [n]
            sizes = [hi - lo for lo, hi in zip(cuts, cuts[1:])]
        starts = [sum(sizes[:r]) for r in range(world)]
        expected = [(lo, lo + k) for lo, k in zip(starts, sizes)]
        assert [lay.local_range(i) for lay in layouts] == expected, (n, fractions)
        assert [layouts[0].local_range(i, r) for r in range(world)] == expected  # asked of another rank
        owner = torch.zeros(n, dtype=torch.int64)
        for lo, hi in expected:
            owner[lo:hi] += 1
        assert bool((owner == 1).all()), (n, fractions)  # every element owned exactly once
        assert all(lay.chunks[i] == max(sizes) for lay in layouts), (n, layouts[0].chunks[i], sizes)


def test_bad_fractions_are_refused() -> None:
    for bad in ((0.5,), (0.5, 0.6), (1.0, 0.0)):
        with pytest.raises(AssertionError, match="fractions"):
            ShardLayout((4,), 2, 0, bad)


def test_the_one_kernel_paths_equal_the_copy_per_parameter() -> None:
    """``pack_full``'s ``_chunk_cat`` and ``unpack_full``'s split copy (issue 45: a few kernels per
    gather and reduction) write what the copy per parameter writes, padding and casts included."""
    import zero_strategy.sharding.layout as L

    for world in (1, 2, 3, 4):
        for numels in ((12, 8, 4), (10, 7, 1, 12, 3), (5,)):
            lay = ShardLayout(numels, world, 0)
            flats = [torch.randn(k) for k in numels]
            for dtype in (torch.float32, torch.bfloat16):
                fast = torch.full((world * lay.shard_numel,), 7.0, dtype=dtype)
                lay.pack_full(flats, fast)
                slow = torch.full_like(fast, 7.0)
                chunk_cat, L._CHUNK_CAT = L._CHUNK_CAT, None
                try:
                    lay.pack_full(flats, slow)
                finally:
                    L._CHUNK_CAT = chunk_cat
                assert torch.equal(fast, slow), (world, numels, dtype)
            gathered = torch.randn(world, lay.shard_numel + 2)  # a tag's columns after the rows
            got = [torch.full((k,), float("nan")) for k in numels]
            lay.unpack_full(gathered, got)
            for i, k in enumerate(numels):
                want = torch.cat([gathered[r, lay.offsets[i] : lay.offsets[i] + lay.chunks[i]] for r in range(world)])
                assert torch.equal(got[i], want[:k]), (world, numels, i)
