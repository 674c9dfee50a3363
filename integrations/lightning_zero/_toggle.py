"""``toggle_optimizer`` / ``untoggle_optimizer`` for several optimizers on one ZeRO model.

Lightning's own methods set ``requires_grad`` on the tensors in each optimizer's
``param_groups``. Under zero_strategy those tensors are this rank's master pieces, which the
optimizer steps, not the model's parameters: autograd would still compute the other
optimizer's gradients, and they would be added to that optimizer's next step (under DDP they
are never computed). The strategy installs these two on the LightningModule instead; they do
what Lightning's do, over the model parameters each optimizer steps
(``zero_strategy.frontend.optimizer_parameters``). ``toggled_optimizer`` calls them.

They are installed only where the module's class keeps Lightning's methods: a class that
overrides ``toggle_optimizer`` is left alone, with a warning."""

from __future__ import annotations

import types
import warnings
from typing import Any

from zero_strategy.frontend import optimizer_parameters

__all__ = ["install_toggles"]


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", None) or optimizer  # LightningOptimizer -> the optimizer


def _toggle_optimizer(module: Any, optimizer: Any) -> None:
    state: dict[Any, bool] = {}
    for opt in module.trainer.optimizers:
        for p in optimizer_parameters(_inner(opt)):
            if p not in state:
                state[p] = p.requires_grad
                p.requires_grad = False
    for p in optimizer_parameters(_inner(optimizer)):
        p.requires_grad = state[p]
    module._param_requires_grad_state = state


def _untoggle_optimizer(module: Any, optimizer: Any) -> None:
    state = module._param_requires_grad_state
    for opt in module.trainer.optimizers:
        if _inner(opt) is not _inner(optimizer):
            for p in optimizer_parameters(_inner(opt)):
                if p in state:
                    p.requires_grad = state[p]
    module._param_requires_grad_state = {}


def install_toggles(module: Any, base: type) -> None:
    """Put the two methods on ``module`` (a LightningModule; ``base``: its namespace's class)."""
    cls = type(module)
    if any(getattr(cls, name) is not getattr(base, name) for name in ("toggle_optimizer", "untoggle_optimizer")):
        warnings.warn(
            f"ZeroStrategy: {cls.__name__} overrides toggle_optimizer/untoggle_optimizer, so they act on the "
            "optimizers' param_groups, which hold zero_strategy's master pieces, not the model's parameters. "
            "Set requires_grad on the parameters of zero_strategy.frontend.optimizer_parameters(opt) instead.",
            UserWarning,
            stacklevel=2,
        )
        return
    module.__dict__["toggle_optimizer"] = types.MethodType(_toggle_optimizer, module)
    module.__dict__["untoggle_optimizer"] = types.MethodType(_untoggle_optimizer, module)
