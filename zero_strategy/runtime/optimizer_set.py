"""Several optimizers over disjoint parameters of one model, as under DDP (a GAN: one
optimizer for the generator, one for the discriminator; Lightning's manual optimization with
``toggle_optimizer``).

Gradients belong to the model: every backward reduces into the same shards, and ``step()`` of
any optimizer first finishes the reduction of the whole model (a collective that every rank
reaches, as DDP's reduction is). What belongs to one optimizer is the set of parameters it
steps, and its calls act on those only:

- ``step()`` updates its own master pieces; the other optimizers' gradients stay where they
  are, and a later ``step()`` of theirs uses them, as under DDP;
- ``zero_grad()`` forgets its own parameters' gradients, not the others';
- ``clip_grad_norm_`` / ``clip_grad_value_`` of an optimizer clip its own parameters'
  gradients by their norm over all ranks: DDP's ``torch.nn.utils.clip_grad_norm_`` over that
  optimizer's parameters (Lightning's ``self.clip_gradients(opt, ...)``).
  ``zero_strategy.clip_grad_norm_(model, ...)`` clips the whole model;
- ``gradient_clipping`` from the config: each ``step()`` clips its own optimizer's gradients;
- checkpoints save optimizer state by parameter name, so one checkpoint holds every
  optimizer's state and loads at another world size or stage.

After ``step()`` the full parameters follow the master pieces it updated: at ZeRO-1/2 only that
optimizer's parameters are all-gathered, so the steps of one iteration gather the model once
between them (ZeRO-3 frees every gathered unit, as with one optimizer). The engine's
``step_count`` counts steps of the model, not of its optimizers: every optimizer stepping at
most once is one step (:meth:`OptimizerSet.begins_step`).

With one optimizer every call acts on the whole model, as it always has. Three settings keep
one optimizer per model and refuse several at ``initialize``: fp16 loss scaling (one scale and
one skip decision per step of the model), the NVMe tier (its swap files are planned for one
optimizer) and top-k compression (its warm-up counts the model's steps).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = ["OptimizerSet", "check_disjoint", "key", "refuse_several"]


def key(optimizer: torch.optim.Optimizer) -> int:
    """What tells an optimizer apart: its ``param_groups`` list. A wrapper that shares the
    optimizer's attributes (Lightning's ``LightningOptimizer``, whose class derives from the
    optimizer's) calls the optimizer's methods with itself as ``self``: the same list."""
    return id(optimizer.param_groups)


class OptimizerSet:
    """The optimizers bound to one engine and, when there are several, the model parameters
    (by id) each one steps."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], param_of_master: Mapping[int, int]) -> None:
        self.optimizers = tuple(optimizers)
        self._scopes: dict[int, frozenset[int]] = {}
        self._round: set[int] = set()  # the optimizers that stepped in the model's current step
        if len(self.optimizers) > 1:
            for opt in self.optimizers:
                ids = (param_of_master.get(id(m)) for group in opt.param_groups for m in group["params"])
                self._scopes[key(opt)] = frozenset(i for i in ids if i is not None)

    @property
    def single(self) -> torch.optim.Optimizer | None:
        """The optimizer when there is exactly one; None when there are none or several."""
        return self.optimizers[0] if len(self.optimizers) == 1 else None

    def stepping_exactly(self, param_ids: frozenset[int]) -> torch.optim.Optimizer | None:
        """The optimizer (of several) that steps exactly the parameters ``param_ids``, if any."""
        return next((o for o in self.optimizers if self._scopes.get(key(o)) == param_ids), None)

    def begins_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Record that ``optimizer`` stepped; whether that began a new step of the model. A step
        of the model is every optimizer stepping at most once: the first optimizer to step begins
        one, and so does an optimizer that already stepped in it (a discriminator stepped twice
        per generator step begins two). With one optimizer every step begins one."""
        k = key(optimizer)
        if len(self.optimizers) < 2 or not self._round or k in self._round:
            self._round = {k}
            return True
        self._round.add(k)
        return False

    def restart_round(self) -> None:
        """The next step of any optimizer begins a step of the model (after a checkpoint load)."""
        self._round = set()

    def __contains__(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(key(opt) == key(optimizer) for opt in self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def scope(self, optimizer: torch.optim.Optimizer | None) -> frozenset[int] | None:
        """The ids of the model parameters ``optimizer`` steps; None: the whole model (one
        optimizer, or a call made on the model rather than on an optimizer)."""
        if optimizer is None or len(self.optimizers) < 2:
            return None
        scope = self._scopes.get(key(optimizer))
        if scope is None:
            raise RuntimeError(
                f"{type(optimizer).__name__} is not one of the optimizers bound to this model (it was replaced by "
                "zero_strategy.replace_optimizer()); use the optimizers initialize() or replace_optimizer() returned"
            )
        return scope


def check_disjoint(optimizers: Sequence[torch.optim.Optimizer], module: nn.Module, call: str) -> None:
    """Several optimizers must step disjoint parameters: refuse one parameter in two of them."""
    names = {id(p): n for n, p in module.named_parameters()}
    owner: dict[int, int] = {}
    for k, opt in enumerate(optimizers):
        if any(opt is other for other in optimizers[:k]):
            raise ValueError(f"{call}: optimizer {k} is the same object as an earlier one; pass each optimizer once")
        for group in opt.param_groups:
            for p in group["params"]:
                first = owner.setdefault(id(p), k)
                if first != k:
                    raise ValueError(
                        f"{call}: parameter '{names.get(id(p), tuple(p.shape))}' is in optimizers {first} and {k}; "
                        "several optimizers must step disjoint parameters (give each parameter to one optimizer, "
                        "or put both sets into parameter groups of one optimizer)"
                    )


def refuse_several(count: int, *, loss_scaling: bool, on_disk: bool, compression: bool, call: str) -> None:
    """The settings that keep one optimizer per model (see the module docstring)."""
    if count < 2:
        return
    why = [
        reason
        for reason, on in (
            ("fp16 loss scaling (precision fp16): one scale and one skip decision per step of the model; use bf16", loss_scaling),
            ("offload_optimizer device 'nvme': its swap files are planned for one optimizer; use device 'cpu'", on_disk),
            ("compression type 'topk': its warm-up counts the model's steps; use compression type 'none'", compression),
        )
        if on
    ]  # fmt: skip
    if why:
        raise ValueError(
            f"{call}: {count} optimizers were given, but several optimizers on one model are not supported with "
            + "; ".join(why)
            + " (or pass one optimizer)"
        )
