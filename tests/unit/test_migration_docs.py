"""What the migration pages promise, measured (issue 47, section 2): the README's comparison
table on the model's class (item 3), ``stage3_param_persistence_threshold`` on the FSDP page
(item 2), and a DeepSpeed file's ``"auto"`` precision under a front-end's ``--bf16`` on the
DeepSpeed page (item 5). Each test runs the behaviour and checks the page that states it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zero_strategy as zs
from zero_strategy.frontend import apply_frontend_settings

ROOT = Path(__file__).resolve().parents[2]


def _page(name: str) -> str:
    return " ".join((ROOT / name).read_text().split())  # line breaks read as spaces


class Block(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class MyModel(nn.Module):
    def __init__(self, big: int) -> None:
        super().__init__()
        self.small, self.big = Block(8), Block(big)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(nn.functional.pad(self.small(x), (0, self.big.lin.in_features - 8)))


def test_readme_says_the_model_class_is_swapped_for_a_subclass() -> None:
    plain = MyModel(8)
    model, _ = zs.initialize(plain, None, config="zero2")
    try:
        assert model is plain and type(model) is not MyModel and isinstance(model, MyModel)
        assert type(model).__qualname__ == "ZeroMyModel" and type(model).__name__ == "MyModel"  # shown as ZeroMyModel
    finally:
        zs.destroy(model)
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| your model"))
    ours = row.split("|")[2]
    assert "class, " not in ours and "`ZeroMyModel`" in ours and "subclass" in ours, ours


def test_the_fsdp_page_names_the_persistence_threshold_and_both_sides_of_it() -> None:
    default = zs.ZeroConfig().stage3_param_persistence_threshold
    page = _page("docs/migrating_fsdp.md")
    assert f"`stage3_param_persistence_threshold` elements (default {default:,}" in page
    assert "`model.state_dict()` returns full values instead of raising" in page
    assert "`stage3_param_persistence_threshold: 0`" in page
    small = {"zero_optimization": {"stage": 3}}  # every unit under the threshold: kept whole
    model, _ = zs.initialize(MyModel(8), None, config=small, policy={Block})
    try:
        assert model.state_dict()["big.lin.weight"].shape == (8, 8)
        with pytest.raises(RuntimeError, match="load_state_dict"):
            model.load_state_dict(zs.full_state_dict(model))
    finally:
        zs.destroy(model)
    side = int(default**0.5) + 1  # one unit just over the default threshold
    for config in (small, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}):
        model, _ = zs.initialize(MyModel(side if config is small else 8), None, config=config, policy={Block})
        try:
            with pytest.raises(RuntimeError, match="is sharded"):
                model.state_dict()
        finally:
            zs.destroy(model)


def test_the_deepspeed_page_says_auto_bf16_under_bf16_is_the_mixed_mode() -> None:
    cfg = zs.ZeroConfig.from_dict({"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}})
    got = apply_frontend_settings(cfg, source="--bf16", precision="bf16-mixed", accumulation=1).precision
    assert got.param_dtype in (None, torch.float32) and got.autocast_dtype == torch.bfloat16, got
    page = _page("docs/migrating_deepspeed.md")
    assert '`"bf16": {"enabled": "auto"}` with the `Trainer`\'s `--bf16` gives the `Trainer`\'s mixed mode' in page
    assert "fp32 parameters under bf16 autocast, where DeepSpeed gives 16-bit parameters" in page
