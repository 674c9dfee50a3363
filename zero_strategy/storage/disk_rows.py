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
raises), as sharded full parameters are. Reads and writes go (``O_DIRECT`` where the
filesystem allows) straight between the file and an aligned slab that the rows live in while
resident: no bounce buffer, and no allocation per read (slabs are reused). Each call moves at
most ``buffer_size`` elements, and DeepSpeed's ``buffer_size: 1e9`` does not become gigabytes of
buffer: a slab is as large as one unit's rows. Checkpoints read the rows through memory maps
(:meth:`DiskRows.mapped`), never all of them in memory at once.

Reading ahead: when the ZeRO-3 scheduler prefetches gathers, it also asks the next unit's
rows to be read in the background (:meth:`DiskRows.read_ahead`): one reader thread per engine
(``os.preadv`` releases the GIL, so the read runs while the current unit computes). The unit's
gather then finds its rows read (``resident`` waits for the read if it is still running) and
issues at once. A read ahead that nothing uses is dropped at the end of the step
(:meth:`RowSwap.drop_ahead`), and before a checkpoint maps the file. All writes run on the
caller's thread and only while the rows are resident, which a pending read ahead never is, so a
read ahead never races a write of its file. It costs one more slab of the unit's size
(``swap_buffers``). ``ZERO_STRATEGY_DISK_READ_AHEAD=0`` turns it off (to measure it).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zero_strategy.storage.disk import ALIGN, DiskFile, SwapDir, aligned_empty, io_at

__all__ = ["DiskRows", "RowSwap"]


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class RowSwap:
    """What every unit's :class:`DiskRows` shares: the swap directory and the aligned slabs that
    resident rows live in (reused, so that reading a unit back does not allocate)."""

    KEEP = 2  # free slabs kept for reuse

    def __init__(self, swap_dir: SwapDir, buffer_size: int, pinned: bool) -> None:
        self.dir = swap_dir
        self.buffer_size = buffer_size  # elements per read or write (DeepSpeed's offload_param.buffer_size)
        self.pinned = pinned
        self.files: list[DiskFile] = []
        self._free: list[tuple[torch.Tensor, Callable[[], None] | None]] = []  # with the fence of a copy reading it
        self.allocated = 0  # bytes of all slabs alive, in use or free
        self.read_ahead = os.environ.get("ZERO_STRATEGY_DISK_READ_AHEAD", "1") != "0"
        self._reader: ThreadPoolExecutor | None = None
        self.ahead: list[DiskRows] = []  # rows with a read ahead pending or done, not yet used
        self.reads = {"ahead": 0, "inline": 0}  # reads of rows: in the background, or on the caller's thread
        self._finalizer = weakref.finalize(self, _close, self.files)

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_strategy-disk-read")
        return self._reader.submit(fn)

    def drop_ahead(self) -> None:
        """Drop every read ahead that was not used (waiting for those still running)."""
        for rows in list(self.ahead):
            rows.drop_ahead()

    def take(self, nbytes: int) -> torch.Tensor:
        """An aligned uint8 slab of at least ``nbytes`` (block-rounded)."""
        need = _round_up(nbytes)
        for k, (slab, fence) in enumerate(self._free):
            if slab.numel() >= need:
                del self._free[k]
                if fence is not None:  # a gather's copy may still read it (storage/uploads.py)
                    fence()
                return slab
        if self._free:  # too small: the largest free one goes before a larger one is made
            self.allocated -= self._free.pop()[0].numel()
        slab = aligned_empty(need, self.pinned)
        self.allocated += slab.numel()
        return slab

    def give(self, slab: torch.Tensor, fence: Callable[[], None] | None = None) -> None:
        """``slab`` is free; ``fence``: to call before it is written again (a copy may read it).
        A slab dropped for good needs none: the pinned allocator keeps it until its copies ran."""
        self._free.append((slab, fence))
        self._free.sort(key=lambda t: t[0].numel())
        while len(self._free) > self.KEEP:
            self.allocated -= self._free.pop(0)[0].numel()

    def chunk_bytes(self) -> int:
        """Bytes per read or write call: ``buffer_size`` fp32 elements, block-rounded."""
        return _round_up(max(self.buffer_size, 1) * 4)

    @property
    def buffer_bytes(self) -> int:
        return self.allocated

    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def close(self) -> None:
        """Close and delete the files (the engine removes the directory)."""
        self.drop_ahead()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self._finalizer()
        self._free.clear()
        self.allocated = 0


def _close(files: list[DiskFile]) -> None:
    for f in files:
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(f.path)
    files.clear()


class DiskRows:
    """One unit's rows kept in one swap file, laid out as in the slab they are read into (each
    row at a block-aligned offset). Built from the filled rows: writes them; the caller drops
    its references, so their memory goes. ``attach(tensors)`` runs when the rows are read back
    (the unit points its row attributes and master pieces at them) and ``detach()`` before they
    go again (the unit points them at memory-less placeholders, so a stray read gives NaN and a
    write raises instead of touching freed memory)."""

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
        self._slab: torch.Tensor | None = None
        self._fence: Callable[[], None] | None = None  # a copy reading the resident slab (storage/uploads.py)
        self._ahead: tuple[torch.Tensor, Future[None]] | None = None  # a read ahead: its slab and its read
        slab = swap.take(self.file.nbytes)
        try:
            for view, t in zip(self._views(slab), tensors):
                view.copy_(t.reshape(-1))
            self._io(slab, reading=False)
        finally:
            swap.give(slab)

    def _views(self, slab: torch.Tensor) -> list[torch.Tensor]:
        return [slab[o : o + n].view(d) for (_, d), o, n in zip(self.specs, self.offsets, self.nbytes)]

    @contextlib.contextmanager
    def resident(self, *, write: bool = False, overwrite: int | None = None) -> Iterator[list[torch.Tensor]]:
        """The rows in memory inside the block; with ``write``, what the block changed is
        written back when the last user leaves. ``overwrite``: the index of a row the block
        writes whole, which is then not read (it starts zeroed)."""
        if self.users == 0:
            slab = self._take_read(overwrite)
            try:
                self._slab = slab
                self.attach(self._views(slab))
            except BaseException:
                self._slab = None
                self.swap.give(slab)
                raise
        current = self._slab
        if current is None:
            raise AssertionError(f"the rows of {self.name} were not loaded (an engine bug)")
        self.users += 1
        try:
            yield self._views(current)
        finally:
            self.users -= 1
            self.dirty = self.dirty or write
            if self.users == 0:
                try:
                    if self.dirty:
                        self._io(current, reading=False)
                finally:
                    self.dirty = False
                    self.detach()
                    self._slab, fence, self._fence = None, self._fence, None
                    self.swap.give(current, fence)

    def fence(self, fence: Callable[[], None]) -> None:
        """A copy reading the resident rows was issued: their slab is not written again before ``fence``."""
        self._fence = fence

    def read_ahead(self) -> None:
        """Start reading the rows in the background, unless they are in memory or on their way."""
        if not self.swap.read_ahead or self.users or self._ahead is not None:
            return
        self.file.check_size()
        slab = self.swap.take(self.file.nbytes)
        self._ahead = (slab, self.swap.submit(lambda: self._io(slab, reading=True)))
        self.swap.ahead.append(self)
        self.swap.reads["ahead"] += 1

    def _finish_ahead(self) -> torch.Tensor | None:
        """The read ahead's slab once its read is done (None: no read ahead); a failed read gives
        its slab back and raises."""
        if self._ahead is None:
            return None
        slab, read = self._ahead
        self._ahead = None
        self.swap.ahead.remove(self)
        try:
            read.result()
        except BaseException:
            self.swap.give(slab)
            raise
        return slab

    def drop_ahead(self) -> None:
        """Forget a read ahead (waiting for it if it still runs): its slab goes back."""
        try:
            slab = self._finish_ahead()
        except OSError:
            return  # its error is the next (inline) read's to raise
        if slab is not None:
            self.swap.give(slab)

    def _take_read(self, overwrite: int | None) -> torch.Tensor:
        """A slab holding the rows: the read ahead's (waited for), or read now."""
        slab = self._finish_ahead()
        if slab is not None:
            if overwrite is not None:  # written whole by the caller: starts zeroed, as an inline read leaves it
                lo = self.offsets[overwrite]
                slab[lo : lo + _round_up(self.nbytes[overwrite])].zero_()
            return slab
        self.file.check_size()
        slab = self.swap.take(self.file.nbytes)
        try:
            self._read(slab, skip=overwrite)
        except BaseException:
            self.swap.give(slab)
            raise
        self.swap.reads["inline"] += 1
        return slab

    def _read(self, slab: torch.Tensor, *, skip: int | None) -> None:
        """The file into ``slab``, except row ``skip`` (zeroed instead: its padding stays zero)."""
        if skip is None:
            self._io(slab, reading=True)
            return
        lo, hi = self.offsets[skip], self.offsets[skip] + _round_up(self.nbytes[skip])
        slab[lo:hi].zero_()
        self._io(slab, reading=True, ranges=[(0, lo), (hi, self.file.nbytes)])

    @contextlib.contextmanager
    def mapped(self, *, writable: bool) -> Iterator[list[torch.Tensor]]:
        """The rows as memory maps of the file: a checkpoint reads (or, ``writable``, loads
        into) them without holding them in memory."""
        if self.users:
            raise RuntimeError(f"the rows of {self.name} are in use; checkpoints map them between steps")
        self.drop_ahead()
        self.file.check_size()
        whole = torch.from_file(self.file.path, shared=writable, size=self.file.nbytes, dtype=torch.uint8)
        yield self._views(whole)

    def _io(self, slab: torch.Tensor, *, reading: bool, ranges: Sequence[tuple[int, int]] | None = None) -> None:
        """The file (or its block-aligned byte ``ranges``) to or from ``slab`` (aligned:
        ``O_DIRECT`` reads straight into it), in calls of at most ``buffer_size`` elements."""
        fn = os.preadv if reading else os.pwritev
        what = f"{'read' if reading else 'write'} of {self.file.path}"
        chunk = self.swap.chunk_bytes()
        for start, end in ranges if ranges is not None else [(0, self.file.nbytes)]:
            for pos in range(start, end, chunk):
                io_at(fn, self.file.fd, slab[pos : min(pos + chunk, end)], pos, what)
