"""Checks that a dropped model's engine is freed by reference counting alone.

A plain module, or one under FSDP2, is freed as soon as its last reference goes. An engine in
a reference cycle is not: its parameters, masters, optimizer state and buffers stay until
Python's cyclic collector runs, which it does only after enough new container objects were
made, so a process that builds several models in turn holds them all. Each check here runs
with the collector off (``gc.disable()``): a cycle anywhere between the model, its optimizers
and the engine keeps them alive, and the check names what survived. Used at world size 1
(``tests/faults/test_refcount_free.py``) and on 2 ranks (``tests/distributed/test_refcount_free.py``).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import sys
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # see below
from torch import nn

import zero_strategy as zs
from zero_strategy.storage.host_memory import rss_anon

# torch._dynamo's first import (torch.optim's first optimizer does it) leaves a reference cycle
# through its importer's frames (torch.fx.wrap keeps its own frame), which holds their locals, the
# model being built among them, until the cyclic collector runs: once per process, and torch's,
# not the engine's. Imported here, before any check.

__all__ = [
    "CELLS", "Cell", "check_freed", "collector_off", "cycle_through", "flat_memory", "left_to_the_collector",
    "still_alive",
]  # fmt: skip

D = 16


@dataclass(frozen=True)
class Cell:
    """One configuration: the stage, extra ``zero_optimization`` keys, other top-level config
    keys, the model (``mlp``; ``moe``: declared experts; ``gan``: two optimizers; ``muon``: the
    ``mlp`` under Muon and AdamW) and where on
    disk (``nvme``: ``optimizer``, ``param`` or ``both``; the path is the check's own)."""

    name: str
    stage: int
    zero: dict[str, Any] = field(default_factory=dict)
    top: dict[str, Any] = field(default_factory=dict)
    model: str = "mlp"
    nvme: str = ""


_CPU = {"device": "cpu"}
CELLS = [
    Cell("stage1", 1),
    Cell("stage2", 2),
    Cell("stage3", 3),
    Cell("stage2-cpu-offload", 2, {"offload_optimizer": _CPU}),
    Cell("stage3-cpu-offload", 3, {"offload_optimizer": _CPU, "offload_param": _CPU}),
    Cell("stage2-nvme-optimizer", 2, nvme="optimizer"),
    Cell("stage3-nvme-both", 3, nvme="both"),
    Cell("stage3-budget", 3, top={"zero_strategy": {"memory": {"budget": "8GB"}}}),
    Cell("stage3-moe", 3, model="moe"),
    Cell("stage2-moe", 2, model="moe"),
    Cell("stage1-two-optimizers", 1, model="gan"),
    Cell("stage3-two-optimizers-cpu-offload", 3, {"offload_optimizer": _CPU}, model="gan"),
    Cell("stage2-muon", 2, model="muon"),  # whole-parameter owners (runtime/whole_params.py)
    Cell("stage3-muon", 3, model="muon"),
]


class _Moe(nn.Module):
    """A block of declared experts (``zs.declare_experts``) between an embedding and a head."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.gate = nn.Linear(D, experts, bias=False)
        self.experts = zs.declare_experts(nn.ModuleList(nn.Linear(D, D) for _ in range(experts)))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        idx = self.gate(h).argmax(-1)
        zs.select_experts(self.experts, idx)
        out = torch.zeros_like(h)
        for e in idx.unique().tolist():
            rows = idx == e
            out[rows] = self.experts[e](h[rows])
        return self.head(torch.tanh(h + out))


def _model(kind: str, width: int = D, depth: int = 3) -> nn.Module:
    torch.manual_seed(0)
    if kind == "moe":
        return _Moe()
    if kind == "gan":
        return nn.ModuleDict({"g": nn.Sequential(nn.Linear(D, D), nn.Tanh()), "d": nn.Linear(D, 4)})
    layers = [nn.Sequential(nn.Linear(D if i == 0 else width, width), nn.Tanh()) for i in range(depth)]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def build(cell: Cell, root: Path, *, width: int = D, device: str = "cpu") -> tuple[nn.Module, Any]:
    """``initialize``'s model and optimizer (a list of two for ``gan``) for ``cell``."""
    zero: dict[str, Any] = {"stage": cell.stage, "stage3_param_persistence_threshold": 0, **cell.zero}
    nvme = {"device": "nvme", "nvme_path": str(root)}
    if cell.nvme in ("optimizer", "both"):
        zero["offload_optimizer"] = nvme
    if cell.nvme in ("param", "both"):
        zero["offload_param"] = nvme
    model = _model(cell.model, width).to(device)
    opt: Any
    if cell.model == "gan":
        opt = [torch.optim.Adam(model[k].parameters(), lr=1e-2) for k in ("g", "d")]  # type: ignore[index]
    elif cell.model == "muon":  # Muon on the matrices, AdamW on the rest
        mats = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() != 2]
        opt = [torch.optim.Muon(mats, lr=1e-2), torch.optim.AdamW(rest, lr=1e-2)]
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return zs.initialize(model, opt, config={"zero_optimization": zero, **cell.top})


def train(model: nn.Module, opt: Any, steps: int = 2, *, rank: int = 0, device: str = "cpu") -> None:
    opts = opt if isinstance(opt, list) else [opt]
    for step in range(steps):
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(10 * step + rank)).to(device)
        out = model["d"](model["g"](x)) if isinstance(model, nn.ModuleDict) else model(x)
        out.square().mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Python's cyclic collector off inside the block (on again after it, also after a raise).
    What exists before it is frozen (``gc.freeze``), so a collection inside scans only what the
    block made: a full one costs about half a second in a process with torch loaded."""
    gc.disable()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.enable()


def left_to_the_collector() -> dict[str, int]:
    """Run the cyclic collector once and count what it found that is ours to free: tensors,
    modules, optimizers and zero_strategy's objects (the rest, closures of torch's and the
    standard library's that make cycles of their own, is not counted)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = list(gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
    counts: dict[str, int] = {}
    for obj in found:
        kind = type(obj)
        if kind in weakref.ProxyTypes:
            continue  # a weak proxy (Lightning's): touching it may raise once its object is gone
        ours = isinstance(obj, (torch.Tensor, nn.Module, torch.optim.Optimizer))
        if ours or (kind.__module__ or "").startswith("zero_strategy"):
            counts[kind.__name__] = counts.get(kind.__name__, 0) + 1
    return counts


def cycle_through(obj: Any, *, limit: int = 200_000) -> list[str] | None:
    """A chain of strong references that leaves ``obj`` and comes back to it (the type names
    along it), None if there is none within ``limit`` objects: ``obj`` would be freed by
    reference counting once the outside lets it go. Classes, modules and module namespaces are
    not walked (they live for the process, and through them everything reaches everything)."""
    skip = {id(vars(m)) for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)}
    parent: dict[int, Any] = {id(obj): None}
    queue = collections.deque([obj])
    while queue and len(parent) < limit:
        cur = queue.popleft()
        for ref in gc.get_referents(cur):
            if ref is obj:
                chain, node = [], cur
                while node is not None:
                    chain.append(type(node).__name__)
                    node = parent[id(node)]
                return [*reversed(chain), type(obj).__name__]
            if id(ref) in parent or id(ref) in skip or isinstance(ref, (type, types.ModuleType)):
                continue
            if not gc.is_tracked(ref):
                continue  # an atom (a number, a string): it refers to nothing
            parent[id(ref)] = cur
            queue.append(ref)
    return None


def still_alive(refs: dict[str, weakref.ref[Any]]) -> list[str]:
    return [name for name, ref in refs.items() if ref() is not None]


def _refs(model: nn.Module, opt: Any) -> dict[str, weakref.ref[Any]]:
    opts = opt if isinstance(opt, list) else [opt]
    refs: dict[str, weakref.ref[Any]] = {
        "model": weakref.ref(model),
        "engine": weakref.ref(model.zero_engine),
    }
    refs.update({f"parameter {n}": weakref.ref(p) for n, p in model.named_parameters()})
    refs.update({f"optimizer {i}": weakref.ref(o) for i, o in enumerate(opts)})
    return refs


def check_freed(cell: Cell, root: Path, *, destroy: bool, rank: int = 0) -> None:
    """Build, train two steps, (``destroy``) and drop: everything is dead at once."""
    with collector_off():
        model, opt = build(cell, root)
        train(model, opt, rank=rank)
        refs = _refs(model, opt)
        if destroy:
            zs.destroy(model)
        del model, opt
        alive = still_alive(refs)
        cycles = left_to_the_collector()
    how = "destroy() then del" if destroy else "del"
    if alive or cycles:
        raise AssertionError(
            f"{cell.name}: after {how} model, optimizer, without the cyclic collector, still alive: {alive}; "
            f"in reference cycles (found by the collector afterwards): {cycles}"
        )


def _memory(device: str) -> tuple[int, int]:
    """(RssAnon, CUDA memory_allocated) after glibc gave back what it can."""
    from zero_strategy.storage.host_memory import _malloc_trim

    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    cuda = torch.cuda.memory_allocated() if device == "cuda" else 0
    return rss_anon() or 0, cuda


def flat_memory(root: Path, *, cycles: int = 10, width: int = 512) -> None:
    """``cycles`` builds, trainings and drops (stages 1-3 in turn, every third destroyed first)
    without the cyclic collector: host memory (and on CUDA the allocated bytes) after the last
    is within one engine's worth of where it was after the second."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cells = [Cell("stage1", 1), Cell("stage2", 2), Cell("stage3-cpu-offload", 3, CELLS[4].zero)]
    readings: list[tuple[int, int]] = []
    held = (0, 0)
    with collector_off():
        for k in range(cycles):
            model, opt = build(cells[k % 3], root, width=width, device=device)
            train(model, opt, device=device)
            if k == 0:
                held = _memory(device)
            if k % 3 == 2:
                zs.destroy(model)
            del model, opt
            readings.append(_memory(device))
    # one engine: its parameters, gradients, masters and Adam's two states, fp32
    one = 5 * 4 * sum(p.numel() for p in _model("mlp", width).parameters())
    base = readings[1]
    grew = [(k + 1, r[0] - base[0], r[1] - base[1]) for k, r in enumerate(readings)]
    if readings[-1][0] - base[0] > one or readings[-1][1] - base[1] > one:
        raise AssertionError(
            f"memory grew over {cycles} builds and drops (cycle, host bytes, device bytes over the 2nd): {grew}; "
            f"one engine holds about {one} bytes (held while the first lived: {held})"
        )
