"""The engine's hooks run outside torch.compile graphs (``zero_strategy/runtime/compile_support.py``);
the multi-rank numbers are in tests/distributed/test_zero3.py (inductor against DDP)."""

from __future__ import annotations

import sys
from types import FrameType

import torch

from zero_strategy.runtime.compile_support import eager, hook_caller


def test_hook_caller_is_the_frame_above_the_eager_wrapper() -> None:
    # The outside-call hooks keep their caller's frame (the module call) to tell a nested call
    # from a stale one: the wrapper's own frame returns at once and must be skipped.
    seen: list[FrameType] = []

    def hook() -> None:
        seen.append(hook_caller())

    def module_call() -> FrameType:
        eager(hook)()
        return sys._getframe(0)

    assert seen == [] and module_call() is seen[0]


def test_an_eager_function_is_not_traced_by_torch_compile() -> None:
    calls: list[bool] = []

    def side(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.compiler.is_compiling())
        return x + 1

    hook = eager(side)
    fn = torch.compile(lambda x: hook(x * 2) * 3, backend="eager", fullgraph=False)
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 9.0))
    assert calls == [False]  # run once, as plain Python
