"""Load balancing's config, refusals and speed measurement (one process)."""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from zero_strategy.comm.balance import measure_speed
from zero_strategy.config.comm import LoadBalanceConfig


def test_config_forms_and_errors() -> None:
    ds = {"zero_optimization": {"stage": 1}, "zero_strategy": {"load_balance": {"alpha": 0.7, "beta": 0.3}}}
    assert zs.ZeroConfig.from_dict(ds).load_balance.weights() == (0.7, 0.3)
    assert zs.ZeroConfig(load_balance="bandwidth").load_balance.weights() == (0.3, 0.7)
    cfg = zs.ZeroConfig(load_balance={"scores": [3, "1"]})
    assert cfg.load_balance.scores == (3.0, 1.0) and cfg.load_balance.enabled
    assert zs.ZeroConfig.from_dict(cfg.to_dict()).load_balance == cfg.load_balance
    assert not zs.ZeroConfig().load_balance.enabled
    for bad, match in (
        ({"scores": [1, 0]}, r"load_balance.scores\[1\]: must be > 0"),
        ({"scores": []}, "empty"),
        ({"scores": "3,1"}, "list of positive numbers"),
        ({"alpha": 0.7}, "both alpha and beta"),
        ({"alpha": 0, "beta": 0}, "both 0"),
        ({"preset": "fast"}, "not one of 'compute', 'bandwidth'"),
        ({"preset": "compute", "alpha": 1, "beta": 1}, "not both"),
        ({"scores": [1, 2], "preset": "compute"}, "used as given"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            zs.ZeroConfig(load_balance=bad)


@pytest.mark.parametrize(
    "config,match",
    [
        ({"stage": 3, "load_balance": {"scores": [1]}, "offload_param": "nvme"}, "offload_param: {device: nvme}"),
        ({"stage": 3, "load_balance": {"scores": [1]}, "offload_optimizer": "nvme"}, "offload_optimizer"),
        ({"stage": 2, "load_balance": {"scores": [3, 1]}}, "2 entries for 1 ranks"),
    ],
)
def test_refused_before_the_model_changes(config: dict, match: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    model, _ = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config={"stage": 2})
    assert model.zero_engine.groups[0].layout.even


def test_speed_is_measured() -> None:
    flops, bandwidth = measure_speed(torch.device("cpu"), seconds=0.01)
    assert flops > 1e6 and bandwidth > 1e6, (flops, bandwidth)
    assert LoadBalanceConfig(preset="compute").enabled


def test_stage3_refuses_a_model_built_sharded() -> None:
    with zs.sharded_init():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="sharded_init"):
        zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      config={"stage": 3, "load_balance": {"scores": [1]}})  # fmt: skip
