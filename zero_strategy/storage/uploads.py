"""Copies from host memory into device tensors, issued now and waited for by their reader.

Two kinds, each a policy chosen by type, None on CPU (nothing to overlap there):

- Uploads (:func:`choose`), for ``offload/host_step.py`` (the host optimizer step overlapped
  with the upload of the previous group's pieces): :class:`StreamUpload` on CUDA (a side
  stream, non-blocking copies from pinned memory, ``record_stream``, an event),
  :class:`DeferredUpload` for the tests on CPU (the copy is written only when waited for, so a
  reader that skips the wait reads stale values). Their sync points are listed in
  ``offload/host_step.py``.
- Feeds (:func:`choose_feed`), for ZeRO-3 gathers of rows kept in host memory or read from disk
  (``offload_param``): the rows' copy into the gather's send buffer and the all-gather that
  sends it are issued on a side stream (:class:`StreamFeed`), so that a prefetched unit's
  copy runs while the current unit computes, and the host never waits for it.
  :class:`DeferredFeed` is the tests' stand-in on CPU: it fails when the host writes rows
  whose copy is still pending. The sync points are listed in :class:`StreamFeed`.

``ZERO_STRATEGY_OFFLOAD_OVERLAP=0`` turns both off on CUDA (the plain, blocking copies), to
measure them (``bench/bench_offload_overlap.py``) or to rule them out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from zero_strategy.comm.collectives import Handle

__all__ = [
    "DeferredFeed", "DeferredUpload", "PendingUpload", "RowFeed", "StreamFeed", "StreamUpload", "Uploader", "choose",
    "choose_feed", "overlapped", "to_device",
]  # fmt: skip


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host-built tensor (flags, indices) on ``device`` without a host wait: on CUDA
    it is pinned (torch's caching host allocator keeps the block until the copy has run) and
    copied ``non_blocking``; a copy from pageable memory would wait for the device."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


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
class _SideStream:
    """A side stream of ``device``, made at its first use."""

    device: torch.device
    _streams: dict[int, torch.cuda.Stream] = field(default_factory=dict, compare=False)

    def _side(self) -> torch.cuda.Stream:
        s = self._streams.get(0)
        if s is None:
            s = self._streams[0] = torch.cuda.Stream(self.device)
        return s


@dataclass(frozen=True)
class StreamUpload(_SideStream, Uploader):
    """CUDA: the copies on a side stream of ``device``, non-blocking from pinned memory, and an event."""

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


def overlapped(device: torch.device) -> bool:
    """Whether host copies to ``device`` run beside the compute: on CUDA, unless
    ``ZERO_STRATEGY_OFFLOAD_OVERLAP=0`` (to measure the overlap, or to rule it out)."""
    return device.type == "cuda" and os.environ.get("ZERO_STRATEGY_OFFLOAD_OVERLAP", "1") != "0"


def choose(device: torch.device) -> Uploader | None:
    """The uploader for rows on ``device`` (``ZERO_STRATEGY_TEST_HOST_COPIES=deferred``:
    :class:`DeferredUpload`, for the tests); None: the plain step, nothing to overlap."""
    if os.environ.get("ZERO_STRATEGY_TEST_HOST_COPIES") == "deferred":
        return DeferredUpload()
    return StreamUpload(device) if overlapped(device) else None


class RowFeed:
    """How a ZeRO-3 unit's rows in host memory reach its gather's send buffer."""

    def run(
        self, buf: torch.Tensor, srcs: Sequence[torch.Tensor], fill: Callable[[], None], issue: Callable[[], Handle]
    ) -> tuple[Handle, Callable[[], None]]:
        """``fill`` copies ``srcs`` (the rows) into ``buf``, ``issue`` starts the collective that
        sends ``buf``; returns its handle, whose ``wait`` also orders the reader after the copy,
        and the host's fence: called before the host writes ``srcs`` again (or reuses their memory)."""
        handle, device_wait, fence = self._start(buf, srcs, fill, issue)
        handle.then(device_wait)
        return handle, fence

    def _start(
        self, buf: torch.Tensor, srcs: Sequence[torch.Tensor], fill: Callable[[], None], issue: Callable[[], Handle]
    ) -> tuple[Handle, Callable[[], None], Callable[[], None]]:
        """Issue the copy and the collective: their handle, the reader's wait, the host's fence."""
        raise NotImplementedError(f"{type(self).__name__}._start")


@dataclass(frozen=True)
class StreamFeed(_SideStream, RowFeed):
    """CUDA: the copy and the all-gather on a side stream of ``device``.

    Sync points, in order:

    1. At the gather's issue (the unit's own, or a prefetch in the previous unit's pre-hook):
       the side stream waits for the current stream, since ``buf`` (from the comm buffer pool)
       may still be read by kernels queued earlier, such as the last gather's unpack. That
       covers the kernels queued until now, not the current unit's compute, which is queued
       after the pre-hook returns, so the copy of the next unit runs beside it.
    2. On the side stream: the rows' copies (``non_blocking`` from pinned memory), then the
       all-gather, which NCCL orders after the side stream (the stream current at its issue),
       not after the compute stream. ``buf`` is recorded on the side stream
       (``Tensor.record_stream``) and an event is recorded after the issue.
    3. The reader: ``wait_unshard`` waits for the collective's work, which queues a wait of
       the compute stream on NCCL's stream (no host block) before the unpack, then a wait of
       the reader's stream on the copy's event (``Handle.then``). NCCL's stream already
       follows the side stream; a group of one rank issues no work, so this second wait is
       what orders its reader after the copy.
    4. The host's fence, ``event.synchronize()`` of the copy's event (normally long done),
       before the host writes the rows again: the engine calls it for every unit before the
       optimizer step and a checkpoint load (``ShardedParams.fence_rows``), and a unit before it
       writes pieces (``store_full``, ``pull_masters``, ``gathered_parameters(modifier_rank=...)``).
       Rows read from disk live in a reused slab: the slab is fenced before it is reused
       (``RowSwap.take``); one dropped for good needs no fence (the pinned allocator keeps it
       until its copies ran).

    Before this feed, the copy ran on the compute stream with ``non_blocking=False``: each
    gather of an offloaded unit blocked the host until everything queued had run."""

    def _start(
        self, buf: torch.Tensor, srcs: Sequence[torch.Tensor], fill: Callable[[], None], issue: Callable[[], Handle]
    ) -> tuple[Handle, Callable[[], None], Callable[[], None]]:
        side = self._side()
        side.wait_stream(torch.cuda.current_stream(self.device))  # sync point 1
        with torch.cuda.stream(side):
            fill()  # sync point 2
            out = issue()
        buf.record_stream(side)
        event = torch.cuda.Event()
        event.record(side)
        return out, lambda: torch.cuda.current_stream(self.device).wait_event(event), event.synchronize  # 3, 4


@dataclass
class DeferredFeed(RowFeed):
    """Tests on CPU: the copy runs at once, but stays pending until its fence is called or a
    later copy from the same memory supersedes it (on a GPU the side stream runs them in
    order); each gather, and the fence, raise if the host wrote a pending copy's rows, as it
    would have raced the copy engine on a GPU. A gather in a group of one rank (nothing in
    flight) shows its rows only when its handle is waited for: a reader that skips the wait
    reads bytes of all ones, as it could read the buffer before the side stream's copy."""

    _pending: dict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)

    @staticmethod
    def _check(entry: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        if any(not torch.equal(s.view(torch.uint8), t.view(torch.uint8)) for s, t in zip(*entry)):  # NaN-safe
            raise RuntimeError(
                "zero_strategy: the host wrote rows whose copy to the device was still pending (a missing "
                "fence before a host write: an engine bug, please report it)"
            )

    def _start(
        self, buf: torch.Tensor, srcs: Sequence[torch.Tensor], fill: Callable[[], None], issue: Callable[[], Handle]
    ) -> tuple[Handle, Callable[[], None], Callable[[], None]]:
        for entry in self._pending.values():
            self._check(entry)
        fill()
        out = issue()
        copied = buf.clone() if out.local else None  # no collective reads the buffer: the copy lands at the wait
        if copied is not None:
            buf.view(torch.uint8).fill_(255)

        def landed() -> None:
            if copied is not None:
                buf.copy_(copied)

        key = tuple(s.data_ptr() for s in srcs)  # a later copy from the same memory supersedes this one
        entry = self._pending[key] = (list(srcs), [s.detach().clone() for s in srcs])

        def fence() -> None:
            if self._pending.get(key) is entry:
                del self._pending[key]
                self._check(entry)

        return out, landed, fence

    @property
    def pending(self) -> int:
        return len(self._pending)


def choose_feed(device: torch.device) -> RowFeed | None:
    """The feed of offloaded rows into gathers on ``device`` (``ZERO_STRATEGY_TEST_HOST_COPIES=deferred``:
    :class:`DeferredFeed`, for the tests); None: copied on the current stream, nothing to overlap."""
    if os.environ.get("ZERO_STRATEGY_TEST_HOST_COPIES") == "deferred":
        return DeferredFeed()
    return StreamFeed(device) if overlapped(device) else None
