"""One optimizer with Muon groups and AdamW groups, for the front-end Muon tests.

``MuonWithAdamW`` takes param groups that each say ``use_muon`` (as ``MuonWithAuxAdam`` is
used: the transformers ``Trainer`` and a ``configure_optimizers`` returning one optimizer take
one) and steps each group with torch's own functional updates: ``torch.optim.Muon``'s
(momentum, Nesterov, Newton-Schulz, its learning-rate adjustment) on the ``use_muon`` groups,
``torch.optim.AdamW``'s on the others. It declares ``@zs.whole_params(group_flag="use_muon")``.

Used by ``_muon_jobs.py`` (Accelerate and the ``Trainer``, imported from this directory) and by
``tests/lightning/test_muon_lightning.py`` (as ``tests.accelerate._muon_optim``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim._muon import muon  # the update torch.optim.Muon.step runs
from torch.optim.adamw import adamw  # the update torch.optim.AdamW.step runs

import zero_strategy as zs

MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}


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
                bufs = [s.setdefault("momentum_buffer", torch.zeros_like(p)) for s, p in zip(state, params)]
                muon(params, grads, bufs, lr=group["lr"], weight_decay=group["weight_decay"],
                     momentum=group["momentum"], nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315),
                     ns_steps=5, eps=1e-7, adjust_lr_fn=None, has_complex=False)  # fmt: skip
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
