"""The process's anonymous resident memory, and how far a phase raised it.

``initialize`` converts the model unit by unit: each unit's new storage (its ZeRO-3 rows, or a
broadcast bucket at ZeRO-1/2) is written while the unit's original parameters still exist, and
those are released before the next unit. The host memory it takes is therefore highest right
after a unit (or bucket) was written, and :class:`HostPeak` reads ``RssAnon`` of
``/proc/self/status`` exactly there: its ``peak`` is the most anonymous memory above the start
that those points saw (``memory_stats()["initialize_host_peak"]``). Anonymous memory is what a
copy costs; weights mapped from files (``from_pretrained``'s safetensors) are file pages and
count only once copied. Where ``/proc`` is absent the peak is unknown (-1).

Freeing an original does not always give its pages back: glibc keeps freed blocks that lie
inside its heap (tensors of a few MB, once its mmap threshold has grown) for reuse, while the new
rows are fresh pages. :meth:`HostPeak.released` counts the host bytes freed and, every
``TRIM_BYTES``, asks glibc to return free pages (``malloc_trim``; nothing elsewhere), so the
originals' pages go as the rows' come.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["TRIM_BYTES", "HostPeak", "rss_anon"]

_STATUS = "/proc/self/status"
TRIM_BYTES = 16 << 20  # host bytes freed between two malloc_trim calls


def rss_anon() -> int | None:
    """This process's anonymous resident bytes (``RssAnon``), None where ``/proc`` is absent."""
    try:
        with open(_STATUS, "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, None where the C library has none (musl, macOS, Windows)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):
        return None


class HostPeak:
    """Anonymous resident bytes above those at construction, at their highest :meth:`mark`."""

    def __init__(self) -> None:
        self.start = rss_anon()
        self._peak = 0
        self._freed = 0  # host bytes released since the last trim

    def released(self, nbytes: int) -> None:
        """``nbytes`` of host memory were freed; every ``TRIM_BYTES`` free pages go back to the OS."""
        self._freed += nbytes
        if self._freed >= TRIM_BYTES:
            self._trim()

    def _trim(self) -> None:
        trim = _malloc_trim()
        if trim is not None and self._freed:
            trim(0)
        self._freed = 0

    def mark(self) -> None:
        self._trim()
        now = rss_anon()
        if now is not None and self.start is not None:
            self._peak = max(self._peak, now - self.start)

    @property
    def peak(self) -> int:
        """The highest growth marked, in bytes (-1: unknown on this platform)."""
        return -1 if self.start is None else self._peak
