"""The engine behind ``zero_strategy.initialize``: one per model.

It owns the communication context, the parameter storage (full parameters at ZeRO-1/2, unit
rows at ZeRO-3), the shard groups, the gradient reducer, the precision policy and every hook:
module hooks around the model's forward (at ZeRO-3 also each unit's and each submodule's, made
by ``zero3_hooks.py``), tensor hooks where gradients reach a unit or an output,
post-accumulate-grad hooks (ZeRO-2) and the end-of-backward callback.
Layers below it never see the engine: it calls their lifecycle methods (``GradReducer``,
``UnitScheduler``, ``ParamStorage``) and pushes settings down. States are explicit enums that
change in one method each, which checks the state they leave.

Who holds whom, so that a dropped model is freed by reference counting alone, as a plain module
is (a cycle would keep every tensor of the engine until Python's cyclic collector runs): the
model owns its engine (``model._zero_engine``); the engine owns its optimizers, storage,
reducer and scheduler. Nothing points back strongly: the engine holds the model weakly
(``engine.module``), each optimizer holds its engine weakly (``optimizer.zero_engine`` is None
once it is gone; a step raises naming the fix), and every hook and callback the engine hands
out holds its object weakly (``_weak.weak_method``): one firing after its engine died does
nothing. ``destroy`` removes the model's pointer too, so the engine goes with the last reference
to it. ``tests/faults/test_refcount_free.py`` checks this with the collector off.

What ``p.grad`` holds (``p`` a model parameter):

- ZeRO-1: the full *local* gradient through backward and accumulation; at the optimizer step
  it is reduced and freed, so after ``step()`` it is ``None``.
- ZeRO-2: ``None`` after each backward (each bucket is reduce-scattered and freed as soon as
  it is ready); inside ``no_sync()`` the full local gradient accumulates there instead.
- Both: this rank's averaged gradient pieces are the ``.grad`` of the optimizer's master
  pieces after ``clip_grad_norm_`` or during ``step()``. ``zero_strategy.full_grad(model, p)``
  returns the full averaged gradient (a collective: call it on every rank).
- Without an optimizer (``initialize(model, None)``) at ZeRO-1/2: DDP's full averaged gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from zero_strategy._swap import unswap_class
from zero_strategy._weak import weak_method
from zero_strategy.comm import collectives as C
from zero_strategy.config import ZeroConfig
from zero_strategy.offload.disk_tier import DiskTier
from zero_strategy.offload.host_step import HostStep
from zero_strategy.offload.swapped_state import SwappedOptimizerState
from zero_strategy.reduction.grads import (
    AllReduceAtEnd,
    GradSchedule,
    ReduceAtStep,
    ReduceAtUnitEnd,
    ReduceInBackward,
)
from zero_strategy.runtime.compile_support import eager
from zero_strategy.runtime.compose import (
    build_storage,
    make_reducer,
    make_scaler,
    make_zero3,
    note_accumulation,
    resolve_policies,
    shard_group_contexts,
    world_context,
)
from zero_strategy.runtime.compressed_adam import adam_direction
from zero_strategy.runtime.engine_state import StepCalls, SyncState, WholeModelState
from zero_strategy.runtime.optimizer_set import OptimizerSet, key
from zero_strategy.runtime.shard_groups import refuse_experts, refuse_modifier_rank
from zero_strategy.runtime.torch_clipping import LiveEngines
from zero_strategy.runtime.whole_params import WholeParams
from zero_strategy.runtime.zero3 import UnitScheduler
from zero_strategy.runtime.zero3_hooks import Zero3Hooks, refuse_load_state_dict, refuse_sharded_state_dict
from zero_strategy.sharding.group import (
    ShardGroup,
)
from zero_strategy.sharding.partition import UnitPolicy
from zero_strategy.sharding.pieces import sharded_init_piece
from zero_strategy.sharding.replicated import ReplicatedParams
from zero_strategy.sharding.states import (
    GRAD_TRANSITIONS,
    TRAINING_TRANSITIONS,
    GradState,
    TrainingState,
    check_transition,
)
from zero_strategy.sharding.unit import ParamStorage, ShardedParams
from zero_strategy.storage.host_memory import HostPeak
from zero_strategy.storage.offload import OffloadPolicy

__all__ = ["GradState", "TrainingState", "ZeroEngine", "live_engines"]

_LIVE: LiveEngines[ZeroEngine] = LiveEngines()  # while it holds one, torch's clipping functions are ours


def live_engines() -> list[ZeroEngine]:
    return list(_LIVE)


class ZeroEngine(WholeModelState):
    opts: OptimizerSet  # the bound optimizers (set_optimizers; several step disjoint parameters), none: model only
    params: ParamStorage
    groups: list[ShardGroup]  # the optimizer's shard groups (ZeRO-3: one per unit with trainable parameters)
    zero3: UnitScheduler | None  # ZeRO-3's unit lifecycle, None at ZeRO-1/2

    def __init__(self, module: nn.Module, config: ZeroConfig, process_group: Any = None,
                 policy: UnitPolicy = None, mesh: Any = None) -> None:  # fmt: skip
        """A few named steps (``compose.py``): the config is read once, into each layer's policy;
        every step below receives policies, and its result becomes a field."""
        self.config = config
        self.policies = p = resolve_policies(config)  # checks the config, before any change
        self._module_ref = weakref.ref(module)  # the model owns the engine (module docstring)
        named = list(module.named_parameters(remove_duplicate=True))
        self._names = {id(q): n for n, q in named}
        built_sharded = any(sharded_init_piece(q) is not None for _, q in named)
        # 1. the whole group's context; self.ctx becomes the shard group's in step 4
        self.world = self.ctx = world_context(module, p, process_group, built_sharded=built_sharded, config=config)
        # 2. storage: swap directories (an unusable nvme_path fails here, before any change)
        self.disk = DiskTier(self.offload_optimizer, self.offload_params, self.ctx)
        weakref.finalize(self, self.disk.close)  # a dropped engine takes its I/O threads and files along
        note_accumulation(p)  # a setting the front-ends read, said here once the config is usable
        # 3. precision, and the engine's own state
        self.precision, self.scaler = p.precision, make_scaler(p)
        self._init_state()
        # 4. every rank's agreement, then the shard, replica and hpZ groups
        owned = {pid: type(e.module).__name__ for e in list(_LIVE) for pid in e._names}
        groups = shard_group_contexts(self.world, p, named, owned, built_sharded=built_sharded, mesh=mesh)
        self.ctx, self.replica = groups.shard, groups.replica
        # 5. parameters and units: the storage, the shard groups, the masters
        built = build_storage(module, named, policy, p, self.precision, self.world, self.ctx, self.disk, self.init_peak)
        self.params, self.groups = built.params, built.groups
        self.policies = p = dataclasses.replace(p, storage=built.placement)  # ratio auto resolved
        refuse_experts(self.replica, self.groups)
        self._master: dict[int, torch.Tensor] = {id(q): m for g in self.groups for q, m in zip(g.params, g.masters)}
        # 6. the gradient reducer, and the owners of whole-stepped parameters (Muon)
        self.reducer = make_reducer(
            self.groups, self.ctx, self.replica, self.world, p, self.scaler,
            describe_step=weak_method(self._step_label, default="after the engine was dropped"),
            steps_done=weak_method(self.steps_done, default=0),
        )  # fmt: skip
        self.whole = WholeParams(self.ctx, self.reducer.locate, self._names)  # Muon & co (whole_params.py)
        # 7. ZeRO-3's scheduler and memory budget (none at ZeRO-1/2)
        others = weak_method(self._other_engines_bytes, default=0)
        self.zero3, self.budget = make_zero3(self.params, built.plan, self.reducer, p, groups.secondary, others)
        self._check_fit()
        # 8. hooks
        self.host_step = HostStep.build(getattr(self, "params", None), self.ctx.device)  # None: nothing to overlap
        self.schedule: GradSchedule = self._schedule_for(())
        self._install_hooks()
        _LIVE.add(self)
        self.init_peak.mark()

    @property
    def offload_optimizer(self) -> OffloadPolicy:
        """Where the masters, their gradients and the optimizer state live."""
        return self.policies.storage.optimizer

    @property
    def offload_params(self) -> OffloadPolicy:
        """Where ZeRO-3's persistent rows live."""
        return self.policies.storage.params

    def _init_state(self) -> None:
        self.opts = OptimizerSet((), {})
        self.training_state = TrainingState.IDLE
        self.grad_state = GradState.EMPTY
        self.step_count = 0
        self.steps = StepCalls()  # the optimizer step's progress (engine_state.py)
        self.sync_state = SyncState()  # when gradients reduce: no_sync, the next backward, the root's nesting
        self.destroyed = False
        self._hooks: list[Any] = []
        self._schedule_hooks: list[Any] = []
        self._on_destroy: list[Callable[[], None]] = []
        self.init_peak = HostPeak()  # the host memory initialize takes (memory_stats' initialize_host_peak)
        self.phase_offloaded: Any = None  # offload_states / reload_states (phase_offload.py)

    def _check_fit(self) -> None:
        """ZeRO-3 with a memory budget: does the model fit? (raises with each tier's bytes)"""
        if self.budget is None or self.zero3 is None:
            return
        caches = sum(x.cache is not None for x in self.zero3.experts.values())
        self.budget.reserve_expert_caches(self.policies.gather.moe_expert_cache, caches)  # from the cache tier
        self.budget.check(self.memory_stats(), self.zero3.cache, when="at initialize")

    def _schedule_for(self, optimizers: Sequence[torch.optim.Optimizer]) -> GradSchedule:
        if self.policies.stage == 3:
            return ReduceAtUnitEnd()
        if not optimizers:  # model-only ZeRO-1/2: DDP's full averaged gradients in p.grad
            return AllReduceAtEnd()
        return ReduceAtStep() if self.policies.stage == 1 else ReduceInBackward()

    def set_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Bind (or, with none, drop) the optimizers whose masters this engine feeds (several:
        disjoint parameters, ``optimizer_set.py``); the gradient schedule follows (without an
        optimizer ZeRO-1/2 reduce full gradients)."""
        self._expect_idle("set_optimizers()", "call it between steps")
        self.zero_grad(set_to_none=True)
        for h in self._schedule_hooks:
            h.remove()
        self.reset_step_calls()
        self.whole.keep({key(o) for o in optimizers})  # the proxies of whole-stepped parameters count as masters
        self.opts = OptimizerSet(
            optimizers, {**{id(m): pid for pid, m in self._master.items()}, **self.whole.proxy_params()}
        )
        self.schedule = self._schedule_for(optimizers)
        self._schedule_hooks = self._install_schedule_hooks()
        self.disk.bind(self.optimizer, [g for g in self.groups if g.tier != "device"], guard=self._internal_step)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The bound optimizer when there is exactly one (None: none, or several: ``opts``)."""
        return self.opts.single

    @property
    def swapped(self) -> SwappedOptimizerState | None:
        """The optimizer state on disk (``offload_optimizer: {device: nvme}``), per optimizer."""
        return self.disk.swapped

    # -- states ----------------------------------------------------------------------------
    def _set_training(self, new: TrainingState, what: str) -> None:
        """The one place the training state changes, from the states it may leave."""
        where = f"rank {self.ctx.rank}: {what} ({self._step_label()})"
        self.training_state = check_transition(TRAINING_TRANSITIONS, self.training_state, new, where)

    def _set_grad(self, new: GradState, what: str) -> None:
        """The one place the gradient state changes, from the states it may leave."""
        where = f"rank {self.ctx.rank}: {what} ({self._step_label()}), for the gradients,"
        self.grad_state = check_transition(GRAD_TRANSITIONS, self.grad_state, new, where)

    def _expect_idle(self, call: str, fix: str, *, forward_ok: bool = False) -> None:
        """Calls that only make sense between steps refuse to run inside backward, and (unless
        ``forward_ok``) inside forward. Lightning's manual optimization steps inside the
        forward it redirects to ``training_step``, after a backward that ended there."""
        if self.training_state is TrainingState.BACKWARD and torch._C._current_graph_task_id() == -1:
            self._abort_backward()  # the last backward raised before its end: nothing runs now
        if self._calls is not None:
            self._calls.drop_stale()  # a submodule call outside the forward that was interrupted
        allowed = (TrainingState.IDLE, TrainingState.FORWARD) if forward_ok else (TrainingState.IDLE,)
        if self.training_state not in allowed:
            raise RuntimeError(f"{call} during {self.training_state.name.lower()} ({self._step_label()}); {fix}")

    def _other_engines_bytes(self) -> int:
        """Device bytes of the other live engines on this engine's device: their model state and
        communication buffers (the memory budget does not count them as this engine's)."""
        others = [e for e in list(_LIVE) if e is not self and e.ctx.device == self.ctx.device]
        return sum(s["tier_device"] + s["comm_scratch"] for s in (e.memory_stats() for e in others))

    # -- hooks (all of them registered here) --------------------------------------------------
    def _install_hooks(self) -> None:
        m = self.module
        self._hooks.append(m.register_forward_pre_hook(eager(weak_method(self._pre_forward))))
        self._hooks.append(m.register_forward_hook(eager(weak_method(self._post_forward)), always_call=True))
        self.root_done = eager(weak_method(self.root_call_done))  # called by ZeroModule.__call__ (compile_support.py)
        self._schedule_hooks = self._install_schedule_hooks()
        self._calls: Zero3Hooks | None = None
        if self.zero3 is not None:  # each unit's forward, and submodules called outside the model's forward
            self._calls = Zero3Hooks(self.zero3, in_root_call=weak_method(self._in_root_call, default=False),
                                     backward_coming=weak_method(self._queue_end_of_backward),
                                     call_started=weak_method(self._outside_call_started),
                                     call_done=weak_method(self._outside_call_done))  # fmt: skip
            self._hooks += self._calls.install(m)
            self._hooks.append(m.register_load_state_dict_pre_hook(refuse_load_state_dict))
            sharded = {id(p) for u in self.zero3.all_units for p in u.params}
            for sub in m.modules():
                local = [n for n, p in sub._parameters.items() if p is not None and id(p) in sharded]
                if local:
                    self._hooks.append(
                        sub._register_state_dict_hook(functools.partial(refuse_sharded_state_dict, local))
                    )
        else:  # masters that are not views of the parameters must follow a load
            self._hooks.append(m.register_load_state_dict_post_hook(weak_method(self._refresh_masters)))

    def _refresh_masters(self, *hook_args: Any) -> None:
        if isinstance(self.params, ReplicatedParams):
            self.params.refresh_all_masters()

    def _install_schedule_hooks(self) -> list[Any]:
        if not self.schedule.reduces_when_ready:
            return []
        hook = weak_method(self.on_grad_accumulated)  # the engine holds the parameters
        return [p.register_post_accumulate_grad_hook(hook) for g in self.groups for p in g.params]

    def root_call_done(self, ok: bool) -> None:
        """The outermost call of the root module returned (``ok``) or raised. On success the
        ZeRO-3 end-of-forward work runs here (a collective when lists are being checked); after
        an exception only local state is put back: no collective, the other ranks may be anywhere
        (and a KeyboardInterrupt skips the forward hooks, which reset the training state)."""
        if not ok and self.training_state is TrainingState.FORWARD:
            self._set_training(TrainingState.IDLE, "a forward that raised")
        if self.zero3 is not None:
            self.zero3.root_post_forward(ok=ok)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.sync_state.root_depth > 1:  # the root called inside its own forward (Lightning's training_step
            return  # calling self(x)): the outermost call gathers and records (depth: ZeroModule.__call__)
        if self.steps.depth and not self.steps.internal:
            self.reset_step_calls()  # a step that raised left its count behind: no step spans a forward
        if self.training_state is TrainingState.BACKWARD and torch._C._current_graph_task_id() == -1:
            self._abort_backward()  # the last backward raised before its end: start clean
        if self._calls is not None:
            self._calls.drop_stale()  # a submodule call outside the forward that was interrupted
        if self.sync_state.buffers_next and module.training:
            buffers = list(module.buffers())
            if buffers:  # like DDP's broadcast_buffers: rank 0's buffers win
                C.broadcast_coalesced(self.world, buffers, what=f"module buffers ({self._step_label()})")
        if self.training_state is TrainingState.IDLE:  # (inside a running backward: a recomputation)
            self._set_training(TrainingState.FORWARD, "forward")
        if torch.is_grad_enabled() and self.sync_state.enabled:
            self.sync_state.backward = True  # the backward of this forward reduces (DDP's rule)
        if self.zero3 is not None:
            self.zero3.root_pre_forward(training=module.training)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.sync_state.root_depth > 1:
            return output
        # As DDP: buffers are broadcast before a forward that follows a synced training forward.
        self.sync_state.buffers_next = torch.is_grad_enabled() and self.sync_state.enabled
        if self.training_state is TrainingState.FORWARD:
            self._set_training(TrainingState.IDLE, "the end of forward")
        self._hook_outputs(output)
        return output

    def _hook_outputs(self, output: Any) -> None:
        """Gradients reaching an output of the model (or of an outside call) start a backward."""
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(weak_method(self._on_output_grad))

    def _outside_call_started(self) -> None:
        """ZeRO-3: a submodule is called outside the model's forward (``zero3_hooks.py``); the
        states move as for a forward, and a backward through it reduces as after a forward."""
        if self.training_state is TrainingState.BACKWARD and torch._C._current_graph_task_id() == -1:
            self._abort_backward()  # the last backward raised before its end: start clean
        if self.training_state is TrainingState.IDLE:
            self._set_training(TrainingState.FORWARD, "a submodule called outside the forward")
        if torch.is_grad_enabled() and self.sync_state.enabled:
            self.sync_state.backward = True

    def _outside_call_done(self, ok: bool, output: Any) -> None:
        if self.training_state is TrainingState.FORWARD:
            self._set_training(TrainingState.IDLE, "the end of a submodule called outside the forward")
        if ok:
            self._hook_outputs(output)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._queue_end_of_backward()

    def _in_root_call(self) -> bool:
        return self.sync_state.root_depth > 0

    def _queue_end_of_backward(self) -> None:
        """The first hook of a backward: gradients are coming (only a backward moves the
        gradient state, so a forward after ``clip_grad_norm_`` does not reopen it)."""
        if self.training_state is TrainingState.BACKWARD:
            return  # queued already
        self._set_training(TrainingState.BACKWARD, "backward")
        self._set_grad(GradState.ACCUMULATING, "backward")
        self.steps.clipped.clear()  # new gradients: every clip so far is over (the step clips again)
        if self.zero3 is not None:
            self.zero3.backward_started(sync=self.sync_state.backward)
        Variable._execution_engine.queue_callback(self._end_of_backward)

    def _abort_backward(self) -> None:
        self._set_training(TrainingState.IDLE, "a backward that raised")
        self.reducer.abort_backward()
        if self.zero3 is not None:
            self.zero3.abort_backward()

    def on_grad_accumulated(self, p: nn.Parameter) -> None:
        self._queue_end_of_backward()  # normally queued already by an output hook
        self.reducer.on_grad_ready(p, sync=self.sync_state.backward)

    @property
    def backward_sync(self) -> bool:
        """Whether the backward now running (or the next one) reduces gradients."""
        return self.sync_state.backward

    def sync_next_backward(self) -> None:
        """Make the next backward reduce even though its forward ran inside ``no_sync()``
        (Accelerate's ``trigger_sync_in_backward``, DDP's ``prepare_for_backward``)."""
        self.sync_state.backward = True

    def _end_of_backward(self) -> None:
        self._set_training(TrainingState.IDLE, "the end of backward")
        sync = self.sync_state.backward
        self.schedule.end_of_backward(self.reducer, sync=sync)
        if self.zero3 is not None:
            self.zero3.end_of_backward()
        if sync:
            self.sync_state.backward = False  # until a forward outside no_sync() (or sync_next_backward)

    # -- gradient accumulation ------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards run inside the block do not reduce in their backward: full local gradients
        accumulate without communication (a full gradient's memory at ZeRO-2). As with DDP,
        what counts is where the forward ran: the backward of the next forward outside the
        block reduces the sum."""
        prev, self.sync_state.enabled = self.sync_state.enabled, False
        try:
            yield
        finally:
            self.sync_state.enabled = prev

    def _need_optimizer(self, call: str) -> None:
        if self.schedule.full_grads:
            raise RuntimeError(
                f"{call}: this model was set up without an optimizer (initialize(model, None)), so there are no "
                "gradient shards to work on; at ZeRO-1/2 p.grad holds the full averaged gradient (use "
                "torch.nn.utils.clip_grad_norm_ on it), or bind an optimizer with zero_strategy.replace_optimizer()"
            )

    def finalize_grads(self) -> None:
        """Finish reduction on every rank and set the master pieces' gradients. Collective."""
        if self.grad_state is GradState.FINAL:
            return
        self._need_optimizer("finalize_grads()")
        self._expect_idle("finalizing the gradients (clip_grad_norm_, optimizer.step(), full_grad)",
                          "call it after loss.backward() returns", forward_ok=True)  # fmt: skip
        unmanaged = [n for n, p in self.module.named_parameters() if p.grad is not None and not self.reducer.manages(p)]
        if unmanaged:
            raise RuntimeError(
                f"parameters {unmanaged[:5]} have gradients but are not managed by zero_strategy (they were "
                "frozen when initialize() ran, or added later); set requires_grad before initialize()"
            )
        if self.scaler.enabled and self.grad_state is GradState.ACCUMULATING and not self.steps.loss_scaled:
            raise RuntimeError(
                "fp16 training needs a scaled loss: gradients are unscaled by the loss scale, so call "
                "zero_strategy.backward(loss) or optimizer.scale_loss(loss).backward() instead of loss.backward()"
            )
        self.steps.skip = self.reducer.finish(check_overflow=self.scaler.enabled)
        self._set_grad(GradState.FINAL, "finalize_grads()")

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        _from_config: bool = False,
    ) -> torch.Tensor:
        """Clip by the global norm over all ranks' shards: of ``optimizer``'s parameters when
        several optimizers are bound, else of the whole model. Returns that norm."""
        cfg_clip = self.policies.clipping
        if not _from_config and cfg_clip is not None and float(max_norm) != float(cfg_clip):
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}) conflicts with gradient_clipping={cfg_clip} from the "
                "config; clip in one place only (remove gradient_clipping from the config, or call "
                "clip_grad_norm_ with the same value)"
            )
        self.finalize_grads()
        self.params.fence_rows()  # the step writes host rows that a gather's copy may still read (uploads.py)
        scope = self.opts.scope(optimizer)
        total = self.reducer.clip_grad_norm_(max_norm, norm_type, only=scope)
        self.steps.clipped.add(0 if scope is None or optimizer is None else key(optimizer))
        return total

    def clip_grad_value_(self, clip_value: float, *, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Clamp every gradient element (of ``optimizer``'s parameters, when several optimizers
        are bound) to ``[-clip_value, clip_value]``."""
        if not clip_value > 0:
            raise ValueError(f"clip_grad_value_(clip_value={clip_value}): use a positive value")
        self.finalize_grads()
        self.reducer.clip_grad_value_(clip_value, only=self.opts.scope(optimizer))

    # -- optimizer step ------------------------------------------------------------------
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._expect_idle("optimizer.step()", "call it after loss.backward() returns", forward_ok=True)
        self.finalize_grads()
        self.params.fence_rows()  # the step writes host rows that a gather's copy may still read (uploads.py)
        scope = self.opts.scope(optimizer)
        clipped = 0 in self.steps.clipped or (scope is not None and key(optimizer) in self.steps.clipped)
        if self.policies.clipping is not None and not clipped:
            self.clip_grad_norm_(self.policies.clipping, optimizer=optimizer, _from_config=True)
        if self.steps.skip:
            self.reducer.drop_master_grads()
            return
        self.whole.gather(optimizer, self._step_label())  # whole matrices to their owners (or nothing)
        adam_direction(self.reducer.compression, optimizer, self.step_count)  # frozen-variance Adam (or nothing)
        if self.swapped is not None and self.optimizer is not None:
            self.disk.step(self.optimizer, self.params.masters_resident, self._step_label())
            # the optimizer's own step skips the disk groups (stepped already); their gradients come back after
            self.steps.stashed = [(m, m.grad) for g in self.swapped.groups for m in g.masters]
            for m, _ in self.steps.stashed:
                m.grad = None
        if self.host_step is not None and optimizer is self.optimizer:  # host masters: step and upload
            self.steps.stashed += self.host_step.run(optimizer, self._internal_step, self.swapped)  # not disk groups

    def _restore_stashed_grads(self) -> None:
        for m, grad in self.steps.stashed:
            m.grad = grad
        self.steps.stashed = []

    @contextlib.contextmanager
    def _internal_step(self) -> Iterator[None]:
        self.steps.internal = True
        try:
            yield
        finally:
            self.steps.internal = False

    def reset_step_calls(self) -> None:
        """No ``optimizer.step()`` is in progress (it returned or raised, or a forward starts):
        the depth count starts over and the disk tier's gradients are back."""
        self.steps.depth = 0
        self.steps.internal = False
        self._restore_stashed_grads()
        self.whole.forget()
        if self.host_step is not None:
            self.host_step.forget()

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._restore_stashed_grads()
        skipped = self.steps.skip
        self.steps.last_skipped = skipped
        self.scaler.update(skipped)
        if self.opts.scope(optimizer) is None:
            self.steps.clipped.clear()
        else:  # a clip of the whole model holds until the next backward (the other optimizers step too)
            self.steps.clipped.discard(key(optimizer))
        self.steps.loss_scaled = False
        if not skipped:
            self.whole.scatter(optimizer, self._step_label())  # the owners' updated matrices back to pieces
            self.params.after_step(self._step_label(), only=self.opts.scope(optimizer))  # its own parameters
            if (
                self.zero3 is not None and self.sync_state.root_depth > 0
            ):  # a step inside the forward (manual optimization)
                self.zero3.regather_root()
        if self.opts.begins_step(optimizer):  # a step of the model (several optimizers: each once in it)
            self.step_count += 1
            C.mark_step()  # the step's wall time, against which comm_report() sets the exposed communication
        if self.zero3 is not None:
            self.zero3.step = self._step_label()
        new = not skipped and key(optimizer) not in self.steps.stepped  # this optimizer's state exists now
        if new:
            self.steps.stepped.add(key(optimizer))
            stats = self.memory_stats()
            self.steps.scratch_budget = int(SCRATCH_SHARE * (stats["model_state"] - stats["tier_disk"]))
        if self.budget is not None and self.zero3 is not None and (new or self.budget.pending and not skipped):
            # measured again, persistent units chosen (budget.py)
            self.budget.after_new_state(self.memory_stats, self.zero3.cache, self.zero3.order, self._step_label(),
                                        can_change=self.sync_state.root_depth == 0)  # fmt: skip
        if self.steps.scratch_budget is not None:
            self.ctx.pool.trim(self.steps.scratch_budget)

    def zero_grad(self, set_to_none: bool = True, *, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Forget this window's gradients (see :meth:`GradReducer.zero_grad`): with several
        optimizers bound, ``optimizer``'s parameters' only; the others' stay, and the next
        step finishes them again (idempotent: a small flag all-reduce)."""
        self._expect_idle("zero_grad()", "call it between steps", forward_ok=True)
        scope = self.opts.scope(optimizer)
        self.reducer.zero_grad(set_to_none=set_to_none, full_grads=self.schedule.full_grads, only=scope)
        if scope is not None and optimizer is not None:
            self.steps.clipped.discard(key(optimizer))
            if self.grad_state is not GradState.EMPTY:
                self._set_grad(GradState.ACCUMULATING, "zero_grad() of one of several optimizers")
            return
        self.steps.clipped.clear()
        self.steps.loss_scaled = False
        self._set_grad(GradState.EMPTY, "zero_grad()")

    @contextlib.contextmanager
    def gathered_parameters(self, params: Any = None, modifier_rank: int | None = None) -> Iterator[None]:
        self._expect_idle(
            "gathered_parameters()",
            "use it between steps (parameters are gathered automatically inside forward and backward)",
        )
        refuse_modifier_rank(self.replica, modifier_rank)
        if modifier_rank is not None and not 0 <= modifier_rank < self.ctx.world_size:
            raise ValueError(
                f"gathered_parameters(modifier_rank={modifier_rank}): use a rank of the group, 0..{self.ctx.world_size - 1}, or None"
            )
        plist = None if params is None else [params] if isinstance(params, torch.Tensor) else list(params)
        with self.params.gathered(plist, modifier_rank, self._step_label()):
            yield

    # -- loss scaling ----------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if not self.scaler.enabled:
            return loss
        self.steps.loss_scaled = True
        return loss * self.scaler.scale

    # -- inspection ----------------------------------------------------------------------
    def full_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The full averaged gradient of model parameter ``p`` (None if no rank had one).
        Collective: every rank must call it for the same parameter."""
        if not self.reducer.manages(p):
            raise ValueError(
                f"full_grad(): parameter of shape {tuple(p.shape)} is not a trainable parameter of this model"
            )
        if self.schedule.full_grads:  # model-only ZeRO-1/2: p.grad is the full average already
            return None if p.grad is None else p.grad.detach().clone()
        self.finalize_grads()
        return self.reducer.full_grad(p, self._names[id(p)])

    # -- checkpoints -------------------------------------------------------------------------
    def wait_for_reductions(self) -> None:
        """Let every reduction in flight land in the gradient shards (before reading them)."""
        self.reducer.wait_all()

    @contextlib.contextmanager
    def swapped_state(self, *, writable: bool) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
        """Per master (by id), the optimizer state that is on disk, as memory maps of the swap
        files (empty without the disk tier); ZeRO-3 rows on disk are memory maps inside the
        block too: checkpoints stream them instead of loading them."""
        with self.disk.mapped(self.optimizer, lambda: self.params.mapped(writable=writable), writable=writable) as m:
            yield m

    def close(self) -> None:
        """Remove the engine's hooks (the model keeps its current parameters) and the swap files
        of the disk tier."""
        self.disk.close()
        for h in self._hooks + self._schedule_hooks:
            h.remove()
        self._hooks.clear()
        self._schedule_hooks.clear()
        _LIVE.discard(self)

    def destroy(self) -> None:
        """Hand the model back as a plain module and free what the engine holds: ZeRO-3 gathers
        every unit into ordinary full parameters (a collective: call it on every rank), the
        hooks go, the module gets its own class back, gradient shards, masters' gradients and
        communication buffers are dropped. The bound optimizer cannot step afterwards."""
        self._expect_idle("destroy()", "call it between steps")
        self.reducer.wait_all()
        if isinstance(self.params, ShardedParams):
            self.params.materialize(f"destroy ({self._step_label()})")
        self.close()
        for g in self.groups:
            g.release_grad_shard()
            for p in g.params:
                p.grad = None
        self.ctx.pool.clear()
        self.destroyed = True
        if getattr(self.module, "_zero_engine", None) is self:
            unswap_class(self.module)
            del self.module._zero_engine
        callbacks, self._on_destroy = self._on_destroy, []
        for fn in callbacks:
            fn()

    def on_destroy(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at the end of :meth:`destroy` (a front-end undoes what it added to the
        module, e.g. a forward wrapper)."""
        self._on_destroy.append(fn)


SCRATCH_SHARE = 0.08  # of the model state: free communication buffers kept from one step to the next
