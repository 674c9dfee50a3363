"""torch's own clipping functions over a ZeRO model, and the registry of live engines.

A plain training loop clips with ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``
after ``loss.backward()``. Under DDP that reads ``p.grad``, the gradient averaged over the
ranks. Under the engine ``p.grad`` is not that value: at ZeRO-2/3 it is None after backward
(the gradients went into the shards), at ZeRO-1 it is this rank's local gradient until the
step. torch's function would clip nothing, or clip by a local norm, without a word.

So while an engine lives, torch's functions are replaced by the ones below, in
``torch.nn.utils`` and in ``torch.nn.utils.clip_grad`` (where torch's deprecated
``clip_grad_norm`` finds ``clip_grad_norm_``). Each looks at the tensors it is given:

- none belongs to an engine: torch's own function runs, unchanged. A ZeRO-1/2 model set up
  without an optimizer counts as none: its ``p.grad`` is DDP's averaged gradient already;
- every trainable parameter of one engine's model, given as the model's parameters or as the
  optimizer's master pieces (frozen parameters may come along, as under DDP where their
  ``grad`` is None): the engine's global clipping over all ranks' shards, DDP's result. It is
  ``optimizer.clip_grad_norm_`` (a collective: every rank calls it, as every rank does in a
  plain loop); ``foreach`` is ignored, ``error_if_nonfinite`` raises as torch does;
- with several optimizers bound (a GAN), every trainable parameter that one of them steps
  (``D.parameters()``, frozen ones may come along): that optimizer's global clipping,
  ``opt_d.clip_grad_norm_``, DDP's result for those parameters;
- anything else (some of a model's parameters, or a ZeRO model's parameters together with
  other tensors): an error that names ``optimizer.clip_grad_norm_``. A norm over an arbitrary
  part of the shards is not offered.

torch's two halves of ``clip_grad_norm_`` cannot give DDP's result on their own:
``get_total_norm`` receives gradients, not parameters, so it refuses any gradient the engine
holds (a ZeRO-1 model's local ``p.grad``, a master piece's ``grad``: both this rank's part
only), and ``clip_grads_with_norm_`` refuses a ZeRO model's parameters. At ZeRO-2/3 a list
``[p.grad for p in model.parameters() if p.grad is not None]`` is empty, and an empty list
belongs to no model: that one case cannot be told from an unrelated empty list. Code that
reads ``p.grad`` itself cannot be caught (a plain attribute of the tensor): what it holds is
the table in ``engine.py``'s docstring, and ``zero_strategy.full_grad(model, p)`` gives DDP's
value. Clipping inside a ``no_sync()`` window is what ``optimizer.clip_grad_norm_`` does there.

The replacement is tied to :class:`LiveEngines`, the engine module's set of live engines:
adding the first engine installs it, and it is undone when the last one is closed, destroyed
or collected, so without an engine torch's functions are torch's own objects. A name bound
before the first engine existed (``from torch.nn.utils import clip_grad_norm_`` at the top of
a script) keeps torch's function: call ``torch.nn.utils.clip_grad_norm_`` or the optimizer's.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch import nn

from zero_strategy.reduction.grads import GradSchedule
from zero_strategy.runtime.optimizer_set import OptimizerSet
from zero_strategy.sharding.group import ShardGroup

__all__ = ["LiveEngines"]

_MODULES = (torch.nn.utils, torch.nn.utils.clip_grad)
_NAMES = ("clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_")
_FIX = (
    "call optimizer.clip_grad_norm_(max_norm) (or zero_strategy.clip_grad_norm_(model, max_norm)), which takes "
    "the global norm over every rank's shards as DDP's clipping does"
)


class _Engine(Protocol):
    """What the replacements read of an engine."""

    groups: list[ShardGroup]
    schedule: GradSchedule
    opts: OptimizerSet

    @property
    def module(self) -> nn.Module: ...

    @property
    def has_model(self) -> bool: ...

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.Tensor: ...

    def clip_grad_value_(self, clip_value: float, *, optimizer: torch.optim.Optimizer | None = None) -> None: ...


E = TypeVar("E", bound=_Engine)


class LiveEngines(Generic[E]):
    """The engines that are alive (weakly held). While it holds one, torch's clipping functions
    are this module's; the last one that leaves (closed, or collected) puts torch's back."""

    def __init__(self) -> None:
        self._engines: weakref.WeakSet[E] = weakref.WeakSet()
        self._originals: dict[tuple[types.ModuleType, str], Callable[..., Any]] = {}
        self._replacements: dict[tuple[types.ModuleType, str], Callable[..., Any]] = {}

    def __iter__(self) -> Iterator[E]:
        """The engines whose model is alive (an engine a caller still holds after its model was
        dropped serves no model: it is neither counted nor asked)."""
        return iter([e for e in list(self._engines) if e.has_model])

    def add(self, engine: E) -> None:
        self._engines.add(engine)
        weakref.finalize(engine, self._restore_if_empty)
        self._install()

    def discard(self, engine: E) -> None:
        self._engines.discard(engine)
        self._restore_if_empty()

    def _install(self) -> None:
        made: dict[int, Callable[..., Any]] = {}  # one replacement per function (both modules hold it)
        for module in _MODULES:
            for name in _NAMES:
                current = getattr(module, name, None)
                if current is None or (module, name) in self._replacements:
                    continue  # not in this torch version, or replaced already
                if id(current) not in made:
                    made[id(current)] = functools.wraps(current)(_REPLACE[name](self, current))
                self._originals[(module, name)] = current
                self._replacements[(module, name)] = made[id(current)]
                setattr(module, name, made[id(current)])

    def _restore_if_empty(self) -> None:
        if any(True for _ in self._engines):  # iterating skips engines that were collected
            return
        for key, original in self._originals.items():
            if getattr(*key) is self._replacements[key]:  # left alone if someone replaced it since
                setattr(*key, original)
        self._originals.clear()
        self._replacements.clear()

    # -- which engine the tensors belong to ----------------------------------------------------
    def owner(self, tensors: list[torch.Tensor], call: str) -> tuple[E, torch.optim.Optimizer | None] | None:
        """The engine whose whole model ``tensors`` are (its parameters or master pieces), or
        whose one optimizer's parameters they are (that optimizer; None: the whole model); None
        if none of them belongs to an engine; raises for another part of a model or a mixture."""
        ids = {id(t) for t in tensors}
        for engine in self:
            if engine.schedule.full_grads:
                continue  # p.grad is DDP's averaged gradient: torch's function is right
            names = {id(p): n for n, p in engine.module.named_parameters()}  # the live objects, frozen ones too
            to_param = {id(m): id(p) for g in engine.groups for p, m in zip(g.params, g.masters)}
            mine = {i for i in ids if i in names or i in to_param}
            if not mine:
                continue
            model = type(engine.module).__name__
            if len(mine) < len(ids):
                raise ValueError(
                    f"{call}: the tensors given mix parameters of the ZeRO model {model} with {len(ids) - len(mine)} "
                    "other tensor(s); its gradients are sharded over the ranks, so it is clipped on its own: "
                    f"{_FIX}, and clip the other tensors in a call of their own"
                )
            given = {to_param.get(i, i) for i in mine}
            missing = [names[id(p)] for g in engine.groups for p in g.params if id(p) not in given]
            stepped = frozenset(id(p) for g in engine.groups for p in g.params if id(p) in given)
            optimizer = engine.opts.stepping_exactly(stepped) if missing and len(engine.opts) > 1 else None
            if optimizer is not None:
                return engine, optimizer
            if missing:
                raise ValueError(
                    f"{call}: the tensors given are part of the ZeRO model {model}, without {missing[:3]}"
                    f"{' ...' if len(missing) > 3 else ''}; its gradients are sharded over the ranks, so it is "
                    f"clipped as a whole (or by one optimizer's parameters): pass model.parameters(), or {_FIX}"
                )
            return engine, None
        return None

    def held_gradients(self) -> set[int]:
        """The ids of the gradients the engines hold that are not DDP's: ZeRO-1's local full
        gradients in ``p.grad`` and the master pieces' gradients (this rank's part)."""
        out: set[int] = set()
        for engine in self:
            if engine.schedule.full_grads:
                continue
            for g in engine.groups:
                out |= {id(t.grad) for t in (*g.params, *g.masters) if t.grad is not None}
        return out


def _as_list(tensors: torch.Tensor | Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    """The tensors as a list, and what to hand to torch's function instead of the argument (a
    generator is consumed here: torch gets a fresh one, so its warning for an empty one holds)."""
    if isinstance(tensors, torch.Tensor):
        return [tensors], tensors
    given = list(tensors)
    return given, ((t for t in given) if isinstance(tensors, types.GeneratorType) else given)


def _clip_grad_norm(registry: LiveEngines[Any], original: Callable[..., Any]) -> Callable[..., Any]:
    def clip_grad_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        given, arg = _as_list(parameters)
        owner = registry.owner(given, "torch.nn.utils.clip_grad_norm_()")
        if owner is None:
            return original(arg, max_norm, norm_type, error_if_nonfinite, foreach)  # torch's
        engine, optimizer = owner
        total = engine.clip_grad_norm_(float(max_norm), float(norm_type), optimizer=optimizer)
        if error_if_nonfinite and not bool(torch.isfinite(total)):  # the gradients were left as they were
            raise RuntimeError(
                f"torch.nn.utils.clip_grad_norm_(): the total norm of order {float(norm_type)} of the gradients is "
                "non-finite, so it cannot be clipped; pass error_if_nonfinite=False to skip this check"
            )
        return total

    return clip_grad_norm_


def _clip_grad_value(registry: LiveEngines[Any], original: Callable[..., Any]) -> Callable[..., Any]:
    def clip_grad_value_(
        parameters: torch.Tensor | Iterable[torch.Tensor], clip_value: float, foreach: bool | None = None
    ) -> None:
        given, arg = _as_list(parameters)
        owner = registry.owner(given, "torch.nn.utils.clip_grad_value_()")
        if owner is None:
            original(arg, clip_value, foreach)
        else:  # element-wise on this rank's averaged pieces: DDP's result without communication
            owner[0].clip_grad_value_(float(clip_value), optimizer=owner[1])

    return clip_grad_value_


def _get_total_norm(registry: LiveEngines[Any], original: Callable[..., Any]) -> Callable[..., Any]:
    def get_total_norm(
        tensors: torch.Tensor | Iterable[torch.Tensor],
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        given, arg = _as_list(tensors)
        held = registry.held_gradients()
        if any(id(t) in held for t in given):
            raise ValueError(
                "torch.nn.utils.get_total_norm(): these are gradients of a ZeRO model that hold this rank's part "
                f"only (ZeRO-1's local p.grad, or a master piece's grad), so their norm is a local number; {_FIX}"
            )
        return original(arg, norm_type, error_if_nonfinite, foreach)  # torch's

    return get_total_norm


def _clip_grads_with_norm(registry: LiveEngines[Any], original: Callable[..., Any]) -> Callable[..., Any]:
    def clip_grads_with_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        total_norm: torch.Tensor,
        foreach: bool | None = None,
    ) -> None:
        given, arg = _as_list(parameters)
        if registry.owner(given, "torch.nn.utils.clip_grads_with_norm_()") is not None:
            raise ValueError(
                "torch.nn.utils.clip_grads_with_norm_(): these are the parameters of a ZeRO model, whose gradients "
                f"are sharded over the ranks (get_total_norm cannot give their norm); {_FIX}"
            )
        original(arg, max_norm, total_norm, foreach)

    return clip_grads_with_norm_


_REPLACE: dict[str, Callable[[LiveEngines[Any], Callable[..., Any]], Callable[..., Any]]] = {
    "clip_grad_norm_": _clip_grad_norm,
    "clip_grad_value_": _clip_grad_value,
    "get_total_norm": _get_total_norm,
    "clip_grads_with_norm_": _clip_grads_with_norm,
}
