"""The host optimizer step of one group overlapped with the upload of the previous one.

With ``offload_optimizer: {device: cpu}`` at ZeRO-3 the fp32 masters and the optimizer state
live in host memory and each unit's persistent row stays on the device (in the compute dtype).
Stepped the plain way, the optimizer updates every group on the host, and only then are the
updated pieces copied up, unit after unit, before the first gather of the next forward: the
device idles through the whole host step, then the host waits through the copies.

Here the engine steps the host groups itself, one at a time (:meth:`HostStep.run`); as soon as
group k is updated, the copy of its pieces into its unit's row is issued (``storage/uploads.py``),
and group k+1 steps on the host while the copy runs. The reader of a row (the unit's next
gather, a checkpoint or ``state_dict`` read of a piece) waits on that copy first
(``UnitStorage.settle``), and so does the host before it writes group k's masters again.

Sync points (CUDA, ``StreamUpload`` (``storage/uploads.py``)), in order:

1. Before group k's host step: ``event.synchronize()`` of group k's previous upload, if one is
   still pending (it reads the pinned masters the step is about to overwrite; normally long done).
2. After it: a side stream waits for the current stream (the row may still be read by kernels
   queued earlier), the copies are queued on the side stream with ``non_blocking=True`` from
   pinned memory, each destination's storage is recorded on the side stream
   (``Tensor.record_stream``, so the allocator never hands it out while the copy is pending),
   and an event is recorded. The CPU goes on to group k+1 at once.
3. The next reader of the row: ``torch.cuda.current_stream().wait_event(event)``, a wait queued
   on the device (no host block) before the gather's encode kernel.

On CPU there is nothing to overlap: ``uploads.choose`` returns None and the plain step runs (a
no-op). ``DeferredUpload`` is the tests' stand-in (``ZERO_STRATEGY_TEST_HOST_COPIES=deferred``,
as for the gradient copies of ``host_copies.py``): it reads the source when the copy is
issued and writes the row only when waited for, so a reader that skipped the wait would
gather the previous step's values and a DDP parity test fails.

ZeRO-1/2 (``sharding/replicated.py``): the parts are the host groups, and what is issued after
group k's step is its copy into the all-gather's send buffer and the all-gather itself, both on
the feed's side stream (``storage/uploads.py``, ``StreamFeed``): sync point 1 is the feed's
fence, point 2 the feed's issue, and the reader is the all-gather's completion (the compute
stream waits for it before the unpack, no host block). At most ``max_in_flight`` of them are
pending; ``after_step`` completes them and gathers the rest.

Not covered: the gradient copies (``host_copies.py``) are all drained at the end of the
backward (they overlap the backward), so each group's step finds its gradient shard complete
(the global norm of clipping and the overflow check need every group's anyway).

Groups whose optimizer state is on disk are stepped by the disk tier before this runs, and are
skipped here, and so are the parts with a master the optimizer does not hold: a matrix stepped
whole on its owner (``runtime/whole_params.py``), whose piece is written by the exchange after
the step; those parts are stepped by the plain step and copied by ``after_step``. The host groups are stepped from the engine's step pre-hook, so a pre-hook that
the user registers on the optimizer after ``initialize`` runs after them: what it changes (a
learning rate, a gradient) reaches only the device groups. Set the learning rate before
``step()`` (as schedulers do). An exception in the middle (an optimizer error on one group)
leaves the groups before it stepped, as torch's own step leaves the param groups before a
failing one: reload a checkpoint rather than call ``step()`` again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch

from zero_strategy._swap import original_class
from zero_strategy.offload.swapped_state import SwappedOptimizerState, step_subset
from zero_strategy.storage.uploads import Uploader, choose

if TYPE_CHECKING:
    from zero_strategy.sharding.group import ShardGroup
    from zero_strategy.sharding.unit import ParamStorage

__all__ = ["HostStep"]


class StepPart(Protocol):
    """What is stepped as one: a ZeRO-3 unit with separate host masters (its upload goes into
    its device row), or a ZeRO-1/2 host group (its copy and all-gather into the full parameters,
    ``sharding/replicated.py``)."""

    @property
    def group(self) -> ShardGroup | None: ...

    def settle(self, *, host: bool = False) -> None: ...

    def start_upload(self, uploader: Uploader) -> None: ...


@dataclass
class HostStep:
    """Steps the storage's parts (``ParamStorage.step_parts``) one by one, each followed by the
    issue of its copy. ``skip_pull`` is the storage's set of the parts whose copy this step
    issued (its ``after_step`` does not copy them again)."""

    uploader: Uploader
    units: Sequence[StepPart]
    skip_pull: set[int]
    params: ParamStorage

    @classmethod
    def build(cls, params: ParamStorage | None, device: torch.device) -> HostStep | None:
        """For the storage ``params`` on ``device``; None where there is nothing to overlap
        (CPU, no part)."""
        units = cast("list[StepPart]", list(params.step_parts())) if params is not None else []
        uploader = choose(device)
        skip = getattr(params, "skip_pull", None)
        if params is None or not units or uploader is None or skip is None:
            return None
        return cls(uploader, units, skip, params)

    def run(
        self,
        optimizer: torch.optim.Optimizer,
        guard: Callable[[], AbstractContextManager[None]],
        disk: SwappedOptimizerState | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Step every unit's group of ``optimizer`` on the host and issue its upload; returns
        the (master, gradient) pairs stepped, whose gradients the caller hides from the
        optimizer's own step. The groups of ``disk`` (the disk tier's optimizer state: stepped
        already, their gradients hidden by the caller) are not stepped again. Only torch's own classes are
        stepped here: a subclass's step code (an EMA, a logger) runs once per step in the
        plain path, so it stays there."""
        self.forget()
        if original_class(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
            return []
        stashed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        stepped = {id(g) for g in disk.groups} if disk is not None else set()
        held = {id(p) for pg in optimizer.param_groups for p in pg["params"]}
        with guard():
            for u in self.units:
                if u.group is None or id(u.group) in stepped:
                    continue
                if any(id(m) not in held for m in u.group.masters):
                    continue  # a master stepped whole on its owner (whole_params.py): written after the step
                u.settle(host=True)  # sync point 1: its previous upload has read the masters
                step_subset(optimizer, u.group.masters)
                u.start_upload(self.uploader)  # sync point 2
                self.skip_pull.add(id(u))
                stashed += [(m, m.grad) for m in u.group.masters]
        for m, _ in stashed:
            m.grad = None
        return stashed

    def forget(self) -> None:
        """The step is over (or failed): the next ``after_step`` copies every part's masters
        (the storage completes what was issued and empties ``skip_pull``)."""
        self.params.forget_issued()
