"""Building a model that no rank ever holds whole: ``sharded_init``.

Inside the block, each module is sharded as soon as its own ``__init__`` returns: its
parameters, and any its children got without an ``__init__`` of their own (``copy.deepcopy``
of a layer, as ``nn.TransformerEncoder`` does), are cut to this rank's ``torch.chunk`` piece and
replaced by empty placeholders. So only the module being built is ever full, with what its
``__init__`` copies or views of its built children until it returns. Initial values equal a
normal construction with the same seed, because every rank runs the same initialisation code
with the same RNG and keeps its piece.

Code that runs after a module was cut may still use its parameters: a parent's ``__init__``
that fills a child's bias (``nn.MultiheadAttention``), a Hugging Face ``post_init`` that
initialises every descendant, a deep copy. Inside the block, every torch operation on a
sharded parameter sees its full value: the parameter is gathered for that one operation, and a
write into it (an in-place op, ``p.data = ...``) is cut into the pieces again at once. An
operation that returns a view of it (``weight[padding_idx]``, to be written next) keeps it
whole until the ``__init__`` it ran in returns. ``module.apply(fn)`` gathers each module's
parameters once around ``fn``. Outside the block, a sharded parameter is a full-shaped
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
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from zero_strategy.comm import collectives as C
from zero_strategy.sharding.pieces import (
    Piece,
    is_placeholder,
    local_range,
    placeholder,
    record_piece,
    recorded,
    take_record,
)

__all__ = ["active_context", "materialize_full", "outside_sharded_init", "sharded_init", "suspended_sharded_init"]

_M = TypeVar("_M", bound=nn.Module)

# Operations that read only a tensor's metadata, never its values: no gather for these.
_METADATA = frozenset(
    {
        "__get__", "__set__", "__delete__", "__len__", "__hash__", "dim", "ndimension", "size", "stride",
        "numel", "nelement", "element_size", "storage_offset", "untyped_storage", "data_ptr",
        "is_contiguous", "is_floating_point", "is_complex", "get_device", "requires_grad_",
    }
)  # fmt: skip
_WRITING_DUNDERS = frozenset(
    {
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
        "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    }
)  # fmt: skip


def _writes(name: str, kwargs: dict[str, Any]) -> bool:
    """Whether an operation named ``name`` writes into its tensor arguments (torch's ``op_`` names)."""
    in_place = name.endswith("_") and not name.startswith("__")
    return in_place or name in _WRITING_DUNDERS or kwargs.get("out") is not None


def _address(t: torch.Tensor) -> int:
    """The address of ``t``'s memory, 0 where it has none to compare (meta, sparse)."""
    if t.layout != torch.strided or t.device.type == "meta":
        return 0
    return t.untyped_storage().data_ptr()


def _gather_full(entry: Piece) -> torch.Tensor:
    ctx, numel = entry.ctx, entry.shape.numel()
    chunk = -(-numel // ctx.world_size)
    buf = torch.zeros(ctx.world_size * chunk, dtype=entry.piece.dtype, device=entry.piece.device)
    row = buf.view(ctx.world_size, chunk)[ctx.rank]
    row[: entry.piece.numel()].copy_(entry.piece)
    C.all_gather(ctx, buf, row, what="a parameter built under sharded_init").wait()
    return buf[:numel].view(entry.shape)


def materialize_full(p: nn.Parameter) -> None:
    """Give a parameter built under :func:`sharded_init` its full value again (collective)."""
    e = take_record(p)
    if e is not None:
        p.data = _gather_full(e)


class _Construction(TorchFunctionMode):
    """One ``sharded_init`` block: cuts parameters, and gives torch operations on a cut parameter
    its full value (a torch function mode, active for the whole block)."""

    def __init__(self, ctx: C.CommContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.sharded: dict[int, Piece] = {}  # placeholder address -> the piece it stands for
        self.frames: list[list[nn.Parameter]] = [[]]  # parameters kept whole, per running __init__
        self.paused = False  # our own bookkeeping runs without the mode
        self.suspended = False  # modules built now are left whole (suspended_sharded_init)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        was, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = was

    def cut(self, p: nn.Parameter) -> None:
        """Keep this rank's piece of ``p``'s (full) value; ``p`` becomes a placeholder."""
        lo, hi = local_range(p.numel(), self.ctx)
        piece, device = p.detach().reshape(-1)[lo:hi].clone(), p.device
        if device.type != self.ctx.device.type:  # built on the CPU for an NCCL group: kept where it is gathered
            device = self.ctx.device
            piece = piece.to(device)
        e = record_piece(p, piece, self.ctx)
        p.data = placeholder(p.shape, p.dtype, device)
        if address := _address(p):
            self.sharded[address] = e

    def cut_tree(self, m: nn.Module) -> None:
        """Cut every parameter under ``m`` that holds full values."""
        with self.pause():
            for sub in m.modules():
                for p in sub._parameters.values():
                    if p is not None and p.numel() > 0 and recorded(p) is None and not is_placeholder(p):
                        self.cut(p)

    @contextlib.contextmanager
    def frame(self) -> Iterator[None]:
        """Parameters kept whole inside (a view of them was taken) are cut when it ends."""
        self.frames.append([])
        try:
            yield
        finally:
            kept = self.frames.pop()
            with self.pause():
                for p in kept:
                    if recorded(p) is None and not is_placeholder(p):
                        self.cut(p)

    @contextlib.contextmanager
    def materialized(self, m: nn.Module) -> Iterator[None]:
        """``m``'s own cut parameters hold full values inside (``module.apply``)."""
        with self.pause():
            entries = [e for p in m._parameters.values() if p is not None and (e := self._entry(p)) is not None]
            for e in entries:
                self.sharded.pop(_address(e.param), None)
                e.param.data = _gather_full(e)
        try:
            yield
        finally:
            with self.pause():
                for e in entries:
                    if recorded(e.param) is e:
                        take_record(e.param)
                        self.cut(e.param)

    def flush(self) -> None:
        """Cut what is kept whole now (views taken at the block's level, or in an ``__init__``
        still running): ``initialize`` inside the block takes the parameters over, and a cut
        made later, when the frame ends, would cut an engine's parameter under it."""
        with self.pause():
            for kept in self.frames:
                for p in kept:
                    if recorded(p) is None and not is_placeholder(p):
                        self.cut(p)
                kept.clear()

    def deepcopy(self, p: Any, memo: dict[int, Any]) -> Any:
        """``copy.deepcopy`` of a parameter inside the block: a cut one is copied as its piece,
        without gathering it (``nn.TransformerEncoder`` copies its layer N times; whole copies
        would hold the whole encoder until its ``__init__`` returns); others as torch does."""
        if id(p) in memo:
            return memo[id(p)]
        e = None if self.paused else self._entry(p)
        if e is None:
            return _PARAM_DEEPCOPY(p, memo)
        with self.pause():
            new = type(p)(placeholder(e.shape, e.piece.dtype, e.piece.device), p.requires_grad)
            copied = record_piece(new, e.piece.clone(), self.ctx)
            if address := _address(new):
                self.sharded[address] = copied
        memo[id(p)] = new
        return new

    def _entry(self, t: torch.Tensor) -> Piece | None:
        """The piece ``t`` stands for, if ``t`` is (an alias of) a cut parameter's placeholder."""
        address = _address(t)
        e = self.sharded.get(address) if address else None
        if e is None or recorded(e.param) is not e or t.shape != e.shape or _address(e.param) != address:
            return None
        return e

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        sets_data = name == "__set__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data"
        if self.paused or (name in _METADATA and not sets_data):
            return func(*args, **kwargs)
        full: dict[int, tuple[Piece, torch.Tensor, torch.Tensor]] = {}  # id(piece) -> (piece, full, arg)

        def full_value(t: torch.Tensor) -> torch.Tensor:
            e = self._entry(t)
            if e is None:
                return t
            if id(e) not in full:
                full[id(e)] = (e, _gather_full(e), t)
            return full[id(e)][1]

        if sets_data:  # `p.data = value`: a cut parameter keeps the new value as pieces
            target, value = args[0], full_value(args[1])
            sharded = self._entry(target) is not None
            func(target, value)
            if sharded:
                take_record(target)
                self.cut(target)
            return None
        new_args, new_kwargs = tree_map_only(torch.Tensor, full_value, (args, kwargs))
        if not full:
            return func(*args, **kwargs)
        result = func(*new_args, **new_kwargs)
        if _writes(name, kwargs):  # written into the full values: cut them again
            for e, value, _ in full.values():
                lo, hi = local_range(value.numel(), self.ctx)
                e.piece = value.detach().reshape(-1)[lo:hi].clone()
            return next((arg for _, value, arg in full.values() if result is value), result)
        for e, value, _ in full.values():  # a view of the full value: keep it whole for now
            if any(isinstance(r, torch.Tensor) and _address(r) == _address(value) for r in tree_leaves(result)):
                self.sharded.pop(_address(e.param), None)
                take_record(e.param)
                e.param.data = value
                self.frames[-1].append(e.param)
        return result


_ACTIVE: list[_Construction] = []  # the sharded_init blocks open now, innermost last
_PARAM_DEEPCOPY = nn.Parameter.__deepcopy__  # torch's own, restored when the outermost block exits


@contextlib.contextmanager
def outside_sharded_init() -> Iterator[None]:
    """Inside, torch operations see cut parameters as they are (placeholders), as outside every
    ``sharded_init`` block: for ``initialize``, which takes the pieces over."""
    with contextlib.ExitStack() as stack:
        for state in _ACTIVE:
            state.flush()
            stack.enter_context(state.pause())
        yield


@contextlib.contextmanager
def suspended_sharded_init() -> Iterator[None]:
    """Inside, the open ``sharded_init`` blocks are off: modules are built as outside them (a
    sharded ``from_pretrained`` builds on the meta device and cuts the pieces itself)."""
    with contextlib.ExitStack() as stack:
        for state in _ACTIVE:
            state.flush()
            stack.enter_context(state.pause())
            was, state.suspended = state.suspended, True
            stack.callback(setattr, state, "suspended", was)
        yield


def active_context() -> C.CommContext | None:
    """The group of the innermost open ``sharded_init`` block (None outside every block)."""
    return _ACTIVE[-1].ctx if _ACTIVE else None


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

    Collective: every rank builds the same modules in the same order. A module built on a device
    the group does not communicate on (the default CPU device with an NCCL group) keeps its
    pieces, and its placeholders, on the group's device (``torch.cuda.current_device()``): no
    ``model.to('cuda')`` is needed, nor wanted, afterwards (it moves the buffers only)."""
    default = torch.empty(0).device  # the default device: the gloo half of a 'cuda:nccl,cpu:gloo' pair for the CPU
    state = _Construction(C.make_context(process_group, comm_timeout, device=default))
    patched: list[tuple[type[nn.Module], Callable]] = []

    def wrap(cls: type[nn.Module]) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or getattr(orig, "_zero_sharded_init", False):
            return

        def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            if type(self).__init__ is not __init__ or state.suspended:  # a base class's part of a derived __init__
                orig(self, *args, **kwargs)
                return
            with state.frame():
                orig(self, *args, **kwargs)
            state.cut_tree(self)  # the most-derived __init__ has returned

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
        if state.suspended:
            return orig_apply(self, fn)
        for child in self.children():
            child.apply(fn)
        with state.frame(), state.materialized(self):
            fn(self)
        return self

    nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]  # patched inside the block
    nn.Module.apply = apply  # type: ignore[method-assign]  # patched inside the block
    nn.Parameter.__deepcopy__ = lambda p, memo: _ACTIVE[-1].deepcopy(p, memo)  # type: ignore[method-assign]  # patched inside the block
    _ACTIVE.append(state)
    try:
        with state:
            with state.frame():
                yield
    finally:
        _ACTIVE.remove(state)
        if not _ACTIVE:
            nn.Parameter.__deepcopy__ = _PARAM_DEEPCOPY  # type: ignore[method-assign]  # restored on exit
        nn.Module.apply = orig_apply  # type: ignore[method-assign]  # restored on exit
        if orig_subclass_hook is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = orig_subclass_hook  # type: ignore[method-assign]  # restored on exit
        for cls, orig in patched:
            cls.__init__ = orig  # type: ignore[method-assign]  # restored on exit
