"""A dropped model's engine is freed by reference counting, as a plain module and FSDP2 are.

With the cyclic collector off (``gc.disable()``), ``del model, optimizer`` (with or without
``zero_strategy.destroy(model)`` first) must leave the model, the optimizer, a parameter and the
engine dead at once: a reference cycle among them would keep every tensor the engine holds alive
until the collector happens to run (on a GPU, six configurations in one process reached 90.6 GiB
instead of 34.8). Cells at world size 1 here (stages 1-3, CPU and NVMe offload, the memory
budget, MoE, several optimizers: ``zero_strategy.testing.refcount``); 2 ranks in
``tests/distributed/test_refcount_free.py``;
the front-ends in ``tests/lightning`` and ``tests/accelerate``. Ten builds and drops in one
process keep ``RssAnon`` (and on CUDA ``memory_allocated``) flat."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from zero_strategy.testing.refcount import CELLS, check_freed, flat_memory


@pytest.mark.parametrize("cell", CELLS, ids=[c.name for c in CELLS])
def test_a_dropped_engine_is_freed_without_the_cyclic_collector(cell, tmp_path: Path) -> None:
    for destroy in (False, True):
        check_freed(cell, tmp_path, destroy=destroy)


def test_ten_builds_and_drops_keep_memory_flat(tmp_path: Path) -> None:
    flat_memory(tmp_path, cycles=10)


def test_a_hook_of_a_dropped_engine_does_nothing() -> None:
    """A tensor hook the engine put on a model output may outlive the engine (the output is the
    user's): once the engine is gone it does nothing, and plain autograd goes on."""
    import zero_strategy as zs

    gc.collect()
    gc.disable()
    try:
        model, opt = zs.initialize(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1), stage=2)
        out = model(torch.ones(2, 4, requires_grad=True))
        del model, opt
        out.sum().backward()  # the output's hook finds no engine: a plain backward
    finally:
        gc.enable()


def test_an_optimizer_whose_engine_went_names_the_fix() -> None:
    """The optimizer holds its engine weakly: after ``destroy`` (or once its model is dropped)
    the engine is gone, ``zero_engine`` is None and a step raises naming the fix."""
    import zero_strategy as zs

    model, opt = zs.initialize(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1), stage=1)
    zs.destroy(model)
    assert opt.zero_engine is None
    with pytest.raises(RuntimeError, match="was destroyed .* or its model was dropped; build a new optimizer"):
        opt.step()
    model2, opt2 = zs.initialize(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1), stage=2)
    del model2
    with pytest.raises(RuntimeError, match="build a new optimizer"):
        opt2.zero_grad()


def test_cycle_through_finds_a_cycle_and_only_a_cycle() -> None:
    """The Lightning test's check (``cycle_through``): a list that holds itself through a dict is
    found with its chain; nested containers without a way back are not. (No engine here: an
    initialize in this process would leave its process group to the tests after it.)"""
    from zero_strategy.testing.refcount import cycle_through

    a: list = []
    a.append({"back": a})
    assert cycle_through(a) == ["list", "dict", "list"]
    assert cycle_through([[1], {"x": 2}]) is None
