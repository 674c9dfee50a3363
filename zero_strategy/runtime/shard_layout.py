"""Where a shard-group layout (runtime/shard_groups.py) comes from besides a number: a
``DeviceMesh``, as FSDP2's HSDP takes it, and the launcher's node layout.

**A mesh.** ``initialize(model, optimizer, mesh=mesh)`` (FSDP2's ``fully_shard(mesh=...)``
name; ``shard_size=mesh`` is the same). Dim 0 replicates and dim 1 shards, as FSDP2 reads a
2-D mesh: ``init_device_mesh("cuda", (replicas, shard), mesh_dim_names=("dp_replicate",
"dp_shard"))`` (or ``("replicate", "shard")``, or no names). A mesh whose dim 0 is named for
sharding or dim 1 for replication is refused rather than read backwards. A 1-D mesh is flat:
its group is the engine's process group. With a 2-D mesh the engine communicates on the
mesh's own groups, so any layout works whose replicate groups pair ranks holding the same
piece: torch numbers a group's members in rank order, so every column of the mesh must take
the same place in its row. ``init_device_mesh``'s meshes (contiguous rank blocks, the layout a
number builds) and their transpose do; others are refused, naming the fix. The config's
``shard_size`` becomes the mesh's dim-1 size (a different explicit value conflicts).

**The node layout.** ``shard_size: node`` is one shard group per node: ``LOCAL_WORLD_SIZE``
(set by torchrun and ``zero-strategy launch``) when every rank reports the same value, it
divides the world and each node's ranks are a contiguous block (rank ``r`` has ``LOCAL_RANK ==
r % LOCAL_WORLD_SIZE``, torchrun's numbering); otherwise flat, with the reason in a warning.
A multi-node user gets intra-node sharding (cross-node traffic: the gradient shards' all-reduce
only) by setting this one key.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

from zero_strategy.comm import collectives as C
from zero_strategy.config.zero_config import NODE_SHARD_SIZE

__all__ = ["MeshLayout", "mesh_shard_size", "resolve_shard_size", "take_mesh"]


@dataclass(frozen=True)
class MeshLayout:
    """A 2-D mesh's groups for this rank and every shard group's ranks (the mesh's rows)."""

    shard: Any  # this rank's dim-1 process group
    replica: Any  # this rank's dim-0 process group
    rows: tuple[tuple[int, ...], ...]


def _says(name: Any, word: str) -> bool:
    return isinstance(name, str) and word in name.lower()


def _checked(mesh: Any, call: str) -> tuple[list[Any], list[list[int]]]:
    """The mesh's groups and its rows of ranks (a 1-D mesh: one row), refusing what cannot be read."""
    groups = C.mesh_groups(mesh)
    if groups is None:
        raise TypeError(f"{call}: mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if len(groups) not in (1, 2):
        raise ValueError(
            f"{call}: a {len(groups)}-D DeviceMesh; give the data-parallel mesh, 1-D (flat) or 2-D with dim 0 "
            "replicate and dim 1 shard, e.g. mesh['dp_replicate', 'dp_shard'] of a larger mesh"
        )
    names = tuple(mesh.mesh_dim_names or (None,) * len(groups))
    if len(groups) == 2 and (
        _says(names[1], "replicate") or (_says(names[0], "shard") and not _says(names[0], "replicate"))
    ):
        raise ValueError(
            f"{call}: the mesh's dims are {names}, but dim 0 replicates and dim 1 shards (FSDP2's HSDP order); "
            "build it with the replicate dim first: init_device_mesh(device, (replicas, shard_size), "
            "mesh_dim_names=('dp_replicate', 'dp_shard'))"
        )
    rows = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()
    if len(groups) == 2:
        place = {r: sorted(row).index(r) for row in rows for r in row}  # a group's rank: its place in rank order
        for col in zip(*rows):
            if len({place[r] for r in col}) > 1:
                raise ValueError(
                    f"{call}: the mesh {rows} cannot be used: its replicate group {sorted(col)} pairs ranks that hold "
                    f"different pieces of their shard groups (torch numbers a group's ranks in rank order: places "
                    f"{[place[r] for r in col]}). Build it with init_device_mesh(device, ({len(rows)}, {len(rows[0])}), "
                    f"mesh_dim_names=('dp_replicate', 'dp_shard')), or pass shard_size={len(rows[0])} instead"
                )
    return groups, rows


def mesh_shard_size(mesh: Any, call: str) -> int:
    """Ranks per shard group of ``mesh`` (its dim-1 size; a 1-D mesh: all its ranks), checked.
    For front-ends that keep the config before ``initialize`` (no collective)."""
    return len(_checked(mesh, call)[1][0])


def take_mesh(mesh: Any, process_group: Any, call: str) -> tuple[list[list[int]] | None, Any, MeshLayout | None]:
    """``initialize(mesh=...)``: the mesh's rank rows (their length is the shard size the
    config takes; None without a mesh), the process group (a 1-D mesh's own group) and, for a
    2-D mesh, its layout for :func:`shard_groups.shard_contexts`."""
    if mesh is None:
        return None, process_group, None
    groups, rows = _checked(mesh, call)
    if len(groups) == 1:
        if process_group is not None and process_group is not groups[0]:
            raise ValueError(f"{call}: both process_group and a 1-D mesh were given; pass one of them")
        return rows, groups[0], None
    return rows, process_group, MeshLayout(groups[1], groups[0], tuple(tuple(r) for r in rows))


def mesh_groups_over(layout: MeshLayout, world: C.CommContext) -> tuple[Any, Any]:
    """The mesh's shard and replica process groups, once its ranks are known to be ``world``'s."""
    ranks = sorted(r for row in layout.rows for r in row)
    if ranks != sorted(world.global_ranks):
        raise ValueError(
            f"initialize(mesh=...): the mesh holds ranks {ranks} but the process group has {sorted(world.global_ranks)}; "
            "give a mesh over the group's ranks, or process_group= a group of exactly the mesh's ranks"
        )
    return layout.shard, layout.replica


def _node_fallback(reason: str, n: int) -> None:
    warnings.warn(f"shard_size='node': {reason}; sharding over all {n} ranks (flat)", UserWarning, stacklevel=5)


def resolve_shard_size(world: C.CommContext, size: int | str | None) -> int | None:
    """The config's ``shard_size`` as a number: ``"node"`` read from the launcher's layout (a
    collective over ``world``; after the setup agreement, so every rank asks), else as given."""
    if size != NODE_SHARD_SIZE:
        return size if isinstance(size, int) else None
    n = world.world_size
    if not world.distributed:
        return None
    mine = []
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        raw = os.environ.get(key, "")
        mine.append(int(raw) if raw.strip().isdigit() else None)
    every = C.all_gather_objects(world, mine, what="shard_size='node': each rank's LOCAL_WORLD_SIZE")
    sizes = sorted({e[0] for e in every if e[0] is not None})
    missing = [r for r, e in enumerate(every) if None in e]
    if missing:
        _node_fallback(f"LOCAL_WORLD_SIZE / LOCAL_RANK are not set on ranks {missing} (torchrun and "
                       "zero-strategy launch set them)", n)  # fmt: skip
        return None
    if len(sizes) > 1:
        _node_fallback(f"the ranks report different LOCAL_WORLD_SIZE {sizes}; give shard_size a number", n)
        return None
    local = sizes[0]
    if local < 1 or n % local:
        _node_fallback(f"LOCAL_WORLD_SIZE={local} does not divide the world size {n}", n)
        return None
    if any(e[1] != r % local for r, e in enumerate(every)):
        _node_fallback(f"the nodes' ranks are not contiguous blocks of {local} (rank r should have LOCAL_RANK "
                       f"r % {local}); give shard_size a number or a DeviceMesh", n)  # fmt: skip
        return None
    return local
