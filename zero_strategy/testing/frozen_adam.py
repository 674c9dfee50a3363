"""The test oracle of the frozen-variance Adam mode of top-k compression
(``compression: {optimizer: adam}``, ``runtime/compressed_adam.py``): a plain optimizer that a
DDP run steps with DDP's averaged gradients.

For the ``freeze`` first steps it is ``torch.optim.AdamW`` (the single-tensor path's formulas).
From then on the variance stays as it was and the momentum goes on in two parts: ``m``, the
dense steps' momentum, decays by ``beta1`` per step, and ``w``, the compressed steps' momentum,
takes each gradient already scaled by ``P = 1 / (sqrt(v_hat) + eps)`` (0 where ``v`` is zero):
``w = beta1 * w + (1 - beta1) * g * P``. The update is ``(m * P + w) / (1 - beta1**t)``; while
the variance does not change that is ``m_t / (1 - beta1**t) / (sqrt(v_hat) + eps)``.

``refresh`` (``compression.variance_refresh``, 0: off): after the freeze, ``refresh`` compressed
steps, one refresh step, ``2 * refresh`` compressed, one refresh, ... (computed here on its own,
not with the config's helper). A refresh step is an AdamW step on ``m`` and ``v``; ``w`` neither
moves the parameters nor decays on it (no sparse exchange runs on a dense step). Written
independently of the engine: at ratio 1.0 without momentum masking the engine must give these
numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["FrozenAdamW"]


def _refresh_steps(freeze: int, refresh: int, upto: int) -> set[int]:
    out, at, gap = set(), freeze, refresh
    while refresh and at + gap <= upto:
        out.add(at + gap)
        at, gap = at + gap + 1, gap * 2
    return out


class FrozenAdamW(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float, *, freeze: int, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, refresh: int = 0) -> None:  # fmt: skip
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.freeze = freeze
        self.refreshes = _refresh_steps(freeze, refresh, 100_000)
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        dense = self.steps < self.freeze or self.steps in self.refreshes
        self.steps += 1
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"], state["v"], state["w"] = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
                    state["t"], state["tv"] = 0, 0
                state["t"] += 1
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
                m, v, w = state["m"], state["v"], state["w"]
                if dense:
                    state["tv"] += 1
                    m.lerp_(p.grad, 1.0 - b1)
                    v.mul_(b2).addcmul_(p.grad, p.grad, value=1.0 - b2)
                denom = v.sqrt() / math.sqrt(1.0 - b2 ** state["tv"]) + group["eps"]
                scale = torch.where(v > 0, 1.0 / denom, torch.zeros_like(denom))
                if dense:
                    update = m / (1.0 - b1 ** state["t"]) / denom
                else:
                    m.mul_(b1)
                    w.mul_(b1).add_(p.grad * scale, alpha=1.0 - b1)
                    update = (m * scale + w) / (1.0 - b1 ** state["t"])
                p.sub_(group["lr"] * update)
