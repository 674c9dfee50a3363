"""The class swap that ``initialize`` applies to the model and the optimizer (as FSDP2's
``fully_shard`` does): the object keeps its identity, passes ``isinstance`` checks for its own
class, and gains the methods of a mixin that run *before* the class's own.

Why not ``type(name, (Mixin, cls), {})``: CPython allows ``obj.__class__ = new`` only when
``new`` has the same memory layout as ``type(obj)``, and it compares the chains of "best
bases". With a plain mixin in front, the new class's best base is the mixin, while a class
deriving from ``abc.ABC`` (``class Model(ABC, nn.Module)``, a common pattern) has ``ABC`` in
that chain: "object layout differs". So the swapped class derives from ``cls`` *alone*, which
makes its layout ``cls``'s by construction (ABC bases, metaclasses, ``__slots__`` in the bases),
and the mixin's attributes are copied into it. A copied function that uses zero-argument
``super()`` refers to its class through a ``__class__`` cell; each copy gets a fresh cell that
points at the swapped class, so ``super()`` inside it continues with ``cls``, exactly as if the
mixin stood first in the MRO. The swapped class is built by ``type(cls)`` (the model's own
metaclass), keeps ``cls.__name__`` (``Zero`` prefixes its ``__qualname__``) and is cached per
(mixin, class).
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["original_class", "swap_class", "swapped_by", "unswap_class"]

_CACHE: dict[tuple[type, type], type] = {}
_SKIP = frozenset({"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__", "__slots__", "__annotations__"})


def swapped_by(obj_or_cls: Any) -> type | None:
    """The mixin a swapped object (or class) was given, or None."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return cls.__dict__.get("_zero_mixin")


def original_class(obj_or_cls: Any) -> type:
    """The class an object had before the swap (its own class if it was not swapped)."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return cls.__dict__.get("_zero_original", cls)


def swap_class(obj: object, mixin: type) -> None:
    cls = type(obj)
    if swapped_by(cls) is mixin:
        return
    key = (mixin, cls)
    if key not in _CACHE:
        _CACHE[key] = _build(cls, mixin)
    obj.__class__ = _CACHE[key]


def _build(cls: type, mixin: type) -> type:
    cells: list[types.CellType] = []
    ns: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": f"Zero{cls.__qualname__}",
        "__doc__": cls.__doc__,
    }
    for klass in reversed(mixin.__mro__[:-1]):  # the mixin's own bases first, the mixin last (it wins)
        for name, attr in vars(klass).items():
            if name not in _SKIP:
                ns[name] = _rebind(attr, cells, f"{mixin.__name__}.{name}")
    ns["_zero_mixin"], ns["_zero_original"] = mixin, cls
    # the class keeps its name (Hugging Face's save_pretrained records it as the architecture);
    # the qualified name says it was swapped
    new = type(cls)(cls.__name__, (cls,), ns)
    for cell in cells:
        cell.cell_contents = new
    return new


def _rebind(attr: Any, cells: list[types.CellType], where: str) -> Any:
    """``attr`` with every ``__class__`` cell (zero-argument ``super()``) replaced by a fresh one."""
    if isinstance(attr, types.FunctionType):
        wrapped = getattr(attr, "__wrapped__", None)
        if isinstance(wrapped, types.FunctionType) and "__class__" in wrapped.__code__.co_freevars:
            raise AssertionError(
                f"{where}: a decorated mixin method may not use zero-argument super(); call the base explicitly"
            )
        code = attr.__code__
        if "__class__" not in code.co_freevars:
            return attr
        closure = []
        for name, cell in zip(code.co_freevars, attr.__closure__ or ()):
            if name == "__class__":
                cell = types.CellType()
                cells.append(cell)
            closure.append(cell)
        new = types.FunctionType(code, attr.__globals__, attr.__name__, attr.__defaults__, tuple(closure))
        new.__kwdefaults__ = attr.__kwdefaults__
        new.__qualname__, new.__doc__ = attr.__qualname__, attr.__doc__
        new.__dict__.update(attr.__dict__)
        return new
    if isinstance(attr, property):
        fget, fset, fdel = (None if f is None else _rebind(f, cells, where) for f in (attr.fget, attr.fset, attr.fdel))
        return property(fget, fset, fdel, doc=attr.__doc__)
    if isinstance(attr, (classmethod, staticmethod)):
        return type(attr)(_rebind(attr.__func__, cells, where))
    return attr


def unswap_class(obj: object) -> None:
    """Give ``obj`` its class from before :func:`swap_class` back (no-op if it was not swapped)."""
    obj.__class__ = original_class(obj)
