"""Seeing the overlap: a Chrome trace of training steps with the engine's own named ranges.

``zs.profile("trace.json")`` runs the block under ``torch.profiler`` and, while it runs, the
engine marks what it does with ranges whose names say the unit or the group:

- ``zero: forward unit 'blocks.3'`` / ``zero: backward unit 'blocks.3'``: the unit's compute;
- ``zero: all_gather parameters of unit 'blocks.4' (step 7)``: a gather being issued;
- ``zero: reduce_scatter gradients of ...``: a reduction being issued;
- ``zero: wait all_gather ...``: the host blocked on a collective: communication that was not
  hidden behind compute (``zs.comm_report()`` sums these as the exposed time).

Open the file in ``chrome://tracing`` or Perfetto. Outside ``profile`` no range is recorded
(the hooks check one flag).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["close_range", "enabled", "open_range", "profile", "span"]

_ACTIVE = [False]


def enabled() -> bool:
    return _ACTIVE[0]


def open_range(*parts: str) -> Any:
    """Start a range named by ``parts`` joined with spaces (None when not profiling, and then
    no name is built); end it with :func:`close_range`."""
    if not _ACTIVE[0]:
        return None
    return torch.ops.profiler._record_function_enter_new(" ".join(parts), None)


def close_range(handle: Any) -> None:
    if handle is not None:
        torch.ops.profiler._record_function_exit._RecordFunction(handle)


@contextlib.contextmanager
def span(*parts: str) -> Iterator[None]:
    """A range named by ``parts`` around the block, when profiling."""
    handle = open_range(*parts)
    try:
        yield
    finally:
        close_range(handle)


@contextlib.contextmanager
def profile(trace_path: str | None = None, **profiler_kwargs: Any) -> Iterator[torch.profiler.profile]:
    """Profile the block with ``torch.profiler`` (CPU, and CUDA when present) with the engine's
    ranges, and write a Chrome trace to ``trace_path`` at its end. Extra keywords go to
    ``torch.profiler.profile``. Yields the profiler (``key_averages()``, ``events()``)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler_kwargs.setdefault("activities", activities)
    prof = torch.profiler.profile(**profiler_kwargs)
    with prof:
        _ACTIVE[0] = True
        try:
            yield prof
        finally:
            _ACTIVE[0] = False
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
