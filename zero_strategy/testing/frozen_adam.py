"""The test oracle of the frozen-variance Adam mode of top-k compression
(``compression: {optimizer: adam}``, ``runtime/compressed_adam.py``): a plain optimizer that a
DDP run steps with DDP's averaged gradients.

For the ``freeze`` first steps it is ``torch.optim.AdamW`` (the single-tensor path's formulas).
From then on the variance stays as it was, the momentum goes on, and the update is
``m_t / (1 - beta1**t) / (sqrt(v_hat) + eps)`` (0 where ``v`` is zero), written independently
of the engine: at ratio 1.0 without momentum masking the engine must give these numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["FrozenAdamW"]


class FrozenAdamW(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float, *, freeze: int, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:  # fmt: skip
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.freeze = freeze
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        frozen = self.steps >= self.freeze
        self.steps += 1
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"], state["v"], state["t"], state["tv"] = torch.zeros_like(p), torch.zeros_like(p), 0, 0
                state["t"] += 1
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
                state["m"].lerp_(p.grad, 1.0 - b1)
                if not frozen:
                    state["tv"] += 1
                    state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1.0 - b2)
                v = state["v"]
                denom = v.sqrt() / math.sqrt(1.0 - b2 ** state["tv"]) + group["eps"]
                update = state["m"] / (1.0 - b1 ** state["t"]) / denom
                p.sub_(group["lr"] * torch.where(v > 0, update, torch.zeros_like(update)) if frozen
                       else group["lr"] * update)  # fmt: skip
