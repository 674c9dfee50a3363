"""Reduced gradient shards to the host without a blocking copy per bucket.

With the optimizer offloaded (``offload_optimizer: {device: cpu}``) each group's masters,
gradient shard and optimizer state live in host memory, while its gradients are reduced on the
GPU. A plain ``scratch.to("cpu")`` after each bucket's reduce-scatter is a synchronous copy:
the CPU stops launching kernels until the GPU has reached that point of the stream, so the
backward's next kernels start only once the CPU is released again, bucket after bucket.

Here the copy of a reduced bucket goes into pinned host memory with ``non_blocking=True`` on
the stream that produced it, and a CUDA event is recorded after it. The CPU goes on launching
the backward. What the host does with the bytes (copy them into the group's gradient shard, or
add them to it during accumulation) waits for that event, and happens only where a host reader
needs them: :meth:`HostCopies.drain`, called by the reducer's ``wait_all`` (the end of every
synchronising backward, the step's ``finalize``, ``zero_grad``), in the order the copies were
issued. So the CPU waits once per backward, for the last bucket's copy, not once per bucket.

Sync points (CUDA), in order:

1. ``handle.wait()`` of the reduce-scatter: makes the current stream wait for NCCL's (no host
   block); the scaling and the copy are queued after it.
2. ``host.copy_(device, non_blocking=True)`` into pinned memory, then ``event.record()``: both
   queued, nothing blocks.
3. The device bucket goes back to the buffer pool at once. The next user of that memory is a
   kernel or collective queued later on the same stream (a collective waits for the current
   stream before it starts), so the copy has read it before it is overwritten.
4. ``drain``: ``event.synchronize()`` per pending copy (the CPU waits for the GPU to reach it),
   then the host add or copy. Reading a gradient shard before ``drain`` would read stale bytes;
   every reader goes through the reducer's ``wait_all`` first.

A fresh shard (the first reduction of a window) is copied straight into the group's pinned
gradient shard; a later one of the same window goes to a pinned staging buffer of the group's
size (one per group, kept for reuse) and is added at ``drain``. The values are those of the
blocking copy: the same bytes, added in the same order.

The policy is chosen by type (:func:`choose`): :class:`StreamCopy` on CUDA; ``None`` (the
blocking path of ``grads.py``) where the gradients are reduced in host memory already.
:class:`DeferredCopy` is the tests' stand-in on CPU: it reads the source when the copy is
issued and writes the destination only when waited for, so a reader that skips ``drain`` sees
stale values and a parity test fails.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zero_strategy.sharding.group import ShardGroup
from zero_strategy.storage.uploads import overlapped

__all__ = ["DeferredCopy", "HostCopies", "StreamCopy", "choose"]


class Copier:
    """How a device tensor's bytes reach host memory: ``start`` issues the copy and returns a
    ``wait`` that returns once ``dst`` holds them."""

    def handles(self, g: ShardGroup, reduced: torch.Tensor) -> bool:
        """Whether ``g``'s reduced shard goes to the host through this path."""
        return g.master_device.type == "cpu" and reduced.device != g.master_device

    def start(self, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        raise NotImplementedError

    def host_buffer(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=like.dtype)


@dataclass(frozen=True)
class StreamCopy(Copier):
    """CUDA: a non-blocking copy into pinned memory on the current stream, and an event."""

    def start(self, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(src.device))
        return event.synchronize

    def host_buffer(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=like.dtype, pin_memory=True)


@dataclass(frozen=True)
class DeferredCopy(Copier):
    """Tests on CPU: the source is read when the copy is issued (as a stream reads it before
    the memory is reused), the destination written only at ``wait``."""

    def handles(self, g: ShardGroup, reduced: torch.Tensor) -> bool:
        return g.tier == "host"  # on CPU the shard is in host memory already: the path is taken to test it

    def start(self, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        taken = src.detach().clone()

        def wait() -> None:
            dst.copy_(taken)

        return wait


def choose(reduce_device: torch.device) -> Copier | None:
    """The copier for gradients reduced on ``reduce_device`` whose shards live on the host
    (``ZERO_STRATEGY_TEST_HOST_COPIES=deferred``: :class:`DeferredCopy`, for the tests)."""
    if os.environ.get("ZERO_STRATEGY_TEST_HOST_COPIES") == "deferred":
        return DeferredCopy()
    return StreamCopy() if overlapped(reduce_device) else None  # ZERO_STRATEGY_OFFLOAD_OVERLAP=0: blocking


@dataclass
class _Pending:
    group: ShardGroup
    wait: Callable[[], None]
    staging: torch.Tensor | None  # None: copied straight into the group's gradient shard


@dataclass
class HostCopies:
    """The host copies issued and not yet applied, in issue order."""

    copier: Copier
    _pending: deque[_Pending] = field(default_factory=deque)
    _staging: dict[int, torch.Tensor] = field(default_factory=dict)

    def handles(self, g: ShardGroup, reduced: torch.Tensor) -> bool:
        """Whether the shard ``reduced`` of ``g`` goes to the host through this path."""
        return self.copier.handles(g, reduced)

    def start(self, g: ShardGroup, reduced: torch.Tensor) -> None:
        """Issue the copy of ``reduced`` (already scaled, in the master dtype, on the device)
        into ``g``'s gradient shard: straight in when the window's first, else to staging."""
        if not g.grad_valid:
            wait = self.copier.start(g.grad_shard, reduced)
            self._pending.append(_Pending(g, wait, None))
            g.grad_valid = True
            return
        if any(p.group is g and p.staging is not None for p in self._pending):
            self.drain()  # its staging buffer is still to be added: a second late reduction of g
        staging = self._staging.get(g.index)
        if staging is None or staging.numel() != reduced.numel():
            staging = self._staging[g.index] = self.copier.host_buffer(reduced, reduced.numel())
        self._pending.append(_Pending(g, self.copier.start(staging, reduced), staging))

    def drain(self) -> None:
        """Wait for every pending copy, in issue order, and add the staged ones."""
        while self._pending:
            p = self._pending.popleft()
            p.wait()
            if p.staging is not None:
                p.group.grad_shard.add_(p.staging)

    @property
    def pending(self) -> int:
        return len(self._pending)
