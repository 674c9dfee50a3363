"""Counting the engine's host synchronisations on a machine without a GPU.

On CUDA, reading a device tensor's value on the host (``tolist``, ``item``, ``bool(t)``,
``float(t)``, ``int(t)``, ``torch.equal``) waits for the device. On CPU those calls cost nothing,
so a test cannot see them in time; it can count them. :class:`HostSyncCounter` is a
``TorchFunctionMode`` that records each such call the engine's own code makes (the caller is in
``zero_strategy/``, but not in its test utilities), with the place it came from, so that a test
can compare the count per step with the documented list (``docs/advanced.md``,
"Host synchronisation"). Reads inside torch functions the engine calls (the optimizer's own step
counters, on the host) are torch's and not counted.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from types import FrameType
from typing import Any

from torch.overrides import TorchFunctionMode

__all__ = ["SYNC_CALLS", "HostSyncCounter"]

SYNC_CALLS = frozenset({"tolist", "item", "__bool__", "__float__", "__int__", "__index__", "equal"})
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../zero_strategy


class HostSyncCounter(TorchFunctionMode):
    """Inside ``with HostSyncCounter() as c:``, ``c.calls`` counts ``"name file:line"`` of every
    value-reading call the engine made."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNC_CALLS:
            frame: FrameType | None = sys._getframe(1)  # the caller itself (torch's own reads are not ours)
            if frame is not None:
                path = os.path.abspath(frame.f_code.co_filename)
                if path.startswith(_PKG + os.sep) and not path.startswith(os.path.join(_PKG, "testing")):
                    self.calls[f"{name} {os.path.relpath(path, _PKG)}:{frame.f_lineno}"] += 1
        return func(*args, **(kwargs or {}))
