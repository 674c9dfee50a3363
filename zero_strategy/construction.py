"""Building a model that no rank ever holds whole: ``sharded_init``.

Inside the block, each module is sharded as soon as its own ``__init__`` returns (its direct
parameters are cut to this rank's ``torch.chunk`` piece and replaced by empty placeholders), so
only one module's parameters are ever full. Initial values equal a normal construction with the
same seed, because every rank runs the same initialisation code with the same RNG and keeps its
piece. Post-hoc initialisation through ``module.apply(fn)`` (what ``GPT.__init__`` and Hugging
Face's ``post_init`` do) works: inside the block, ``apply`` gathers each module's parameters,
runs ``fn``, and shards them again. Outside that, a sharded parameter is a full-shaped
placeholder that holds no memory: reading it gives NaN and writing into it raises an error, so
no write is ever lost silently.

Seed every rank alike before building: ranks keep pieces of their own local values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from zero_strategy import collectives as C
from zero_strategy.pieces import (
    Piece,
    local_range,
    placeholder,
    record_piece,
    recorded,
    sharded_init_piece,
    take_record,
)

__all__ = ["materialize_full", "sharded_init"]

_M = TypeVar("_M", bound=nn.Module)


def _shard_module(m: nn.Module, ctx: C.CommContext) -> None:
    for p in m._parameters.values():
        if p is None or sharded_init_piece(p) is not None or p.numel() == 0:
            continue
        lo, hi = local_range(p.numel(), ctx)
        record_piece(p, p.detach().reshape(-1)[lo:hi].clone(), ctx)
        p.data = placeholder(p.shape, p.dtype, p.device)


def _gather_full(entry: Piece) -> torch.Tensor:
    ctx, numel = entry.ctx, entry.shape.numel()
    chunk = -(-numel // ctx.world_size)
    buf = torch.zeros(ctx.world_size * chunk, dtype=entry.piece.dtype, device=entry.piece.device)
    row = buf.view(ctx.world_size, chunk)[ctx.rank]
    row[: entry.piece.numel()].copy_(entry.piece)
    C.all_gather(ctx, buf, row, what="a parameter built under sharded_init").wait()
    return buf[:numel].view(entry.shape)


@contextlib.contextmanager
def _materialized(m: nn.Module) -> Iterator[None]:
    entries = [e for p in m._parameters.values() if p is not None and (e := recorded(p)) is not None]
    for e in entries:
        e.param.data = _gather_full(e)
    try:
        yield
    finally:
        for e in entries:
            lo, hi = local_range(e.shape.numel(), e.ctx)
            e.piece = e.param.detach().reshape(-1)[lo:hi].clone()
            e.param.data = placeholder(e.shape, e.piece.dtype, e.piece.device)


def materialize_full(p: nn.Parameter) -> None:
    """Give a parameter built under :func:`sharded_init` its full value again (collective)."""
    e = take_record(p)
    if e is not None:
        p.data = _gather_full(e)


def _all_module_classes() -> list[type[nn.Module]]:
    seen: list[type[nn.Module]] = []
    stack: list[type[nn.Module]] = [nn.Module]
    while stack:
        cls = stack.pop()
        seen.append(cls)
        stack.extend(c for c in cls.__subclasses__() if c not in seen)
    return seen


@contextlib.contextmanager
def sharded_init(*, process_group: Any = None, comm_timeout: float | None = None) -> Iterator[None]:
    """Build models inside this block so that no rank ever holds all of their parameters.

    Collective: every rank builds the same modules in the same order."""
    ctx = C.make_context(process_group, comm_timeout)
    patched: list[tuple[type[nn.Module], Callable]] = []

    def wrap(cls: type[nn.Module]) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or getattr(orig, "_zero_sharded_init", False):
            return

        def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            if type(self).__init__ is __init__:  # the most-derived __init__ has returned
                _shard_module(self, ctx)

        __init__.__dict__.update(_zero_sharded_init=True, __wrapped__=orig)  # marked, and what it wraps
        cls.__init__ = __init__  # type: ignore[method-assign]  # patched inside the block, restored on exit
        patched.append((cls, orig))

    for cls in _all_module_classes():
        if cls is not nn.Module:
            wrap(cls)
    orig_subclass_hook = nn.Module.__dict__.get("__init_subclass__")
    orig_apply = nn.Module.apply

    def __init_subclass__(cls: type[nn.Module], **kwargs: Any) -> None:
        super(nn.Module, cls).__init_subclass__(**kwargs)
        wrap(cls)

    def apply(self: _M, fn: Callable[[nn.Module], None]) -> _M:
        for child in self.children():
            child.apply(fn)
        with _materialized(self):
            fn(self)
        return self

    nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]  # patched inside the block
    nn.Module.apply = apply  # type: ignore[method-assign]  # patched inside the block
    try:
        yield
    finally:
        nn.Module.apply = orig_apply  # type: ignore[method-assign]  # restored on exit
        if orig_subclass_hook is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = orig_subclass_hook  # type: ignore[method-assign]  # restored on exit
        for cls, orig in patched:
            cls.__init__ = orig  # type: ignore[method-assign]  # restored on exit
