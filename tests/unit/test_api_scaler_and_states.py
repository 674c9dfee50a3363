"""The single-process API, continued (``test_api_single_process.py``): fp16 loss scaling at run
time and across a resume, clipping and a forward between clip and step, an initialize that
fails or meets a managed parameter, named illegal state transitions, and shard sizes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import zero_strategy as zs
from zero_strategy.models import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layer=2, n_head=2, qkv_bias=False)


def _loss(model, step: int) -> torch.Tensor:
    x, y = synthetic_batch(CFG, 2, step)
    return F.cross_entropy(model(x).view(-1, CFG.vocab_size), y.reshape(-1))


def _zero3(seed: int = 0, **cfg):
    torch.manual_seed(seed)
    return zs.initialize(GPT(CFG), lambda params: torch.optim.AdamW(params, lr=1e-2), stage=3,
                         stage3_param_persistence_threshold=0, **cfg)  # fmt: skip


def test_fp16_deepspeed_schedule_hysteresis_and_window_at_runtime() -> None:
    """fp16 with 16-bit parameters follows DeepSpeed's schedule: hysteresis 2 absorbs one overflow
    before halving, loss_scale_window good steps double the scale (and refill the allowance)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    cfg = zs.ZeroConfig(
        stage=2, precision="fp16", loss_scale={"initial_scale_power": 8, "hysteresis": 2, "loss_scale_window": 3}
    )
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), config=cfg)
    inject = [False]
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if inject[0] else g)
    scales, skipped = [], []
    for step in range(9):
        inject[0] = step in (3, 4)
        zs.backward(model(torch.ones(2, 4, dtype=torch.float16)).float().sum(), model=model)
        opt.step()
        opt.zero_grad()
        scales.append(model.zero_engine.scaler.scale)
        skipped.append(opt.step_was_skipped)
    assert skipped == [False, False, False, True, True, False, False, False, False]
    # 3 good steps double; the first overflow is absorbed, the second halves; 3 good steps double again
    assert scales == [256, 256, 512, 512, 256, 256, 256, 512, 512], scales


def test_fp16_mixed_follows_grad_scaler_schedule() -> None:
    """fp16 mixed (fp32 parameters under autocast) follows torch.amp.GradScaler: no hysteresis, the
    scale halves at every overflow and can fall below 1; 2000 good steps double it."""
    from zero_strategy.sharding.precision import GradScalerSchedule, LossScaler

    scaler = LossScaler(GradScalerSchedule(init_scale=4.0, growth_interval=2), enabled=True)
    seen = []
    for inf in (True, True, True, False, False, True):
        scaler.update(inf)
        seen.append(scaler.scale)
    assert seen == [2.0, 1.0, 0.5, 0.5, 1.0, 0.5], seen
    model, _ = zs.initialize(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), stage=2, precision="16-mixed")
    assert (
        isinstance(model.zero_engine.scaler.schedule, GradScalerSchedule) and model.zero_engine.scaler.scale == 2.0**16
    )


def test_a_forward_between_clip_and_step_does_not_reopen_finalized_gradients() -> None:
    """clip_grad_norm_ finalizes the gradients; an evaluation forward (with or without grad)
    before step() must neither reduce again nor drop the clipped gradients."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    for stage in (1, 2, 3):
        model = copy.deepcopy(ref)
        plain = copy.deepcopy(ref)
        model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        _loss(model, 0).backward()
        _loss(plain, 0).backward()
        norm = opt.clip_grad_norm_(0.05)
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        assert float(norm) == pytest.approx(float(expected), rel=1e-6)
        _loss(model, 1)  # a forward with grad enabled, no backward
        with torch.no_grad():
            _loss(model, 2)
        opt.step()
        plain_opt.step()
        with zs.gathered_parameters(model):
            for (n, a), b in zip(model.named_parameters(), plain.parameters()):
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (stage, n)


def test_fp16_endless_overflow_raises() -> None:
    """Gradients that overflow at every scale must not skip steps forever in silence."""
    for cfg, steps in ((zs.ZeroConfig(stage=2, precision="fp16", loss_scale={"max_consecutive_skips": 5}), 5),
                       (zs.ZeroConfig(stage=2, precision="fp16", loss_scale={"initial_scale_power": 2, "hysteresis": 1}), 3)):  # fmt: skip
        torch.manual_seed(0)
        model, opt = zs.initialize(torch.nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1), config=cfg)
        model.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        with pytest.raises(RuntimeError, match=r"fp16: \d+ optimizer steps in a row were skipped"):
            for _ in range(steps + 5):
                zs.backward(model(torch.ones(2, 4, dtype=torch.float16)).float().sum(), model=model)
                opt.step()
                opt.zero_grad()
        assert model.zero_engine.scaler.consecutive_skips == steps, (
            cfg.loss_scale,
            model.zero_engine.scaler.consecutive_skips,
        )


def test_a_failed_zero3_initialize_leaves_the_model_as_it_was() -> None:
    """The dtype check of the last (root) unit fails after the block units were built: no
    parameter may have lost its values, and the retry the error asks for must work."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))
            self.proj = torch.nn.Linear(2, 2)
            self.head = torch.nn.Linear(2, 2).double()  # the root unit mixes float32 and float64

    torch.manual_seed(0)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="mixes parameter dtypes"):
        zs.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=3)
    assert type(model) is Net
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    model.head.float()
    zs.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=3)
    with zs.gathered_parameters(model):
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k].float()), k


def test_a_parameter_of_a_managed_model_is_refused_by_a_second_engine() -> None:
    student = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 2))
    teacher = torch.nn.Sequential(student[0], torch.nn.Linear(2, 2))  # shares the embedding
    zs.initialize(student, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=2)
    with pytest.raises(ValueError, match=r"parameter '0.weight' already belongs to Sequential.*nn.ModuleDict"):
        zs.initialize(teacher, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=2)
    assert getattr(teacher, "zero_engine", None) is None
    zs.destroy(student)  # a destroyed engine no longer owns it
    zs.initialize(teacher, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=2)


def test_fp16_scaler_schedule_resumes_where_it_was_saved(tmp_path) -> None:
    """Saved after an absorbed overflow (hysteresis used) in the middle of a window: the resumed
    run halves at the next overflow and doubles at the same step as the uninterrupted one."""
    cfg = zs.ZeroConfig(
        stage=2, precision="fp16", loss_scale={"initial_scale_power": 8, "hysteresis": 2, "loss_scale_window": 3}
    )

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), config=cfg)
        inject = [False]
        model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if inject[0] else g)
        return model, opt, inject

    def run(model, opt, inject, steps) -> list[float]:
        scales = []
        for step in steps:
            inject[0] = step in (3, 4)
            zs.backward(model(torch.ones(2, 4, dtype=torch.float16)).float().sum(), model=model)
            opt.step()
            opt.zero_grad()
            scales.append(model.zero_engine.scaler.scale)
        return scales

    whole = run(*build(), range(9))
    model, opt, inject = build()
    first = run(model, opt, inject, range(4))
    zs.save_checkpoint(tmp_path, model, opt)
    model, opt, inject = build()
    zs.load_checkpoint(tmp_path, model, opt)
    assert first + run(model, opt, inject, range(4, 9)) == whole == [256, 256, 512, 512, 256, 256, 256, 512, 512]


def test_illegal_transitions_are_named() -> None:
    """A state change from a state it may not leave raises where it happens: optimizer.step() or
    zero_grad() run from a hook inside backward (the gradients are not all there yet), and, one
    layer down, a unit asked to finish a gather that was never started."""
    model, opt = _zero3()
    seen: list[str] = []

    def step_inside_backward(grad: torch.Tensor) -> torch.Tensor:
        for call in (opt.step, opt.zero_grad):
            try:
                call()
            except RuntimeError as e:
                seen.append(str(e))
        return grad

    x, y = synthetic_batch(CFG, 2, 0)
    logits = model(x)
    logits.register_hook(step_inside_backward)
    F.cross_entropy(logits.view(-1, CFG.vocab_size), y.reshape(-1)).backward()
    assert len(seen) == 2, seen
    assert seen[0].startswith("optimizer.step() during backward (step 0); call it after loss.backward() returns"), seen
    assert seen[1].startswith("zero_grad() during backward (step 0); call it between steps"), seen
    opt.step()  # after backward: fine
    unit = model.zero_engine.zero3.all_units[0]
    assert unit.state.name == "SHARDED"
    with pytest.raises(
        RuntimeError,
        match=r"wait_unshard of unit 'blocks.0' moves it to UNSHARDED, which needs state UNSHARDING, but it is SHARDED",
    ):
        unit.wait_unshard({})


def test_shard_size_must_divide_the_world():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"shard_size=2 does not divide the world size 1; .*sizes at 1 ranks: 1 "):
        zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=zs.ZeroConfig(shard_size=2))
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=zs.ZeroConfig(shard_size=1))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # one rank, one group of one: the flat layout
