"""The public API in one process (no process group: a world of one)."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import zero_strategy as zs
from zero_strategy.models import GPT, GPTConfig, synthetic_batch
from zero_strategy.testing import assert_close

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layer=2, n_head=2, qkv_bias=False)


def _loss(model, step: int) -> torch.Tensor:
    x, y = synthetic_batch(CFG, 2, step)
    return F.cross_entropy(model(x).view(-1, CFG.vocab_size), y.reshape(-1))


@pytest.mark.parametrize("stage", [1, 2])
def test_same_objects_and_same_numbers_as_plain_training(stage: int) -> None:
    torch.manual_seed(0)
    ref = GPT(CFG).double()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    names = [n for n, _ in model.named_parameters()]
    m2, o2 = zs.initialize(model, opt, config=zs.ZeroConfig(stage=stage, reduce_bucket_size=500))
    assert m2 is model and o2 is opt
    assert isinstance(model, GPT) and isinstance(opt, torch.optim.AdamW)
    assert [n for n, _ in model.named_parameters()] == names
    assert model.state_dict().keys() == ref.state_dict().keys()
    for step in range(6):
        _loss(ref, step).backward()
        _loss(model, step).backward()
        if stage == 2:
            assert all(p.grad is None for p in model.parameters()), "ZeRO-2 frees full gradients after backward"
        else:
            assert all(p.grad is not None for p in model.parameters()), "ZeRO-1 keeps full local gradients"
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        n = opt.clip_grad_norm_(0.5)
        assert torch.allclose(n, n_ref, rtol=1e-12)
        ref_opt.step(), opt.step()
        ref_sched.step(), sched.step()
        ref_opt.zero_grad(), opt.zero_grad()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 1e-2 * 0.5**3
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14), k


def test_full_grad_and_module_level_clip() -> None:
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    model, opt = zs.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config={"zero_optimization": {"stage": 2}}
    )
    _loss(ref, 0).backward()
    _loss(model, 0).backward()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        g = zs.full_grad(model, p)
        assert g is not None and g.shape == p.shape
        assert torch.allclose(g, p_ref.grad, rtol=1e-5, atol=1e-7), name
    total = zs.clip_grad_norm_(model, 1e9)
    assert torch.allclose(total, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9), rtol=1e-5)


def test_optimizer_factory_and_param_groups() -> None:
    model = GPT(CFG)

    def factory(params):
        params = list(params)
        return torch.optim.SGD([{"params": params[:3], "lr": 0.5}, {"params": params[3:]}], lr=0.1, momentum=0.9)

    model, opt = zs.initialize(model, factory, config=zs.ZeroConfig(stage=1))
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1]
    _loss(model, 0).backward()
    opt.step()
    n_masters = sum(len(g["params"]) for g in opt.param_groups)
    assert len(opt.state) == n_masters > 0
    assert all("momentum_buffer" in s for s in opt.state.values())


def test_user_errors_are_clear() -> None:
    model = GPT(CFG)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not in the model"):
        zs.initialize(model, torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        zs.initialize(GPT(CFG), "adam")
    with pytest.raises(ValueError, match=r"offload_optimizer.ratio=0.5 with offload_param on nvme.*remove"):
        both = {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme", "ratio": 0.5}}
        zs.initialize(
            GPT(CFG), lambda p: torch.optim.SGD(p, lr=0.1), config={"zero_optimization": {"stage": 3, **both}}
        )
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        zs.initialize(
            GPT(CFG),
            lambda p: torch.optim.SGD(p, lr=0.1),
            config={"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        )
    m, o = zs.initialize(GPT(CFG), lambda p: torch.optim.SGD(p, lr=0.1), gradient_clipping=1.0)
    with pytest.raises(RuntimeError, match="already managed"):
        zs.initialize(m, lambda p: torch.optim.SGD(p, lr=0.1))
    _loss(m, 0).backward()
    with pytest.raises(ValueError, match="conflicts with gradient_clipping=1.0"):
        o.clip_grad_norm_(0.5)
    assert float(o.clip_grad_norm_(1.0)) > 0  # the same value is fine


def test_explicit_clip_with_the_config_value_is_applied_once() -> None:
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), gradient_clipping=0.01)
    _loss(ref, 0).backward()
    _loss(model, 0).backward()
    total = opt.clip_grad_norm_(0.01)
    assert float(total) > 0.1  # so a second clipping would change the numbers
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    ref_opt.step()
    opt.step()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_clip_before_another_backward_does_not_exempt_the_step_from_the_config_clip() -> None:
    """``gradient_clipping`` promises that the step's gradients are clipped: an explicit clip
    followed by another backward (more gradients) is clipped again at the step."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), gradient_clipping=0.01)
    for net, clip in ((ref, lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)), (model, None)):
        _loss(net, 0).backward()
        if clip is None:
            opt.clip_grad_norm_(0.01)
        else:
            clip()
        _loss(net, 1).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)  # what the config does at the step
    ref_opt.step()
    opt.step()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()


def test_optimizers_that_need_whole_shapes_or_closures_are_refused() -> None:
    model = GPT(CFG)
    with pytest.raises(TypeError, match="LBFGS re-runs its closure"):
        zs.initialize(model, torch.optim.LBFGS(model.parameters()))
    # declaring whole parameters does not let a closure optimizer through
    with pytest.raises(TypeError, match="WholeLBFGS re-runs its closure"):
        zs.initialize(model, zs.whole_params(type("WholeLBFGS", (torch.optim.LBFGS,), {}))(model.parameters()))
    # a factored update (Adafactor) needs each parameter's whole shape and does not declare it
    with pytest.raises(TypeError, match="Adafactor updates a parameter from its whole shape"):
        zs.initialize(model, torch.optim.Adafactor(model.parameters()))
    # Muon is stepped whole on an owner rank (whole_params.py): accepted
    matrices = torch.nn.Linear(4, 4, bias=False)
    zs.initialize(matrices, torch.optim.Muon(matrices.parameters()))
    matrices.zero_engine.close()
    # ... also with the optimizer offloaded to the host, but not to NVMe (swap files hold 1-D pieces)
    matrices = torch.nn.Linear(4, 4, bias=False)
    zs.initialize(matrices, torch.optim.Muon(matrices.parameters()), offload_optimizer={"device": "cpu"})
    matrices.zero_engine.close()
    matrices = torch.nn.Linear(4, 4, bias=False)
    with pytest.raises(ValueError, match="offload_optimizer"):
        zs.initialize(matrices, torch.optim.Muon(matrices.parameters()), offload_optimizer={"device": "nvme"})
    assert getattr(matrices, "zero_engine", None) is None
    assert type(model) is GPT and getattr(model, "zero_engine", None) is None  # nothing was changed
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match=r"step\(closure\) is not supported"):
        opt.step(lambda: _loss(model, 0))


class _TrustRatio(torch.optim.Optimizer):
    """A LAMB-style update: each parameter's step is scaled by ||p|| / ||grad|| of the WHOLE
    parameter, which a rank holding a 1-D piece of it cannot compute."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = p.norm() / p.grad.norm().clamp_min(1e-12)
                    p.add_(p.grad, alpha=-group["lr"] * float(ratio))


def _optimizer_warnings(build) -> list[warnings.WarningMessage]:
    """The warnings ``initialize`` gives about the optimizer ``build`` makes (a fresh model each time)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        _, opt = zs.initialize(model, build(model.parameters()))
        model.zero_engine.close()
    return [w for w in seen if type(opt).__name__ in str(w.message) or "element-wise" in str(w.message)]


def test_optimizers_are_sorted_by_whether_their_update_is_elementwise() -> None:
    # known per-parameter-norm families are refused, by the words of the class name (apex's
    # FusedLAMB, timm's Lamb/Lars, torch_optimizer's NovoGrad, bitsandbytes' LAMB8bit), also as
    # subclasses of a torch optimizer
    for name in ("Lamb", "FusedLAMB", "Lars", "LARS", "NovoGrad", "FusedNovoGrad", "LAMB8bit", "OnebitLamb"):
        cls = type(name, (_TrustRatio,), {})
        model = GPT(CFG)
        with pytest.raises(TypeError, match=f"{name} scales each parameter's update by that parameter's norm"):
            zs.initialize(model, cls(model.parameters()))
        assert type(model) is GPT and getattr(model, "zero_engine", None) is None  # nothing was changed
    sub = type("LarsSGD", (torch.optim.SGD,), {})
    with pytest.raises(TypeError, match="LarsSGD scales"):
        zs.initialize(GPT(CFG), lambda p: sub(p, lr=0.1))
    with pytest.raises(TypeError, match="AdafactorBigVision updates a parameter from its whole shape"):
        zs.initialize(GPT(CFG), lambda p: type("AdafactorBigVision", (_TrustRatio,), {})(p))
    # an unknown class (here the same trust-ratio math under another name): one warning per class
    unknown = type("TrustRatioSGD", (_TrustRatio,), {})
    first = _optimizer_warnings(lambda p: unknown(p))
    assert len(first) == 1, [str(w.message) for w in first]
    assert issubclass(first[0].category, zs.UnknownOptimizerWarning)
    assert "TrustRatioSGD is not an optimizer zero_strategy knows to be element-wise" in str(first[0].message)
    assert first[0].filename == __file__, first[0].filename  # points at the user's initialize() call
    assert _optimizer_warnings(lambda p: unknown(p)) == []  # once per class and process
    # torch's element-wise optimizers and their subclasses are silent; 'Scalars' is not 'lars'
    quiet = [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
             torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Adadelta,
             torch.optim.Rprop, type("Scalars", (torch.optim.AdamW,), {})]  # fmt: skip
    for cls in quiet:
        assert _optimizer_warnings(lambda p, cls=cls: cls(p, lr=0.1)) == [], cls.__name__


def test_bad_parameters_are_named() -> None:
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())
    net[0].weight.data = net[0].weight.data.to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="parameter '0.weight' is not contiguous"):
        zs.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1))
    model = GPT(CFG)
    model.pos.weight.requires_grad_(False)
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model.pos.weight.requires_grad_(True)  # unfrozen after initialize: would train on local grads
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match=r"\[.pos.weight.\] have gradients but are not managed"):
        opt.step()


def test_zero_dim_parameter_with_adagrad() -> None:
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.temp = torch.nn.Parameter(torch.tensor(2.0))
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * self.temp

    torch.manual_seed(0)
    ref = Scaled()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    model, opt = zs.initialize(model, torch.optim.Adagrad(model.parameters(), lr=0.1), config=zs.ZeroConfig(stage=2))
    assert all(s["step"].dim() == 0 for s in opt.state.values())
    for i in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        ref(x).sum().backward()
        model(x).sum().backward()
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    assert torch.allclose(model.temp, ref.temp) and torch.allclose(model.lin.weight, ref.lin.weight)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_backward_that_raises_does_not_poison_the_next_step(stage: int) -> None:
    """At ZeRO-3 (the small model's units are persistent) the persistent parameters stay
    readable after the failed backward: they were freed by it, and read a placeholder."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=zs.ZeroConfig(stage=stage))

    def boom(grad):
        raise RuntimeError("boom")

    out = model(synthetic_batch(CFG, 2, 0)[0])
    h = out.register_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        out.sum().backward()
    h.remove()
    opt.zero_grad()  # the engine sees the failed backward here (the next call), and starts clean
    if stage == 3:
        assert all(u.persistent for u in model.zero_engine.params.units)
        assert torch.equal(model.ln_f.weight, ref.ln_f.weight), "a persistent parameter reads its values"
    _loss(ref, 1).backward()
    _loss(model, 1).backward()
    assert all(p.grad is None for p in model.parameters()), "ZeRO-2/3 reduced and freed every bucket again"
    ref_opt.step()
    opt.step()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_zero3_model_refuses_load_state_dict_and_loads_full_weights() -> None:
    torch.manual_seed(0)
    ref = GPT(CFG)
    model, opt = zs.initialize(GPT(CFG), lambda p: torch.optim.SGD(p, lr=0.1), config=zs.ZeroConfig(stage=3))
    with pytest.raises(RuntimeError, match="Use zero_strategy.load_full_state_dict"):
        model.load_state_dict(ref.state_dict())
    zs.load_full_state_dict(model, ref.state_dict())
    with zs.gathered_parameters(model):
        assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), model.state_dict().values()))
    # only the persistent units stay gathered (never partitioned, as in DeepSpeed); the rest is freed
    persistent = sum(u.full_bytes for u in model.zero_engine.params.units if u.persistent)
    assert persistent > 0
    assert zs.memory_stats(model)["gathered"] == persistent


def test_backward_helper_needs_an_engine() -> None:
    for engine in zs.api.live_engines():  # engines of earlier tests in this process
        engine.close()
    with pytest.raises(RuntimeError, match="call zero_strategy.initialize"):
        zs.backward(torch.ones(1, requires_grad=True).sum())


def test_config_clipping_applies_when_the_user_does_not_clip() -> None:
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    model, opt = zs.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        config={"gradient_clipping": 0.01, "zero_optimization": {"stage": 2}},
    )
    _loss(ref, 0).backward()
    _loss(model, 0).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    ref_opt.step()
    opt.step()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_frozen_parameters_stay_untouched_and_unsharded() -> None:
    model = GPT(CFG)
    model.pos.weight.requires_grad_(False)
    before = model.pos.weight.detach().clone()
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.1), config=zs.ZeroConfig(stage=2))
    assert any(p is model.pos.weight for p in opt.param_groups[0]["params"])  # kept as is: no grad, no update
    _loss(model, 0).backward()
    opt.step()
    assert torch.equal(model.pos.weight, before)
    assert model.pos.weight not in opt.state


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nested_root_calls_and_inference_mode_first_match_plain_training(stage: int) -> None:
    """Lightning runs training_step inside the root's forward (which calls self(x) again), and
    its validation sanity check runs under inference_mode before the first training step."""
    torch.manual_seed(0)
    ref = GPT(CFG).double()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage)
    with torch.inference_mode():  # buffers first allocated here are reused by training
        x, _ = synthetic_batch(CFG, 2, 0)
        assert torch.equal(model(x), ref(x))
    plain_forward = model.forward
    for step in range(3):

        def redirected(step: int = step) -> torch.Tensor:  # as Lightning's forward redirection
            model.forward = plain_forward
            return _loss(model, step)

        model.forward = redirected
        loss = model()
        assert "forward" not in vars(model) or model.forward is plain_forward
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = _loss(ref, step)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.allclose(loss, ref_loss, rtol=1e-12), (step, loss.item(), ref_loss.item())


@pytest.mark.parametrize("first", ["train", "infer"])
def test_inference_between_steps_with_deferred_gather_checks(first: str) -> None:
    """On a GPU the gather checks are deferred once the unit order is known; the buffers they keep
    (tag digits, cached placeholders) must be usable outside inference mode even when an
    inference-mode forward (Lightning's validation, a rollout) made them, and a write into a
    sharded parameter under inference mode is still named."""
    torch.manual_seed(0)
    ref = GPT(CFG).double()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_strategy": {"gather_checks": "deferred"}}  # fmt: skip
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
    x, _ = synthetic_batch(CFG, 2, 0)
    for step in range(3):
        if first == "infer" or step == 1:
            with torch.inference_mode():
                assert torch.equal(model(x), ref(x)), step
        loss = _loss(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = _loss(ref, step)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.allclose(loss, ref_loss, rtol=1e-12), (step, loss.item(), ref_loss.item())
    with torch.no_grad(), torch.inference_mode():
        model.blocks[0].ln1.bias.fill_(1.0)  # a placeholder: the write is lost
    with pytest.raises(RuntimeError, match="'blocks.0.ln1.bias' was written while it was sharded"):
        _loss(model, 3).backward()
        opt.step()
    opt.zero_grad()
    loss = _loss(model, 4)  # reported once: the placeholder has its value back
    loss.backward()
    opt.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clip_grad_value_matches_torch(stage: int) -> None:
    torch.manual_seed(0)
    ref = GPT(CFG).double()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage)
    for step in range(2):
        _loss(ref, step).backward()
        _loss(model, step).backward()
        torch.nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
        opt.clip_grad_value_(1e-3)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    with zs.gathered_parameters(model):
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-12, atol=1e-15), n
    with pytest.raises(ValueError, match="clip_value=0"):
        opt.clip_grad_value_(0)


def test_checkpoint_objects_and_keep_last(tmp_path) -> None:
    torch.manual_seed(0)
    model, opt = zs.initialize(GPT(CFG), lambda params: torch.optim.AdamW(params, lr=1e-2), stage=2)
    root = tmp_path / "ckpt"
    for step in range(3):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
        zs.save_checkpoint(root, model, opt, objects={"trainer": {"step": step, "t": torch.arange(3)}}, keep_last=2)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-2", "step-3"]
    state = zs.read_checkpoint_object(root, "trainer")
    assert state["step"] == 2 and torch.equal(state["t"], torch.arange(3))
    assert zs.read_checkpoint_object(root / "step-2", "trainer", weights_only=True)["step"] == 1
    with pytest.raises(ValueError, match="has no object 'loops'"):
        zs.read_checkpoint_object(root, "loops")
    with open(root / "step-3" / "trainer.pt", "ab") as f:
        f.write(b"x")
    with pytest.raises(RuntimeError, match="trainer.pt"):
        zs.read_checkpoint_object(root, "trainer")
    with pytest.raises(ValueError, match="keep_last=0"):
        zs.save_checkpoint(root, model, opt, keep_last=0)


def test_checkpoint_restores_param_group_settings(tmp_path) -> None:
    torch.manual_seed(0)
    model, opt = zs.initialize(GPT(CFG), lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.9)), stage=3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _loss(model, 0).backward()
    opt.step()
    sched.step()
    zs.save_checkpoint(tmp_path, model, opt)
    model2, opt2 = zs.initialize(GPT(CFG), lambda params: torch.optim.AdamW(params, lr=1e-2), stage=1)
    zs.load_checkpoint(tmp_path, model2, opt2)
    assert opt2.param_groups[0]["lr"] == 5e-3 and opt2.param_groups[0]["betas"] == (0.8, 0.9)


def _zero3(seed: int = 0, **cfg):
    torch.manual_seed(seed)
    return zs.initialize(GPT(CFG), lambda params: torch.optim.AdamW(params, lr=1e-2), stage=3,
                         stage3_param_persistence_threshold=0, **cfg)  # fmt: skip


def test_zero3_state_dict_outside_gathering_raises_instead_of_placeholders() -> None:
    model, _ = _zero3()
    with pytest.raises(RuntimeError, match=r"state_dict\(\) of a ZeRO-3 model.*full_state_dict"):
        model.state_dict()
    with pytest.raises(RuntimeError, match=r"'ln1.weight' is sharded"):
        model.blocks[0].state_dict()  # a submodule too
    assert len(model.state_dict(keep_vars=True)) > 0  # names (and Parameter objects) stay available
    with zs.gathered_parameters(model):
        sd = model.state_dict()
    assert all(not torch.isnan(v).any() for v in sd.values() if v.is_floating_point())


def test_keyboard_interrupt_in_forward_leaves_the_engine_usable() -> None:
    model, opt = _zero3()
    ref, ref_opt = _zero3()
    block = model.blocks[0]
    orig = block.forward

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    block.forward = interrupt
    with pytest.raises(KeyboardInterrupt):
        _loss(model, 0)
    del block.forward
    assert block.forward == orig
    with zs.gathered_parameters(model):  # refused while a forward is (still) running
        pass
    # a forward pre-hook placed before the engine's raises: the nesting count stays right
    handle = model.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(ValueError("hook")), prepend=True)
    with pytest.raises(ValueError, match="hook"):
        _loss(model, 0)
    handle.remove()
    with zs.gathered_parameters(model):
        pass
    for m, o in ((model, opt), (ref, ref_opt)):
        _loss(m, 0).backward()
        o.step()
        o.zero_grad()
    with zs.gathered_parameters(model), zs.gathered_parameters(ref):
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), n


def test_replace_optimizer_starts_fresh_as_ddp_would() -> None:
    torch.manual_seed(0)
    plain = GPT(CFG)
    model = copy.deepcopy(plain)
    model, old = zs.initialize(model, lambda params: torch.optim.SGD(params, lr=0.0), stage=3)
    with torch.no_grad():
        _loss(model, 0)  # evaluated first, as Lightning's validate() before fit()
    new = zs.replace_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(2):
        for m, o in ((model, new), (plain, plain_opt)):
            _loss(m, step).backward()
            o.step()
            o.zero_grad()
    with zs.gathered_parameters(model):
        for (n, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), n
    with pytest.raises(RuntimeError, match="replaced by zero_strategy.replace_optimizer"):
        old.step()
    with pytest.raises(ValueError, match="already bound"):
        zs.replace_optimizer(model, new)


def test_16bit_parameters_refuse_batchnorm_mixed_precision_trains_it_as_plain_autocast() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm1d\) keeps fp32 running statistics.*use mixed precision"):
        zs.initialize(net, lambda p: torch.optim.SGD(p, lr=0.1), stage=2, precision="bf16")
    # mixed precision keeps fp32 parameters and statistics: BatchNorm trains as under DDP + autocast
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    for stage in (2, 3):
        m = copy.deepcopy(ref)
        m, opt = zs.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), stage=stage, precision="bf16-mixed")
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = ref(x).float().square().mean()
        loss = m(x).float().square().mean()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6, abs=0)
        loss.backward()
        opt.step()
        with zs.gathered_parameters(m):
            assert all(p.dtype == torch.float32 for p in m.parameters()) and torch.isfinite(m[1].running_mean).all()


def test_export_bf16_casts_floating_tensors_only(tmp_path) -> None:
    """``zero-strategy export --dtype bf16`` keeps integer and bool tensors bit-exact (an int64
    position id of 257 would come back as 256 through bf16)."""
    from safetensors.torch import load_file

    from zero_strategy import cli

    class WithIds(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("position_ids", torch.arange(250, 260, dtype=torch.int64))
            self.register_buffer("mask", torch.tensor([True, False, True]))

        def forward(self, x):
            return self.lin(x)

    model, opt = zs.initialize(WithIds(), lambda p: torch.optim.SGD(p, lr=0.1), stage=3)
    zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    for out in (tmp_path / "a.safetensors", tmp_path / "b.pt"):
        cli.export(str(tmp_path / "ckpt"), str(out), dtype="bf16")
        sd = load_file(out) if out.suffix == ".safetensors" else torch.load(out, weights_only=True)
        assert sd["position_ids"].dtype == torch.int64 and sd["position_ids"].tolist() == list(range(250, 260))
        assert sd["mask"].dtype == torch.bool and sd["mask"].tolist() == [True, False, True]
        assert sd["lin.weight"].dtype == torch.bfloat16


def test_load_checkpoint_leaves_non_persistent_buffers_alone(tmp_path) -> None:
    """Checkpoints hold what state_dict() holds: a non-persistent buffer (RoPE's inv_freq,
    recomputed after a config change) keeps the value the new model computed."""

    class Rope(torch.nn.Module):
        def __init__(self, base: float) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("inv_freq", 1.0 / base ** torch.arange(0, 4, 2).float(), persistent=False)
            self.register_buffer("kept", torch.zeros(2))

        def forward(self, x):
            return self.lin(x)

    for stage in (1, 3):
        saved = Rope(10000.0)
        saved.kept.fill_(7.0)
        model, opt = zs.initialize(saved, lambda p: torch.optim.SGD(p, lr=0.1), stage=stage)
        root = tmp_path / f"s{stage}"
        zs.save_checkpoint(root, model, opt)
        fresh = Rope(500000.0)  # a new rope base: its inv_freq is recomputed
        expected = fresh.inv_freq.clone()
        fresh, opt2 = zs.initialize(fresh, lambda p: torch.optim.SGD(p, lr=0.1), stage=stage)
        zs.load_checkpoint(root, fresh, opt2)
        assert torch.equal(fresh.inv_freq, expected) and fresh.kept.tolist() == [7.0, 7.0]
        zs.load_full_state_dict(fresh, {k: v for k, v in Rope(1.0).state_dict().items()})  # strict: no inv_freq needed
        assert torch.equal(fresh.inv_freq, expected)


@pytest.mark.parametrize(
    ("device", "flag"),
    [("cpu", "fused"), pytest.param("cuda", "capturable", marks=pytest.mark.gpu),
     pytest.param("cuda", "fused", marks=pytest.mark.gpu)],
)  # fmt: skip
def test_resume_into_a_fresh_capturable_or_fused_adam(tmp_path, device: str, flag: str) -> None:
    """A fresh capturable/fused Adam gets ``step`` on the parameter's device (float32) from
    load_checkpoint, as torch's load_state_dict gives it, so its first step runs and continues
    the saved run exactly. (The CPU rule is checked in test_checkpoint's export test.) The
    ``cpu`` variant runs the fused one, the same body on the CPU (torch's capturable Adam takes
    no CPU parameters)."""

    def build():
        torch.manual_seed(0)
        model = GPT(CFG).to(device)
        return zs.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2, **{flag: True}))

    def train(model, opt, steps: range) -> None:
        for step in steps:
            x, y = synthetic_batch(CFG, 2, step)
            F.cross_entropy(model(x.to(device)).view(-1, CFG.vocab_size), y.to(device).reshape(-1)).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    train(model, opt, range(2))
    zs.save_checkpoint(tmp_path, model, opt)
    train(model, opt, range(2, 4))
    fresh, fresh_opt = build()
    zs.load_checkpoint(tmp_path, fresh, fresh_opt)
    for state in fresh_opt.state.values():
        assert state["step"].device.type == device and state["step"].dtype == torch.float32, state["step"]
    train(fresh, fresh_opt, range(2, 4))  # raised before the fix: step on the CPU
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):  # full at stage 1/2
        assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7, what=name)


def test_save_never_writes_into_an_existing_checkpoint_and_checks_objects(tmp_path) -> None:
    model, opt = _zero3()
    first = zs.save_checkpoint(tmp_path, model, opt)
    second = zs.save_checkpoint(tmp_path, model, opt)  # the same step again
    assert first.endswith("step-0") and second.endswith("step-0.1")
    assert (tmp_path / "latest").read_text().strip() == "step-0.1"
    with pytest.raises(ValueError, match="step-0' exists"):
        zs.save_checkpoint(tmp_path, model, opt, tag="step-0")
    with pytest.raises(RuntimeError, match="could not start the save .*pickle"):
        zs.save_checkpoint(tmp_path, model, opt, objects={"bad": lambda: 0})
    assert (tmp_path / "latest").read_text().strip() == "step-0.1"


def test_zero3_zero_dim_parameter_and_partial_saves_pruned(tmp_path) -> None:
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
            self.scale = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x * self.scale

    torch.manual_seed(0)
    ref = Scaled()
    model = copy.deepcopy(ref)
    model, opt = zs.initialize(
        model, lambda p: torch.optim.SGD(p, lr=0.1), stage=3, stage3_param_persistence_threshold=0
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(torch.ones(2, 4)).sum().backward()
        o.step()
    with zs.gathered_parameters(model):
        assert torch.equal(model.scale, ref.scale) and torch.equal(model.blocks[1].weight, ref.blocks[1].weight)
    (tmp_path / "step-0").mkdir()  # the remains of our save killed before its metadata: its owner is gone
    (tmp_path / "step-0" / "__0_0.distcp").write_bytes(b"x")
    import json
    import subprocess
    import sys

    dead = int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    )
    (tmp_path / "step-0" / ".zero_owner.json").write_text(
        json.dumps({"host": os.uname().nodename, "pid": dead, "created": 0.0})
    )
    (tmp_path / "notes").mkdir()  # not ours: kept
    zs.save_checkpoint(tmp_path, model, opt, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes", "step-1"]
