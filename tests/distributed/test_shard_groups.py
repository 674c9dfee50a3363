"""Shard groups (``shard_size``, DeepSpeed's ``mics_shard_size``) against the DDP oracle over
all ranks: 4 ranks as 2 shard groups of 2, at stages 1, 2 and 3, in one launch.

Each cell also checks the layout (``parity.check_shard_groups``): the shard group's and the
replica group's ranks, and every gradient shard cut over 2 ranks, so a run that stayed flat
cannot pass. A 3-rank launch refuses a shard size that does not divide the world.
"""

from __future__ import annotations

import os

CELLS: list[dict] = [
    {"stage": 1, "optim": "adam"},
    {"stage": 1, "accum": "no_sync", "clip": 0.05, "optim": "sgd"},
    {"stage": 2, "accum": "plain", "clip": 0.05},
    {"stage": 2, "accum": "no_sync", "impl": "native", "offload": "cpu"},
    {"stage": 2, "unused": "some_ranks"},  # a gradient on one rank only: the flags agree over all ranks
    {"stage": 3, "persist": 0, "accum": "plain", "clip": 0.05},
    {"stage": 3, "persist": 0, "accum": "no_sync", "optim": "adagrad", "impl": "native"},
    {"stage": 3, "persist": 0, "shard_size": 1},  # one rank per group: reduced by the all-reduce alone
    {"stage": 2, "shard_size": 4},  # one group of all ranks: the flat layout
    {"stage": 3, "persist": 0, "accum": "no_sync", "mesh": "2x2"},  # a 2-D DeviceMesh: its own process groups
    {"stage": 2, "mesh": "2x2t"},  # a mesh whose shard groups are {0, 2} and {1, 3}, not contiguous blocks
    {"stage": 3, "persist": 0, "shard_size": "node"},  # LOCAL_WORLD_SIZE=2 (set below): two "nodes" of 2
]


def _worker(rank: int, world: int, root: str) -> int:
    import warnings

    import torch
    from torch.distributed.device_mesh import DeviceMesh

    import zero_strategy as zs
    from zero_strategy.testing import run_subtests
    from zero_strategy.testing.parity import Cell, Net, compare

    def one(**kw) -> None:
        compare(Cell(dtype="float32", steps=4, **{"shard_size": 2, **kw}), rank, world)

    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2))  # as torchrun on 2 nodes of 2
    run_subtests(one, CELLS, label="shard groups, 4 ranks as 2 x 2")
    # "node" where the layout does not divide the world: flat, with the reason
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flat, _ = zs.initialize(Net(Cell()), None, config=zs.ZeroConfig(stage=1, shard_size="node"))
    if flat.zero_engine.ctx.world_size != 4 or not any(
        "does not divide the world size 4" in str(w.message) for w in caught
    ):
        raise AssertionError(f"shard_size='node' with LOCAL_WORLD_SIZE=3: {[str(w.message) for w in caught]}")
    # a mesh whose replicate groups pair different pieces is refused on every rank, naming the fix
    bad = DeviceMesh("cpu", torch.tensor([[0, 3], [2, 1]]), mesh_dim_names=("replicate", "shard"))
    try:
        zs.initialize(Net(Cell()), None, mesh=bad)
    except ValueError as e:
        if "init_device_mesh(device, (2, 2)" not in str(e):
            raise AssertionError(f"the refusal does not name the fix: {e}") from e
    else:
        raise AssertionError("a mesh with mismatched replicate groups was not refused")
    # a setting that does not work with shard groups yet is refused on every rank, naming it
    cfg = zs.ZeroConfig(stage=2, shard_size=2, compression={"type": "topk", "ratio": 0.01})
    try:
        zs.initialize(Net(Cell()), None, config=cfg)
    except ValueError as e:
        if "top-k compression" not in str(e):
            raise AssertionError(f"the refusal does not name top-k compression: {e}") from e
    else:
        raise AssertionError("shard_size with top-k compression was not refused")
    return len(CELLS)


def test_shard_groups_match_ddp(launch, tmp_path) -> None:
    assert launch(_worker, 4, args=(str(tmp_path),), timeout=300) == [len(CELLS)] * 4


def _refusal_worker(rank: int, world: int) -> str:
    import torch

    import zero_strategy as zs
    from zero_strategy.testing.parity import Cell, Net

    model = Net(Cell())
    try:
        zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      config={"zero_optimization": {"stage": 3, "mics_shard_size": 2}})  # fmt: skip
    except ValueError as e:
        return str(e)
    return "accepted"


def test_shard_size_must_divide_the_world(launch) -> None:
    for message in launch(_refusal_worker, 3, timeout=120):
        assert "shard_size=2 does not divide the world size 3" in message, message
        assert "valid shard sizes at 3 ranks: 1, 3" in message, message
