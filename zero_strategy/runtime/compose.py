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
``StoragePolicy``      ``storage/offload.py``          groups, unit rows, disk tier,
                                                       ``placement.resolve_ratios``
``Precision``          ``sharding/precision.py``       groups, units, reducer, forward
``GatherPolicy``       ``sharding/gather_policy.py``   unit storage, hpZ, ``UnitScheduler``
``ReducePolicy``       ``reduction/policy.py``         ``GradReducer``, ZeRO-1/2 gathers
=====================  ==============================  =====================================

:func:`resolve_policies` checks the config once (its conflicts, the settings read but not
applied) and builds them all into :class:`EnginePolicies`; the engine's constructor then runs
the steps below in order, each a plain function whose result becomes one of its fields.
Nothing below this module imports ``ZeroConfig`` (``tests/unit/test_imports.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from zero_strategy.comm import collectives as C
from zero_strategy.comm.balance import check_load_balance
from zero_strategy.comm.policy import CommPolicy, comm_policy
from zero_strategy.config import ZeroConfig, warn_not_applied
from zero_strategy.config.blocks import LossScaleConfig
from zero_strategy.config.comm import LoadBalanceConfig
from zero_strategy.config.memory import MemoryConfig
from zero_strategy.reduction.policy import ReducePolicy, reduce_policy
from zero_strategy.runtime.shard_groups import ShardGroupPolicy, shard_contexts, shard_group_policy
from zero_strategy.runtime.shard_layout import MeshLayout
from zero_strategy.sharding.gather_policy import GatherPolicy, gather_policy
from zero_strategy.sharding.precision import LossScaler, Precision, select_precision, select_scaler
from zero_strategy.sharding.secondary import secondary_context
from zero_strategy.sharding.setup_checks import agree_on_setup, check_params
from zero_strategy.storage.offload import StoragePolicy, storage_policy

__all__ = ["Contexts", "EnginePolicies", "make_scaler", "resolve_policies", "shard_group_contexts", "world_context"]


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


def resolve_policies(config: ZeroConfig, caller: str = "initialize()") -> EnginePolicies:
    """Check ``config`` (every conflict of the resolved config, ``ZeroConfig.conflicts``; bad
    offload settings fail here, before any change) and build each layer's policy from it."""
    warn_not_applied(config)  # once per setting and job
    config.check(caller=caller)
    if config.gradient_accumulation_steps not in (None, 1):
        warnings.warn(
            f"gradient_accumulation_steps={config.gradient_accumulation_steps} is read by the Lightning and "
            "Accelerate front-ends; the core API neither scales the loss nor skips steps for it. In a plain "
            "loop, divide the loss by the number of micro-steps and use model.no_sync().",
            UserWarning,
            stacklevel=4,
        )
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
