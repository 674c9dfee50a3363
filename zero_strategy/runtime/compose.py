"""The composition root: the one place below the public API where the user's config is read.

``ZeroConfig`` speaks the user's language (DeepSpeed's keys, our own knobs, the front-ends'
overrides). The layers below speak their own: each owns a small frozen policy and the function
that builds it from the few fields it uses, declared as a ``Protocol`` beside it, so a reader
of a layer sees exactly which settings it depends on (FSDP2 resolves ``fully_shard``'s
arguments the same way, into ``MixedPrecisionPolicy`` and ``OffloadPolicy``):

=====================  ==============================  =====================================
policy                 built by                        read by
=====================  ==============================  =====================================
``CommPolicy``         ``comm/policy.py``              every context: world, shard and
                                                       replica groups, hpZ's groups
``ShardGroupPolicy``   ``runtime/shard_groups.py``     ``shard_contexts``
``StoragePolicy``      ``storage/offload.py``          ``placement.resolve_ratios``,
                                                       :func:`build_storage` (its two
                                                       ``OffloadPolicy``: groups, unit rows)
``Precision``          ``sharding/precision.py``       groups, units, reducer, forward
``GatherPolicy``       ``sharding/gather_policy.py``   unit storage, hpZ, ``UnitScheduler``
``ReducePolicy``       ``reduction/policy.py``         :func:`make_reducer`, the ZeRO-1/2
                                                       buckets (:func:`build_storage`)
=====================  ==============================  =====================================

:func:`resolve_policies` checks the config once (its conflicts, the settings read but not
applied) and builds them all into :class:`EnginePolicies`; the engine's constructor then runs
the steps below in order, each a plain function whose result becomes one of its fields.
Nothing below this module and the engine imports ``ZeroConfig`` (``tests/unit/test_imports.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zero_strategy.comm import collectives as C
from zero_strategy.comm.balance import check_load_balance, shard_fractions
from zero_strategy.comm.policy import CommPolicy, comm_policy
from zero_strategy.config import ZeroConfig, warn_not_applied
from zero_strategy.config.blocks import LossScaleConfig
from zero_strategy.config.comm import LoadBalanceConfig
from zero_strategy.config.memory import MemoryConfig
from zero_strategy.offload.disk_tier import DiskTier
from zero_strategy.reduction.compression import build_compression
from zero_strategy.reduction.grads import GradReducer
from zero_strategy.reduction.policy import ReducePolicy, reduce_policy
from zero_strategy.runtime.budget import Budget
from zero_strategy.runtime.placement import resolve_ratios
from zero_strategy.runtime.shard_groups import ShardGroupPolicy, shard_contexts, shard_group_policy
from zero_strategy.runtime.shard_layout import MeshLayout
from zero_strategy.runtime.zero3 import UnitScheduler, Zero3Settings
from zero_strategy.sharding.construction import materialize_full
from zero_strategy.sharding.experts.owners import unit_cuts
from zero_strategy.sharding.gather_policy import GatherPolicy, gather_policy
from zero_strategy.sharding.group import (
    GroupSpec,
    InPlaceMasters,
    SeparateMasters,
    ShardGroup,
    bucket_numel,
    build_groups,
)
from zero_strategy.sharding.members import unit_members
from zero_strategy.sharding.partition import UnitPlan, UnitPolicy, find_units
from zero_strategy.sharding.pieces import check_placeholder, forget_pieces, sharded_init_piece
from zero_strategy.sharding.precision import LossScaler, Precision, select_precision, select_scaler
from zero_strategy.sharding.replicated import ReplicatedParams
from zero_strategy.sharding.secondary import SecondaryShards, secondary_context
from zero_strategy.sharding.setup_checks import agree_on_setup, check_params, refuse_norm_layers_with_running_stats
from zero_strategy.sharding.unit import ParamStorage, ShardedParams
from zero_strategy.storage.host_memory import HostPeak
from zero_strategy.storage.offload import StoragePolicy, storage_policy

__all__ = [
    "Contexts", "EnginePolicies", "Storage", "build_storage", "make_reducer", "make_scaler", "make_zero3",
    "note_accumulation", "resolve_policies", "shard_group_contexts", "world_context",
]  # fmt: skip


@dataclass(frozen=True)
class EnginePolicies:
    """Each layer's policy, and the few settings the engine itself reads."""

    stage: int
    comm: CommPolicy
    groups: ShardGroupPolicy
    storage: StoragePolicy
    precision: Precision
    gather: GatherPolicy
    reduce: ReducePolicy
    clipping: float | None  # gradient_clipping: the norm clipped to before every step, None: off
    loss_scale: LossScaleConfig
    loss_scale_explicit: bool  # an fp16 block was given: DeepSpeed's schedule even in mixed precision
    memory: MemoryConfig  # the ZeRO-3 memory budget (runtime/budget.py)
    load_balance: LoadBalanceConfig  # uneven shards by rank speed (comm/balance.py)
    settings: Mapping[str, Any]  # the resolved config as plain values: every rank must agree on them
    accumulation_steps: int | None  # gradient_accumulation_steps: the front-ends' business (note_accumulation)


def resolve_policies(config: ZeroConfig, caller: str = "initialize()") -> EnginePolicies:
    """Check ``config`` (every conflict of the resolved config, ``ZeroConfig.conflicts``; bad
    offload settings fail here, before any change) and build each layer's policy from it."""
    warn_not_applied(config, stacklevel=5)  # once per setting and job; at initialize(), as before the root
    config.check(caller=caller)
    return EnginePolicies(
        stage=config.stage,
        comm=comm_policy(config),
        groups=shard_group_policy(config),
        storage=storage_policy(config),
        precision=select_precision(config.precision),
        gather=gather_policy(config),
        reduce=reduce_policy(config),
        clipping=config.gradient_clipping,
        loss_scale=config.loss_scale,
        loss_scale_explicit=config.explicitly_set("loss_scale"),
        memory=config.memory,
        load_balance=config.load_balance,
        settings=config.to_dict(),
        accumulation_steps=config.gradient_accumulation_steps,
    )


def note_accumulation(policies: EnginePolicies) -> None:
    """The core API does not accumulate for ``gradient_accumulation_steps``: say so (at the
    caller of ``initialize``)."""
    steps = policies.accumulation_steps
    if steps not in (None, 1):
        warnings.warn(
            f"gradient_accumulation_steps={steps} is read by the Lightning and Accelerate front-ends; the core API "
            "neither scales the loss nor skips steps for it. In a plain loop, divide the loss by the number of "
            "micro-steps and use model.no_sync().",
            UserWarning,
            stacklevel=4,
        )


def world_context(
    module: nn.Module, policies: EnginePolicies, process_group: Any, *, built_sharded: bool, config: ZeroConfig
) -> C.CommContext:
    """The whole group's context, on the model's device (its first parameter's), once what
    needs only the world size is refused (the config's rules with it, load balancing)."""
    first = next(module.parameters(), None)
    world = policies.comm.context(process_group, first.device if first is not None else None)
    config.check(world.world_size, caller="initialize()")
    check_load_balance(policies.load_balance, policies.stage, built_sharded=built_sharded)
    return world


def make_scaler(policies: EnginePolicies) -> LossScaler:
    return select_scaler(policies.loss_scale, policies.precision, explicit=policies.loss_scale_explicit)


@dataclass(frozen=True)
class Contexts:
    """The shard group's context (the engine's ``ctx``), the replica group's (one rank when
    flat) and hpZ's secondary group (None: off)."""

    shard: C.CommContext
    replica: C.CommContext
    secondary: C.CommContext | None


def shard_group_contexts(
    world: C.CommContext, policies: EnginePolicies, named: Sequence[tuple[str, nn.Parameter]],
    owned: Mapping[int, str], *, built_sharded: bool, mesh: MeshLayout | None,
) -> Contexts:  # fmt: skip
    """The parameters checked (``owned``: those another live engine holds), every rank's
    agreement on the model and config (one small all-gather), then the shard, replica and hpZ
    groups (collective when the layout is not flat)."""
    check_params(list(named), world, dict(owned))
    agree_on_setup(world, policies.settings, list(named))
    shard, replica = shard_contexts(world, policies.groups, policies.comm, built_sharded=built_sharded, mesh=mesh)
    hpz = secondary_context(shard, policies.gather.hpz_size, policies.comm, grouped=policies.groups.size is not None)
    return Contexts(shard, replica, hpz)


@dataclass(frozen=True)
class Storage:
    """Step 5's result: the parameter storage and its shard groups (at ZeRO-3 each unit's rows
    hold this rank's pieces and the masters are views of them; at ZeRO-1/2 the groups are size
    buckets and the masters are views of the parameters, or fp32 copies for 16-bit parameters),
    the placement with any ``ratio: auto`` resolved, and ZeRO-3's unit plan (None at ZeRO-1/2)."""

    params: ParamStorage
    groups: list[ShardGroup]
    placement: StoragePolicy
    plan: UnitPlan | None


def build_storage(
    module: nn.Module, named: list[tuple[str, nn.Parameter]], unit_policy: UnitPolicy, policies: EnginePolicies,
    precision: Precision, world: C.CommContext, ctx: C.CommContext, disk: DiskTier, peak: HostPeak,
) -> Storage:  # fmt: skip
    """Rank 0's values everywhere (DDP's start), then the storage of ``policies.stage``: the
    first change the engine makes to the model."""
    built_sharded = [p for _, p in named if sharded_init_piece(p) is not None]
    for n, p in named:
        if sharded_init_piece(p) is not None:
            check_placeholder(p.data, n)
    if policies.stage != 3:  # ZeRO-1/2 keep full parameters: gather what sharded_init cut
        for p in built_sharded:
            materialize_full(p)

    # one bucket at a time: a rank that holds them already writes nothing (mapped weights stay
    # file pages); at ZeRO-3 unit by unit, each just before its rows are written (ShardedParams),
    # so no copy of the model exists
    def sync(params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor] = ()) -> None:
        full = [p for p in params if sharded_init_piece(p) is None]  # sharded_init: pieces of one init
        C.broadcast_coalesced(
            world, full + list(buffers), what="initial module state", keep_equal=True, on_bucket=peak.mark
        )

    sync([] if policies.stage == 3 else [p for _, p in named], list(module.buffers()))
    if precision.low_params:
        refuse_norm_layers_with_running_stats(module, precision.param_dtype)
    fractions = shard_fractions(policies.load_balance, ctx)  # None: even shards
    if policies.stage == 3:
        plan = find_units(module, unit_policy)
        # with a budget, persistent units are chosen by the budget (budget.py) once the state exists
        threshold = -1 if policies.memory.enabled else policies.gather.persistence_threshold
        # found once: ratio auto (the smallest offload that fits) and the unit storage
        members = unit_members(module, plan.storage_units(), named)
        cuts = unit_cuts(plan.experts, policies.gather.moe_expert_layout, ctx.world_size, fractions)
        placement = resolve_ratios(policies.storage, policies.memory, members, precision, ctx, fractions, cuts)
        storage = ShardedParams(
            members, named, ctx, precision, threshold,
            offload_optimizer=placement.optimizer, offload_params=placement.params,
            row_swap=disk.row_swap, fractions=fractions, unit_cuts=cuts, sync=sync, peak=peak,
            codec=policies.gather.codec,
        )  # fmt: skip
        forget_pieces(built_sharded)  # their pieces live in the unit rows now
        return Storage(storage, storage.groups, placement, plan)
    spec = GroupSpec(
        world_size=ctx.world_size,
        rank=ctx.rank,
        master_dtype_for=precision.master_dtype_for,
        reduce_dtype_for=precision.grad_reduce_dtype,
        master_policy=SeparateMasters() if precision.low_params else InPlaceMasters(),
        offload=policies.storage.optimizer,
        total_numel=sum(p.numel() for _, p in named if p.requires_grad),
        fractions=fractions,
    )
    trainable = [(n, p) for n, p in named if p.requires_grad]
    bucket = bucket_numel(policies.reduce.bucket_size, sum(p.numel() for _, p in trainable))
    groups = build_groups(list(reversed(trainable)), spec, bucket_numel=bucket)
    with torch.no_grad():  # 16-bit parameters, after the fp32 masters were taken from them
        for _, p in named:
            target = precision.param_dtype_for(p)
            if p.dtype != target:
                held = p.untyped_storage().nbytes() if p.device.type == "cpu" else 0
                p.data = p.data.to(target)
                peak.released(held)  # the original's pages go back as the 16-bit copies come
    params = ReplicatedParams(ctx, groups, [p for _, p in named], max_in_flight=policies.reduce.max_in_flight)
    peak.mark()  # the masters of 16-bit parameters and offloaded groups exist now
    return Storage(params, groups, policies.storage, None)


def make_reducer(
    groups: list[ShardGroup], ctx: C.CommContext, replica: C.CommContext, world: C.CommContext,
    policies: EnginePolicies, scaler: LossScaler, *, describe_step: Callable[[], str], steps_done: Callable[[], int],
) -> GradReducer:  # fmt: skip
    """The gradient reducer from the reduction policy (its callables hold no engine: they are
    the engine's weak methods)."""
    reduce = policies.reduce
    return GradReducer(
        groups,
        ctx,
        max_in_flight=reduce.max_in_flight,
        grad_factor=lambda: 1.0 / (world.world_size * scaler.scale),
        replica=replica,
        world=world,
        describe_step=describe_step,
        compression=build_compression(reduce.compression, groups, ctx, steps=steps_done),
        codec=reduce.codec(),
    )


def make_zero3(
    params: ParamStorage, plan: UnitPlan | None, reducer: GradReducer, policies: EnginePolicies,
    hpz: C.CommContext | None, other_engines_bytes: Callable[[], int],
) -> tuple[UnitScheduler | None, Budget | None]:  # fmt: skip
    """ZeRO-3's unit scheduler from the gather policy, and the memory budget's tiers when one
    is set (None, None at ZeRO-1/2). The budget's fit check needs the engine's memory stats:
    the engine runs it once both exist."""
    if not isinstance(params, ShardedParams) or plan is None:
        return None, None
    gather, memory = policies.gather, policies.memory
    budget = Budget(memory, params.ctx, params) if memory.enabled else None
    if budget is not None:
        budget.others = other_engines_bytes
    params.use_secondary(SecondaryShards(hpz) if hpz is not None else None)
    cache = budget.cache if budget is not None else None
    settings = Zero3Settings(gather, defer_checks=gather.defer_checks(params.ctx.device), cache=cache)
    zero3 = UnitScheduler(params, plan, reducer, settings)
    params.refresh_persistent("initialize")  # never partitioned for their readers
    reducer.deferred_check = params.checks  # read with the gradient flags
    return zero3, budget
