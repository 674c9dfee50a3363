"""Full weights streamed one ZeRO-3 unit at a time: for pushing them to an inference engine or
writing them out without ever holding the whole model.

``gathered_weights(model)`` is a generator of ``(name, tensor)`` over the model's state dict:
original names and shapes, each tensor a copy that stays valid after the iteration moves on.
At ZeRO-3 it gathers one unit, yields that unit's tensors, frees the unit and only then
gathers the next, so the gathered bytes never exceed the largest unit (plus the units that
stay gathered anyway: persistent ones, or all of them inside ``gathered_parameters``), and the
copies it hands out are one tensor at a time. At ZeRO-1/2 the parameters are full on every rank
already and are copied as they are.

The order is the state dict's order of first appearance, with a unit's tensors together (a
unit's parameters are contiguous in the state dict of a model partitioned by blocks, so this is
usually the state dict's own order). Tied parameters (one Parameter under two names) are
gathered once and yielded under every name, as the same tensor.

vLLM's ``model.load_weights(weights)`` takes exactly such an iterable::

    llm_model.load_weights(zero_strategy.gathered_weights(model, rank0_only=True))

It is a collective: every rank iterates it to the end, in step (with ``rank0_only`` the other
ranks get nothing but still take part in each gather). Stopping early on one rank leaves the
others waiting in a gather until the communication timeout; ``close()`` the generator (or
leave the ``for`` loop by ``break`` on every rank alike) to free the unit it holds.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from zero_strategy.api import gathered_parameters
from zero_strategy.runtime.module import get_engine

__all__ = ["gathered_weights"]


def gathered_weights(
    model: nn.Module,
    *,
    rank0_only: bool = False,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every entry of ``model.state_dict()``, one ZeRO-3 unit
    gathered at a time. Collective: every rank iterates it to the end.

    ``rank0_only``: only rank 0 (of all ranks) receives tensors; the others take part in the
    gathers and yield nothing. ``dtype``: floating tensors cast to it. ``device``: where the
    copies go (default the host; ``None`` keeps the model's device, as an inference engine on
    the same GPU wants)."""
    engine = get_engine(model)
    keep = not rank0_only or engine.world.rank == 0
    tensors = model.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}  # tensor id -> every name it has (tied parameters)
    for name, t in tensors.items():
        names.setdefault(id(t), []).append(name)
    unit_of = getattr(engine.params, "unit_of", None)  # ZeRO-3: parameters live in units
    done: set[int] = set()

    def copies(group: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for t in group:
            done.add(id(t))
            if not keep:
                continue
            d = dtype if dtype is not None and t.is_floating_point() else t.dtype
            value = t.detach().to(device=device if device is not None else t.device, dtype=d, copy=True)
            for name in names[id(t)]:
                yield name, value

    for t in tensors.values():
        if id(t) in done:
            continue
        where = unit_of(t) if unit_of is not None and isinstance(t, nn.Parameter) else None
        if where is None:  # a buffer, or a parameter that is full already (ZeRO-1/2)
            yield from copies([t])
            continue
        mates = {id(p) for p in where[0].params}
        group = [m for m in tensors.values() if id(m) in mates and id(m) not in done]
        group = list({id(m): m for m in group}.values())  # tied: once
        with gathered_parameters([p for p in group if isinstance(p, nn.Parameter)]):
            yield from copies(group)
