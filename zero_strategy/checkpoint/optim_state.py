"""Optimizer state in a checkpoint, apart from the tensors' pieces: where a loaded state value
goes when the optimizer has none yet (``fresh_state``, placed as torch's
``Optimizer.load_state_dict`` places it), and the param-group settings (lr as a scheduler left
it, betas, weight decay) saved as JSON and restored over the ones the optimizer was built with.
Both zero_strategy's own checkpoints (``state.py``) and other engines' (``foreign.py``) use them.
"""

from __future__ import annotations

import json
from typing import Any

import torch

__all__ = ["fresh_state", "group_settings", "restore_group_settings", "saved_groups"]


def fresh_state(key: str, master: torch.Tensor, saved: Any, group: dict[str, Any], numel: int) -> torch.Tensor:
    """A tensor to load a state value into that the optimizer does not have yet (a fresh
    optimizer), placed as torch's ``Optimizer.load_state_dict`` places a loaded value: ``step``
    keeps its saved dtype on the host, unless the group is ``fused`` or ``capturable``, whose
    kernels want it in float32 on the parameter's device; anything else takes the master's
    dtype and device, per element (``numel`` elements saved: this rank's piece) or in its saved
    shape (a scalar such as ASGD's ``eta``). ``saved``: the key's DCP metadata."""
    size = torch.Size(getattr(saved, "size", ()))
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return torch.zeros(size, dtype=torch.float32, device=master.device)
        return torch.zeros(size, dtype=getattr(getattr(saved, "properties", None), "dtype", None) or torch.float32)
    if size == torch.Size([numel]):
        return torch.zeros_like(master.data)
    return torch.zeros(size, dtype=master.dtype, device=master.device)


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    out = []
    for group in optimizer.param_groups:
        kept: dict[str, Any] = {}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, tuple):
                value = list(value)
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue  # not a plain setting; the optimizer's construction provides it
            kept[key] = value
        out.append(kept)
    return out


# how the optimizer runs, not what it computes: the loading run's own choice stands
_IMPLEMENTATION_KEYS = frozenset({"fused", "foreach", "capturable", "differentiable"})


def restore_group_settings(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    for group, values in zip(optimizer.param_groups, saved):
        for key, value in values.items():
            if key in _IMPLEMENTATION_KEYS:
                continue
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                if value is not None:
                    current.fill_(value)
            elif isinstance(current, tuple):
                group[key] = tuple(value)
            else:
                group[key] = value


def saved_groups(meta: dict[str, Any]) -> list[list[dict[str, Any]]] | None:
    """Each saved optimizer's param-group settings (None: saved without an optimizer)."""
    if meta.get("param_groups_per_optimizer") is not None:
        return list(meta["param_groups_per_optimizer"])
    return None if meta.get("param_groups") is None else [meta["param_groups"]]
