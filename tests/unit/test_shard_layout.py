"""Shard groups from a DeviceMesh and from the launcher's node layout (runtime/shard_layout.py),
single process: the config's values, the mesh's checks on a one-rank gloo group, the node
layout's reasons on a faked 4-rank gather, and the front-end helpers. The 4-rank numbers are
in tests/distributed/test_shard_groups.py."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zero_strategy as zs
from zero_strategy.comm import collectives as C
from zero_strategy.frontend import parallelism_shard_size, split_shard_size
from zero_strategy.runtime import shard_layout


@pytest.fixture
def one_rank(tmp_path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_shard_size_node_is_a_config_value_and_a_mesh_is_not() -> None:
    assert zs.ZeroConfig(shard_size="Node").shard_size == "node"
    assert zs.ZeroConfig.from_dict({"zero_strategy": {"shard_size": "node"}}).shard_size == "node"
    assert zs.ZeroConfig.from_dict(zs.ZeroConfig(shard_size="node").to_dict()).shard_size == "node"
    with pytest.raises(ValueError, match="'node' for one group per node"):
        zs.ZeroConfig(shard_size=-2)

    class DeviceMesh:  # the config refuses it by name, before any process group exists
        pass

    with pytest.raises(
        TypeError, match=r"a DeviceMesh is not a config value.*initialize\(model, optimizer, mesh=mesh\)"
    ):
        zs.ZeroConfig(shard_size=DeviceMesh())


def _fake_world(monkeypatch: pytest.MonkeyPatch, every: list[Any]) -> C.CommContext:
    """A 4-rank world whose gather of (LOCAL_WORLD_SIZE, LOCAL_RANK) returns ``every``."""
    monkeypatch.setattr(C, "all_gather_objects", lambda ctx, obj, what: every)
    return C.CommContext(None, 0, 4, C.DEFAULT_TIMEOUT, "native", torch.device("cpu"), global_ranks=(0, 1, 2, 3))


@pytest.mark.parametrize(
    ("every", "reason"),
    [
        ([[2, 0], [2, 1], [2, 0], [2, 1]], None),  # torchrun on 2 nodes of 2
        ([[4, 0], [4, 1], [4, 2], [4, 3]], None),  # one node: flat, nothing to report
        ([[2, 0], [None, None], [2, 0], [2, 1]], "are not set on ranks [1]"),
        ([[2, 0], [2, 1], [1, 0], [1, 0]], "different LOCAL_WORLD_SIZE [1, 2]"),
        ([[3, 0], [3, 1], [3, 2], [3, 0]], "LOCAL_WORLD_SIZE=3 does not divide the world size 4"),
        ([[2, 0], [2, 0], [2, 1], [2, 1]], "not contiguous blocks of 2"),
    ],
)
def test_node_shard_size_from_the_launcher(
    monkeypatch: pytest.MonkeyPatch, every: list[Any], reason: str | None
) -> None:
    world = _fake_world(monkeypatch, every)
    cfg = zs.ZeroConfig(shard_size="node")
    if reason is None:
        assert shard_layout.resolve_shard_size(world, cfg.shard_size) == every[0][0]
        return
    with pytest.warns(UserWarning, match=r"shard_size='node': .*sharding over all 4 ranks \(flat\)") as record:
        assert shard_layout.resolve_shard_size(world, cfg.shard_size) is None
    assert reason in str(record[0].message)
    assert shard_layout.resolve_shard_size(world, zs.ZeroConfig(shard_size=2).shard_size) == 2  # a number: as given


def test_mesh_reaches_the_engine_and_is_checked(one_rank: None) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    for kwargs in ({"mesh": mesh}, {"shard_size": mesh}):
        model = torch.nn.Linear(4, 4)
        model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, **kwargs)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        assert model.zero_engine.config.shard_size == 1  # the mesh's dim-1 size
        zs.destroy(model)
    flat = init_device_mesh("cpu", (1,))  # 1-D: flat over its group
    model, _ = zs.initialize(torch.nn.Linear(4, 4), None, mesh=flat)
    assert model.zero_engine.ctx.world_size == 1 and not model.zero_engine.replica.distributed
    with pytest.raises(ValueError, match=r"shard_size=2 from the config conflicts with shard_size=1 from"):
        zs.initialize(torch.nn.Linear(4, 4), None, config=zs.ZeroConfig(shard_size=2), mesh=mesh)
    backwards = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "dp_replicate"))
    with pytest.raises(ValueError, match=r"dim 0 replicates and dim 1 shards .*replicate dim first"):
        zs.initialize(torch.nn.Linear(4, 4), None, mesh=backwards)
    with pytest.raises(ValueError, match=r"a 3-D DeviceMesh; give the data-parallel mesh"):
        zs.initialize(torch.nn.Linear(4, 4), None, mesh=init_device_mesh("cpu", (1, 1, 1)))
    with pytest.raises(TypeError, match="both mesh= and shard_size="):
        zs.initialize(torch.nn.Linear(4, 4), None, mesh=mesh, shard_size=mesh)
    assert split_shard_size(mesh, "X(shard_size=...)") == (1, mesh)
    assert split_shard_size("node", "X(shard_size=...)") == ("node", None)


def test_accelerate_parallelism_config_as_shard_size() -> None:
    def pc(**sizes: int) -> SimpleNamespace:
        return SimpleNamespace(**({"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1, "cp_size": 1} | sizes))

    assert parallelism_shard_size(pc(dp_replicate_size=2, dp_shard_size=4), "P()") == 4
    assert parallelism_shard_size(pc(dp_replicate_size=8), "P()") is None  # dp_shard_size 1: not given
    assert parallelism_shard_size(None, "P()") is None
    for name in ("tp_size", "cp_size"):
        with pytest.raises(ValueError, match=rf"P\(\): ParallelismConfig\({name}=2\) is not supported.*Set {name}=1"):
            parallelism_shard_size(pc(dp_shard_size=2, **{name: 2}), "P()")
