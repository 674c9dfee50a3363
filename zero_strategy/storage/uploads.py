"""Copies from host memory into device tensors, issued now and waited for by their reader.

The policies of ``offload/host_step.py`` (the host optimizer step overlapped with the upload
of the previous group's pieces), chosen by type (:func:`choose`): :class:`StreamUpload` on
CUDA (a side stream, non-blocking copies from pinned memory, ``record_stream``, an event),
None on CPU (nothing to overlap), :class:`DeferredUpload` for the tests on CPU (the copy is
written only when waited for, so a reader that skips the wait reads stale values). Their sync
points are listed in ``offload/host_step.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["DeferredUpload", "PendingUpload", "StreamUpload", "Uploader", "choose"]


@dataclass(frozen=True)
class PendingUpload:
    """An issued copy: ``device_wait`` before a device reader uses the destination,
    ``host_wait`` before the host writes the source again."""

    device_wait: Callable[[], None]
    host_wait: Callable[[], None]


class Uploader:
    """How a group's updated host pieces reach their device row."""

    def start(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> PendingUpload:
        raise NotImplementedError(f"{type(self).__name__}.start")


@dataclass(frozen=True)
class StreamUpload(Uploader):
    """CUDA: the copies on a side stream of ``device``, non-blocking from pinned memory, and an event."""

    device: torch.device
    _streams: dict[int, torch.cuda.Stream] = field(default_factory=dict, compare=False)

    def _side(self) -> torch.cuda.Stream:
        s = self._streams.get(0)
        if s is None:
            s = self._streams[0] = torch.cuda.Stream(self.device)
        return s

    def start(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> PendingUpload:
        side, current = self._side(), torch.cuda.current_stream(self.device)
        side.wait_stream(current)  # earlier kernels may still read the row
        with torch.cuda.stream(side):
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=s.is_pinned())
        for d in dsts:
            d.record_stream(side)
        event = torch.cuda.Event()
        event.record(side)
        return PendingUpload(lambda: torch.cuda.current_stream(self.device).wait_event(event), event.synchronize)


@dataclass(frozen=True)
class DeferredUpload(Uploader):
    """Tests on CPU: the source is read at ``start`` (as the copy engine would read it), the
    destination written only when either wait is called."""

    def start(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> PendingUpload:
        taken = [s.detach().clone() for s in srcs]
        done = [False]

        def wait() -> None:
            if not done[0]:
                done[0] = True
                for d, t in zip(dsts, taken):
                    d.copy_(t)

        return PendingUpload(wait, wait)


def choose(device: torch.device) -> Uploader | None:
    """The uploader for rows on ``device`` (``ZERO_STRATEGY_TEST_HOST_COPIES=deferred``:
    :class:`DeferredUpload`, for the tests); None: the plain step, nothing to overlap."""
    if os.environ.get("ZERO_STRATEGY_TEST_HOST_COPIES") == "deferred":
        return DeferredUpload()
    return StreamUpload(device) if device.type == "cuda" else None
