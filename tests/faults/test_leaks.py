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
from zero_strategy.runtime.engine import ZeroEngine, live_engines


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


def _swap_dirs(root: Path) -> int:
    from zero_strategy.storage.disk import swap_root_name

    base = root / swap_root_name()
    return len(list(base.iterdir())) if base.is_dir() else 0


NVME_CELLS = [  # (stage, where on disk); each built, trained and dropped with and without destroy()
    (2, "optimizer"),
    (3, "param"),
    (3, "both"),
]


def _nvme_engine(root: Path, stage: int, where: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    nvme = {"device": "nvme", "nvme_path": str(root)}
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if where in ("optimizer", "both"):
        zero["offload_optimizer"] = nvme
    if where in ("param", "both"):
        zero["offload_param"] = nvme
    model, opt = zs.initialize(_model(), lambda p: torch.optim.AdamW(p, lr=1e-2), config={"zero_optimization": zero})
    for _ in range(2):
        model(torch.ones(2, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _light_count() -> dict[str, int]:
    gc.collect()  # after gc.freeze(): only what came since (a full collection costs half a second here)
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}


def test_a_dropped_nvme_engine_takes_its_threads_files_and_directories_along(tmp_path: Path) -> None:
    """With the optimizer or the parameters on disk, an engine that is dropped without
    ``destroy()`` (as Lightning's teardown leaves it, so that ``test()`` may follow ``fit()``)
    is collected, and its I/O threads, file descriptors and swap directories go with it."""
    model, opt = _nvme_engine(tmp_path, 3, "both")  # lazy imports and first uses settle first
    zs.destroy(model)
    del model, opt
    gc.collect()
    gc.freeze()
    try:
        baseline = _light_count()
        for stage, where in NVME_CELLS:
            for destroy in (True, False):
                model, opt = _nvme_engine(tmp_path, stage, where)
                ref = weakref.ref(model.zero_engine)
                assert _swap_dirs(tmp_path) >= 1
                if destroy:
                    zs.destroy(model)
                del model, opt
                after = _light_count()
                cell = (stage, where, "destroy" if destroy else "dropped")
                assert ref() is None, f"{cell}: the engine is still alive"
                assert after["threads"] <= baseline["threads"], (cell, baseline, after)
                assert after["fds"] <= baseline["fds"], (cell, baseline, after)
                assert _swap_dirs(tmp_path) == 0, f"{cell}: swap directories left: {_swap_dirs(tmp_path)}"
    finally:
        gc.unfreeze()
