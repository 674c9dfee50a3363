"""Offload policies in one process: which masters go to the host, the host step's fused fast
path (only where the user left the flags unset), DeepSpeed's legacy switch, and the errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_strategy as zs


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _cfg(**offload) -> dict:
    return {"zero_optimization": {"stage": 2, "reduce_bucket_size": 300, **offload}}


def _host_bytes(model) -> int:
    s = model.zero_engine.memory_stats()
    return s["tier_host_pinned"] + s["tier_host_pageable"]


def test_fused_fast_path_only_where_the_flags_are_unset() -> None:
    off = {"offload_optimizer": {"device": "cpu"}}
    _, opt = zs.initialize(_model(), lambda p: torch.optim.AdamW(p, lr=1e-3), config=_cfg(**off))
    assert [g["fused"] for g in opt.param_groups] == [True]
    for kw in ({"foreach": False}, {"fused": False}, {"foreach": True}):
        _, opt = zs.initialize(_model(), lambda p, kw=kw: torch.optim.AdamW(p, lr=1e-3, **kw), config=_cfg(**off))
        g = opt.param_groups[0]
        assert g["fused"] in (None, False) and all(g[k] == v for k, v in kw.items()), (kw, g)
    _, opt = zs.initialize(_model(), lambda p: torch.optim.SGD(p, lr=0.1), config=_cfg(**off))
    assert "fused" not in opt.param_groups[0] or opt.param_groups[0]["fused"] is None
    _, opt = zs.initialize(_model(), lambda p: torch.optim.AdamW(p, lr=1e-3), config=_cfg())  # no offload
    assert opt.param_groups[0]["fused"] is None


def test_ratio_offloads_the_first_groups_and_the_fast_path_skips_mixed_groups() -> None:
    model, opt = zs.initialize(
        _model(),
        lambda p: torch.optim.AdamW(p, lr=1e-3),
        config=_cfg(offload_optimizer={"device": "cpu", "ratio": 0.5}),
    )
    groups = model.zero_engine.groups
    tiers = [g.tier for g in groups]
    assert "host" in tiers and "device" in tiers, tiers
    host = sum(sum(p.numel() for p in g.params) for g in groups if g.tier == "host")
    total = sum(p.numel() for p in model.parameters())
    assert 0.5 * total <= host < total
    assert opt.param_groups[0]["fused"] is None  # one param group over host and device masters: left alone


def test_legacy_cpu_offload_and_pin_memory_without_a_gpu() -> None:
    cfg = {"zero_optimization": {"stage": 1, "cpu_offload": True, "cpu_offload_use_pin_memory": True}}
    model, opt = zs.initialize(_model(), lambda p: torch.optim.AdamW(p, lr=1e-3), config=cfg)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    opt.step()
    stats = model.zero_engine.memory_stats()
    assert stats["tier_host_pageable"] > 0 and stats["tier_host_pinned"] == 0  # no GPU: nothing to pin for
    assert _host_bytes(model) == stats["masters"] + stats["grad_shards"] + stats["optimizer_state"]


def test_offload_errors_name_the_field_and_the_fix(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"offload_param needs stage 3.*Use stage 3"):
        zs.initialize(_model(), lambda p: torch.optim.SGD(p, lr=0.1), config=_cfg(offload_param={"device": "cpu"}))
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "ratio": 0.5}}}
    with pytest.raises(ValueError, match=r"offload_param.ratio.*offload_optimizer.ratio"):
        zs.initialize(_model(), lambda p: torch.optim.SGD(p, lr=0.1), config=cfg)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bad = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(blocker / "swap")}}
    with pytest.raises(
        RuntimeError, match=r"zero_optimization.offload_param.nvme_path=.*point nvme_path at a writable"
    ):
        zs.initialize(model, None, config={"zero_optimization": bad})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was changed


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_16bit_parameters_offloaded_train_exactly_as_on_the_device(stage: int, precision: str) -> None:
    """16-bit parameters with fp32 masters on the host (at ZeRO-3 a 16-bit device row): the same
    bits as the masters on the device, fp16's loss scaling and overflow check included."""
    from zero_strategy.models import GPT, GPTConfig

    torch.manual_seed(1)
    pretrained = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layer=2, n_head=2)).state_dict()  # fp32

    def run(offload: dict) -> tuple[list[float], dict]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layer=2, n_head=2))
        cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, **offload}, "gradient_clipping": 0.5,
               precision: {"enabled": True}}  # fmt: skip
        model, opt = zs.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False), config=cfg)
        zs.load_full_state_dict(model, pretrained)  # fp32 weights into the fp32 masters, not through a 16-bit row
        losses = []
        for step in range(4):
            x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(step))
            loss = model.loss(x[:, :-1], x[:, 1:])
            zs.backward(loss, model=model)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, model.zero_engine.memory_stats()

    ref, ref_stats = run({})
    got, stats = run({"offload_optimizer": {"device": "cpu"}})
    assert got == ref and all(v == v for v in got), (got, ref)  # bit-equal, and no NaN
    assert ref_stats["tier_host_pageable"] == 0
    assert stats["tier_host_pageable"] == stats["masters"] + stats["grad_shards"] + stats["optimizer_state"] > 0
    if stage == 3:  # rows on disk: 16-bit rows beside host masters, or fp32 rows that are the masters
        for opt_device in ("cpu", "nvme"):
            on_disk = {"offload_optimizer": {"device": opt_device}, "offload_param": {"device": "nvme"}}
            got, stats = run(on_disk)
            assert got == ref, (opt_device, got, ref)
            assert stats["param_shards"] > 0 and stats["tier_disk"] >= stats["param_shards"], stats


def test_a_checkpoint_does_not_carry_the_fused_choice_into_another_run(tmp_path) -> None:
    off = {"offload_optimizer": {"device": "cpu"}}
    model, opt = zs.initialize(_model(), lambda p: torch.optim.AdamW(p, lr=1e-3), config=_cfg(**off))
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert opt.param_groups[0]["fused"] is True
    zs.save_checkpoint(str(tmp_path), model, opt)
    model2, opt2 = zs.initialize(_model(), lambda p: torch.optim.AdamW(p, lr=2e-3, foreach=False), config=_cfg())
    zs.load_checkpoint(str(tmp_path), model2, opt2)
    g = opt2.param_groups[0]
    assert g["fused"] is None and g["foreach"] is False and g["lr"] == 1e-3  # hyperparameters do come back


@pytest.mark.parametrize(
    "offload", [{}, {"offload_optimizer": {"device": "cpu"}}, {"offload_optimizer": {"device": "nvme"}}]
)
def test_an_optimizer_subclass_calling_super_step_steps_once(offload: dict, tmp_path) -> None:
    """torch fires the step hooks again when a subclass's ``step`` calls ``super().step()`` on a
    class that was hooked already; the engine's work still runs once per step."""

    class MyAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # AdamW's own step is hooked now
    if "offload_optimizer" in offload and offload["offload_optimizer"]["device"] == "nvme":
        offload = {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    runs = []
    for cls in (torch.optim.AdamW, MyAdamW):
        model, opt = zs.initialize(_model(), lambda p, cls=cls: cls(p, lr=1e-2, foreach=False), config=_cfg(**offload))
        for s in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert model.zero_engine.step_count == 3 and model.zero_engine.steps.depth == 0
        runs.append({k: v.clone() for k, v in zs.full_state_dict(model).items()})
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


@pytest.mark.parametrize(
    "offload", [{}, {"offload_optimizer": {"device": "cpu"}}, {"offload_optimizer": {"device": "nvme"}}]
)
def test_what_a_subclass_does_after_super_step_reaches_the_model(offload: dict, tmp_path) -> None:
    """A subclass that changes the parameters after ``super().step()`` (here: clamps them) must
    see its change in the model, as without ZeRO: the engine's after-step work runs on the
    outermost step call only."""

    class ClampAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            out = super().step(closure)
            with torch.no_grad():
                for g in self.param_groups:
                    for p in g["params"]:
                        p.clamp_(-0.05, 0.05)
            return out

    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # AdamW's own step is hooked now
    if offload.get("offload_optimizer", {}).get("device") == "nvme":
        offload = {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    ref = _model()
    ref_opt = ClampAdamW(ref.parameters(), lr=1e-2, foreach=False)
    model, opt = zs.initialize(_model(), lambda p: ClampAdamW(p, lr=1e-2, foreach=False), config=_cfg(**offload))
    for s in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s))
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    got = zs.full_state_dict(model)
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, rtol=0, atol=1e-7), k
        assert float(got[k].abs().max()) <= 0.05 + 1e-7, k  # the clamp reached the model


def test_a_refused_or_failed_step_leaves_no_step_open() -> None:
    """A step that raises (here a closure, refused), through a scheduler built before
    initialize (torch's scheduler then calls the class's step, not the engine's mixin): the
    next step works fully."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model, opt = zs.initialize(model, opt, config=_cfg())
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: 0.0)
    assert model.zero_engine.steps.depth == 0
    before = {k: v.clone() for k, v in zs.full_state_dict(model).items()}
    opt.step()  # the same gradients, now stepped
    sched.step()
    assert model.zero_engine.step_count == 1
    after = zs.full_state_dict(model)
    assert all(not torch.equal(before[k], after[k]) for k in before)
