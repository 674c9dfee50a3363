"""The model side of the class swap: ``initialize`` places :class:`ZeroModule` in front of the
model's own class (as FSDP2's ``fully_shard`` does, see ``_swap.py``), so calling the model runs
the engine's root work around the model's own ``__call__``, ``forward`` runs under the
precision policy's autocast, and ``no_sync``/``zero_grad``/``memory_stats`` are the engine's. A
ZeRO-3 model with ``generate`` gets :class:`ZeroGenerationModule`, whose ranks generate in step."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from types import MethodType
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from zero_strategy._swap import swap_class

if TYPE_CHECKING:
    from zero_strategy.runtime.engine import ZeroEngine

__all__ = ["ZeroGenerationModule", "ZeroModule", "get_engine", "swap_module_class"]


if TYPE_CHECKING:
    _ModuleBase = nn.Module  # what the mixin's methods extend once swapped in (see _swap)
else:
    _ModuleBase = object


class ZeroModule(_ModuleBase):
    """Mixin placed in front of the model's class by ``initialize`` (as FSDP2 does)."""

    _zero_engine: ZeroEngine

    @property
    def zero_engine(self) -> ZeroEngine:
        return self._zero_engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The nesting of root calls is counted here (not in the hooks), so a hook that raises
        # or a KeyboardInterrupt cannot leave it wrong; the root hooks act at depth 1 only.
        eng = self._zero_engine
        if eng.phase_offloaded is not None:
            raise RuntimeError(
                "a forward after offload_states(model): the model's state is on the host; call "
                "zero_strategy.reload_states(model) first"
            )
        depth = eng.sync_state.root_depth
        eng.sync_state.root_depth = depth + 1
        try:
            out = super().__call__(*args, **kwargs)
        except BaseException:
            eng.sync_state.root_depth = depth
            if depth == 0:
                eng.root_done(ok=False)
            raise
        eng.sync_state.root_depth = depth
        if depth == 0:
            eng.root_done(ok=True)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        eng = self._zero_engine
        with eng.precision.forward_context(eng.ctx.device.type):
            return super().forward(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self._zero_engine.no_sync():
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_engine.zero_grad(set_to_none=set_to_none)

    def memory_stats(self) -> dict[str, int]:
        return self._zero_engine.memory_stats()


class ZeroGenerationModule(ZeroModule):
    """The mixin for a ZeRO-3 model with a ``generate`` method (Hugging Face's
    ``GenerationMixin``): the ranks generate in step (``synced_gpus``, see
    ``UnitScheduler.synced_generation``), since each forward gathers with the other ranks.
    ``generate``'s own keyword is the hook; transformers turns it on by itself only for
    DeepSpeed and FSDP."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        scheduler = self._zero_engine.zero3
        if scheduler is not None:
            kwargs["synced_gpus"] = scheduler.synced_generation(kwargs.get("synced_gpus"))
        return super().generate(*args, **kwargs)  # type: ignore[misc]  # the model's own generate


def swap_module_class(module: nn.Module, engine: ZeroEngine) -> None:
    generates = engine.zero3 is not None and callable(getattr(type(module), "generate", None))
    swap_class(module, ZeroGenerationModule if generates else ZeroModule)
    cast(ZeroModule, module)._zero_engine = engine  # the swapped class carries ZeroModule's attributes
    _autocast_instance_forward(module, engine)


def _autocast_instance_forward(module: nn.Module, engine: ZeroEngine) -> None:
    """A ``forward`` set on the instance (TRL's ``add_fused_lm_head`` assigns ``model.forward``)
    shadows :meth:`ZeroModule.forward` and so its autocast: the model would run in fp32 where
    DDP under Accelerate's autocast runs in bf16. It is wrapped in the same precision context,
    kept a bound method (front-ends read ``model.forward.__func__``); ``destroy`` restores it."""
    own = module.__dict__.get("forward")
    if own is None or engine.precision.autocast_dtype is None:
        return

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with engine.precision.forward_context(engine.ctx.device.type):
            return own(*args, **kwargs)

    wrapped = MethodType(functools.wraps(own)(forward), module)
    module.__dict__["forward"] = wrapped
    # the engine keeps restore(): it holds the model (and ``own``, bound to it) weakly
    model, wrapper = weakref.ref(module), weakref.ref(wrapped)

    def restore() -> None:
        m, w = model(), wrapper()
        if m is not None and w is not None and m.__dict__.get("forward") is w:
            m.__dict__["forward"] = w.__func__.__wrapped__  # type: ignore[union-attr]  # own, set by functools.wraps

    engine.on_destroy(restore)


def get_engine(module: nn.Module) -> ZeroEngine:
    eng = getattr(module, "_zero_engine", None)
    if eng is None:
        raise ValueError(
            f"{type(module).__name__} is not managed by zero_strategy; call zero_strategy.initialize(model, optimizer) first"
        )
    return eng
