"""The whole-parameter protocol (``runtime/whole_params.py``): which optimizers and groups
are stepped whole, how owners are chosen, and a world-size-1 smoke run (the parity with DDP is
``tests/distributed/test_muon.py``)."""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from zero_strategy.runtime.whole_params import assign_owners, matrix_cost, whole_groups


def test_owners_balance_the_newton_schulz_cost() -> None:
    assert matrix_cost((20, 10)) == 20 * 10 * 10
    assert matrix_cost((4, 2, 3)) == 4 * 6 * 4  # shape[0] x rest
    assert matrix_cost((7,)) == 7
    costs = [matrix_cost(s) for s in [(64, 64), (64, 256), (256, 64), (16, 16), (16, 16)]]
    loads = [0, 0]
    owners = assign_owners(costs, 2, loads)
    assert owners == [0, 0, 1, 1, 1], owners  # the two largest on different ranks, the rest evening out
    assert loads == [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    # a second optimizer continues from the loads: its one matrix goes to the lighter rank
    assert loads[1] < loads[0] and assign_owners([1], 2, loads) == [1]
    assert assign_owners([5, 5, 5], 3) == [0, 1, 2]


def test_which_groups_are_stepped_whole() -> None:
    w, b = torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(3))
    assert whole_groups(torch.optim.Muon([w])) == [True]
    assert whole_groups(torch.optim.AdamW([w, b])) == [False]

    @zs.whole_params(group_flag="use_muon")
    class Mixed(torch.optim.SGD):
        pass

    opt = Mixed([{"params": [w], "use_muon": True}, {"params": [b]}], lr=0.1)
    assert whole_groups(opt) == [True, False]
    assert whole_groups(zs.whole_params(type("Whole", (torch.optim.SGD,), {}))([w], lr=0.1)) == [True]
    opted_out = type("PieceMuon", (torch.optim.Muon,), {"zero_whole_params": False})
    assert whole_groups(opted_out([w])) == [False]
    with pytest.raises(TypeError, match="zero_whole_params = 3"):
        whole_groups(type("Odd", (torch.optim.SGD,), {"zero_whole_params": 3})([w], lr=0.1))
    with pytest.raises(TypeError, match="decorate a torch.optim.Optimizer subclass"):
        zs.whole_params(int)


def test_an_undeclared_shampoo_is_refused_and_names_the_decorator() -> None:
    model = torch.nn.Linear(4, 4)
    shampoo = type("Shampoo", (torch.optim.SGD,), {})
    with pytest.raises(TypeError, match=r"declare it with @zero_strategy.whole_params"):
        zs.initialize(model, shampoo(model.parameters(), lr=0.1))
    assert getattr(model, "zero_engine", None) is None


@pytest.mark.parametrize("stage", [1, 3])
def test_muon_at_world_size_1_equals_plain_muon(stage: int) -> None:
    """Smoke test at world size 1: the owner is rank 0, the step equals torch's Muon's."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.Linear(8, 3, bias=False))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.Linear(8, 3, bias=False))
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.Muon(ref.parameters(), lr=0.02)
    model, opt = zs.initialize(model, torch.optim.Muon(model.parameters(), lr=0.02), stage=stage)
    x = torch.randn(5, 6)
    for net, o in ((ref, ref_opt), (model, opt)):
        for _ in range(3):
            net(x).square().mean().backward()
            o.step()
            o.zero_grad()
    with zs.gathered_parameters(model):
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert len(opt.state) == 2 and all("momentum_buffer" in s for s in opt.state.values())
    # replace_optimizer: the old optimizer's matrices are forgotten, the new one's stepped whole
    new = zs.replace_optimizer(model, torch.optim.Muon(model.parameters(), lr=0.02))
    assert len(model.zero_engine.whole.entries) == 2
    model(x).square().mean().backward()
    new.step()
    assert len(new.state) == 2
    model.zero_engine.close()


def test_memory_counts_an_owners_whole_matrix_and_its_state_in_its_tier() -> None:
    """``model_state_bytes`` counts a whole-stepped proxy as masters (and as ``whole_masters``)
    and its optimizer state in the tier given for it (the host under ``offload_optimizer``)."""
    from zero_strategy.sharding.memory import model_state_bytes

    proxy = torch.zeros(8, 4)
    opt = torch.optim.Muon([proxy], lr=0.02)
    opt.state[proxy]["momentum_buffer"] = torch.zeros(8, 4)
    for tier, key in (("host", "tier_host_pageable"), ("device", "tier_device")):
        stats = model_state_bytes([], [], [], [opt], whole=[(proxy, tier)])
        assert stats["whole_masters"] == stats["masters"] == 128 and stats["optimizer_state"] == 128
        assert stats[key] == stats["model_state"] == 256, (tier, stats)
    assert model_state_bytes([], [], [], [opt])["whole_masters"] == 0


def test_optimizer_state_on_disk_is_refused_with_the_field_and_the_fix() -> None:
    model = torch.nn.Linear(4, 4, bias=False)
    with pytest.raises(
        ValueError, match=r"offload_optimizer: \{device: nvme\}.*use offload_optimizer: \{device: cpu\}"
    ):
        zs.initialize(model, torch.optim.Muon(model.parameters()), stage=2, offload_optimizer={"device": "nvme"})
    assert getattr(model, "zero_engine", None) is None


@pytest.mark.parametrize("name", ["Muon", "MUON", "muon", "MuonWithAuxAdam"])
def test_a_deepspeed_muon_optimizer_block_names_the_line_that_builds_it(name: str, tmp_path) -> None:
    """``optimizer: {type: Muon}`` (DeepSpeed's ``MUON_OPTIMIZER``, any case; and the class it
    builds) warns on its own: the training loop builds it, with the line, the JSON's values filled
    in (``muon_lr``/``adam_lr`` over ``lr``) and DeepSpeed's defaults for the rest; ``check``
    gives the same reason. Another optimizer type stays in the generic list."""
    import json

    from zero_strategy.config.report import check_file

    params = {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.1, "adam_lr": 1e-3, "betas": [0.9, 0.99]}
    config = {"zero_optimization": {"stage": 2}, "optimizer": {"type": name, "params": params}}
    with pytest.warns(UserWarning) as caught:
        zs.ZeroConfig.from_dict(config, source=f"ds-{name}.json")
    notes = [str(w.message) for w in caught if f"optimizer: {{type: {name}}} in ds-{name}.json" in str(w.message)]
    assert len(notes) == 1, [str(w.message) for w in caught]
    line = ("torch.optim.Muon(matrices, lr=0.01, momentum=0.9, weight_decay=0.1) beside "
            "torch.optim.AdamW(rest, lr=0.001, betas=(0.9, 0.99), eps=1e-10, weight_decay=0.1)")  # fmt: skip
    assert line in notes[0] and "the training loop builds it" in notes[0], notes[0]
    assert not any("owns them: " in str(w.message) and "optimizer" in str(w.message) for w in caught)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**config, "optimizer": {"type": name}}))
    reasons = dict(check_file(path).ignored)
    defaults = ("torch.optim.Muon(matrices, lr=0.02, momentum=0.95, weight_decay=0.0) beside "
                "torch.optim.AdamW(rest, lr=0.0003, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)")  # fmt: skip
    assert defaults in reasons["optimizer"], reasons
    with pytest.warns(UserWarning, match=r"owns them: optimizer"):
        zs.ZeroConfig.from_dict({"optimizer": {"type": "AdamW"}}, source=f"ds-adamw-{name}.json")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # the CPU variant runs the same body in CI


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", [1, 3])
def test_offloaded_muon_steps_on_the_device_and_keeps_its_state_on_the_host(device: str, stage: int) -> None:
    """``offload_optimizer: {device: cpu}`` with Muon beside AdamW at world size 1, against the
    same optimizers on the plain model: equal within 1e-6 after 3 steps, and between steps the
    owner's whole matrices and their momentum are in host memory (on a GPU: moved up for the
    step and back after it, ``whole_params._Lifted``)."""
    torch.manual_seed(0)

    def net() -> torch.nn.Sequential:
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device)

    ref, model = net(), net()
    model.load_state_dict(ref.state_dict())

    def optimizers(m: torch.nn.Module) -> list[torch.optim.Optimizer]:
        matrices = [m[0].weight, m[2].weight]
        rest = [m[0].bias, m[2].bias]
        return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]

    ref_opts = optimizers(ref)
    config = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"},
                                    "stage3_param_persistence_threshold": 0}}  # fmt: skip
    model, opts = zs.initialize(model, optimizers(model), config=config)
    x = torch.randn(5, 6, device=device)
    for m, os_ in ((ref, ref_opts), (model, opts)):
        for _ in range(3):
            m(x).square().mean().backward()
            for o in os_:
                o.step()
                o.zero_grad()
    with zs.gathered_parameters(model):
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    entries = [e for e in model.zero_engine.whole.entries if e.owner == 0]
    assert len(entries) == 2, entries
    for e in entries:
        state = opts[0].state[e.proxy]
        assert e.proxy.device.type == "cpu" and state["momentum_buffer"].device.type == "cpu", (e.proxy.device, state)
        assert e.proxy.shape == e.param.shape and state["momentum_buffer"].abs().sum() > 0
    zs.destroy(model)
