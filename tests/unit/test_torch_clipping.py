"""torch.nn.utils' clipping functions over a ZeRO model (``runtime/torch_clipping.py``) in one
process: what is refused, what falls through to torch, and that torch's functions are its own
again once no engine lives. DDP parity of the routed calls is in the ZeRO-1/2 and ZeRO-3 grids
(cells with ``clip_with``, world size 2)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F

import zero_strategy as zs
from zero_strategy.models import GPT, GPTConfig, synthetic_batch
from zero_strategy.testing import assert_close

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layer=2, n_head=2, qkv_bias=False)
NAMES = ("clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_")
TU = torch.nn.utils


def _backward(model: torch.nn.Module, step: int = 0, scale: float = 1.0) -> None:
    x, y = synthetic_batch(CFG, 2, step)
    (scale * F.cross_entropy(model(x).view(-1, CFG.vocab_size), y.reshape(-1))).backward()


def _no_engines() -> dict[str, object]:
    """Close the engines earlier tests of this process left alive; torch's own functions."""
    for engine in zs.api.live_engines():
        engine.close()
    gc.collect()
    return {name: getattr(TU, name) for name in NAMES}


def test_torch_functions_are_replaced_only_while_an_engine_lives() -> None:
    torch_own = _no_engines()
    assert torch_own["clip_grad_norm_"] is TU.clip_grad.clip_grad_norm_  # nothing of ours is left over
    a, _ = zs.initialize(GPT(CFG), lambda p: torch.optim.SGD(p, lr=0.1), stage=2)
    b, _ = zs.initialize(GPT(CFG), lambda p: torch.optim.SGD(p, lr=0.1), stage=3)
    for name in NAMES:
        assert getattr(TU, name) is not torch_own[name], name
    assert TU.clip_grad_norm_ is TU.clip_grad.clip_grad_norm_  # one replacement, in both modules
    zs.destroy(a)
    assert TU.clip_grad_norm_ is not torch_own["clip_grad_norm_"], "b still lives"
    zs.destroy(b)
    for name in NAMES:
        assert getattr(TU, name) is torch_own[name], name
    assert TU.clip_grad.clip_grad_value_ is torch_own["clip_grad_value_"]
    zs.initialize(GPT(CFG), lambda p: torch.optim.SGD(p, lr=0.1), stage=1)  # dropped, never closed
    gc.collect()
    assert TU.clip_grad_norm_ is torch_own["clip_grad_norm_"], "a collected engine puts torch's function back"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_part_of_a_model_or_a_mixture_is_refused_naming_the_optimizer_call(stage: int) -> None:
    torch.manual_seed(0)
    other = GPT(CFG)
    model, opt = zs.initialize(GPT(CFG), lambda p: torch.optim.SGD(p, lr=0.1), stage=stage)
    _backward(model)
    _backward(other)
    params = list(model.parameters())
    fix = r"optimizer\.clip_grad_norm_\(max_norm\)"
    with pytest.raises(ValueError, match=rf"clip_grad_norm_\(\): the tensors given are part of .*{fix}"):
        TU.clip_grad_norm_(params[1:], 1.0)
    with pytest.raises(ValueError, match=rf"clip_grad_value_\(\): the tensors given are part of .*{fix}"):
        TU.clip_grad_value_(params[0], 1e-3)
    with pytest.raises(ValueError, match=rf"mix parameters of the ZeRO model GPT with 1 other tensor.*{fix}"):
        TU.clip_grad_norm_([*params, next(other.parameters())], 1.0)
    with pytest.raises(
        ValueError, match=rf"clip_grads_with_norm_\(\): these are the parameters of a ZeRO model.*{fix}"
    ):
        TU.clip_grads_with_norm_(model.parameters(), 1.0, torch.tensor(1.0))
    if stage == 1:  # ZeRO-1 keeps the local gradients in p.grad until the step
        with pytest.raises(ValueError, match=rf"get_total_norm\(\): these are gradients of a ZeRO model.*{fix}"):
            TU.get_total_norm([p.grad for p in model.parameters()])
    opt.clip_grad_norm_(1e9)  # the master pieces get their gradients: this rank's part
    with pytest.raises(ValueError, match=rf"get_total_norm\(\): these are gradients of a ZeRO model.*{fix}"):
        TU.get_total_norm([m.grad for g in opt.param_groups for m in g["params"] if m.grad is not None])
    # tensors of no engine: torch's own functions, unchanged
    grads = [p.grad for p in other.parameters()]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert_close(TU.get_total_norm(grads), want, rtol=1e-6, what="get_total_norm of a plain model")
    assert_close(TU.clip_grad_norm_(other.parameters(), 1e9), want, rtol=1e-6, what="a plain model's norm")
    with pytest.warns(UserWarning, match="empty generator"):  # torch's warning, from torch's function
        TU.clip_grad_norm_((p for p in []), 1.0)
    zs.destroy(model)


def test_a_non_finite_norm_raises_as_torch_does_and_a_model_without_optimizer_is_torchs() -> None:
    _no_engines()
    torch.manual_seed(0)
    model, _ = zs.initialize(GPT(CFG), lambda p: torch.optim.SGD(p, lr=0.1), stage=2)
    _backward(model, scale=float("inf"))
    with pytest.raises(RuntimeError, match="non-finite"):
        TU.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    assert not torch.isfinite(TU.clip_grad_norm_(model.parameters(), 1.0))  # the engine's norm, unchecked
    zs.destroy(model)
    # ZeRO-1/2 without an optimizer: p.grad is DDP's averaged gradient, torch's function clips it
    ref = GPT(CFG)
    plain, _ = zs.initialize(copy.deepcopy(ref), None, stage=2)
    _backward(ref)
    _backward(plain)
    n_ref, n = TU.clip_grad_norm_(ref.parameters(), 0.1), TU.clip_grad_norm_(plain.parameters(), 0.1)
    assert_close(n, n_ref, rtol=1e-6, what="norm of a model-only engine")
    for p, q in zip(plain.parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None
        assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9, what="clipped gradient of a model-only engine")
    zs.destroy(plain)
