"""Which modules are MoE experts modules, without a per-model list (the detection half of
``selective.py``, which documents it; kept apart so that ``sharding/partition.py`` can find
the experts without importing the units that gather them).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "SELECTION_ARGUMENTS",
    "SELECT_HOOK",
    "ExpertsModule",
    "declare_experts",
    "find_expert_modules",
    "select_experts",
]

SELECTION_ARGUMENTS = ("top_k_index", "router_indices", "selected_experts", "expert_indices", "topk_ids", "topk_idx")
_CONFIG_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class ExpertsModule:
    """A detected experts module: where it is, its number of experts, and the forward argument
    (name and position) that carries the selection."""

    fqn: str
    module: nn.Module
    num_experts: int
    argument: str
    position: int | None  # positional index after ``self``; None: keyword only
    members: bool = False  # a declared ModuleList of experts (:func:`declare_experts`), not stacked weights

    def selection(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The selected expert indices of one call (None: the call does not say)."""
        if self.position is not None and len(args) > self.position:
            value = args[self.position]
        else:
            value = kwargs.get(self.argument)
        return value if isinstance(value, torch.Tensor) else None


def _num_experts(m: nn.Module) -> int | None:
    n = getattr(m, "num_experts", None)
    if isinstance(n, int):
        return n
    config = getattr(m, "config", None)
    for key in _CONFIG_COUNTS:
        n = getattr(config, key, None)
        if isinstance(n, int):
            return n
    return None


def _selection_argument(m: nn.Module) -> tuple[str, int | None] | None:
    try:
        params = list(inspect.signature(m.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for p in params:
        if p.name in SELECTION_ARGUMENTS:
            return p.name, positional.index(p) if p in positional else None
    marked = getattr(type(m), "_apply_gate", None) is not None and hasattr(m, "_is_expert_parallel")
    if marked and len(positional) >= 2:  # transformers' experts decorator: forward(hidden_states, selection, ...)
        return positional[1].name, 1
    return None


_DECLARED = "_zero_experts_list"
SELECT_HOOK = "_zero_select_experts"  # on a declared list: {handle id: the ZeRO-3 engine's call}


def declare_experts(experts: nn.ModuleList) -> nn.ModuleList:
    """Declare a ``ModuleList`` whose members are the experts of an MoE layer (expert ``e`` is
    ``experts[e]``), before ``initialize``. At ZeRO-3 its forward must call
    :func:`select_experts` with the router's selection before running any member; then only the
    experts some rank selected are gathered. Returns ``experts``."""
    if not isinstance(experts, nn.ModuleList) or len(experts) < 2:
        raise TypeError(
            f"declare_experts() takes an nn.ModuleList of two or more experts, got {type(experts).__name__}"
        )
    setattr(experts, _DECLARED, True)
    return experts


def select_experts(experts: nn.ModuleList, selection: torch.Tensor) -> None:
    """Before running any member of a :func:`declare_experts` list: ``selection`` holds the expert
    indices this rank's tokens chose (any shape; out-of-range values are ignored). At ZeRO-3 every
    rank must call it once per forward of the layer (a collective: the ranks agree on the union
    and gather it); elsewhere it does nothing."""
    for hook in list(getattr(experts, SELECT_HOOK, {}).values()):  # none once the engine is closed
        hook(selection)


def find_expert_modules(root: nn.Module) -> list[ExpertsModule]:
    """The outermost experts modules below ``root`` (see the module doc), in registration order."""
    found: list[ExpertsModule] = []
    inside: list[str] = []
    for fqn, m in root.named_modules():
        if m is root or any(fqn.startswith(f"{p}.") for p in inside):
            continue
        if getattr(m, _DECLARED, False) and any(True for _ in m.parameters()):
            found.append(ExpertsModule(fqn, m, len(m), "", None, members=True))
            inside.append(fqn)
            continue
        n = _num_experts(m)
        params = list(m.parameters())
        if n is None or n < 2 or not params or any(p.dim() < 2 or p.shape[0] != n for p in params):
            continue
        arg = _selection_argument(m)
        if arg is None:
            continue
        found.append(ExpertsModule(fqn, m, n, arg[0], arg[1]))
        inside.append(fqn)
    return found
