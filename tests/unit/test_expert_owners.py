"""The expert owners' layout (``moe_expert_layout: owners``, ``sharding/experts/owners.py``):
where the experts live, and the settings it refuses. The exchange itself is tested against DDP
at world size 2 in ``tests/distributed/test_moe_fetch.py``."""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from zero_strategy.sharding.experts.owners import owner_cuts
from zero_strategy.sharding.layout import ShardLayout


def test_owner_cuts_even_and_by_fractions() -> None:
    assert owner_cuts(8, 2, None, where="x") == (0, 4, 8)
    assert owner_cuts(5, 2, None, where="x") == (0, 3, 5)
    assert owner_cuts(7, 3, None, where="x") == (0, 3, 5, 7)
    assert owner_cuts(3, 3, None, where="x") == (0, 1, 2, 3)
    # load balancing's fractions: largest remainders, at least one expert each
    assert owner_cuts(10, 2, (0.75, 0.25), where="x") == (0, 8, 10)  # 7.5 / 2.5: the tie goes to rank 0
    assert owner_cuts(4, 3, (0.9, 0.05, 0.05), where="x") == (0, 2, 3, 4)
    for e, fr in ((64, (0.3, 0.3, 0.4)), (9, (0.5, 0.5)), (5, (0.1, 0.2, 0.3, 0.4))):
        cuts = owner_cuts(e, len(fr), fr, where="x")
        assert cuts[0] == 0 and cuts[-1] == e and all(b > a for a, b in zip(cuts, cuts[1:])), cuts


def test_owner_cuts_refuse_fewer_experts_than_ranks() -> None:
    with pytest.raises(ValueError, match="model.experts' has 2 experts for 4 ranks.*moe_expert_layout 'sharded'"):
        owner_cuts(2, 4, None, where="experts module 'model.experts'")


def test_layout_with_expert_cuts_keeps_experts_whole() -> None:
    # gate_up_proj [5, 4, 3] and down_proj [5, 3, 2]: rank 0 owns experts 0-2, rank 1 experts 3-4
    for rank in (0, 1):
        lay = ShardLayout((60, 30), 2, rank, cuts=(0, 3, 5))
        assert lay.bounds == ((0, 36, 60), (0, 18, 30))
        assert lay.local_range(0) == ((0, 36) if rank == 0 else (36, 60))
        assert lay.chunks == (36, 18) and not lay.even
    lay = ShardLayout((60, 30), 2, 0, cuts=(0, 3, 5))
    full = [torch.arange(60.0), torch.arange(30.0)]
    buf = torch.empty(2 * lay.shard_numel)
    lay.pack_full(full, buf)
    back = [torch.zeros(60), torch.zeros(30)]
    lay.unpack_full(buf, back)
    assert all(torch.equal(a, b) for a, b in zip(full, back))
    with pytest.raises(AssertionError, match="expert cuts"):
        ShardLayout((60, 31), 2, 0, cuts=(0, 3, 5))  # 31 is not 5 experts' rows


def test_config_refuses_owners_with_the_experts_cache() -> None:
    with pytest.raises(ValueError, match="moe_expert_cache=4096 with moe_expert_layout='owners'"):
        zs.ZeroConfig(stage=3, moe_expert_layout="owners", moe_expert_cache=4096)
    with pytest.raises(ValueError, match="moe_expert_layout"):
        zs.ZeroConfig(stage=3, moe_expert_layout="rows")
    cfg = zs.ZeroConfig.from_dict({"zero_optimization": {"stage": 3}, "zero_strategy": {"moe_expert_layout": "owners"}})
    assert cfg.moe_expert_layout == "owners"


def _tiny_mixtral(experts: int = 8):
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=experts, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def test_the_experts_caches_come_out_of_the_budgets_cache_tier() -> None:
    """With a memory budget, ``moe_expert_cache`` x experts layers is taken from the cache tier:
    the cache of whole units gets the rest, and a cache tier too small for both is refused.
    (World size 1: the accounting, not the exchange.)"""
    per_layer, tier = 8192, 1_000_000
    memory = {"budget": 4_000_000, "persistent": 0.5, "cache": tier, "working": 0}
    model = _tiny_mixtral()
    cfg = zs.ZeroConfig(stage=3, memory=memory, moe_expert_cache=per_layer)
    net, _ = zs.initialize(model, lambda p: torch.optim.SGD(p, lr=0.1), config=cfg)
    stats = net.zero_engine.memory_stats()
    assert stats["budget_expert_caches"] == 2 * per_layer, stats  # two decoder layers, one experts module each
    assert stats["cache_cap"] == tier - 2 * per_layer, stats
    ids = torch.tensor([[1, 2, 3]])
    net(input_ids=ids, labels=ids).loss.backward()  # runs within the smaller unit cache
    with pytest.raises(
        ValueError,
        match=r"moe_expert_cache: 600.00 KiB .* per experts layer x 2 layers.*at most 491776 bytes, or raise memory.cache",
    ):
        big = zs.ZeroConfig(stage=3, memory=memory, moe_expert_cache=600 * 1024)
        zs.initialize(_tiny_mixtral(), lambda p: torch.optim.SGD(p, lr=0.1), config=big)


def test_moe_knobs_below_stage_3_are_reported_not_applied() -> None:
    from zero_strategy.config import not_applied_settings

    said = not_applied_settings(zs.ZeroConfig(stage=2, moe_expert_layout="owners", moe_full_gather_share=0.5))
    assert [m.split("=")[0] for m in said] == ["moe_full_gather_share", "moe_expert_layout"], said
    assert all("not applied at stage 2" in m and "use stage 3" in m for m in said), said
    assert not_applied_settings(zs.ZeroConfig(stage=3, moe_expert_layout="owners")) == []


def test_the_auto_offload_estimate_counts_the_owners_padding() -> None:
    """``ratio: auto`` sizes each unit's rows: with owners of 3 + 2 experts every rank's row is
    padded to 3 experts, not the even 2.5."""
    from datetime import timedelta

    from torch import nn

    from zero_strategy.comm.collectives import CommContext
    from zero_strategy.config.blocks import PrecisionConfig
    from zero_strategy.runtime.placement import unit_bytes
    from zero_strategy.sharding.precision import select_precision

    ctx = CommContext(None, 1, 2, timedelta(seconds=60), "native", torch.device("cpu"), global_ranks=(0, 1))
    members = [("m.experts", [("m.experts.w", nn.Parameter(torch.zeros(5, 4)))])]
    precision = select_precision(PrecisionConfig())
    even = unit_bytes(members, precision, ctx, None)[0]
    owned = unit_bytes(members, precision, ctx, None, {"m.experts": (0, 3, 5)})[0]
    assert even.on_device > 0 and owned.on_device * 10 == even.on_device * 12, (even, owned)  # rows of 12, not 10


def test_owners_refuse_uneven_cuts_of_a_model_built_under_sharded_init(monkeypatch) -> None:
    from zero_strategy.sharding.experts import owners
    from zero_strategy.sharding.experts.detect import find_expert_modules

    model = _tiny_mixtral(experts=5)
    found = find_expert_modules(model)
    assert len(found) == 2 and owners.unit_cuts(found, "owners", 2, None)["model.layers.0.mlp.experts"] == (
        0,
        3,
        5,
    )
    monkeypatch.setattr(owners, "sharded_init_piece", lambda p: torch.zeros(1))  # as if built sharded
    with pytest.raises(ValueError, match="built under sharded_init.*5 experts on 2 ranks.*without sharded_init"):
        owners.unit_cuts(found, "owners", 2, None)
    even = _tiny_mixtral(experts=4)  # 2 + 2: the owners' cuts are sharded_init's even pieces
    assert owners.unit_cuts(find_expert_modules(even), "owners", 2, None)


def test_a_cache_tier_the_experts_caches_fill_exactly_frees_units_after_use() -> None:
    per_layer = 16384  # two layers: 32 KiB, more than the units gathered at once (about 16 KiB)
    memory = {"budget": 4_000_000, "persistent": 0.5, "cache": 2 * per_layer, "working": 0}
    cfg = zs.ZeroConfig(stage=3, memory=memory, moe_expert_cache=per_layer)
    net, _ = zs.initialize(_tiny_mixtral(), lambda p: torch.optim.SGD(p, lr=0.1), config=cfg)
    stats = net.zero_engine.memory_stats()
    assert stats["budget_expert_caches"] == 2 * per_layer and stats["cache_cap"] == 0, stats
