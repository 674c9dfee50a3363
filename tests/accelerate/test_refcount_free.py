"""``ZeroPlugin.prepare`` on an Accelerator, then ``del accelerator, model, optimizer`` (with or
without ``zero_strategy.destroy(model)`` first): the Accelerator, the model, the optimizer (and
Accelerate's wrapper of it), a parameter and the engine are freed at once, with Python's cyclic
collector off, as plain Accelerate's are. The binding ZeroPlugin puts on the Accelerator holds it
weakly (``binding.py``). Mixed precision is left out: Accelerate's own ``prepare`` leaves a
bound ``forward`` in the model's ``__dict__`` then (a cycle of the model with itself), and
ZeroPlugin does the same to return fp32 outputs as Accelerate does."""

from __future__ import annotations

import weakref

import pytest


def _prepared(stage: int, two: bool):
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from accelerate_zero import ZeroPlugin

    # Accelerate's state is shared by the process: an earlier test's mixed_precision="bf16" would
    # carry over (and with it the bound forward this test leaves out)
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    if acc.mixed_precision != "no":
        raise AssertionError(f"the Accelerator kept mixed_precision={acc.mixed_precision!r} from an earlier test")
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"g": torch.nn.Linear(8, 8), "d": torch.nn.Linear(8, 1)})
    opts = [torch.optim.AdamW(model[k].parameters(), lr=1e-2) for k in ("g", "d")] if two else [
        torch.optim.AdamW(model.parameters(), lr=1e-2)]  # fmt: skip
    model, *opts = ZeroPlugin(stage=stage).prepare(acc, model, *opts)
    for _ in range(2):
        acc.backward(model["d"](torch.tanh(model["g"](torch.randn(4, 8)))).square().mean())
        for o in opts:
            o.step()
            o.zero_grad()
    return acc, model, opts


@pytest.mark.parametrize(("stage", "two"), [(3, False), (2, True), (1, False)])
def test_a_dropped_accelerator_frees_the_engine(stage: int, two: bool) -> None:
    import zero_strategy as zs
    from zero_strategy.testing.refcount import collector_off, left_to_the_collector, still_alive

    for destroy in (False, True):
        with collector_off():
            acc, model, opts = _prepared(stage, two)
            refs = {"accelerator": weakref.ref(acc), "model": weakref.ref(model), "engine": weakref.ref(model.zero_engine),
                    "a parameter": weakref.ref(next(model.parameters()))}  # fmt: skip
            for i, o in enumerate(opts):
                refs[f"optimizer {i}"], refs[f"its wrapper {i}"] = weakref.ref(o.optimizer), weakref.ref(o)
            if destroy:
                zs.destroy(model)
            del acc, model, opts, o
            alive = still_alive(refs)
            cycles = left_to_the_collector()
        assert (alive, cycles) == ([], {}), (stage, two, destroy, alive, cycles)
