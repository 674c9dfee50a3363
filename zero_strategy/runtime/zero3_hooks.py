"""ZeRO-3's module hooks: around each unit's forward, and around calls of the model's
submodules made outside the model's forward. The engine creates them, keeps their handles
(``close()`` removes them) and gives them its side of the work as callables; the scheduler
(``zero3.py``) gathers and frees.

Unit hooks. Before a unit's forward its parameters are gathered, after it they are freed, and
each tensor the unit *produced* gets a hook that starts the unit's backward when its gradient
arrives. A tensor the unit returns unchanged from its inputs (a T5 block hands ``position_bias``
on to the next) was produced elsewhere: its gradient is complete only once every user of it is
done, in the middle of its producer's backward, and a hook of the unit that passed it on would
finish (and free) the producer then, while the producer's backward still reads its
parameters. Such a tensor gets no hook; one the unit changed in place (its version moved) did
come out of the unit, and gets one.

Outside calls. Code may call a submodule without calling the model: Hugging Face's
``generate`` runs ``model.get_encoder()(...)`` before the decoding loop, a user may call one
block. Such a call reads parameters that the model's forward would have gathered: the root
unit (embeddings, final norms), the pinned units, and the unit that encloses the called module.
The outermost such call gathers them, and the units inside it gather through their own hooks,
as in a forward. Without gradients everything is freed when the call returns (persistent units
stay); with gradients it stays gathered until the end of the backward, as after a forward. The
unit order is not recorded from such calls (prefetch follows the model's forward). A call inside
the model's forward, or inside a backward (activation checkpointing recomputes there), is not
an outside call: the hooks only check two counters then.

Every hook holds these hooks weakly (``_weak.py``): the engine holds them, their scheduler and the
modules, so a strong hook on a module would close a reference cycle through it.

State-dict hooks. ``load_state_dict`` cannot write into sharded parameters, and ``state_dict``
of a sharded parameter would be a placeholder: both refuse and name the call that works.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from zero_strategy._weak import weak_method
from zero_strategy.runtime.compile_support import eager, hook_caller
from zero_strategy.runtime.zero3 import UnitScheduler
from zero_strategy.sharding.experts.selective import SELECT_HOOK, ExpertRows
from zero_strategy.sharding.pieces import is_placeholder
from zero_strategy.sharding.unit import UnitStorage

__all__ = ["Zero3Hooks", "refuse_load_state_dict", "refuse_sharded_state_dict"]


def _tensors(*trees: Any) -> list[torch.Tensor]:
    return [t for tree in trees for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class Zero3Hooks:
    """The module hooks of one ZeRO-3 engine. The engine's callables: ``in_root_call`` (a call
    of the model is running), ``backward_coming`` (gradients reached a unit: queue the end of
    backward), ``call_started``/``call_done(ok, output)`` (an outside call began or ended, for
    the engine's states and the hooks on its outputs)."""

    def __init__(
        self,
        scheduler: UnitScheduler,
        *,
        in_root_call: Callable[[], bool],
        backward_coming: Callable[[], None],
        call_started: Callable[[], None],
        call_done: Callable[[bool, Any], None],
    ) -> None:
        self.scheduler = scheduler
        self._in_root_call = in_root_call
        self._backward_coming = backward_coming
        self._call_started = call_started
        self._call_done = call_done
        self._depth = 0  # module calls running inside the outside call in progress (0: none)
        self._frame: FrameType | None = None  # the frame of the outermost call, while it runs
        self._inputs: dict[int, dict[int, int]] = {}  # per unit tag: version of each input tensor (by id)

    def install(self, root: nn.Module) -> list[RemovableHandle]:
        """Hooks on every submodule of ``root`` that holds parameters (the root has its own):
        the outside-call hooks around each, the unit hooks inside them on the units."""
        units = {id(m): u for m, u in self.scheduler.module_units}
        enclosing: dict[int, UnitStorage] = {}
        for m, u in self.scheduler.module_units:
            for sub in m.modules():
                if sub is not m:
                    enclosing.setdefault(id(sub), u)
        handles: list[RemovableHandle] = []
        for listed in self.scheduler.experts.values():  # a declared ModuleList: select_experts() calls in
            if listed.found.members:
                slot: OrderedDict[int, Any] = OrderedDict()  # RemovableHandle keeps a weak reference
                setattr(listed.found.module, SELECT_HOOK, slot)
                handle = RemovableHandle(slot)  # closing the engine empties the slot
                slot[handle.id] = eager(weak_method(self.scheduler.expert_pre_forward, listed))
                handles.append(handle)
        for sub in root.modules():
            if sub is root or next(sub.parameters(), None) is None:
                continue
            pre = weak_method(self._outside_pre_forward, enclosing.get(id(sub)))
            handles.append(sub.register_forward_pre_hook(eager(pre)))
            unit = units.get(id(sub))
            if unit is not None:
                pre_unit = weak_method(self._unit_pre_forward, unit)
                post_unit = weak_method(self._unit_post_forward, unit)
                handles.append(sub.register_forward_pre_hook(eager(pre_unit), with_kwargs=True))
                handles.append(sub.register_forward_hook(eager(post_unit), with_kwargs=True))
            x = self.scheduler.experts.get(id(sub))
            if x is not None and not x.found.members:  # an MoE experts module: gathered by the router's selection
                expert_pre = eager(weak_method(self._expert_pre, x))
                handles.append(sub.register_forward_pre_hook(expert_pre, with_kwargs=True))
                handles.append(sub.register_forward_hook(eager(weak_method(self._expert_post, x))))
                done = eager(weak_method(self._expert_call_done, x))  # num_experts back, also after a raise
                handles.append(sub.register_forward_hook(done, always_call=True))
            handles.append(sub.register_forward_hook(eager(weak_method(self._outside_post_forward)), always_call=True))
        return handles

    # -- MoE experts modules ---------------------------------------------------------------
    def _expert_pre(self, x: ExpertRows, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        self.scheduler.expert_pre_forward(x, x.found.selection(args, kwargs))
        x.open_call = True
        return x.call_arguments(args, kwargs)  # compact rows: the selection as slots (experts/compact.py)

    def _expert_call_done(self, x: ExpertRows, module: nn.Module, args: Any, output: Any) -> None:
        x.call_done()
        if x.open_call:  # the call raised between the gather and the forward hook
            self.scheduler.expert_call_raised(x)

    def _expert_post(self, x: ExpertRows, module: nn.Module, args: Any, output: Any) -> Any:
        x.open_call = False
        self.scheduler.expert_post_forward(x)
        if torch.is_grad_enabled():  # its backward gathers the same union again
            hooked = False
            for t in _tensors(output):
                if t.requires_grad and not hooked:
                    t.register_hook(weak_method(self._expert_pre_backward, x))
                    hooked = True
        return output

    def _expert_pre_backward(self, x: ExpertRows, grad: torch.Tensor) -> None:
        self._backward_coming()
        self.scheduler.expert_pre_backward(x)

    # -- units -----------------------------------------------------------------------------
    def _unit_pre_forward(self, u: UnitStorage, module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled():  # which tensors come in, and as which version (see the module doc)
            self._inputs[u.tag] = {id(t): t._version for t in _tensors(args, kwargs)}
        self.scheduler.pre_forward(u)

    def _unit_post_forward(self, u: UnitStorage, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        self.scheduler.post_forward(u)
        seen = self._inputs.pop(u.tag, None)
        if torch.is_grad_enabled():  # gradients reaching an output the unit produced start its backward
            inputs = _tensors(args, kwargs) if seen else []
            for t in _tensors(output):
                if not t.requires_grad:
                    continue
                if seen is not None and seen.get(id(t)) == t._version and any(t is i for i in inputs):
                    continue  # passed through unchanged: its producer's hook covers it
                t.register_hook(weak_method(self._unit_pre_backward, u))
        return output

    def _unit_pre_backward(self, u: UnitStorage, grad: torch.Tensor) -> None:
        self._backward_coming()
        self.scheduler.pre_backward(u)

    # -- outside calls ---------------------------------------------------------------------
    def _outside_pre_forward(self, enclosing: UnitStorage | None, module: nn.Module, args: Any) -> None:
        if self._depth:
            if self._frame_running():  # a module called inside the outside call in progress
                self._depth += 1
                return
            self.drop_stale()
        if self._in_root_call() or torch._C._current_graph_task_id() != -1:
            return  # inside the model's forward, or a recomputation inside backward
        self._depth = 1  # first: the post hook (always called) closes the call even if what follows raises
        self._frame = hook_caller()  # the module call's own frame: it runs the forward too
        self._call_started()
        self.scheduler.outside_pre_forward(enclosing)

    def _outside_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._depth:
            return
        self._depth -= 1
        if self._depth:
            return
        self._frame = None
        # torch calls this hook with no output when the forward raised (the exception is being handled)
        ok = output is not None or sys.exc_info()[0] is None
        self._call_done(ok, output)
        self.scheduler.outside_post_forward(ok=ok)

    def _frame_running(self) -> bool:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame is not self._frame:
            frame = frame.f_back
        return frame is not None

    def drop_stale(self) -> None:
        """An outside call that a ``KeyboardInterrupt`` left open (torch skips its always-called
        hooks on a ``BaseException``) is closed as one that raised; one still running is not."""
        if self._depth and not self._frame_running():
            self._depth, self._frame = 0, None
            self._call_done(False, None)
            self.scheduler.outside_post_forward(ok=False)


def refuse_load_state_dict(*args: Any) -> None:
    """A ZeRO-3 model's load_state_dict pre-hook: it cannot write into sharded parameters."""
    raise RuntimeError(
        "model.load_state_dict() cannot write into a ZeRO-3 model: each rank holds only pieces of the "
        "parameters. Use zero_strategy.load_full_state_dict(model, state_dict_or_path) instead."
    )


def refuse_sharded_state_dict(
    local_names: list[str], module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any
) -> None:
    """On every module that owns sharded parameters. Outside gathering, a sharded value
    would be a placeholder: raise. A gathered value is copied, because the gathered storage
    is freed at the next release (a view kept past it would read freed memory).
    ``keep_vars=True`` (the Parameter objects, e.g. for their names) is left alone."""
    for local in local_names:
        name = prefix + local
        value = state_dict.get(name)
        if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
            continue
        if is_placeholder(value):
            raise RuntimeError(
                f"state_dict() of a ZeRO-3 model: '{name}' is sharded (this rank holds only a piece), so "
                "its value would be a placeholder. Use zero_strategy.full_state_dict(model) (a collective: call "
                "it on every rank; Accelerate: accelerator.get_state_dict(model)), or call state_dict() inside "
                "`with zero_strategy.gathered_parameters(model):` on every rank. Hugging Face and PEFT "
                "save_pretrained (which calls state_dict(); PEFT keeps the adapter's entries only): on every rank "
                "`model.save_pretrained(dir, state_dict=accelerator.get_state_dict(model), "
                "is_main_process=accelerator.is_main_process)`, or with state_dict=zero_strategy.full_state_dict(model)"
            )
        state_dict[name] = value.clone()
