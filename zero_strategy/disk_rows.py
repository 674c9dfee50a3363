"""ZeRO-3 parameter rows on disk (``offload_param: {device: nvme}``, ZeRO-Infinity's parameter tier).

At ZeRO-3 each unit keeps one persistent row per rank: its pieces of the unit's trainable
parameters, and one of its frozen ones (``unit.py``). With the parameters on NVMe those rows
live in a swap file per unit and take no memory between uses. A row is *resident* (its
storage allocated and read back) only while something uses it:

- a gather copies it into the all-gather's send buffer;
- ``load_full``, ``gathered_parameters(modifier_rank=...)`` and, with host masters, the copy
  of the updated masters after a step write it (and it is written back at the end);
- with the optimizer state on NVMe too, the optimizer's master pieces are views of the row:
  the disk tier makes it resident around that unit's step, so between steps neither the
  parameters nor the masters nor the optimizer state take host memory (only the gradient
  shards do, until ``zero_grad``).

Residency is counted, so nested uses read and write once. Between uses the unit's row
attributes and master pieces are memory-less placeholders (a stray read gives NaN, a write
raises), as sharded full parameters are. Reads and writes go through one aligned buffer (``O_DIRECT`` where the filesystem
allows), in chunks of at most ``buffer_size`` elements, so that DeepSpeed's
``buffer_size: 1e9`` does not become gigabytes of buffer: the buffer is as large as the largest
row needs and no larger. Checkpoints read the rows through memory maps (:meth:`DiskRows.mapped`),
never all of them in memory at once.

Reads are synchronous, just before each gather is issued (the gather prefetch decides when);
reading ahead on a second buffer is left for later.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch

from zero_strategy.disk import ALIGN, DiskFile, SwapDir, aligned_empty, io_at

__all__ = ["DiskRows", "RowSwap"]


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class RowSwap:
    """What every unit's :class:`DiskRows` shares: the swap directory and the one I/O buffer."""

    def __init__(self, swap_dir: SwapDir, buffer_size: int, pinned: bool) -> None:
        self.dir = swap_dir
        self.buffer_size = buffer_size  # elements per chunk (DeepSpeed's offload_param.buffer_size)
        self.pinned = pinned
        self.files: list[DiskFile] = []
        self._buf: torch.Tensor | None = None
        self._finalizer = weakref.finalize(self, _close, self.files)

    def buffer(self, need: int) -> torch.Tensor:
        """The aligned I/O buffer, grown to at least ``need`` bytes (rounded to the block)."""
        need = _round_up(need)
        if self._buf is None or self._buf.numel() < need:
            self._buf = None  # the old one goes before the new one is made
            self._buf = aligned_empty(need, self.pinned)
        return self._buf

    def chunk_bytes(self, t: torch.Tensor) -> int:
        return _round_up(min(max(self.buffer_size, 1) * t.element_size(), t.numel() * t.element_size()))

    @property
    def buffer_bytes(self) -> int:
        return self._buf.numel() if self._buf is not None else 0

    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def close(self) -> None:
        """Close and delete the files (the engine removes the directory)."""
        self._finalizer()
        self._buf = None


def _close(files: list[DiskFile]) -> None:
    for f in files:
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(f.path)
    files.clear()


class DiskRows:
    """One unit's rows kept in one swap file. Built from the filled rows: writes them; the
    caller drops its references, so their memory goes. ``attach(tensors)`` runs when the rows
    are read back (the unit points its row attributes and master pieces at them) and
    ``detach()`` before they go again (the unit points them at memory-less placeholders, so a
    stray read gives NaN and a write raises instead of touching freed memory)."""

    def __init__(
        self,
        swap: RowSwap,
        name: str,
        tensors: Sequence[torch.Tensor],
        attach: Callable[[list[torch.Tensor]], None],
        detach: Callable[[], None],
    ) -> None:
        self.swap = swap
        self.name = name
        self.specs = [(t.numel(), t.dtype) for t in tensors]
        self.attach, self.detach = attach, detach
        self.offsets: list[int] = []
        self.nbytes: list[int] = []
        offset = 0
        for t in tensors:
            self.offsets.append(offset)
            self.nbytes.append(t.numel() * t.element_size())
            offset += _round_up(self.nbytes[-1])
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:80]
        path = os.path.join(swap.dir.path, f"rows{len(swap.files)}-{safe}.swap")
        self.file = DiskFile(path, offset, swap.dir.direct)
        swap.files.append(self.file)
        swap.dir.reserve(self.file)
        self.users = 0
        self.dirty = False
        self.tensors: list[torch.Tensor] | None = None
        self._move(list(tensors), reading=False)

    @contextlib.contextmanager
    def resident(self, *, write: bool = False) -> Iterator[list[torch.Tensor]]:
        """The rows in memory inside the block; with ``write``, what the block changed is
        written back when the last user leaves."""
        if self.users == 0:
            self._load()
        if self.tensors is None:
            raise AssertionError(f"the rows of {self.name} were not loaded (an engine bug)")
        tensors = self.tensors
        self.users += 1
        try:
            yield tensors
        finally:
            self.users -= 1
            self.dirty = self.dirty or write
            if self.users == 0:
                try:
                    if self.dirty:
                        self._move(tensors, reading=False)
                finally:
                    self.dirty = False
                    self.detach()
                    self.tensors = None

    @contextlib.contextmanager
    def mapped(self, *, writable: bool) -> Iterator[list[torch.Tensor]]:
        """The rows as memory maps of the file: a checkpoint reads (or, ``writable``, loads
        into) them without holding them in memory."""
        if self.users:
            raise RuntimeError(f"the rows of {self.name} are in use; checkpoints map them between steps")
        self.file.check_size()
        whole = torch.from_file(self.file.path, shared=writable, size=self.file.nbytes, dtype=torch.uint8)
        yield [whole[o : o + n].view(d) for (_, d), o, n in zip(self.specs, self.offsets, self.nbytes)]

    def _load(self) -> None:
        self.file.check_size()
        pinned = self.swap.pinned
        tensors = [torch.empty(n, dtype=d, pin_memory=pinned) for n, d in self.specs]
        self._move(tensors, reading=True)
        self.tensors = tensors
        self.attach(tensors)

    def _move(self, tensors: Sequence[torch.Tensor], *, reading: bool) -> None:
        fn = os.preadv if reading else os.pwritev
        what = f"{'read' if reading else 'write'} of {self.file.path}"
        for t, off, n in zip(tensors, self.offsets, self.nbytes):
            if n == 0:
                continue
            chunk = self.swap.chunk_bytes(t)
            buf = self.swap.buffer(chunk)
            data = t.view(-1).view(torch.uint8)
            for pos in range(0, n, chunk):
                m = min(chunk, n - pos)
                length = _round_up(m)
                if reading:
                    io_at(fn, self.file.fd, buf[:length], off + pos, what)
                    data[pos : pos + m].copy_(buf[:m])
                else:
                    buf[:m].copy_(data[pos : pos + m])
                    io_at(fn, self.file.fd, buf[:length], off + pos, what)
