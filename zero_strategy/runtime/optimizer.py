"""Binding the user's optimizer instance to the engine.

The instance the user built stays the same object (so an LR scheduler built on it keeps
working, and ``isinstance`` checks still hold). Its ``param_groups`` keep their dicts and
hyperparameters; only each trainable parameter in them is replaced by this rank's 1-D master
piece of it. The instance's class is swapped for a subclass that adds ``clip_grad_norm_``
and ``scale_loss`` and routes ``zero_grad`` through the engine, and two step hooks run the
engine's work around the unchanged ``step()`` (once per call: an optimizer subclass whose
``step`` calls ``super().step()`` fires torch's hooks twice; a depth count makes the engine act
on the outermost pair):

- before: finish gradient reduction, unscale and check for overflow (fp16), apply
  ``gradient_clipping`` from the config unless the user clipped explicitly;
- after: all-gather the updated parameters and update the loss scale.

An overflowing step is skipped by leaving every master gradient ``None``, which every
``torch.optim`` optimizer treats as "no update".

Which optimizers give DDP's numbers: those whose update of an element reads only that element
(and scalars such as the step count), since each rank steps only its 1-D pieces. An update
that reads a whole parameter (factored or orthogonalised updates, a LAMB/LARS trust ratio, a
NovoGrad norm) would be computed on a piece and silently differ. ``check_optimizer`` sorts by
class: torch's element-wise optimizers (and subclasses) and bitsandbytes' 8-bit Adam pass; the
known whole-parameter families are refused by the words of the class name (``FusedLAMB``,
``Lars``, ``NovoGrad``, ``Adafactor``, ...); anything else passes with a warning, once per class.
"""

from __future__ import annotations

import re
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from zero_strategy._swap import swap_class, swapped_by
from zero_strategy.runtime.compressed_adam import bind_adam
from zero_strategy.runtime.optimizer_set import key
from zero_strategy.runtime.whole_params import declared, whole_groups

if TYPE_CHECKING:
    from zero_strategy.runtime.engine import ZeroEngine

__all__ = [
    "UnknownOptimizerWarning",
    "ZeroOptimizer",
    "bind_optimizer",
    "build_optimizer",
    "check_optimizer",
    "engine_of",
    "use_host_kernel",
]

ENGINE_GONE = (
    "this optimizer's zero_strategy engine was destroyed (zero_strategy.destroy) or its model was dropped; "
    "build a new optimizer for the model (and keep the model referenced while you step its optimizer)"
)
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


if TYPE_CHECKING:
    _OptimizerBase = torch.optim.Optimizer  # what the mixin's methods extend once swapped in (see _swap)
else:
    _OptimizerBase = object


class ZeroOptimizer(_OptimizerBase):
    """Mixin placed in front of the user's optimizer class by :func:`bind_optimizer`. It holds
    its engine weakly: the engine holds its optimizers, and the model holds the engine."""

    _zero_engine_ref: weakref.ref[ZeroEngine]

    @property
    def zero_engine(self) -> ZeroEngine | None:
        """The engine this optimizer is bound to; None once it is gone (its model destroyed or dropped)."""
        return self._zero_engine_ref()

    @property
    def _zero_engine(self) -> ZeroEngine:
        engine = self._zero_engine_ref()
        if engine is None:
            raise RuntimeError(ENGINE_GONE)
        return engine

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all shards by their *global* norm; return that norm. With
        several optimizers on the model: this optimizer's parameters only."""
        return self._zero_engine.clip_grad_norm_(max_norm, norm_type, optimizer=self)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp all gradient shards (with several optimizers: this one's) element-wise to
        ``[-clip_value, clip_value]``."""
        self._zero_engine.clip_grad_value_(clip_value, optimizer=self)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` was skipped because fp16 gradients overflowed (on any rank)."""
        return self._zero_engine.steps.last_skipped

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply ``loss`` by the current fp16 loss scale (identity otherwise)."""
        return self._zero_engine.scale_loss(loss)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_engine.zero_grad(set_to_none=set_to_none, optimizer=self)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The class's own ``step`` (its hooks run the engine's work); whatever happens inside,
        the engine's per-step flags are cleared when it returns or raises."""
        try:
            return super().step(*args, **kwargs)
        finally:
            engine = self._zero_engine_ref()
            if engine is not None:  # gone: the step hook raised ENGINE_GONE
                engine.reset_step_calls()


def build_optimizer(
    optimizer: torch.optim.Optimizer | OptimizerFactory, module: torch.nn.Module
) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        opt = optimizer(module.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"initialize(optimizer=...): the callable returned {type(opt).__name__}, not a "
                "torch.optim.Optimizer; pass an optimizer instance or a function params -> optimizer"
            )
        return opt
    raise TypeError(
        f"initialize(optimizer=...): expected a torch.optim.Optimizer or a callable params -> optimizer, "
        f"got {type(optimizer).__name__}"
    )


# torch's optimizers whose update of each element reads only that element (and scalars such as
# the step count): stepped on 1-D pieces they give DDP's numbers. Their subclasses count too.
_ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Adadelta,
    torch.optim.Rprop,
)  # fmt: skip
# bitsandbytes' 8-bit Adam, recognised by module and name (the core never imports it)
_ELEMENTWISE_BNB = frozenset({"Adam8bit", "AdamW8bit", "PagedAdam8bit", "PagedAdamW8bit"})
# Refused, matched against the words of the class's name and its bases' (``FusedLAMB``: fused,
# lamb): a 1-D piece cannot reproduce an update that reads the whole parameter.
_WHOLE_SHAPE = frozenset({"adafactor", "muon", "shampoo", "soap"})  # factored, orthogonalised
_CLOSURE = frozenset({"lbfgs"})  # re-runs the closure (forward and backward) inside step()
_WHOLE_NORM = frozenset({"lamb", "lars", "novograd"})  # trust ratio or normalisation by a parameter's norm
_PIECES = (
    ", but ZeRO gives each rank 1-D pieces of parameters, so the numbers would differ from DDP. Use an "
    "element-wise optimizer (AdamW, Adam, SGD, Adagrad, RMSprop, ...)."
)
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_WARNED: set[type] = set()


class UnknownOptimizerWarning(UserWarning):
    """``initialize`` got an optimizer it cannot tell to be element-wise (see ``check_optimizer``)."""


def _words(name: str) -> set[str]:
    words = [w.lower() for w in _WORDS.findall(name)]
    return {*words, *(a + b for a, b in zip(words, words[1:]))}  # "NovoGrad" -> novo, grad, novograd


def _refusal(cls: type) -> str | None:
    """Why ``cls`` (or one of its bases) cannot be stepped on 1-D pieces; None if nothing is known."""
    for base in cls.__mro__:
        if base is torch.optim.Optimizer or base is object:
            continue
        words = _words(base.__name__)
        if words & _CLOSURE:
            return (
                f"{cls.__name__} re-runs its closure (forward and backward) inside step(), but under ZeRO the "
                "gradients are reduced by the backward before step() runs, so its line search cannot be reproduced "
                "(declaring whole parameters does not change that). Use an optimizer without a closure."
            )
        if declared(cls):  # steps each parameter whole on one rank (whole_params.py)
            return None
        if words & _WHOLE_SHAPE:
            return (
                f"{cls.__name__} updates a parameter from its whole shape (if it reads each parameter alone, declare "
                "it with @zero_strategy.whole_params and each parameter is stepped whole on one rank)" + _PIECES
            )
        if words & _WHOLE_NORM:
            return (
                f"{cls.__name__} scales each parameter's update by that parameter's norm (a LAMB/LARS-style "
                "trust ratio or a NovoGrad-style normalisation)" + _PIECES
            )
    return None


def _is_elementwise(cls: type) -> bool:
    if issubclass(cls, _ELEMENTWISE):
        return True
    return cls.__module__.split(".")[0] == "bitsandbytes" and cls.__name__ in _ELEMENTWISE_BNB


def check_optimizer(optimizer: torch.optim.Optimizer, module: torch.nn.Module, *, stacklevel: int = 3) -> None:
    """Validate before anything is changed: an element-wise update, parameters of ``module``.

    Each rank steps only its 1-D pieces of the parameters, so an update that reads a whole
    parameter (its shape, its norm, other elements) silently differs from DDP. Known ones are
    refused; torch's element-wise optimizers (and their subclasses) and bitsandbytes' 8-bit Adam
    pass silently; any other class passes with one :class:`UnknownOptimizerWarning` per class
    and process."""
    if swapped_by(optimizer) is ZeroOptimizer:
        raise RuntimeError("initialize(): this optimizer is already bound to a zero_strategy engine; build a new one")
    cls = type(optimizer)
    refusal = _refusal(cls)
    if refusal is not None:
        raise TypeError(f"initialize(): {refusal}")
    if not _is_elementwise(cls) and not declared(cls) and cls not in _WARNED:
        _WARNED.add(cls)
        warnings.warn(
            f"initialize(): {cls.__module__}.{cls.__qualname__} is not an optimizer zero_strategy knows to be "
            "element-wise. ZeRO steps it on each rank's 1-D pieces of the parameters, so if its update reads a "
            "whole parameter (a norm, a trust ratio, the shape) the numbers differ from DDP without an error. "
            "If it updates each element from that element alone, ignore this warning "
            "(warnings.filterwarnings('ignore', category=zero_strategy.UnknownOptimizerWarning)).",
            UnknownOptimizerWarning,
            stacklevel=stacklevel,  # the user's call of initialize / replace_optimizer
        )
    names = {id(p): n for n, p in module.named_parameters()}
    seen: set[int] = set()
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(
                    f"initialize(): parameter '{names.get(id(p), tuple(p.shape))}' appears twice in "
                    f"optimizer.param_groups (group {gi}); list each parameter once"
                )
            seen.add(id(p))
            if id(p) not in names:
                raise ValueError(
                    f"initialize(): optimizer.param_groups[{gi}] holds a parameter of shape {tuple(p.shape)} "
                    "that is not in the model; build the optimizer on model.parameters()"
                )


def _check_momentum(optimizer: torch.optim.Optimizer, engine: ZeroEngine) -> None:
    """Under ``compression.momentum`` the engine owns SGD's momentum (DGC's momentum
    correction): the optimizer must not add its own on top of the exchanged velocity."""
    fb = engine.reducer.compression
    if fb is None or fb.config.momentum == 0:
        return
    for gi, group in enumerate(optimizer.param_groups):
        if group.get("momentum", 0) or group.get("nesterov", False):
            raise ValueError(
                f"initialize(): compression.momentum={fb.config.momentum} makes the engine keep SGD's momentum "
                f"(the exchanged update is the velocity), but optimizer.param_groups[{gi}] has momentum="
                f"{group.get('momentum')}; build the optimizer with momentum=0 (e.g. torch.optim.SGD(params, lr)), "
                "or set compression.momentum: 0 to let the optimizer keep it"
            )


def _shard_like(engine: ZeroEngine, p: torch.Tensor, key: str, value: Any) -> Any:
    """This rank's piece of per-parameter optimizer state shaped like ``p`` (state that
    exists before ``initialize``, e.g. Adagrad's); ``step`` and other values are copied."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step" or value.shape != p.shape:
        return value.clone()
    g, i = engine.reducer.locate(p)
    lo, hi = g.layout.local_range(i)
    return value.detach().reshape(-1)[lo:hi].to(g.master_device, copy=True)  # beside its master


def _whole_proxies(optimizer: torch.optim.Optimizer, engine: ZeroEngine) -> dict[int, torch.Tensor]:
    """For the parameters ``optimizer`` steps whole (``whole_params.py``): model parameter id
    -> the tensor the optimizer steps instead (whole on its owner rank, empty elsewhere)."""
    whole = [p for group, on in zip(optimizer.param_groups, whole_groups(optimizer)) if on for p in group["params"]]
    pairs = [(p, m) for p in whole for m in [engine.master_of(p)] if m is not None]  # frozen ones stay as they are
    if not pairs:
        return {}
    proxies = engine.whole.bind(key(optimizer), [p for p, _ in pairs], [m for _, m in pairs])
    return {id(p): x for (p, _), x in zip(pairs, proxies)}


def bind_optimizer(optimizer: torch.optim.Optimizer, engine: ZeroEngine) -> torch.optim.Optimizer:
    _check_momentum(optimizer, engine)
    bind_adam(optimizer, engine.reducer.compression, check_only=True)
    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    proxies = _whole_proxies(optimizer, engine)
    for group in optimizer.param_groups:
        new_params = []
        for p in group["params"]:
            master = engine.master_of(p)
            if master is None:  # frozen: kept as is
                new_params.append(p)
                continue
            proxy = proxies.get(id(p))
            new_params.append(master if proxy is None else proxy)
            if p not in optimizer.state:  # e.g. Adagrad fills its state at construction
                continue
            if proxy is None:
                new_state[master] = {k: _shard_like(engine, p, k, v) for k, v in optimizer.state[p].items()}
            elif proxy.numel():  # whole on its owner rank only
                new_state[proxy] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                    for k, v in optimizer.state[p].items()}  # fmt: skip
        group["params"] = new_params
    optimizer.state.clear()
    optimizer.state.update(new_state)
    use_host_kernel(optimizer, engine.host_masters())
    swap_class(optimizer, ZeroOptimizer)
    # the swapped class carries ZeroOptimizer's attributes; the engine holds the optimizer, so weakly
    cast(ZeroOptimizer, optimizer)._zero_engine_ref = weakref.ref(engine)
    optimizer.register_step_pre_hook(_before_step)
    optimizer.register_step_post_hook(_after_step)
    bind_adam(optimizer, engine.reducer.compression)  # reads the masters' state
    return optimizer


# Optimizers whose CPU step torch can run as one fused kernel per group (``fused=True``).
_HOST_FUSED = (torch.optim.Adam, torch.optim.AdamW)


def use_host_kernel(optimizer: torch.optim.Optimizer, host: set[int]) -> list[int]:
    """The host step's fast path: a torch Adam/AdamW param group whose masters are all
    offloaded to the host, and whose ``fused`` and ``foreach`` the user left unset (None),
    steps with torch's fused CPU kernel instead of the per-tensor loop torch picks for CPU
    tensors. A flag the user set is never changed. Returns the indices of the groups changed."""
    if type(optimizer) not in _HOST_FUSED or not host:
        return []
    changed = []
    for gi, group in enumerate(optimizer.param_groups):
        params = group["params"]
        unset = group.get("fused") is None and group.get("foreach") is None
        plain = not group.get("differentiable", False) and not group.get("capturable", False)
        if unset and plain and params and all(id(p) in host and p.dtype in _FUSED_DTYPES for p in params):
            group["fused"] = True
            changed.append(gi)
    return changed


_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def engine_of(optimizer: torch.optim.Optimizer) -> ZeroEngine:
    """The engine ``optimizer`` was bound to (by ``initialize`` or ``replace_optimizer``)."""
    engine: ZeroEngine | None = getattr(optimizer, "_zero_engine", None)
    if engine is None:
        raise ValueError(
            f"{type(optimizer).__name__} is not bound to a zero_strategy model; use the optimizer that "
            "zero_strategy.initialize returned"
        )
    return engine


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    engine = engine_of(optimizer)
    if engine.steps.internal:  # the engine steps the optimizer itself (the disk tier)
        return
    engine.steps.depth += 1
    if engine.steps.depth > 1:  # a subclass's super().step() re-enters the hooks: the engine acts once
        return
    try:
        _check_step_call(optimizer, engine, args, kwargs)
        engine.before_optimizer_step(optimizer)
    except BaseException:
        engine.reset_step_calls()  # nothing is in progress after a refused or failed start
        raise


def _check_step_call(optimizer: torch.optim.Optimizer, engine: ZeroEngine, args: Any, kwargs: Any) -> None:
    if engine.destroyed:
        raise RuntimeError(ENGINE_GONE)
    if engine.phase_offloaded is not None:
        raise RuntimeError(
            "optimizer.step() after offload_states(model): the model's state is on the host; call "
            "zero_strategy.reload_states(model) first"
        )
    if optimizer not in engine.opts:
        raise RuntimeError(
            "optimizer.step(): this optimizer was replaced by zero_strategy.replace_optimizer(); step the new one"
        )
    if (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None:  # args[0]: the optimizer
        raise RuntimeError(
            "optimizer.step(closure) is not supported by zero_strategy: the closure's backward would run after "
            "the gradients were reduced. Run forward and backward before step() and call step() without a closure."
        )


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    engine = engine_of(optimizer)
    if engine.steps.internal or engine.steps.depth == 0:  # the engine's own step, or a count that was reset
        return
    engine.steps.depth -= 1
    if engine.steps.depth == 0:  # the outermost step call: everything the subclass did is in the masters
        engine.after_optimizer_step(optimizer)
