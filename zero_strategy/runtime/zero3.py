"""ZeRO-3 unit scheduling: gather a unit before its forward, free it after, gather it again for
its backward, reduce its gradients and free it again. The engine owns the hooks and calls the
scheduler's lifecycle methods; the scheduler never imports the engine.

Order of collectives. Every rank must issue the same gathers and reductions in the same
order. Gathers happen at module boundaries (forward pre-hooks, and backward pre-hooks made
of tensor hooks on each unit's outputs); a unit's gradients are reduced when the *next*
unit's backward starts, or at the end of backward. Both are structural points that every
rank reaches in the same order as long as every rank runs the same units, which the tag in
every gather checks (see ``unit.py``).

Prefetch. The forward order of units is recorded in the first training step and checked to
be the same on every rank. Afterwards each forward pre-hook issues the gather of the next
``prefetch`` units before waiting for its own, and each backward pre-hook does the same in
reverse order. The first unit it issues is issued whatever its size, as DeepSpeed's coordinator
always fetches the next parameter: ``stage3_prefetch_bucket_size`` (0: no prefetch) bounds only
the units beyond it, and ``stage3_max_live_parameters`` (or the cache cap) bounds them all. If a
step takes another path, prefetch stops for that step, the new order is recorded, and this is
logged once.

Cache (``zero_strategy.memory``, ``sharding/cache.py``). With a cache cap, units are not freed
after use: they stay until a gather needs their room, and then the one whose next use is
farthest goes (the uses repeat as the forward order, then the same order backwards). Prefetch
fills the cache within the cap, evicting only units needed later than the one it fetches;
``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` are not applied then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zero_strategy.comm import collectives as C
from zero_strategy.comm import profiling as P
from zero_strategy.reduction.grads import GradReducer
from zero_strategy.sharding.cache import GatherCache
from zero_strategy.sharding.experts.owners import OwnedExperts
from zero_strategy.sharding.experts.selective import ExpertRows, MoeStats
from zero_strategy.sharding.gather_policy import GatherPolicy
from zero_strategy.sharding.partition import UnitPlan
from zero_strategy.sharding.states import ShardedState
from zero_strategy.sharding.unit import ShardedParams, UnitStorage

__all__ = ["UnitScheduler", "Zero3Settings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Zero3Settings:
    """What the scheduler reads: the gather policy (``sharding/gather_policy.py``: prefetch,
    the live and reuse caps, the unit-order check, the MoE switches) and two values the engine
    resolves for this engine: whether gather checks are read once per step (deferred, on its
    device), and the cache cap in bytes (memory budget; None or 0: free each unit after use)."""

    gather: GatherPolicy
    defer_checks: bool = False
    cache: int | None = None


class UnitScheduler:
    """Lifecycle of the ZeRO-3 units. The engine owns every hook and calls these methods:
    ``root_pre_forward``/``root_post_forward`` around the model's forward, ``pre_forward``/
    ``post_forward`` around each unit's, ``outside_pre_forward``/``outside_post_forward`` around
    a submodule called outside the model's forward, ``backward_started``, ``pre_backward`` when
    gradients reach a unit's outputs, and ``end_of_backward``/``abort_backward``. It never sees the
    engine: the engine pushes down the step label (``step``) and whether the backward reduces."""

    def __init__(self, storage: ShardedParams, plan: UnitPlan, reducer: GradReducer, settings: Zero3Settings) -> None:
        self.ctx = storage.ctx
        self.reducer = reducer
        self.settings = settings
        storages = storage.units
        by_label = {u.label: u for u in storages}
        self.module_units: list[tuple[nn.Module, UnitStorage]] = [
            (m, by_label[fqn]) for fqn, m in plan.units if fqn in by_label
        ]
        # units of lists that might run conditionally (default policy): list index by unit tag
        self.lists: list[list[UnitStorage]] = [
            [by_label[f] for f in fqns if f in by_label] for fqns in plan.conditional_lists
        ]
        self.list_of: dict[int, int] = {u.tag: k for k, members in enumerate(self.lists) for u in members}
        self.pinned: set[int] = set()  # tags of units gathered with the root (their list diverged once)
        self.root: UnitStorage | None = by_label.get("<root>")
        self.all_units = storages
        self.names = storage.names
        self.checks = storage.checks
        self.step = "step 0"  # the engine's step, for messages and collective names
        self.order: list[int] | None = None  # recorded forward order (tags)
        self._seq: list[int] = []  # this step's forward order so far
        self._on_path = True  # this step still follows the recorded order
        self._training = True  # the root module's mode in this forward
        self._in_backward = False
        self._outside = False  # a submodule called outside the model's forward is running (zero3_hooks.py)
        self._outside_gathered: list[UnitStorage] = []  # the units that call gathered
        self._outside_units: list[UnitStorage] = []  # the units that call needs (the cache keeps them)
        self._between: list[UnitStorage] | None = None  # a no-grad forward before a pending backward: what was sharded
        self._sync = True  # whether the running backward reduces
        self._active: UnitStorage | None = None  # unit whose backward runs now
        self._fwd_pos: int | None = None  # position in the recorded order of the unit in forward
        self._bwd_pos: int | None = None  # same, for the unit whose backward runs now
        self._warned_order = False
        self._warned_generate = False
        self._ranges: dict[tuple[str, int], Any] = {}  # open profiler ranges (only inside zs.profile)
        self.cache = GatherCache(storage.meter, settings.cache)
        self._running: list[int] = []  # tags of the units whose forward runs now (the cache keeps them)
        self._step_live = False  # the root and pinned units are in use (a forward and its backward)
        # MoE experts units (sharding/experts/selective.py): gathered by selection, finished with their block's unit
        self.moe = MoeStats()
        unit_fqns = [fqn for fqn, _ in plan.units]
        self.experts: dict[int, ExpertRows] = {}
        self.experts_of: dict[int | None, list[ExpertRows]] = {}  # enclosing unit tag -> its experts
        for found in plan.experts:
            eu = by_label.get(found.fqn)
            if eu is None:
                continue
            x = (
                OwnedExperts(found, eu, self.moe, settings.gather.moe_full_share)
                if eu.layout.cuts is not None  # moe_expert_layout: owners (sharding/experts/owners.py)
                else ExpertRows(
                    found,
                    eu,
                    self.moe,
                    settings.gather.moe_full_share,
                    settings.gather.moe_expert_cache,
                    settings.gather.moe_compact,
                )
            )
            self.experts[id(found.module)] = x
            outer = max((f for f in unit_fqns if found.fqn.startswith(f"{f}.")), key=len, default=None)
            tag = by_label[outer].tag if outer is not None and outer in by_label else None
            self.experts_of.setdefault(tag, []).append(x)
        # hpZ (sharding/secondary.py): the units freed after their forward keep secondary shards
        self.hpz = storage.secondary
        self._grad_forward = False  # the model's forward in progress runs with gradients (a backward may follow)
        self._expert_tags = {x.unit.tag for x in self.experts.values()}

    # -- helpers ---------------------------------------------------------------------------
    def _gather(self, u: UnitStorage, position: int | None = None) -> None:
        """An on-demand gather of ``u``, for its use at ``position`` of the cache's order."""
        self.cache.gathering(u, self._busy(), position)
        u.unshard_async(self.step)

    def _busy(self) -> set[int]:
        """Tags of the units in use, which the cache may not evict."""
        busy = set(self._running)
        if self._active is not None:
            busy.add(self._active.tag)
        if self._step_live or self._outside:
            busy |= self.pinned | ({self.root.tag} if self.root is not None else set())
        if self._outside:
            busy |= {u.tag for u in self._outside_units}
        return busy

    def _use_index(self, pos: int | None, direction: int) -> int | None:
        """Where a use is in the cache's order: forward position ``pos``, or the backward of it."""
        if pos is None or self.order is None or not self._on_path:
            return None
        return pos if direction > 0 else 2 * len(self.order) - 1 - pos

    def _release(self, u: UnitStorage) -> None:
        """Done with ``u`` for now: freed, unless the cache keeps it (until its room is needed)."""
        if not self.cache.enabled:
            u.release()

    def _prefetch(self, position: int, direction: int) -> None:
        depth = self.settings.gather.prefetch
        if not depth or self.order is None or not self._on_path:
            return
        tags = self.order
        nxt = (
            range(position + 1, min(len(tags), position + 1 + depth))
            if direction > 0
            else range(position - 1, max(-1, position - 1 - depth), -1)
        )
        beyond = position + direction * (depth + 1)  # rows on disk: read in the background ahead of the gathers
        if 0 <= beyond < len(tags) and (far := self.all_units[tags[beyond] - 1].disk) is not None:
            far.read_ahead()
        cap, budget = self.settings.gather.max_live_parameters, self.settings.gather.prefetch_bucket_size
        if budget <= 0:
            return  # stage3_prefetch_bucket_size 0: no prefetch
        ahead = 0  # elements this prefetch gathers
        here = self._use_index(position, direction)
        for j in nxt:
            u = self.all_units[tags[j] - 1]
            if u.state is not ShardedState.SHARDED:
                continue
            if ahead and ahead + u.numel > budget:
                return  # stage3_prefetch_bucket_size bounds what goes beyond the first: on demand instead
            if self.cache.enabled:  # within the cap, evicting only units needed later than u
                soon = self.cache.policy.distance(u.tag, here)
                if not self.cache.make_room(u.full_bytes, self._busy(), here, before=soon):
                    return
            elif sum(v.numel for v in self.all_units if v.state is not ShardedState.SHARDED) + u.numel > cap:
                return  # stage3_max_live_parameters
            ahead += u.numel
            u.unshard_async(self.step)

    def _reuse_soon(self, u: UnitStorage, pos: int | None, direction: int) -> bool:
        """Will ``u`` run again in this pass (later in forward, or earlier in forward order during
        backward) with at most ``stage3_max_reuse_distance`` elements of other units between?"""
        if self.order is None or not self._on_path or pos is None:
            return False
        limit, dist = self.settings.gather.max_reuse_distance, 0
        for j in range(pos + 1, len(self.order)) if direction > 0 else range(pos - 1, -1, -1):
            tag = self.order[j]
            if tag == u.tag:
                return dist < limit
            dist += self.all_units[tag - 1].numel
            if dist >= limit:
                return False
        return False

    def _keeps_secondary(self, u: UnitStorage) -> bool:
        """hpZ: does ``u``'s forward gather keep a secondary shard for its backward? Only in a
        forward with gradients (not inside the backward, not an outside or in-between call), for
        a unit freed after use (not the root unit or the pinned ones, not persistent, not MoE experts)."""
        return (
            self._grad_forward and not self._in_backward and not self._outside and self._between is None
            and not u.persistent and u is not self.root and u.tag not in self.pinned and u.tag not in self._expert_tags
        )  # fmt: skip

    def _recording(self) -> bool:
        return torch.is_grad_enabled() and self._training and not self._in_backward and not self._outside

    # -- agreement on lists that might run conditionally ------------------------------------
    def _checking(self) -> bool:
        return len(self.pinned) < len(self.list_of)

    def _agree(self, tag: int) -> bool:
        """Every rank says which list unit it is about to enter (0: the forward ends). If ranks
        differ, every list involved is pinned, on every rank in the same order: its units are
        gathered now and from then on together with the root unit (gathered for the whole
        forward and backward, reduced at the end of backward). If a rank has ended its forward,
        every list is pinned: that rank takes part in no further agreement, so no other rank may
        ask for one. Pinned sets stay equal on every rank, so the k-th agreement of each rank
        meets the k-th of the others. Returns whether all agreed."""
        ctx = self.ctx
        out = torch.zeros(ctx.world_size, dtype=torch.int64, device=ctx.device)
        mine = out[ctx.rank : ctx.rank + 1]
        mine.fill_(tag)
        C.all_gather(ctx, out, mine, what=f"list-unit agreement ({self.step})").wait()
        tags = out.tolist()
        if len(set(tags)) == 1:
            return True
        if 0 in tags:  # a rank has ended its forward: no list may ask for another agreement
            lists = list(range(len(self.lists)))
        else:
            lists = sorted({self.list_of[t] for t in tags if t in self.list_of})
        log.warning(
            "zero_strategy: ZeRO-3 ranks enter different blocks of a list at %s (%s); the list%s %s now stay%s "
            "gathered with the root unit (more memory, no divergence). To keep them sharded, decorate the module "
            "that owns the conditional branch with @zero_auto_partition or pass initialize(policy=...).",
            self.step,
            ", ".join(f"rank {r}: {self.names.get(t, 'end of forward')}" for r, t in enumerate(tags)),
            "s" if len(lists) > 1 else "",
            [self.lists[k][0].label.rsplit(".", 1)[0] for k in lists],
            "" if len(lists) > 1 else "s",
        )
        newly = [u for k in lists for u in self.lists[k] if u.tag not in self.pinned]
        for u in newly:
            self.pinned.add(u.tag)
            self._gather(u)
        for u in newly:
            u.wait_unshard(self.names)
        return False

    # -- root ------------------------------------------------------------------------------
    def root_pre_forward(self, *, training: bool) -> None:
        if self._step_live and not torch.is_grad_enabled() and not self._in_backward:
            self._between_pre_forward()
            return
        self._training = training
        self._grad_forward = torch.is_grad_enabled()
        self._seq = []
        self._on_path = True
        self._step_live = True
        self._running = []  # a forward that raised left its units here
        # a known unit order: each gather's checks stay on the device until the step's flags
        self.checks.deferred = self.settings.defer_checks and self.order is not None
        pinned = [u for u in self.all_units if u.tag in self.pinned]
        if self.root is not None:
            self.cache.used(self.root)
        for u in ([self.root] if self.root is not None else []) + pinned:
            self._gather(u, self._use_index(0, +1))
        for u in ([self.root] if self.root is not None else []) + pinned:
            u.wait_unshard(self.names)

    def _between_pre_forward(self) -> None:
        """A forward without gradients while a forward's backward is pending (TRL's reference
        log-probs under ``no_grad``): the units it finds gathered are the pending backward's
        (the root unit, the pinned units, the cache's) and stay; it frees only what it gathers.
        Its units are not recorded, and the step's order, prefetch path and deferred gather
        checks are the pending forward's: they are left as they are (the checks are read with
        the step's gradient flags, on every rank, whether or not every rank made this call)."""
        self._between = [u for u in self.all_units if u.state is ShardedState.SHARDED]
        for u in [self.root] if self.root is not None else []:  # gathered already: no collective
            self._gather(u)
            u.wait_unshard(self.names)

    def regather_root(self) -> None:
        """An optimizer step ran inside the model's forward (Lightning's manual optimization
        steps inside ``training_step``) and freed every gathered unit, whose copies held the old
        values. The root unit and the pinned units are gathered once per forward, so the rest of
        this forward would read freed storage: gather them again. Collective, as the step is."""
        units = ([self.root] if self.root is not None else []) + [u for u in self.all_units if u.tag in self.pinned]
        for u in units:
            self._gather(u)
        for u in units:
            u.wait_unshard(self.names)

    def root_post_forward(self, *, ok: bool = True, only: list[UnitStorage] | None = None) -> None:
        """The forward ended (``ok``) or raised. After an exception nothing may wait on the
        other ranks: a gather still in flight stays so (its next use waits on it). Without
        gradients the units are freed: all of them, or ``only`` those (an outside call's, or a
        forward's between a forward and its backward: what it gathered)."""
        if not ok:
            self._close_ranges("forward")
        if ok and self._checking():
            self._agree(0)  # a rank that skipped the last list units meets the others here
        between, self._between = self._between, None
        if between is not None:  # a call between a forward and its backward (_between_pre_forward)
            only = between
        pending = between is not None or (only is not None and self._step_live)  # a backward is pending
        if not torch.is_grad_enabled():
            if ok and not pending:  # no backward follows: this forward's deferred gather checks are read now
                self.checks.check_now()
            if only is None:
                self._step_live = False
                if self.hpz is not None:  # no backward follows: the secondary shards are not needed
                    self.hpz.drop_all()
            for u in self.all_units if only is None else only:  # eval / no_grad: nothing but persistent units stays
                if pending and u.tag in self.pinned:
                    continue  # pinned during the call: gathered with the root from now on
                if ok or u.state is not ShardedState.UNSHARDING:
                    self._release(u)

    def outside_pre_forward(self, enclosing: UnitStorage | None) -> None:
        """A submodule is called outside the model's forward: gather what a forward would have
        gathered by then (the root unit, the pinned units) and ``enclosing``, the unit the
        module is part of. The units it runs are not recorded as the forward order."""
        self._outside = True
        units = ([self.root] if self.root is not None else []) + [u for u in self.all_units if u.tag in self.pinned]
        if enclosing is not None and enclosing not in units:
            units.append(enclosing)
        # what this call gathers is all it may free: a forward's backward may still be pending
        self._outside_gathered = [u for u in units if u.state is ShardedState.SHARDED]
        self._outside_units = units
        for u in units:
            self._gather(u)
        for u in units:
            u.wait_unshard(self.names)

    def outside_post_forward(self, *, ok: bool) -> None:
        """The outside call returned (``ok``) or raised: as at the end of a forward, except that
        without gradients only what the call gathered is freed (the units a pending backward
        needs stay: a call between a forward and its backward)."""
        self._outside = False
        gathered, self._outside_gathered, self._outside_units = self._outside_gathered, [], []
        self.root_post_forward(ok=ok, only=gathered)

    # -- generation --------------------------------------------------------------------------
    def synced_generation(self, asked: bool | None) -> bool | None:
        """``generate``'s ``synced_gpus`` on this model (``module.py``), ``asked`` being the
        caller's. With more than one rank, a forward gathers units together with the other
        ranks, so a rank whose sequences reached EOS must keep running forwards until every
        rank's have (DeepSpeed's ZeRO-3 does the same): True by default, and an explicit False
        is followed only where no forward communicates (every unit persistent, no MoE experts
        units, no list agreement); else it would hang, and True is used, with a warning."""
        if self.ctx.world_size == 1:
            return asked  # nothing to wait for
        communicates = any(not u.persistent for u in self.all_units) or bool(self.experts) or self._checking()
        if asked is False and communicates:
            if not self._warned_generate:
                self._warned_generate = True
                log.warning(
                    "zero_strategy: generate(synced_gpus=False) on a ZeRO-3 model would hang once the ranks reach "
                    "EOS at different steps (each forward gathers units with the other ranks); generating with "
                    "synced_gpus=True (logged once)"
                )
            return True
        return True if asked is None else asked

    # -- units -----------------------------------------------------------------------------
    def pre_forward(self, u: UnitStorage) -> None:
        # a recomputation inside backward (activation checkpointing) may stop early, without the
        # post hook: only the latest one counts as running
        self._running = [u.tag] if self._in_backward else [*self._running, u.tag]
        self._gather_for_forward(u)
        if P.enabled():  # the unit's compute, named in a profile (zs.profile)
            self._ranges[("forward", u.tag)] = P.open_range("zero: forward", u.name)

    def _gather_for_forward(self, u: UnitStorage) -> None:
        if u.tag in self.list_of and not self._in_backward:
            if u.tag in self.pinned or not self._agree(u.tag):
                u.wait_unshard(self.names)  # gathered with the root
                return
        if self._recording():
            pos = len(self._seq)
            self._seq.append(u.tag)
            if self.order is not None and self._on_path and (pos >= len(self.order) or self.order[pos] != u.tag):
                self._on_path = False
                self.checks.deferred = False  # off the recorded order: check each gather at once
                if not self._warned_order:
                    self._warned_order = True
                    log.warning(
                        "zero_strategy: the order of ZeRO-3 units changed at %s (%s instead of %s); "
                        "prefetching is off until the new order is recorded (logged once)",
                        self.step,
                        self.names.get(u.tag),
                        self.names.get(self.order[pos]) if pos < len(self.order) else "the end of the recorded order",
                    )
            self._fwd_pos = pos
            self.cache.used(u)
            self._gather(u, self._use_index(pos, +1))
            self._prefetch(pos, +1)
        else:
            self._fwd_pos = None
            self.cache.used(u)
            self._gather(u)
        if self.hpz is not None and u.state is ShardedState.UNSHARDING and self._keeps_secondary(u):
            self.hpz.want(u)
        u.wait_unshard(self.names)

    def post_forward(self, u: UnitStorage) -> None:
        P.close_range(self._ranges.pop(("forward", u.tag), None))
        if not self._in_backward:  # a ModuleList of experts inside: regathered for the unit's backward
            for x in self.experts_of.get(u.tag, ()):
                if x.found.members:
                    x.release()
        if u.tag in self._running:  # the innermost call of it
            del self._running[len(self._running) - 1 - self._running[::-1].index(u.tag)]
        # a checkpoint's recomputation keeps it for the backward; a unit that runs again soon
        # in this forward stays gathered (stage3_max_reuse_distance); a pinned one stays too
        if self.cache.enabled:
            return
        if not self._in_backward and u.tag not in self.pinned and not self._reuse_soon(u, self._fwd_pos, +1):
            u.release()

    def backward_started(self, *, sync: bool) -> None:
        """The first hook of a backward ran (``sync``: it reduces gradients)."""
        self._in_backward = True
        self._sync = sync

    def pre_backward(self, u: UnitStorage) -> None:
        """Gradients reached one of ``u``'s outputs: gather it for its backward (and finish the
        unit whose backward ran before)."""
        if u.tag in self.pinned:  # gathered with the root; reduced at the end of backward
            u.wait_unshard(self.names)
            return
        if self._active is u and u.state is ShardedState.UNSHARDED:
            return
        self._running = []  # a recomputation for this backward is over
        if self._active is not None and self._active is not u:
            self._finish_backward(self._active)
        self._active = u
        self._bwd_pos = self._backward_position(u)
        self.cache.used(u)
        self._gather(u, self._use_index(self._bwd_pos, -1))
        if self._bwd_pos is not None:
            self._prefetch(self._bwd_pos, -1)
        u.wait_unshard(self.names)
        for x in self.experts_of.get(u.tag, ()):  # a ModuleList of experts: its forward's union again
            if x.found.members and not x.unit.persistent:
                x.backward_gather(self.step)
        if P.enabled():
            self._ranges[("backward", u.tag)] = P.open_range("zero: backward", u.name)

    def _close_ranges(self, kind: str) -> None:
        for key in [k for k in self._ranges if k[0] == kind]:
            P.close_range(self._ranges.pop(key))

    def _backward_position(self, u: UnitStorage) -> int | None:
        """Where ``u``'s backward is in the recorded forward order (walked from the end)."""
        if self.order is None or not self._on_path:
            return None
        start = len(self.order) if self._bwd_pos is None else self._bwd_pos
        return next((j for j in range(start - 1, -1, -1) if self.order[j] == u.tag), None)

    def _finish_backward(self, u: UnitStorage) -> None:
        P.close_range(self._ranges.pop(("backward", u.tag), None))
        if self._sync and u.group is not None:
            self.reducer.launch(u.group)  # whether the cache keeps the parameters or not
        self._finish_experts(u.tag)
        if not self.cache.enabled and not self._reuse_soon(u, self._bwd_pos, -1):
            u.release()

    # -- MoE experts units (sharding/experts/selective.py) ----------------------------------
    def expert_pre_forward(self, x: ExpertRows, selection: torch.Tensor | None) -> None:
        """Before an experts module's forward: agree on the union of the selected experts (one
        all-reduce) and gather its rows. A forward with gradients remembers the union for its
        backward and the reduction."""
        if x.unit.persistent:
            return
        x.forward_gather(x.agree(selection, self.step), self.step)

    def expert_post_forward(self, x: ExpertRows) -> None:
        x.release()

    def expert_call_raised(self, x: ExpertRows) -> None:
        """The experts module's call raised after its gather. In a forward its rows go now
        (:meth:`ExpertRows.abandon`); in a backward they stay: non-reentrant activation
        checkpointing stops a recomputation with an exception once it has what the backward
        needs, which reads these rows, and they go with their block."""
        if self._in_backward:
            x.open_call = False
        else:
            x.abandon()

    def expert_pre_backward(self, x: ExpertRows) -> None:
        """Gradients reached an experts module's output: gather its forward's union again. It
        stays until its block's unit finishes its backward (or the backward ends)."""
        if x.unit.persistent:
            return
        x.backward_gather(self.step)

    def _finish_experts(self, tag: int | None) -> None:
        for x in self.experts_of.get(tag, ()):  # their backward ran inside the unit's
            if self._sync and x.unit.group is not None:
                self.reducer.launch(x.unit.group)
            x.release()

    def abort_backward(self) -> None:
        self._drop_reads()
        for x in self.experts.values():
            x.forget()
        self._close_ranges("backward")
        self._in_backward = False
        self._active = None
        self._bwd_pos = None
        self._step_live = False
        self._running = []
        if self.hpz is not None:
            self.hpz.drop_all()
        for u in self.all_units:
            if not u.persistent:  # persistent units stay gathered (a backward never changes their values)
                u.reshard()
        for x in self.experts.values():  # their compact rows go with their units
            x.release()

    def _drop_reads(self) -> None:
        """Rows read ahead from disk and not used (the step took another path): their slabs go."""
        for u in self.all_units:
            if u.disk is not None:
                u.disk.drop_ahead()

    def end_of_backward(self) -> None:
        """After the gradient schedule reduced what was left: free the units, adopt the order."""
        self._drop_reads()
        self._close_ranges("backward")
        self._in_backward = False
        self._active = None
        self._bwd_pos = None
        self._step_live = False
        if self.hpz is not None:  # units whose backward did not gather them
            self.hpz.drop_all()
        for u in self.all_units:
            self._release(u)
        for x in self.experts.values():
            x.clear_passes()
            x.release()
        if self._seq:
            self._adopt_order(self._seq)
            self._seq = []

    def _adopt_order(self, seq: list[int]) -> None:
        """After a training backward: the first recorded order is checked to be the same on
        every rank (a collective every rank reaches at its first backward); later changes are
        adopted locally, since every gather checks which unit each rank is gathering."""
        self.cache.policy.set_order(seq + seq[::-1])  # the uses: forward, then backward
        if self.order is not None or not self.settings.gather.check_unit_order:
            self.order = list(seq)  # check_unit_order=False: trust the order, no collective
            return
        digest = torch.tensor([len(seq), hash(tuple(seq)) % (2**31 - 1)], dtype=torch.int64, device=self.ctx.device)
        both = torch.cat([digest, -digest])
        C.all_reduce(self.ctx, both, op="max", what=f"unit order check ({self.step})").wait()
        if not torch.equal(both[:2], -both[2:]):
            raise RuntimeError(
                f"rank {self.ctx.rank}: ZeRO-3 units ran in a different order on different ranks at "
                f"{self.step}; this rank ran {[self.names[t] for t in seq]}. Make every rank run the same "
                "modules (or group the conditional part into one unit with @zero_auto_partition / policy=...)."
            )
        self.order = list(seq)
