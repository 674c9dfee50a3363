"""Shard layout: where each rank's piece of each parameter lives. No communication here.

Every parameter is flattened and split like ``torch.chunk`` into ``world_size`` pieces of
``chunk = ceil(numel / world_size)`` elements; the last pieces are padded (and may be empty).
So a rank's piece of a parameter is exactly what a DTensor ``Shard(0)`` placement of the
flattened parameter describes, which is what lets checkpoints reshard.

With load balancing (``balance.py``) the layout has per-rank ``fractions``: rank ``r``'s piece
of every parameter is the contiguous range between the cumulative fractions before and after
it (rounded down), so its share of each parameter, and of the optimizer state, follows its
score. ``chunks[i]`` is then the *largest* piece of parameter ``i``: every rank's row is padded
to it, and the collectives stay equal-sized. Checkpoints record the real offsets
(``checkpoint/state.py``), since a ``Shard(0)`` DTensor would assume ``torch.chunk``'s.

With expert owners (``experts/owners.py``) the layout has ``cuts``: ``world_size + 1`` expert
boundaries (0 to ``E``) for parameters whose first dimension is ``E`` experts, and rank ``r``'s
piece of every parameter is experts ``cuts[r]:cuts[r + 1]``, whole. Like load balancing, it is
uneven, so checkpoints record the real offsets and reshard between layouts.

For communication, a rank's pieces of the parameters of one group sit side by side in a flat
buffer of ``shard_numel`` elements (each piece at ``offsets[i]``, ``chunks[i]`` long). A
gathered or to-be-reduced buffer holds ``world_size`` such rows, rank-major.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["ShardLayout"]

_CHUNK_CAT = getattr(torch, "_chunk_cat", None)  # torch >= 2.4: chunk each tensor, pad, concatenate by chunk


@dataclass(frozen=True)
class ShardLayout:
    numels: tuple[int, ...]
    world_size: int
    rank: int
    fractions: tuple[float, ...] | None = None  # per rank, summing to 1 (load balancing); None: even
    cuts: tuple[int, ...] | None = None  # expert boundaries per rank (expert owners); None: by numel

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise AssertionError(f"rank {self.rank}: bad shard layout for world size {self.world_size}")
        f = self.fractions
        if f is not None and (len(f) != self.world_size or min(f) <= 0 or abs(sum(f) - 1.0) > 1e-9):
            raise AssertionError(
                f"rank {self.rank}: shard fractions {f} are not {self.world_size} positive shares of 1"
            )

        c = self.cuts
        if c is not None and (
            len(c) != self.world_size + 1
            or c[0] != 0
            or any(b < a for a, b in zip(c, c[1:]))
            or any(k % c[-1] for k in self.numels)
        ):
            raise AssertionError(
                f"rank {self.rank}: expert cuts {c} are not {self.world_size + 1} rising boundaries from 0 to a "
                f"number of experts that divides every parameter's numel {self.numels}"
            )

    @property
    def even(self) -> bool:
        return self.fractions is None and self.cuts is None

    @cached_property
    def bounds(self) -> tuple[tuple[int, ...], ...]:
        """Per parameter, the ``world_size + 1`` cut points of its flat elements: rank ``r`` owns
        ``bounds[i][r]:bounds[i][r + 1]``."""
        n = self.world_size
        if self.cuts is not None:
            e = self.cuts[-1]
            return tuple(tuple(c * (k // e) for c in self.cuts) for k in self.numels)
        if self.fractions is None:
            out = []
            for k in self.numels:
                c = -(-k // n)
                out.append(tuple(min(r * c, k) for r in range(n)) + (k,))
            return tuple(out)
        cum, acc = [], 0.0
        for f in self.fractions[:-1]:
            acc += f
            cum.append(acc)
        return tuple((0, *(min(k, int(k * c)) for c in cum), k) for k in self.numels)

    @cached_property
    def chunks(self) -> tuple[int, ...]:
        n = self.world_size
        if self.even:
            return tuple(-(-k // n) for k in self.numels)
        return tuple(max(b[r + 1] - b[r] for r in range(n)) for b in self.bounds)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for c in self.chunks:
            out.append(acc)
            acc += c
        return tuple(out)

    @cached_property
    def shard_numel(self) -> int:
        return sum(self.chunks)

    def local_range(self, i: int, rank: int | None = None) -> tuple[int, int]:
        """Range of parameter ``i``'s flat elements that ``rank`` (default: this rank) owns."""
        r = self.rank if rank is None else rank
        b = self.bounds[i]
        return b[r], b[r + 1]

    def local_numel(self, i: int) -> int:
        lo, hi = self.local_range(i)
        return hi - lo

    @cached_property
    def unpadded(self) -> bool:
        """Whether every parameter splits into ``world_size`` equal pieces (no padding anywhere)."""
        return self.even and all(k == c * self.world_size for k, c in zip(self.numels, self.chunks))

    # -- packing -------------------------------------------------------------------------
    def pack_full(self, flats: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
        """Write full flat tensors (``None`` = zeros) into the rank-major ``out`` buffer
        (``world_size * shard_numel``), padding with zeros. An even layout with every tensor
        present is one ``_chunk_cat`` (one kernel on a GPU, the cast included), as FSDP2's
        reduce-scatter input; otherwise a copy per parameter."""
        rows = out.view(self.world_size, self.shard_numel)
        present = [f for f in flats if f is not None]
        if _CHUNK_CAT is not None and self.even and len(present) == len(flats) and all(f.numel() for f in present):
            _CHUNK_CAT(present, 0, self.world_size, out=rows)
            return
        for i, flat in enumerate(flats):
            off, c, n = self.offsets[i], self.chunks[i], self.numels[i]
            dst = rows[:, off : off + c]
            if flat is None:
                dst.zero_()
                continue
            if not self.even:  # uneven: each rank's range, then padding
                b = self.bounds[i]
                for r in range(self.world_size):
                    k = b[r + 1] - b[r]
                    dst[r, :k].copy_(flat[b[r] : b[r + 1]])
                    dst[r, k:].zero_()
                continue
            full_rows = n // c if c else 0
            if full_rows:
                dst[:full_rows].copy_(flat[: full_rows * c].view(full_rows, c))
            rem = n - full_rows * c
            if rem:
                dst[full_rows, :rem].copy_(flat[full_rows * c :])
                dst[full_rows, rem:].zero_()
                full_rows += 1
            if full_rows < self.world_size:
                dst[full_rows:].zero_()

    def unpack_full(self, gathered: torch.Tensor, flats: Sequence[torch.Tensor]) -> None:
        """Inverse of :meth:`pack_full`: copy every rank's pieces back into full flat tensors.
        ``gathered`` is flat, or already 2-D (world_size rows, possibly with extra columns)."""
        rows = gathered if gathered.dim() == 2 else gathered.view(self.world_size, self.shard_numel)
        n = self.world_size
        if (
            self.unpadded and all(self.chunks) and flats and all(f.dtype == rows.dtype for f in flats)
        ):  # one split copy, as FSDP2's
            torch.split_with_sizes_copy(
                rows[:, : self.shard_numel], list(self.chunks), dim=1, out=[f.view(n, -1) for f in flats]
            )
            return
        for i, flat in enumerate(flats):
            off, c, n = self.offsets[i], self.chunks[i], self.numels[i]
            src = rows[:, off : off + c]
            if not self.even:
                b = self.bounds[i]
                for r in range(self.world_size):
                    flat[b[r] : b[r + 1]].copy_(src[r, : b[r + 1] - b[r]])
                continue
            full_rows = n // c if c else 0
            if full_rows:
                flat[: full_rows * c].view(full_rows, c).copy_(src[:full_rows])
            rem = n - full_rows * c
            if rem:
                flat[full_rows * c :].copy_(src[full_rows, :rem])

    def pack_local(self, pieces: Sequence[torch.Tensor], out: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Write this rank's pieces (each ``local_numel(i)`` long) into a flat row of
        ``shard_numel`` elements, zero-padding each to its chunk (``non_blocking``: pieces in
        pinned host memory are copied without a host wait; the caller fences them)."""
        for i, piece in enumerate(pieces):
            off, c = self.offsets[i], self.chunks[i]
            k = piece.numel()
            out[off : off + k].copy_(piece, non_blocking=non_blocking)
            if k < c:
                out[off + k : off + c].zero_()

    def local_view(self, row: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's piece of parameter ``i`` inside a flat row (without padding)."""
        off = self.offsets[i]
        return row[off : off + self.local_numel(i)]
