"""Which parameters each ZeRO-3 unit holds: the units (modules, in order) and the root unit.

A plain function of module names, shared by the storage (``unit.py``, which builds a unit per
entry) and by the engine's placement (``ratio: auto`` sizes the units before they exist). It
imports nothing of the package, so both the partition (which finds experts units) and the unit
storage can use it."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["unit_members"]


def unit_members(
    root: nn.Module, units: Sequence[tuple[str, nn.Module]], named: Sequence[tuple[str, nn.Parameter]]
) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """The parameters of each ZeRO-3 unit: one per module of ``units`` (in that order), then the
    root unit (label ``<root>``) for the parameters outside every unit; units without a
    parameter are left out. A parameter belongs to the innermost unit whose module holds it (an
    experts unit inside its block's); one reachable from two units that do not nest, or from a
    unit and outside it (tied weights), belongs to the root unit."""
    prefixes = [(f"{fqn}.", k) for k, (fqn, _) in enumerate(units)]
    owners: dict[int, set[int | None]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        inner = [k for pre, k in prefixes if name.startswith(pre)]  # an experts unit inside a block's
        owner = max(inner, key=lambda k: len(prefixes[k][0]), default=None)
        owners.setdefault(id(p), set()).add(owner)
    members: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(units) + 1)]
    for name, p in named:
        o = owners[id(p)]
        k = next(iter(o)) if len(o) == 1 else None
        members[len(units) if k is None else k].append((name, p))
    labels = [fqn for fqn, _ in units] + ["<root>"]
    return [(label, m) for label, m in zip(labels, members) if m]
