"""One optimizer with Muon groups and AdamW groups, for the front-end Muon tests.

``MuonWithAdamW`` takes param groups that each say ``use_muon`` (as ``MuonWithAuxAdam`` is
used: the transformers ``Trainer`` and a ``configure_optimizers`` returning one optimizer take
one) and steps the ``use_muon`` groups as ``torch.optim.Muon`` does (Nesterov momentum, its
quintic Newton-Schulz, its learning-rate adjustment, decoupled weight decay) but orthogonalises
in fp32 where torch's Muon rounds to bf16 (in bf16, the last-bit differences of a gradient norm
summed in another order flip roundings that grow over the steps: 1e-5 apart from DDP after 12
steps), and the others with torch's own AdamW update (``torch.optim.adamw.adamw``). It declares
``@zs.whole_params(group_flag="use_muon")``.

Used by ``_muon_jobs.py`` (Accelerate and the ``Trainer``, imported from this directory) and by
``tests/lightning/test_muon_lightning.py`` (as ``tests.accelerate._muon_optim``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw  # the update torch.optim.AdamW.step runs

import zero_strategy as zs

MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}
NS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's Newton-Schulz coefficients (5 iterations)


def orthogonalise(g: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration, in the matrix's dtype (fp32)."""
    a, b, c = NS
    x = g / g.norm().clamp_min(1e-7)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(5):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


@zs.whole_params(group_flag="use_muon")
class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the ``use_muon=True`` groups, AdamW on the others (defaults: ``MUON``, ``ADAMW``)."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        filled = [{**(MUON if g["use_muon"] else ADAMW), **g} for g in groups]
        super().__init__(filled, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]  # a matrix another rank owns: none
            if not params:
                continue
            grads = [p.grad for p in params]
            state = [self.state[p] for p in params]
            if group["use_muon"]:
                lr, m = group["lr"], group["momentum"]
                for s, p, g in zip(state, params, grads):
                    buf = s.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(g, 1 - m)
                    p.mul_(1 - lr * group["weight_decay"])
                    p.add_(orthogonalise(g.lerp(buf, m)), alpha=-lr * max(1, p.shape[0] / p.shape[1]) ** 0.5)
                continue
            for s, p in zip(state, params):
                if not s:
                    s.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            b1, b2 = group["betas"]
            adamw(params, grads, [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state], [],
                  [s["step"] for s in state], foreach=False, amsgrad=False, beta1=b1, beta2=b2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)  # fmt: skip
        return loss


def split(model: nn.Module, hidden: str) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The 2-D weights under the submodule ``hidden`` (Muon's), and every other trainable parameter."""
    matrices = [p for p in model.get_submodule(hidden).parameters() if p.ndim == 2 and p.requires_grad]
    ids = {id(p) for p in matrices}
    return matrices, [p for p in model.parameters() if p.requires_grad and id(p) not in ids]


def one_optimizer(model: nn.Module, hidden: str) -> MuonWithAdamW:
    matrices, rest = split(model, hidden)
    return MuonWithAdamW([{"params": matrices, "use_muon": True}, {"params": rest, "use_muon": False}])


def two_optimizers(model: nn.Module, hidden: str) -> list[torch.optim.Optimizer]:
    """``[torch.optim.Muon(matrices), torch.optim.AdamW(rest)]`` with the same settings."""
    matrices, rest = split(model, hidden)
    return [torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(rest, **ADAMW)]
