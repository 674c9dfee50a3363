"""Train a reference and the engine side by side, one batch at a time.

The DDP oracle of a parity test is the same loop run twice: for each step, each run computes its
loss on the same batch, backpropagates, steps its own optimizer and clears its gradients. This
module is that loop, so each test states only what differs: the batches, the loss and (for a
front-end such as Accelerate's ``accelerator.backward``) how one run backpropagates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

Run = tuple[Callable[..., Any], torch.optim.Optimizer]


def lockstep_losses(
    runs: Mapping[str, Run],
    batch_of: Callable[[int], Any],
    loss_of: Callable[[Callable[..., Any], Any], torch.Tensor],
    *,
    steps: int = 3,
    backward: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
) -> dict[str, list[float]]:
    """Run ``steps`` optimizer steps of every ``(model, optimizer)`` in ``runs`` in lockstep.

    ``batch_of(step)`` gives the step's batch (the same for every run), ``loss_of(model, batch)``
    its loss; ``backward[name]``, where given, replaces ``loss.backward()`` for that run. Returns
    each run's losses by name, in step order.
    """
    backward = backward or {}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(steps):
        batch = batch_of(step)
        for name, (model, opt) in runs.items():
            loss = loss_of(model, batch)
            backward.get(name, torch.Tensor.backward)(loss)
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    return losses
