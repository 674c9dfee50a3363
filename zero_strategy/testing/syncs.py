"""Counting the engine's host synchronisations on a machine without a GPU.

On CUDA, reading a device tensor's value on the host (``tolist``, ``item``, ``bool(t)``,
``float(t)``, ``int(t)``, ``torch.equal``) waits for the device. On CPU those calls cost nothing,
so a test cannot see them in time; it can count them. :class:`HostSyncCounter` is a
``TorchFunctionMode`` that records each such call the engine's own code makes (the caller is in
``zero_strategy/``, but not in its test utilities), with the place it came from, so that a test
can compare the count per step with the documented list (``docs/advanced.md``,
"Host synchronisation"). Reads inside torch functions the engine calls (the optimizer's own step
counters, on the host) are torch's and not counted.

Besides the reads, it counts the calls that wait for the device without reading a value: those
whose output size depends on the values (boolean-mask indexing ``t[mask]`` and ``t[mask] = v``,
``nonzero``, ``masked_select``, ``unique``, one-argument ``where``, ``repeat_interleave`` with
tensor repeats and no ``output_size``), and ``torch.tensor``/``torch.as_tensor`` of host data
with a ``device``: on a GPU a blocking copy from pageable memory, which waits for the stream.
``torch.tensor`` is not seen by torch function modes, so the counter wraps it while active.

It also counts the writes that, on CUDA, copy from the host into a device tensor and so wait
for it (issue 45): a Python number written by indexing (``t[i] = 3``: a blocking copy of a
one-element host tensor), and a ``.to(device)`` of a host tensor that is neither pinned nor
``non_blocking``. On a machine without a GPU the engine's device is the host, so every such
call in the engine's code counts: the engine builds host-side values from Python lists
(``torch.tensor(list)``) and fills device tensors with ``fill_``, which passes the number to
the kernel and copies nothing.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["SHAPE_SYNC_CALLS", "SYNC_CALLS", "HostSyncCounter"]

SYNC_CALLS = frozenset({"tolist", "item", "__bool__", "__float__", "__int__", "__index__", "equal"})
# output sizes that depend on the values: the host waits for them
SHAPE_SYNC_CALLS = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"})
_INDEXING = frozenset({"__getitem__", "__setitem__", "index_put", "index_put_"})
_NUMBER = (bool, int, float)


def _has_mask(index: Any) -> bool:
    """Whether an index (a tensor, or a tuple/list of them) holds a boolean tensor."""
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    return isinstance(index, (tuple, list)) and any(_has_mask(i) for i in index)


def _names_device(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names a device (not only a dtype)."""
    if "device" in kwargs:
        return kwargs["device"] is not None
    return any(isinstance(a, (str, torch.device, torch.Tensor)) for a in args[1:])


def _host_copy(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the call copies host data into the device, blocking: a Python number written by
    indexing, or ``.to(device)`` of a host tensor neither pinned nor ``non_blocking``."""
    if name == "__setitem__":
        return len(args) > 2 and isinstance(args[2], _NUMBER)
    if name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor):
        t = args[0]
        if t.device.type != "cpu" or kwargs.get("non_blocking") or (len(args) > 2 and args[-1] is True):
            return False
        if name == "to" and not _names_device(args, kwargs):
            return False
        return not (torch.cuda.is_available() and t.is_pinned())
    return False


def _waits(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the call ``name(*args, **kwargs)`` waits for the device."""
    if name in SYNC_CALLS or name in SHAPE_SYNC_CALLS:
        return True
    if _host_copy(name, args, kwargs):
        return True
    if name in _INDEXING:
        return len(args) > 1 and _has_mask(args[1])
    if name == "where":
        return len(args) + len(kwargs) == 1
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and kwargs.get("output_size") is None
    return False


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../zero_strategy


class HostSyncCounter(TorchFunctionMode):
    """Inside ``with HostSyncCounter() as c:``, ``c.calls`` counts ``"name file:line"`` of every
    value-reading or device-waiting call the engine made."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __enter__(self) -> HostSyncCounter:
        self._factories = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}
        for name, factory in self._factories.items():
            setattr(torch, name, self._copying(name, factory))
        return super().__enter__()  # TorchFunctionMode returns self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, factory in self._factories.items():
            setattr(torch, name, factory)

    def _copying(self, name: str, factory: Any) -> Any:
        def wrapped(data: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
                self._record(f"torch.{name}(device=)", sys._getframe(1))
            return factory(data, *args, **kwargs)

        return wrapped

    def _record(self, name: str, frame: FrameType | None) -> None:
        """Count ``name`` if ``frame`` (the caller itself: torch's own calls are not ours) is the engine's."""
        if frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if path.startswith(_PKG + os.sep) and not path.startswith(os.path.join(_PKG, "testing")):
                self.calls[f"{name} {os.path.relpath(path, _PKG)}:{frame.f_lineno}"] += 1

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if _waits(name, args, kwargs or {}):
            self._record(name, sys._getframe(1))
        return func(*args, **(kwargs or {}))
