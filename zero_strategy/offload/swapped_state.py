"""Optimizer state on disk, stepped group by group (``offload_optimizer: {device: nvme}``).

The user's optimizer stays the one they built. At each step the engine hands it one shard
group at a time: the group's state is read from its swap file into an aligned buffer, installed
in ``optimizer.state`` as views of that buffer, the optimizer steps only that group's master
pieces (its ``param_groups`` are narrowed for the call; hyperparameters and LR schedules are
the group's own), and the buffer is written back while the next group steps. What steps a
group is the update of the optimizer's most basic class (:func:`base_step`: torch's ``AdamW``
under a user's subclass of it), so a subclass's own ``step`` code runs once per step, not
once per group. Between steps
``optimizer.state`` keeps only the small entries (Adam's ``step``); the per-element tensors are
on disk. Element-wise optimizers give the same numbers stepped in pieces as whole, so the
result is DDP's.

Which state entries are per-element, and their dtypes, is learnt once, before the first step,
by stepping a tiny probe parameter through the same optimizer and param group; the files are
sized from that and the free disk space checked before anything is written.

Checkpoints read and write the state through memory maps of the files (:meth:`mapped_state`),
so saving or loading offloaded state never holds it all in memory.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, cast

import torch

from zero_strategy._swap import original_class
from zero_strategy.sharding.group import ShardGroup
from zero_strategy.storage.disk import ALIGN, DiskFile, Region, SwapDir, SwapPool, views, wait_io

__all__ = ["SwappedOptimizerState", "base_step", "step_subset"]


def _unhooked(fn: Any) -> Any:
    """``fn`` without torch's step-hook wrapper: ``torch.optim.Optimizer`` wraps the ``step`` of
    each optimizer class it builds, once, in a function that runs the step hooks."""
    while getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def base_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any]:
    """The update that the disk tier runs group by group: the ``step`` of the most basic class
    of ``optimizer`` that defines one (torch's ``AdamW`` under a user's subclass of it; the
    user's own class when it derives from ``torch.optim.Optimizer`` directly), without the hook
    wrapper. A subclass's ``step`` on top of it is not run per group: its own code (a counter,
    an EMA after ``super().step()``) runs once, in the user's ``step()`` call, around the whole
    step. A subclass ``step`` that does not call ``super().step()`` replaces the update, so it
    cannot be split this way: refused, naming it."""
    cls = original_class(optimizer)  # the user's class, not the swapped one
    steps: list[Any] = []  # distinct step functions, most derived first
    for klass in cls.__mro__:
        fn = vars(klass).get("step")
        if fn is None or klass is torch.optim.Optimizer:
            continue
        fn = _unhooked(fn)
        if fn not in steps:
            steps.append(fn)
    if not steps:
        raise TypeError(
            f"offload_optimizer nvme: {cls.__name__} defines no step() of its own; use offload_optimizer device 'cpu'"
        )
    base, *_ = reversed(steps)
    for fn in steps[:-1]:
        code = getattr(inspect.unwrap(fn), "__code__", None)
        if code is None or not {"super", "step"} & set(code.co_names):
            raise TypeError(
                f"offload_optimizer nvme: {fn.__qualname__} does not call super().step(), so it replaces "
                f"{base.__qualname__}; the disk tier steps the base class's update group by group and runs a "
                "subclass's own step code once per step. Call super().step() in it, or use offload_optimizer "
                "device 'cpu'"
            )
    return cast(Callable[[torch.optim.Optimizer], Any], base)


def unhooked_step(optimizer: torch.optim.Optimizer) -> None:
    """The base class's update (:func:`base_step`) over the current param groups, without the
    step hooks (the engine's, the user's, the global ones): a user's hook or subclass code (an
    EMA update, a logger) runs once per step, around the whole step, as without offload."""
    base_step(optimizer)(optimizer)


@contextlib.contextmanager
def narrowed(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Inside the block every param group of ``optimizer`` holds only its members of ``params``
    (the same group dicts: hyperparameters, LR schedules); the full lists come back after."""
    ids = {id(p) for p in params}
    saved = [pg["params"] for pg in optimizer.param_groups]
    try:
        for pg, full in zip(optimizer.param_groups, saved):
            pg["params"] = [p for p in full if id(p) in ids]
        yield
    finally:
        for pg, full in zip(optimizer.param_groups, saved):
            pg["params"] = full


def step_subset(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """One step of ``optimizer`` over ``params`` only (see :func:`narrowed`), without hooks."""
    with narrowed(optimizer, params):
        unhooked_step(optimizer)


class SwappedOptimizerState:
    """The swap files, buffers and step pipeline of the groups whose state is on disk."""

    def __init__(
        self,
        groups: Sequence[ShardGroup],
        swap_dir: SwapDir,
        buffer_count: int,
        pinned: bool,
        guard: Callable[[], contextlib.AbstractContextManager[None]],
        threads: int = 4,
    ) -> None:
        self.groups = list(groups)
        self.guard = guard  # around every step made here: the engine's step hooks stand aside
        self.dir = swap_dir
        self.buffer_count = buffer_count
        self.pinned = pinned
        self.threads = threads
        self.files: dict[int, DiskFile] = {}  # group index -> its file (after planning)
        self.keys: dict[tuple[int, torch.dtype], list[tuple[str, torch.dtype]]] = {}  # (param group, dtype) -> keys
        self.layout: dict[int, list[tuple[int, list[Region]]]] = {}  # group index -> (master index, its regions)
        self.has_state: set[int] = set()  # masters whose state is in their file (they were stepped or loaded)
        self.pool: SwapPool | None = None
        self._finalizer = weakref.finalize(self, _close, self.files, [None])

    # -- planning (once, before the first step) ----------------------------------------------
    def _param_group_of(self, optimizer: torch.optim.Optimizer) -> dict[int, int]:
        return {id(p): gi for gi, pg in enumerate(optimizer.param_groups) for p in pg["params"]}

    def _probe(self, optimizer: torch.optim.Optimizer, gi: int, dtype: torch.dtype) -> list[tuple[str, torch.dtype]]:
        """The per-element state entries ``optimizer`` makes for param group ``gi`` and masters of
        ``dtype``: one step of a tiny parameter through that group (its hyperparameters), then
        forgotten. An optimizer whose step changes its param group (schedule-free AdamW's
        ``k``, D-Adaptation's ``d``) keeps state per group, which stepping in pieces would
        advance once per piece: refused."""
        probe = torch.nn.Parameter(torch.zeros(8, dtype=dtype))
        probe.grad = torch.full((8,), 1e-3, dtype=dtype)
        group = optimizer.param_groups[gi]
        before = {k: _snapshot(v) for k, v in group.items() if k != "params"}
        saved = [pg["params"] for pg in optimizer.param_groups]
        try:
            for pg in optimizer.param_groups:
                pg["params"] = []
            group["params"] = [probe]
            with self.guard():
                unhooked_step(optimizer)
            changed = [k for k in group if k != "params" and (k not in before or not _same(before[k], group[k]))]
        finally:
            for pg, full in zip(optimizer.param_groups, saved):
                pg["params"] = full
            for k in [k for k in group if k != "params" and k not in before]:  # the probe leaves no trace
                del group[k]
            for k, v in before.items():
                if not _same(v, group.get(k)):
                    group[k] = v
            state = optimizer.state.pop(probe, {})
        if changed:
            raise ValueError(
                f"offload_optimizer nvme: {type(optimizer).__name__}.step() changes its param group's {changed} "
                "(state kept per group), but the disk tier steps each group of parameters separately, which would "
                "advance it once per piece; use offload_optimizer device 'cpu' with this optimizer"
            )
        return [(k, v.dtype) for k, v in state.items() if _per_element(k, v, probe)]

    def plan(self, optimizer: torch.optim.Optimizer) -> None:
        """Size every group's file from the probed state entries, check the free space, create
        the files and the buffer pool. Idempotent."""
        if self.pool is not None:
            return
        where = self._param_group_of(optimizer)
        layouts: list[tuple[ShardGroup, list[tuple[int, list[Region]]]]] = []
        for g in self.groups:
            per_master: list[tuple[int, list[Region]]] = []
            offset = 0
            for i, m in enumerate(g.masters):
                gi = where.get(id(m))
                if gi is None:
                    continue  # not given to the optimizer: no state
                if (gi, m.dtype) not in self.keys:
                    self.keys[(gi, m.dtype)] = self._probe(optimizer, gi, m.dtype)
                regions = []
                for key, dtype in self.keys[(gi, m.dtype)]:
                    r = Region(key, offset, m.numel(), dtype)
                    regions.append(r)
                    offset += _align(r.nbytes)
                per_master.append((i, regions))
            layouts.append((g, per_master))
        need = sum(_file_bytes(pm) for _, pm in layouts)
        self.dir.check_space(need)
        biggest = 0
        try:
            for g, per_master in layouts:
                f = DiskFile(
                    os.path.join(self.dir.path, f"group{g.index}.swap"), _file_bytes(per_master), self.dir.direct
                )
                self.files[g.index] = f
                self.layout[g.index] = per_master
                biggest = max(biggest, f.nbytes)
                self.dir.reserve(f)  # the space is taken now: a full disk fails here, not mid-step
        except BaseException:
            _close(self.files, [None])
            self.files.clear()
            self.layout.clear()
            raise
        count = max(min(self.buffer_count, 3), 2)
        self.pool = SwapPool(count, biggest, self.pinned, self.threads)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close, self.files, [self.pool])

    # -- the step --------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, inner: Callable[[ShardGroup], None]) -> None:
        """Step every disk group through ``inner(group)`` (the optimizer over its masters),
        pipelined: read the next group while this one steps, write it back while the next
        steps. A group without any gradient is neither read nor stepped."""
        self.plan(optimizer)
        if self.pool is None:
            raise AssertionError("SwappedOptimizerState.plan left no pool")
        pool = self.pool  # the directory's owner was checked by the caller (DiskTier)
        todo = [g for g in self.groups if any(m.grad is not None for m in g.masters) and g.index in self.files]
        reads: dict[int, tuple[torch.Tensor, Future[None] | None]] = {}
        writes: list[tuple[Future[None], torch.Tensor]] = []
        current: ShardGroup | None = None

        def start_read(g: ShardGroup) -> None:
            f = self.files[g.index]
            buf = pool.get()
            fut = None
            try:
                fut = pool.read(f, buf) if f.written else None
            finally:
                reads[g.index] = (buf, fut)  # owned from here, whatever happens

        try:
            if todo:
                start_read(todo[0])
            for k, g in enumerate(todo):
                while len(writes) > max(pool.count - 2, 0):  # a buffer for the next read
                    wfut, wbuf = writes[0]
                    wait_io(wfut)
                    writes.pop(0)
                    pool.put(wbuf)
                if k + 1 < len(todo):
                    start_read(todo[k + 1])
                buf, rfut = reads[g.index]
                if rfut is not None:
                    wait_io(rfut)
                f = self.files[g.index]
                current = g
                self._install(optimizer, g, buf, fresh=not f.written)
                with self.guard():
                    inner(g)
                self._take_back(optimizer, g, buf)
                current = None
                wfut = pool.write(f, buf)
                del reads[g.index]
                writes.append((wfut, buf))
            while writes:
                wfut, wbuf = writes[0]
                wait_io(wfut)
                writes.pop(0)
                pool.put(wbuf)
        finally:
            if current is not None:  # an error while it stepped: no view of a returned buffer stays behind
                self._drop_views(optimizer, current)
            for buf, rfut in reads.values():  # let every read and write finish before its buffer goes back
                if rfut is not None:
                    with contextlib.suppress(Exception):
                        rfut.result()
                pool.put(buf)
            for wfut, wbuf in writes:
                with contextlib.suppress(Exception):
                    wfut.result()
                pool.put(wbuf)

    def _install(self, optimizer: torch.optim.Optimizer, g: ShardGroup, buf: torch.Tensor, *, fresh: bool) -> None:
        if fresh:
            return  # no state yet: the optimizer makes it in this step; _take_back copies it in
        for m, regions in self._regions(g):
            if id(m) not in self.has_state:
                continue  # never stepped (no gradient yet): the optimizer starts its state afresh
            st = optimizer.state[m]
            for r, view in views(buf, regions):
                st[r.key] = view.view(m.shape)

    def _drop_views(self, optimizer: torch.optim.Optimizer, g: ShardGroup) -> None:
        for m, regions in self._regions(g):
            st = optimizer.state.get(m)
            if st is not None:
                for r in regions:
                    st.pop(r.key, None)

    def _take_back(self, optimizer: torch.optim.Optimizer, g: ShardGroup, buf: torch.Tensor) -> None:
        """Copy state the optimizer made (first step) into the buffer and drop the per-element
        entries from ``optimizer.state``: until the next step they are only on disk."""
        for m, regions in self._regions(g):
            st = optimizer.state.get(m)
            if st is None or not any(r.key in st for r in regions):
                continue  # not stepped (no gradient): its region stays as it was
            for r, view in views(buf, regions):
                t = st.pop(r.key, None)
                if t is None:
                    view.zero_()
                elif t.data_ptr() != view.data_ptr():
                    view.copy_(t.reshape(-1))
            self.has_state.add(id(m))

    def _regions(self, g: ShardGroup) -> list[tuple[torch.Tensor, list[Region]]]:
        return [(g.masters[i], regions) for i, regions in self.layout.get(g.index, [])]

    # -- checkpoints and stats -----------------------------------------------------------------
    @contextlib.contextmanager
    def mapped_state(
        self, optimizer: torch.optim.Optimizer, *, writable: bool
    ) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
        """Per master (by id), its per-element state as memory maps of the files: a checkpoint
        reads (or, ``writable``, loads into) them without holding the state in memory. Reading
        gives the masters that have state; loading offers every master, and the masters whose
        entries the caller leaves in the dict count as loaded when the block ends."""
        self.plan(optimizer)  # the directory's owner was checked by the caller (DiskTier)
        out: dict[int, dict[str, torch.Tensor]] = {}
        maps = []
        for g in self.groups:
            f = self.files.get(g.index)
            if f is None or f.nbytes == 0:
                continue
            f.check_size()
            masters = [(m, rs) for m, rs in self._regions(g) if writable or id(m) in self.has_state]
            if not masters:
                continue  # no state yet (no step ran): nothing to save, as for an unstepped optimizer
            whole = torch.from_file(f.path, shared=writable, size=f.nbytes, dtype=torch.uint8)
            maps.append(whole)
            for m, regions in masters:
                out[id(m)] = {r.key: v.view(m.shape) for r, v in views(whole, regions)}
            if writable:
                f.written = True
        try:
            yield out
            if writable:
                self.has_state.update(k for k, entries in out.items() if entries)
        finally:
            out.clear()
            maps.clear()

    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    def buffer_bytes(self) -> int:
        return self.pool.allocated if self.pool is not None else 0

    def close(self) -> None:
        """Stop the I/O threads, close and delete the files (the engine removes the directory)."""
        self._finalizer()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _per_element(key: str, value: Any, probe: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == probe.shape


def _file_bytes(per_master: Sequence[tuple[int, list[Region]]]) -> int:
    regions = [r for _, rs in per_master for r in rs]
    return _align(regions[-1].offset + regions[-1].nbytes) if regions else 0


def _close(files: dict[int, DiskFile], pools: list[SwapPool | None]) -> None:
    for pool in pools:
        if pool is not None:
            pool.shutdown()
    for f in files.values():
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(f.path)


def _snapshot(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return copy.deepcopy(v)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # values without a plain equality: treat as unchanged only if the same object
        return a is b
