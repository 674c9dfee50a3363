"""Several optimizers on one model in one process (a world of one): the refusals, each made
before anything is changed, and which calls act on one optimizer's parameters only. Equality
with DDP on several ranks is ``tests/distributed/test_several_optimizers.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_strategy as zs


def _gan() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"g": nn.Linear(4, 4), "d": nn.Linear(4, 1)}).double()


def _two(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model["g"].parameters(), lr=0.1), torch.optim.SGD(model["d"].parameters(), lr=0.1)]


@pytest.mark.parametrize(
    ("opts", "overrides", "words"),
    [
        (lambda m: [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m["d"].parameters(), lr=0.1)], {},
         "parameter 'd.weight' is in optimizers 0 and 1; several optimizers must step disjoint parameters"),
        (lambda m: [_two(m)[0]] * 2, {}, "optimizer 1 is the same object as an earlier one"),
        (lambda m: [], {}, "an empty list of optimizers; pass None"),
        (_two, {"precision": "fp16"}, "fp16 loss scaling"),
        (_two, {"offload_optimizer": {"device": "nvme", "nvme_path": "."}}, "offload_optimizer device 'nvme'"),
    ],
)  # fmt: skip
def test_refusals_before_anything_changes(opts, overrides, words) -> None:
    model = _gan()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=words):
        zs.initialize(model, opts(model), stage=2, **overrides)
    assert getattr(model, "zero_engine", None) is None and type(model) is nn.ModuleDict
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_optimizer_zero_grads_steps_and_clips_its_own(stage: int) -> None:
    model = _gan()
    ref = _gan()
    model, (opt_g, opt_d) = zs.initialize(model, _two(model), stage=stage)
    ref_g, ref_d = _two(ref)
    x = torch.randn(3, 4, dtype=torch.float64)
    for m in (model, ref):
        m["d"](m["g"](x)).square().sum().backward()
    # clipping one optimizer: the norm over its own parameters (DDP: clip_grad_norm_ of those)
    got = opt_d.clip_grad_norm_(1e-3)
    want = torch.nn.utils.clip_grad_norm_(ref["d"].parameters(), 1e-3)
    assert torch.allclose(got, want, rtol=1e-12), (got, want)
    opt_g.step()
    ref_g.step()
    opt_g.zero_grad()  # the discriminator's gradients stay for its own step
    ref_g.zero_grad()
    opt_d.step()
    ref_d.step()
    with zs.gathered_parameters(model):
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-12, atol=1e-15), n
    # an optimizer that was replaced cannot step or zero_grad
    zs.replace_optimizer(model, _two(model))
    with pytest.raises(RuntimeError, match="not one of the optimizers bound to this model"):
        opt_g.zero_grad()


def test_the_model_counts_one_step_per_round_of_its_optimizers() -> None:
    """``step_count`` (the checkpoint's default tag, the step in messages) counts steps of the
    model: every optimizer stepping once is one step; an optimizer that steps again begins the
    next (a discriminator stepped twice per generator step: two)."""
    model = _gan()
    model, (opt_g, opt_d) = zs.initialize(model, _two(model), stage=2)
    counts = []
    for which in ("g", "d", "d", "g", "d"):
        model["d"](model["g"](torch.randn(3, 4, dtype=torch.float64))).square().sum().backward()
        (opt_g if which == "g" else opt_d).step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        counts.append(model.zero_engine.step_count)
    assert counts == [1, 1, 2, 2, 3], counts


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoints_take_every_optimizer_and_match_them_by_their_parameters(tmp_path, stage: int) -> None:
    """A save or load with a subset of the optimizers is refused (the others' state would be
    left out, and the given one would get entries for masters it does not step); a load with the
    optimizers in another order restores each one's settings by the parameters it steps (they
    were restored by position: the learning rates swapped)."""
    model = _gan()
    opt_g, opt_d = (
        torch.optim.Adam(model["g"].parameters(), lr=1e-3),
        torch.optim.Adam(model["d"].parameters(), lr=5e-2),
    )
    model, (opt_g, opt_d) = zs.initialize(model, [opt_g, opt_d], stage=stage)
    model["d"](model["g"](torch.randn(3, 4, dtype=torch.float64))).square().sum().backward()
    opt_g.step()
    opt_d.step()
    with pytest.raises(ValueError, match="the model trains with 2 optimizer"):
        zs.save_checkpoint(tmp_path, model, opt_g)
    assert len(opt_g.state) == 2  # nothing added for the discriminator's masters
    zs.save_checkpoint(tmp_path, model, [opt_g, opt_d])

    other = _gan()
    og2, od2 = torch.optim.Adam(other["g"].parameters(), lr=7.0), torch.optim.Adam(other["d"].parameters(), lr=9.0)
    other, (od2, og2) = zs.initialize(other, [od2, og2], stage=stage)  # another order at initialize too
    with pytest.raises(ValueError, match="the model trains with 2 optimizer"):
        zs.load_checkpoint(tmp_path, other, [og2])
    zs.load_checkpoint(tmp_path, other, [od2, og2])
    assert og2.param_groups[0]["lr"] == 1e-3 and od2.param_groups[0]["lr"] == 5e-2
