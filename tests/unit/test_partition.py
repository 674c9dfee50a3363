"""Which modules form ZeRO-3 units."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from zero_strategy import zero_auto_partition
from zero_strategy.models import GPT, Block, GPTConfig
from zero_strategy.sharding.partition import find_units

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layer=3, n_head=2)


@zero_auto_partition
class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.layers = nn.Sequential(Layer(), Layer())
        self.out = nn.Linear(4, 4)


def test_default_policy_takes_the_outermost_block_list() -> None:
    plan = find_units(GPT(CFG))
    assert [n for n, _ in plan.units] == ["blocks.0", "blocks.1", "blocks.2"] and "default" in plan.rule
    # the default cannot see whether every block runs: its lists are checked while they run
    assert plan.conditional_lists == [["blocks.0", "blocks.1", "blocks.2"]]


def test_default_policy_lists_several_containers() -> None:
    class EncDec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.dec = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    plan = find_units(EncDec())
    assert plan.conditional_lists == [["enc.0", "enc.1"], ["dec.0", "dec.1", "dec.2"]]
    assert find_units(EncDec(), {nn.Linear}).conditional_lists == []  # an explicit policy is trusted


def test_decorator_policy_classes_and_callable() -> None:
    plan = find_units(Net())
    assert [n for n, _ in plan.units] == ["layers.0", "layers.1"] and plan.rule == "@zero_auto_partition"
    assert plan.conditional_lists == []
    units = find_units(GPT(CFG), {nn.LayerNorm}).units
    assert [n for n, _ in units] == [
        "blocks.0.ln1",
        "blocks.0.ln2",
        "blocks.1.ln1",
        "blocks.1.ln2",
        "blocks.2.ln1",
        "blocks.2.ln2",
        "ln_f",
    ]
    units = find_units(GPT(CFG), lambda m, name: name in ("blocks.1", "head")).units
    assert [n for n, _ in units] == ["blocks.1", "head"]
    with pytest.raises(TypeError, match="not nn.Module classes"):
        find_units(GPT(CFG), {int})
    with pytest.raises(ValueError, match="root module GPT itself matched"):
        find_units(GPT(CFG), {GPT})


def test_decorated_class_behaves_the_same() -> None:
    layer = Layer()
    assert type(layer) is Layer and isinstance(layer, nn.Module)
    clone = pickle.loads(pickle.dumps(layer))
    x = torch.randn(2, 4)
    assert torch.equal(clone(x), layer(x))
    with pytest.raises(TypeError, match="decorates nn.Module subclasses"):
        zero_auto_partition(int)


def test_hugging_face_no_split_modules() -> None:
    transformers = pytest.importorskip("transformers")  # in the dev extra: CI always has it
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    plan = find_units(model)
    units = plan.units
    assert "_no_split_modules" in plan.rule and plan.conditional_lists == []
    assert [n for n, _ in units] == ["transformer.h.0", "transformer.h.1"]
    assert all(type(m).__name__ == "GPT2Block" for _, m in units)


def test_block_is_not_decorated_by_default() -> None:
    assert not getattr(Block, "_zero_auto_partition", False)
