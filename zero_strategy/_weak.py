"""Callbacks that hold their object weakly, so that a dropped model frees its engine at once.

Python frees an object when its reference count drops to zero, except inside a reference
cycle, which waits for the cyclic collector (and so does every tensor the cycle reaches). An
engine registers callbacks on objects it holds itself: hooks on the model's submodules and
parameters, and callables handed to its reducer, scheduler, budget and disk tier. A bound
method there (``module.register_forward_hook(self.method)``) points back at its owner and closes
a cycle. :func:`weak_method` is the callback instead: it calls the method while the object
lives, and afterwards does nothing and returns ``default``. The ownership this keeps acyclic
is written down in ``runtime/engine.py``'s docstring.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["weak_method"]


def weak_method(method: Callable[..., Any], *args: Any, default: Any = None) -> Callable[..., Any]:
    """``functools.partial(method, *args)`` without a strong reference to the method's object:
    once that object is gone the call does nothing and returns ``default``. ``args`` are held
    strongly (they must not lead back to the object)."""
    ref = weakref.WeakMethod(method)  # a bound method (WeakMethod raises TypeError for anything else)

    def call(*more: Any, **kwargs: Any) -> Any:
        bound = ref()
        if bound is None:
            return default
        return bound(*args, *more, **kwargs)

    call.__name__ = call.__qualname__ = f"weak {method.__qualname__}"  # not functools.wraps: __wrapped__ is strong
    return call
