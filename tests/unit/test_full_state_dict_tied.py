"""``zero_strategy.full_state_dict`` and tied parameters (one Parameter under two names)."""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from zero_strategy.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layer=1, n_head=2, tie_embeddings=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_tied_parameters_share_one_tensor_as_in_state_dict(stage: int) -> None:
    """As ``model.state_dict()`` gives both names one storage, so that ``save_pretrained``
    writes the tied weight once (it wrote a separate copy under each name before)."""
    torch.manual_seed(0)
    plain = GPT(CFG)
    want = {k: v.clone() for k, v in plain.state_dict().items()}
    assert plain.head.weight is plain.tok.weight
    model, _ = zs.initialize(GPT(CFG).requires_grad_(True), None, stage=stage)
    model.load_state_dict(want) if stage < 3 else zs.load_full_state_dict(model, want)
    got = zs.full_state_dict(model)
    assert sorted(got) == sorted(want)
    assert got["head.weight"] is got["tok.weight"]
    for k, v in want.items():
        assert torch.equal(got[k], v), k
