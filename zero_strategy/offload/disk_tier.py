"""The engine's disk tier: what ``offload_optimizer`` and ``offload_param`` with ``device: nvme``
put in swap files, in one place.

- The optimizer state (``swapped_state.py``): stepped group by group, pipelined through a few
  aligned buffers, before the optimizer's own step; every rank agrees on the outcome.
- ZeRO-3's parameter rows (``disk_rows.py``): read back for each gather, load and step.
  With both on disk, the masters are views of the rows, and each group's step runs with its
  unit's rows resident.

Each kind gets its own swap directory (``disk.py``: per user, per process, removed at exit,
cleaned after a killed run), made when the engine is built, before the model changes, so an
unusable ``nvme_path`` fails first. Checkpoints read and write both through memory maps of the
files (:meth:`DiskTier.mapped`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch

from zero_strategy.comm import collectives as C
from zero_strategy.offload.swapped_state import SwappedOptimizerState, step_subset
from zero_strategy.sharding.group import ShardGroup
from zero_strategy.storage.disk import SwapDir
from zero_strategy.storage.disk_rows import RowSwap
from zero_strategy.storage.offload import OffloadPolicy, OnDisk

__all__ = ["DiskTier"]

Resident = Callable[[ShardGroup], contextlib.AbstractContextManager[object]]


class DiskTier:
    """The swap directories and files of one engine (none when nothing is on disk)."""

    def __init__(self, optimizer: OffloadPolicy, params: OffloadPolicy, ctx: C.CommContext) -> None:
        self.ctx = ctx
        self.optimizer_policy = optimizer
        self.dirs: list[SwapDir] = []
        self.opt_dir = self._dir(optimizer, "offload_optimizer")
        self.row_swap: RowSwap | None = None
        param_dir = self._dir(params, "offload_param")
        if param_dir is not None and isinstance(params, OnDisk):
            self.row_swap = RowSwap(param_dir, params.buffer_size, params.pinned(ctx.device))
        self.swapped: SwappedOptimizerState | None = None

    def _dir(self, policy: OffloadPolicy, field: str) -> SwapDir | None:
        if not isinstance(policy, OnDisk):
            return None
        try:
            d = SwapDir(policy.nvme_path, self.ctx.rank, field)
        except BaseException:
            self.remove()
            raise
        self.dirs.append(d)
        return d

    def bind(
        self,
        optimizer: torch.optim.Optimizer | None,
        groups: Sequence[ShardGroup],
        guard: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        """A new optimizer (or none): the previous one's swap files go; groups not on the device
        get their state on disk when the optimizer policy says so. ``guard`` (the engine's
        method) is held weakly: the engine's finalizer holds this tier, so a strong reference
        back would keep a dropped engine, its I/O threads and its files alive until exit."""
        if self.swapped is not None:
            self.swapped.close()
            self.swapped = None
        policy = self.optimizer_policy
        if optimizer is not None and isinstance(policy, OnDisk) and self.opt_dir is not None:
            self.swapped = SwappedOptimizerState(
                groups, self.opt_dir, buffer_count=policy.buffer_count, pinned=policy.pinned(self.ctx.device),
                guard=_weakly(guard),
            )  # fmt: skip

    def check_owner(self) -> None:
        """Refuse swap directories another run has taken over (once per step)."""
        for d in self.dirs:
            d.check_owner()

    def step(self, optimizer: torch.optim.Optimizer, resident: Resident, label: str) -> None:
        """Check the swap directories' owners, step the disk groups (their units' rows resident
        around each, when the masters are views of rows on disk), then agree on the outcome
        across ranks."""
        if self.swapped is None:
            return

        def one(g: ShardGroup) -> None:
            with resident(g):
                step_subset(optimizer, g.masters)

        error = None
        try:
            self.check_owner()
            self.swapped.step(optimizer, one)
        except Exception as e:
            error = e
        C.agree_on_failure(self.ctx, error, what=f"disk tier step ({label})", call="optimizer.step()")

    @contextlib.contextmanager
    def mapped(
        self,
        optimizer: torch.optim.Optimizer | None,
        rows: Callable[[], contextlib.AbstractContextManager[None]],
        *,
        writable: bool,
    ) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
        """Inside the block the rows on disk are memory maps (``rows()``), and the result is,
        per master (by id), its optimizer state on disk as memory maps. Every rank agrees
        before any checkpoint collective runs."""
        with contextlib.ExitStack() as stack:
            error, maps = None, {}
            try:  # a rank's missing space or damaged file: every rank stops here, before DCP's collectives
                if self.dirs:
                    self.check_owner()
                stack.enter_context(rows())
                if self.swapped is not None and optimizer is not None:
                    maps = stack.enter_context(self.swapped.mapped_state(optimizer, writable=writable))
            except Exception as e:
                error = e
            if self.dirs:
                C.agree_on_failure(
                    self.ctx, error, what="disk tier checkpoint files", call="save_checkpoint/load_checkpoint"
                )
            elif error is not None:
                raise error
            yield maps

    def disk_bytes(self) -> dict[str, int]:
        """Bytes in swap files, by kind (``memory_stats``)."""
        return {
            "optimizer_state": self.swapped.disk_bytes() if self.swapped is not None else 0,
            "param_shards": self.row_swap.disk_bytes() if self.row_swap is not None else 0,
        }

    def file_paths(self) -> list[str]:
        """Every swap file of this engine."""
        out = [f.path for f in self.swapped.files.values()] if self.swapped is not None else []
        return out + ([f.path for f in self.row_swap.files] if self.row_swap is not None else [])

    def buffer_bytes(self) -> int:
        """The aligned I/O buffers held now."""
        out = self.swapped.buffer_bytes() if self.swapped is not None else 0
        return out + (self.row_swap.buffer_bytes if self.row_swap is not None else 0)

    def close(self) -> None:
        """Close and delete every swap file and directory."""
        if self.swapped is not None:
            self.swapped.close()
            self.swapped = None
        if self.row_swap is not None:
            self.row_swap.close()
        self.remove()

    def remove(self) -> None:
        for d in self.dirs:
            d.remove()


def _weakly(
    method: Callable[[], contextlib.AbstractContextManager[None]],
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """``method`` (bound) without a reference to its object; a no-op once the object is gone."""
    ref = weakref.WeakMethod(method)

    def call() -> contextlib.AbstractContextManager[None]:
        live = ref()
        return live() if live is not None else contextlib.nullcontext()

    return call
