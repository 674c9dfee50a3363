"""Shard groups (hybrid sharding: DeepSpeed's MiCS, FSDP's HSDP): shard within a group,
replicate across groups.

With ``shard_size = s`` the ``N`` ranks form ``N/s`` shard groups of ``s`` contiguous ranks
(group ``g`` is ranks ``[g*s, (g+1)*s)``). Parameters (ZeRO-3), gradient shards and optimizer
state are cut into ``s`` pieces within each group, and every group holds the same pieces. The
ranks with the same index in every group form a *replica group*.

The engine's communication context (``engine.ctx``) is the shard group's, so everything that
shards or gathers (ZeRO-3's unit gathers, ZeRO-1/2's parameter all-gather after the step,
``full_grad``, the gradient norm) runs inside the group unchanged. ``engine.replica`` is the
replica group's: each gradient shard, once reduce-scattered inside the group, is all-reduced
across it (``GradReducer``), and averaged over all ``N`` ranks, so the numbers are DDP's over
all ranks. What must agree over all ranks uses ``engine.world`` (the whole group): the start
broadcast, the buffers' broadcast, the setup agreement, the gradient flags and the fp16
overflow flag. Data stays per global rank. A flat layout (``shard_size`` None or ``N``) has a
one-rank replica group whose collectives are no-ops.

Sharded checkpoints keep their one layout (``checkpoint/state.py``): each piece is described
within its shard group, and DCP runs over all ranks, so the pieces that every group holds alike
are written once and a checkpoint loads at any world size, stage and shard size.

Per step the slow link (across groups) carries ``2 (r-1)/r * Psi/s`` gradient elements
(``r = N/s`` replicas) instead of a flat ZeRO-3's gathers and reduce-scatter over all ranks;
the price is memory: model state per rank is ``1/s`` instead of ``1/N``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from zero_strategy.comm import collectives as C
from zero_strategy.comm.policy import CommPolicy
from zero_strategy.config.comm import CompressionConfig, LoadBalanceConfig
from zero_strategy.config.memory import MemoryConfig
from zero_strategy.runtime.shard_layout import MeshLayout, mesh_groups_over, resolve_shard_size
from zero_strategy.storage.offload import OffloadSettings

__all__ = [
    "ShardGroupPolicy", "ShardGroupSettings", "refuse_modifier_rank", "shard_contexts", "shard_group_policy",
    "valid_shard_sizes",
]  # fmt: skip


def valid_shard_sizes(world_size: int) -> list[int]:
    return [d for d in range(1, world_size + 1) if world_size % d == 0]


class ShardGroupSettings(OffloadSettings, Protocol):
    """What :func:`shard_group_policy` reads of a config (``ZeroConfig`` has these), the two
    offload sections included."""

    @property
    def shard_size(self) -> int | str | None: ...
    @property
    def compression(self) -> CompressionConfig: ...
    @property
    def load_balance(self) -> LoadBalanceConfig: ...
    @property
    def memory(self) -> MemoryConfig: ...
    @property
    def moe_expert_layout(self) -> str: ...


@dataclass(frozen=True)
class ShardGroupPolicy:
    """``size``: the config's ``shard_size`` (a number, ``"node"``, or None: all ranks);
    ``unsupported``: the settings that do not work with shard groups yet, each with what to do
    (refused when the groups are smaller than the world)."""

    size: int | str | None = None
    unsupported: tuple[str, ...] = ()


def shard_group_policy(config: ShardGroupSettings) -> ShardGroupPolicy:
    out = []
    if config.compression.enabled:
        out.append("top-k compression (compression) exchanges sparse pieces over all ranks; remove it")
    if config.load_balance.enabled:
        out.append("load_balance cuts shards over all ranks; remove it")
    if config.memory.enabled:
        out.append("the memory budget (memory) may choose different persistent units per shard group; remove it")
    if "nvme" in (config.offload_optimizer.device, config.offload_param.device):
        out.append("offload to nvme keeps swap files per rank of one flat layout; offload to 'cpu' instead")
    if config.moe_expert_layout != "sharded":
        out.append(f"moe_expert_layout={config.moe_expert_layout!r} places experts over all ranks; use 'sharded'")
    return ShardGroupPolicy(config.shard_size, tuple(out))


def shard_contexts(
    world: C.CommContext, policy: ShardGroupPolicy, comm: CommPolicy, *, built_sharded: bool,
    mesh: MeshLayout | None = None,
) -> tuple[C.CommContext, C.CommContext]:  # fmt: skip
    """The shard group's and the replica group's contexts for ``policy.size`` (or a 2-D
    ``mesh``'s own groups, runtime/shard_layout.py) over ``world``'s ranks (flat: ``world`` and a
    one-rank context). Collective over ``world`` when the layout is not flat or the size is
    ``"node"``; call it after the setup agreement (every rank has this config)."""
    size, n = resolve_shard_size(world, policy.size), world.world_size
    if size is None or size == n:
        return world, C.solo_context(world)
    if n % size:
        sizes = ", ".join(map(str, valid_shard_sizes(n)))
        raise ValueError(
            f"initialize(): shard_size={size} does not divide the world size {n}; use one of the valid shard sizes "
            f"at {n} ranks: {sizes} (or None / -1 to shard over all ranks)"
        )
    problems = list(policy.unsupported)
    if built_sharded:
        problems.append("a model built with zero_strategy.sharded_init holds pieces cut over all ranks; build it whole")
    if problems:
        raise ValueError(f"initialize(): shard_size={size} does not work yet with: " + "; ".join(problems))
    shard_pg, replica_pg = C.split_groups(world, size) if mesh is None else mesh_groups_over(mesh, world)
    return comm.context(shard_pg, world.device), comm.context(replica_pg, world.device)


def refuse_experts(replica: C.CommContext, groups: Any) -> None:
    """MoE experts units reduce the rows of each group's own selection, which differ between
    shard groups: refused with shard groups."""
    if replica.distributed and any(g.experts is not None for g in groups):
        raise ValueError(
            "initialize(): shard_size with MoE experts units (stacked experts found at stage 3) is not supported yet: "
            "each shard group selects other experts; use stage 1 or 2, or no shard_size"
        )


def refuse_modifier_rank(replica: C.CommContext, modifier_rank: int | None) -> None:
    if replica.distributed and modifier_rank is not None:
        raise NotImplementedError(
            "gathered_parameters(modifier_rank=...) with shard_size is not supported yet (the changes would reach "
            "one shard group only); modify the parameters identically on every rank with modifier_rank=None"
        )
