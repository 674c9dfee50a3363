"""Which modules are MoE experts modules (``sharding/experts/selective.py``): found by their stacked
parameters and selection argument, never by a per-model list; and the rows each rank sends."""

from __future__ import annotations

import torch
import transformers
from torch import nn

from zero_strategy.sharding.experts.selective import find_expert_modules, row_segments
from zero_strategy.sharding.layout import ShardLayout
from zero_strategy.sharding.partition import find_units

COMMON = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def test_hugging_face_experts_are_found_inside_their_layer_units() -> None:
    models = [
        transformers.MixtralForCausalLM(transformers.MixtralConfig(intermediate_size=8, num_local_experts=4, **COMMON)),
        transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(moe_intermediate_size=8, num_experts=4, head_dim=8, **COMMON)
        ),
        transformers.GptOssForCausalLM(
            transformers.GptOssConfig(intermediate_size=8, num_local_experts=4, head_dim=8, **COMMON)
        ),
    ]
    for model in models:
        plan = find_units(model)
        assert [e.fqn for e in plan.experts] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], plan
        assert [fqn for fqn, _ in plan.units] == ["model.layers.0", "model.layers.1"], plan.units
        e = plan.experts[0]
        assert e.num_experts == 4 and e.position == 1, e
        assert e.argument in ("top_k_index", "router_indices"), e
        idx = torch.tensor([[0, 3]])
        assert e.selection((torch.zeros(1, 16), idx, None), {}) is idx


class Undeclared(nn.Module):
    """Stacked [E, ...] weights and a selection argument, no decorator: found."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.num_experts = experts
        self.w = nn.Parameter(torch.zeros(experts, 4, 4))

    def forward(self, x, expert_indices):
        return x


class NoSelection(Undeclared):
    def forward(self, x, scores):  # the same weights, but the forward is not told the selection
        return x


class Mixed(Undeclared):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)  # a parameter that is not per expert


def test_only_modules_with_per_expert_weights_and_a_selection() -> None:
    root = nn.Module()
    root.a, root.b, root.c = Undeclared(), NoSelection(), Mixed()
    found = find_expert_modules(root)
    assert [(f.fqn, f.argument, f.position) for f in found] == [("a", "expert_indices", 1)]
    assert found[0].selection((torch.zeros(1),), {"expert_indices": torch.tensor([2])}).tolist() == [2]


def test_row_segments_cover_each_selected_expert_once_across_ranks() -> None:
    rows = [12, 5]  # elements per expert of two parameters of 7 experts
    for world in (1, 2, 3, 4):
        layout = ShardLayout(tuple(7 * r for r in rows), world, 0)
        union = [0, 2, 3, 6]
        seen: list[list[int]] = [[], []]
        for rank in range(world):
            for i, idx in row_segments(layout, rows, union, rank, torch.device("cpu")):
                lo, hi = layout.local_range(i, rank)
                assert all(lo <= v < hi for v in idx.tolist()), (world, rank, i)
                seen[i] += idx.tolist()
        for i, r in enumerate(rows):
            want = [e * r + j for e in union for j in range(r)]
            assert sorted(seen[i]) == want, (world, i)
