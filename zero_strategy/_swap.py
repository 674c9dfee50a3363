"""The class swap that ``initialize`` applies to the model and the optimizer (as FSDP2's
``fully_shard`` does): the object keeps its identity and passes ``isinstance`` checks for its
own class, and gains the methods of a mixin placed in front of it."""

from __future__ import annotations

__all__ = ["swap_class"]

_CACHE: dict[tuple[type, type], type] = {}


def swap_class(obj: object, mixin: type) -> None:
    cls = type(obj)
    if issubclass(cls, mixin):
        return
    key = (mixin, cls)
    if key not in _CACHE:
        _CACHE[key] = type(f"Zero{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
    obj.__class__ = _CACHE[key]
