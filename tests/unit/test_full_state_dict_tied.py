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


@pytest.mark.parametrize("stage", [2, 3])
def test_strict_load_accepts_weights_that_name_a_tied_parameter_once(stage: int) -> None:
    """``save_pretrained`` (safetensors) writes a tied weight under one name: a strict load
    takes it (the other name is the same Parameter), and still refuses a really missing key."""
    torch.manual_seed(0)
    plain = GPT(CFG)
    want = {k: v.clone() for k, v in plain.state_dict().items() if k != "head.weight"}
    model, _ = zs.initialize(GPT(CFG).requires_grad_(True), None, stage=stage)
    zs.load_full_state_dict(model, want)  # strict by default
    got = zs.full_state_dict(model)
    assert torch.equal(got["head.weight"], plain.tok.weight) and torch.equal(got["tok.weight"], plain.tok.weight)
    lacking = {k: v for k, v in want.items() if k != "tok.weight"}  # neither name of the tied weight
    with pytest.raises(ValueError, match=r"missing \['head.weight', 'tok.weight'\]"):
        zs.load_full_state_dict(model, lacking)
    no_norm = {k: v for k, v in want.items() if not k.startswith("ln_f")}
    with pytest.raises(ValueError, match="missing.*ln_f"):
        zs.load_full_state_dict(model, no_norm)
