"""``torch.compile`` around the engine: its hooks run eagerly, the module bodies compile.

The engine's hooks communicate (all-gathers, reductions) and swap each ZeRO-3 parameter's
storage between a memory-less placeholder and its gathered value; none of that belongs in a
graph. Traced, the hooks' tensor work would land in the graphs (a graph that captured a
placeholder asserts its 0 strides on the next call; one that captured a gather's writes fails
in backward on the version counter). So every hook the engine registers, and the root call's
end-of-forward work, is wrapped in :func:`eager` (``torch.compiler.disable``): dynamo breaks its
graph there and runs the hook as plain Python, and compiles the module code between hooks.
The compiled code then only ever sees gathered parameters (full shape, contiguous strides),
the same tensors at every call, so it neither recompiles nor reads a placeholder; backward
reads the parameters the engine gathered again for it, as eager autograd does. One exception:
an MoE experts module with compact gathers (``sharding/experts/compact.py``) sees parameters of
``[U, ...]`` and ``num_experts = U``, so its code is recompiled for new union sizes, up to
dynamo's recompile limit, after which that module runs eagerly.

This holds whether the model was compiled before ``initialize`` (``torch.compile(model)``, or
``module.compile()`` of blocks) or after it (``torch.compile`` of the wrapped model): either
way dynamo meets the hooks when it calls a module. Tested with ``inductor`` (torch's default
backend) and ``aot_eager``: ``tests/distributed/test_zero3.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import torch

__all__ = ["eager", "hook_caller"]

F = TypeVar("F", bound=Callable[..., Any])

_REASON = "zero_strategy's engine hooks gather, free and reduce parameters: they run eagerly"
_WRAPPER_FILES: set[str] = set()  # where torch.compiler.disable's wrappers run (their frames)


def eager(fn: F) -> F:
    """``fn`` run outside any ``torch.compile`` graph (dynamo graph-breaks at the call)."""
    wrapped = torch.compiler.disable(fn, reason=_REASON)
    code = getattr(wrapped, "__code__", None)
    if code is not None:
        _WRAPPER_FILES.add(code.co_filename)
    return wrapped


def hook_caller() -> FrameType:
    """The frame that called the running hook (a module hook's caller: the module call's own
    frame), above the :func:`eager` wrapper's frames. Call it from the hook itself."""
    frame = sys._getframe(2)  # 0: here, 1: the hook
    while frame.f_code.co_filename in _WRAPPER_FILES and frame.f_back is not None:
        frame = frame.f_back
    return frame
