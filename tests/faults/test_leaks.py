"""Nothing outlives an engine: counted, not measured by RSS. After 20 engines (stages 1-3, some
with a checkpoint saved and loaded) are built, trained and destroyed in one process, the live
engines, the hooks on the models, the open file descriptors and the threads are back to the
baseline; ``destroy()`` hands back a plain module that trains on its own."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from pathlib import Path

import torch

import zero_strategy as zs
from zero_strategy.engine import ZeroEngine, live_engines


def _hooks(model: torch.nn.Module) -> int:
    n = 0
    for m in model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        n += len(m._state_dict_hooks) + len(m._load_state_dict_pre_hooks) + len(m._load_state_dict_post_hooks)
    for p in model.parameters():
        n += len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {})
    return n


def _count() -> dict[str, int]:
    gc.collect()
    return {
        "engines": len(live_engines()) + sum(isinstance(o, ZeroEngine) for o in gc.get_objects()),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
    }


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)), torch.nn.Linear(16, 4)
    )


def test_twenty_engines_leave_nothing_behind(tmp_path: Path) -> None:
    before = _count()  # engines of earlier tests in this process may still be alive: not ours
    baseline = None
    refs = []
    for k in range(20):
        stage = 1 + k % 3
        model = _model()
        before_hooks = _hooks(model)
        model, opt = zs.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-2), stage=stage,
                                   stage3_param_persistence_threshold=0)  # fmt: skip
        assert _hooks(model) > before_hooks
        for _ in range(2):
            model(torch.ones(2, 16)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        if k % 4 == 0:
            zs.save_checkpoint(tmp_path / f"ck{k}", model, opt)
            zs.load_checkpoint(tmp_path / f"ck{k}", model, opt)
        refs.append(weakref.ref(model.zero_engine))
        zs.destroy(model)
        assert _hooks(model) == before_hooks, (k, _hooks(model), before_hooks)
        assert type(model) is torch.nn.Sequential and not hasattr(model, "zero_engine")
        del model, opt
        if k == 1:
            baseline = _count()  # after the first engines (lazy imports, DCP's first use) settled
    after = _count()
    assert all(r() is None for r in refs), "an engine is still alive"
    assert after["engines"] <= before["engines"], (before, after)
    assert after["fds"] <= baseline["fds"] and after["threads"] <= baseline["threads"], (baseline, after)


def test_destroy_hands_back_a_plain_module_with_its_trained_values() -> None:
    for stage in (1, 2, 3):
        model = _model()
        plain = _model()
        model, opt = zs.initialize(
            model, lambda p: torch.optim.SGD(p, lr=0.1), stage=stage, stage3_param_persistence_threshold=0
        )
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        for m, o in ((model, opt), (plain, plain_opt)):
            m(torch.ones(2, 16)).square().sum().backward()
            o.step()
            o.zero_grad()
        zs.destroy(model)
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            assert a.untyped_storage().nbytes() == a.numel() * a.element_size(), (stage, name)  # no placeholder
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (stage, name)
        model(torch.ones(2, 16)).sum().backward()  # a plain module: trains without the engine
        assert all(p.grad is not None for p in model.parameters())
        try:
            opt.step()
            raise AssertionError("the destroyed engine's optimizer stepped")
        except RuntimeError as e:
            assert "was destroyed" in str(e)
