"""Building and loading a model that no rank ever holds whole.

``sharded_init``: inside the block, each module is sharded as soon as its own ``__init__``
returns (its direct parameters are cut to this rank's ``torch.chunk`` piece and replaced by
empty placeholders), so only one module's parameters are ever full. Initial values equal a
normal construction with the same seed, because every rank runs the same initialisation code
with the same RNG and keeps its piece. Post-hoc initialisation through ``module.apply(fn)``
(what ``GPT.__init__`` and Hugging Face's ``post_init`` do) works: inside the block, ``apply``
gathers each module's parameters, runs ``fn``, and shards them again. Outside that, a sharded
parameter is a full-shaped placeholder that holds no memory: reading it gives zeros and
writing into it raises an error, so no write is ever lost silently.

Seed every rank alike before building: ranks keep pieces of their own local values.

``load_full_state_dict``: load full pretrained weights (a state dict, a ``.safetensors`` file
or a ``.pt``/``.bin`` file) parameter by parameter, each rank keeping only its pieces.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from zero_strategy import collectives as C

__all__ = ["check_placeholder", "forget_pieces", "load_full_state_dict", "materialize_full", "piece_of", "placeholder", "sharded_init", "sharded_init_piece"]


@dataclass
class _Piece:
    param: nn.Parameter
    piece: torch.Tensor
    shape: torch.Size
    ctx: C.CommContext


_PIECES: dict[int, _Piece] = {}  # id(parameter) -> this rank's piece, for params built sharded


def sharded_init_piece(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of ``p`` if ``p`` was built under :func:`sharded_init` (else None)."""
    entry = _PIECES.get(id(p))
    return entry.piece if entry is not None and entry.param is p else None


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A full-shaped stand-in for a sharded parameter that holds no memory: one element
    expanded to ``shape``, NaN for floating dtypes (so reading it is conspicuous). Most writes
    into it raise ("more than one element ... refers to a single memory location"); a fill
    (``zero_``, ``fill_``) changes the element, which :func:`check_placeholder` reports."""
    value = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    if len(shape) == 0:  # a 0-dim parameter: its one element is the placeholder
        return torch.full((), value, dtype=dtype, device=device)
    return torch.full((1,), value, dtype=dtype, device=device).expand(shape)


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is (a view of) a memory-less placeholder of a sharded parameter."""
    return t.numel() > 1 and t.stride() == (0,) * t.dim() and t.untyped_storage().nbytes() == t.element_size()


def check_placeholder(t: torch.Tensor, name: str) -> None:
    """Raise if ``t`` is a placeholder that something wrote into (that write is lost)."""
    if not is_placeholder(t):
        return
    base = t.as_strided((1,), (1,), t.storage_offset())
    written = not bool(torch.isnan(base).all()) if base.dtype.is_floating_point else bool(base.ne(0).any())
    if written:
        raise RuntimeError(
            f"parameter '{name}' was written while it was sharded (the write cannot be kept: this "
            "rank holds only a piece of it). Write full values inside `with "
            "zero_strategy.gathered_parameters(model, modifier_rank=0):`, or inside module.apply(fn) "
            "under sharded_init"
        )


def piece_of(p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements ``lo:hi`` of flattened ``p``: from its sharded_init piece when it has one (that
    piece must be exactly this range), else from its data."""
    entry = _PIECES.get(id(p))
    if entry is not None and entry.param is p:
        elo, ehi = _local_range(entry.shape.numel(), entry.ctx)
        if (elo, ehi) != (lo, hi):
            raise AssertionError(
                f"rank {entry.ctx.rank}: sharded_init kept elements {elo}:{ehi} of a parameter, the engine needs {lo}:{hi}; "
                "build and initialize with the same process group"
            )
        return entry.piece
    return p.detach().reshape(-1)[lo:hi]


def _local_range(numel: int, ctx: C.CommContext) -> tuple[int, int]:
    chunk = -(-numel // ctx.world_size)
    lo = min(ctx.rank * chunk, numel)
    return lo, min(lo + chunk, numel)


def _shard_module(m: nn.Module, ctx: C.CommContext) -> None:
    for p in m._parameters.values():
        if p is None or sharded_init_piece(p) is not None or p.numel() == 0:
            continue
        lo, hi = _local_range(p.numel(), ctx)
        piece = p.detach().reshape(-1)[lo:hi].clone()
        _PIECES[id(p)] = _Piece(p, piece, p.shape, ctx)
        p.data = placeholder(p.shape, p.dtype, p.device)


def _gather_full(entry: _Piece) -> torch.Tensor:
    ctx, numel = entry.ctx, entry.shape.numel()
    chunk = -(-numel // ctx.world_size)
    buf = torch.zeros(ctx.world_size * chunk, dtype=entry.piece.dtype, device=entry.piece.device)
    row = buf.view(ctx.world_size, chunk)[ctx.rank]
    row[: entry.piece.numel()].copy_(entry.piece)
    C.all_gather(ctx, buf, row, what="a parameter built under sharded_init").wait()
    return buf[:numel].view(entry.shape)


@contextlib.contextmanager
def _materialized(m: nn.Module) -> Iterator[None]:
    entries = [e for p in m._parameters.values() if p is not None and (e := _PIECES.get(id(p))) is not None]
    for e in entries:
        e.param.data = _gather_full(e)
    try:
        yield
    finally:
        for e in entries:
            lo, hi = _local_range(e.shape.numel(), e.ctx)
            e.piece = e.param.detach().reshape(-1)[lo:hi].clone()
            e.param.data = placeholder(e.shape, e.piece.dtype, e.piece.device)


def forget_pieces(params: list[torch.Tensor]) -> None:
    for p in params:
        _PIECES.pop(id(p), None)


def materialize_full(p: nn.Parameter) -> None:
    """Give a parameter built under :func:`sharded_init` its full value again (collective)."""
    e = _PIECES.pop(id(p), None)
    if e is not None and e.param is p:
        p.data = _gather_full(e)


def _all_module_classes() -> list[type]:
    seen, stack = [], [nn.Module]
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
    patched: list[tuple[type, Callable]] = []

    def wrap(cls: type) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or getattr(orig, "_zero_sharded_init", False):
            return

        def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            if type(self).__init__ is __init__:  # the most-derived __init__ has returned
                _shard_module(self, ctx)

        __init__._zero_sharded_init = True  # type: ignore[attr-defined]
        __init__.__wrapped__ = orig  # type: ignore[attr-defined]
        cls.__init__ = __init__
        patched.append((cls, orig))

    for cls in _all_module_classes():
        if cls is not nn.Module:
            wrap(cls)
    orig_subclass_hook = nn.Module.__dict__.get("__init_subclass__")
    orig_apply = nn.Module.apply

    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        super(nn.Module, cls).__init_subclass__(**kwargs)
        wrap(cls)

    def apply(self: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
        for child in self.children():
            child.apply(fn)
        with _materialized(self):
            fn(self)
        return self

    nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
    nn.Module.apply = apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.apply = orig_apply  # type: ignore[method-assign]
        if orig_subclass_hook is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = orig_subclass_hook  # type: ignore[assignment]
        for cls, orig in patched:
            cls.__init__ = orig


def _open_state_dict(source: str | os.PathLike[str] | Mapping[str, torch.Tensor]) -> tuple[Callable[[str], torch.Tensor], list[str]]:
    if isinstance(source, Mapping):
        return (lambda k: source[k]), list(source.keys())
    path = os.fspath(source)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load_full_state_dict(): no file at {path!r}")
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        f = safe_open(path, framework="pt")
        return f.get_tensor, list(f.keys())
    sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    return (lambda k: sd[k]), list(sd.keys())


def load_full_state_dict(model: nn.Module, source: str | os.PathLike[str] | Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load full weights into a model managed by ``initialize``, one tensor at a time; each
    rank keeps only its pieces (ZeRO-3) or the full tensors it needs (ZeRO-1/2). Not a
    collective: every rank reads the source itself."""
    from zero_strategy.engine import get_engine

    get_engine(model).load_full_state_dict(*_open_state_dict(source), strict=strict)
