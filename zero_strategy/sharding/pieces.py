"""Placeholders and pieces: the leaf helpers every sharded storage uses.

A sharded parameter keeps its shape but holds no memory: its data is a *placeholder*, one
element expanded to the full shape (NaN for floating dtypes, so reading it is conspicuous;
most writes into it raise). This rank's *piece* of a parameter is a slice of its flattened
value. A parameter built under ``sharded_init`` (``construction.py``) has its piece recorded
here until the engine takes it over, so the engine and the shard groups read pieces without
depending on how the model was built.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from zero_strategy.comm import collectives as C

__all__ = [
    "written_while_sharded",
    "check_placeholder",
    "forget_pieces",
    "is_placeholder",
    "local_range",
    "piece_of",
    "placeholder",
    "record_piece",
    "recorded",
    "reset_placeholder",
    "sharded_init_piece",
    "take_record",
]


@dataclass
class Piece:
    """This rank's piece of a parameter built under ``sharded_init``, and how it was cut."""

    param: nn.Parameter
    piece: torch.Tensor
    shape: torch.Size
    ctx: C.CommContext


_PIECES: dict[int, Piece] = {}  # id(parameter) -> this rank's piece, for params built sharded


def recorded(p: torch.Tensor) -> Piece | None:
    """The record of ``p`` if it was built under ``sharded_init`` and not taken over yet."""
    entry = _PIECES.get(id(p))
    return entry if entry is not None and entry.param is p else None


def record_piece(p: nn.Parameter, piece: torch.Tensor, ctx: C.CommContext) -> Piece:
    entry = _PIECES[id(p)] = Piece(p, piece, p.shape, ctx)
    return entry


def sharded_init_piece(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of ``p`` if ``p`` was built under ``sharded_init`` (else None)."""
    entry = recorded(p)
    return entry.piece if entry is not None else None


def forget_pieces(params: Iterable[torch.Tensor]) -> None:
    for p in params:
        _PIECES.pop(id(p), None)


def take_record(p: torch.Tensor) -> Piece | None:
    """Remove and return ``p``'s record (None if it has none)."""
    entry = _PIECES.pop(id(p), None)
    return entry if entry is not None and entry.param is p else None


def local_range(numel: int, ctx: C.CommContext) -> tuple[int, int]:
    """The elements of a flattened tensor of ``numel`` elements this rank keeps (``torch.chunk``'s cut)."""
    chunk = -(-numel // ctx.world_size)
    lo = min(ctx.rank * chunk, numel)
    return lo, min(lo + chunk, numel)


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A full-shaped stand-in for a sharded parameter that holds no memory: one element
    expanded to ``shape``, NaN for floating dtypes (so reading it is conspicuous). Most writes
    into it raise ("more than one element ... refers to a single memory location"); a fill
    (``zero_``, ``fill_``) changes the element, which :func:`check_placeholder` reports."""
    value = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    if len(shape) == 0:  # a 0-dim parameter: its one element is the placeholder
        return torch.full((), value, dtype=dtype, device=device)
    return torch.full((1,), value, dtype=dtype, device=device).expand(shape)


def reset_placeholder(t: torch.Tensor) -> None:
    """Give a written placeholder its value back (NaN, or 0), once the write was reported: a
    unit reuses its placeholders at every reshard."""
    if is_placeholder(t):
        base = t.as_strided((1,), (1,), t.storage_offset())
        base.fill_(float("nan") if base.dtype.is_floating_point or base.dtype.is_complex else 0)


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is (a view of) a memory-less placeholder of a sharded parameter."""
    return t.numel() > 1 and t.stride() == (0,) * t.dim() and t.untyped_storage().nbytes() == t.element_size()


def written_while_sharded(name: str) -> str:
    return (
        f"parameter '{name}' was written while it was sharded (the write cannot be kept: this "
        "rank holds only a piece of it). Write full values inside `with "
        "zero_strategy.gathered_parameters(model, modifier_rank=0):`, or inside module.apply(fn) "
        "under sharded_init"
    )


def check_placeholder(t: torch.Tensor, name: str) -> None:
    """Raise if ``t`` is a placeholder that something wrote into (that write is lost)."""
    if not is_placeholder(t):
        return
    base = t.as_strided((1,), (1,), t.storage_offset())
    written = not bool(torch.isnan(base).all()) if base.dtype.is_floating_point else bool(base.ne(0).any())
    if written:
        raise RuntimeError(written_while_sharded(name))


def piece_of(p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements ``lo:hi`` of flattened ``p``: from its sharded_init piece when it has one (that
    piece must be exactly this range), else from its data."""
    entry = recorded(p)
    if entry is not None:
        elo, ehi = local_range(entry.shape.numel(), entry.ctx)
        if (elo, ehi) != (lo, hi):
            raise AssertionError(
                f"rank {entry.ctx.rank}: sharded_init kept elements {elo}:{ehi} of a parameter, the engine needs {lo}:{hi}; "
                "build and initialize with the same process group"
            )
        return entry.piece
    return p.detach().reshape(-1)[lo:hi]
