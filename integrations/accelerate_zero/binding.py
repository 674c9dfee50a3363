"""What ``ZeroPlugin.prepare`` does to one Accelerator instance.

Accelerate 1.15 has no hook for another data-parallel engine, and several of its plain-path
methods would give wrong results for a ZeRO model, so the first ``prepare`` binds replacements
onto that Accelerator *instance* (the class is untouched, other Accelerators are unaffected).
Any number of models may be prepared, each with its optimizer, several optimizers over disjoint
parameters (a GAN), or none (evaluation models, gradient checks:
``zero_strategy.initialize(model, None)``); the replacements act on the ZeRO models and hand
everything else to the Accelerator's own methods:

- Each model is initialized by ``zero_strategy`` and flagged ``_is_accelerate_prepared``, so
  Accelerate tracks it without DDP and without its autocast wrapper (the engine runs the
  forward under the same autocast itself).
- ``backward``: divides by ``gradient_accumulation_steps`` (as Accelerate does) and scales by
  the engine's fp16 loss scale; Accelerate's ``GradScaler`` is turned off (it would scale
  again and check overflows per rank; the engine checks on every rank at once).
- ``clip_grad_norm_``: the global norm over all ranks' shards (torch's
  ``clip_grad_norm_``, which Accelerate's plain path calls, is routed to the same while an
  engine lives: ``runtime/torch_clipping.py``): the model's parameters, or, with several
  optimizers, exactly one optimizer's (that optimizer's norm, as DDP's clipping of those
  parameters; ``model.discriminator.parameters()``). It clips at the micro-step that synchronises;
  on the others it returns None, as Accelerate does under DDP. A model prepared
  without an optimizer has DDP's full gradients in ``p.grad``: Accelerate's own clipping.
- ``clip_grad_value_`` clips this rank's averaged gradient pieces; ``unscale_gradients`` is a
  no-op (gradients are unscaled as they are reduced).
- ``trigger_sync_in_backward(model)``: the next backward reduces although its forward ran in
  ``no_sync`` (Accelerate skips models that are not DDP; the engine decides at forward, as DDP).
- ``get_state_dict``: the full weights gathered to rank 0 (other ranks get ``{}``), for
  ``save_pretrained``; at ZeRO-3 a call under ``if accelerator.is_main_process:`` is refused at
  once with the fix (``_main_only.py``), instead of waiting for the other processes.
- ``save_state``/``load_state``: save and load pre-hooks write each model's (and optimizer's)
  shards (every optimizer's) through ``zero_strategy.save_checkpoint`` (subdirectories ``zero_strategy_model``,
  ``zero_strategy_model_1``, ...), which load at any number of processes; Accelerate itself
  saves a small marker for each optimizer (its own code would write rank 0's shard only) and
  no full model weights. ``save_state(dir)`` writes the whole save, Accelerate's scheduler,
  sampler and RNG files included, into a fresh ``dir/state-<step>`` and moves ``dir/latest``
  once all of it is durable; ``load_state(dir)`` follows ``latest``.

``ZeroPlugin.prepare`` checks the Accelerator (``check_accelerator``), pairs the objects and
resolves the config, then calls ``prepare_with_zero``; nothing here imports the plugin module.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from types import MethodType
from typing import Any, Protocol, cast

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType, DynamoBackend, convert_outputs_to_fp32, is_compiled_module
from torch import nn

import zero_strategy as zs
from accelerate_zero._main_only import main_process_only_test
from zero_strategy.frontend import (
    accumulation_to_adopt,
    frontend_engine_config,
    optimizer_parameters,
    parallelism_shard_size,
)
from zero_strategy.runtime.module import get_engine

__all__ = [
    "CHECKPOINT_DIR",
    "OPTIMIZER_MARKER",
    "ZeroAcceleratedOptimizer",
    "attach_optimizers",
    "check_accelerator",
    "prepare_with_zero",
]

CHECKPOINT_DIR = "zero_strategy_model"
OPTIMIZER_MARKER = "zero_strategy_sharded_optimizer"
_SUPPORTED_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper (``step``/``zero_grad`` act only on the micro-step that
    synchronises) around the engine's optimizer. ``step_was_skipped`` reports an fp16 overflow
    found by the engine; ``state_dict()`` is a marker, because this rank's state is only a
    shard: checkpoints go through ``accelerator.save_state`` or ``zero_strategy.save_checkpoint``."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._zero_model = model

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if not self.gradient_state.sync_gradients:
            return  # accumulating: as AcceleratedOptimizer, step on the synchronising micro-step only
        # (no scaler, no XLA: what AcceleratedOptimizer.step does reduces to this)
        self.optimizer.step(closure)
        self._is_overflow = self.optimizer.step_was_skipped

    def state_dict(self) -> dict[str, Any]:
        return {OPTIMIZER_MARKER: True, "saved_in": CHECKPOINT_DIR}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if isinstance(state_dict, dict) and state_dict.get(OPTIMIZER_MARKER):
            return  # the shards were loaded by the load_state pre-hook
        raise ValueError(
            "ZeroAcceleratedOptimizer.load_state_dict(): this is a full (non-ZeRO) optimizer state; the ZeRO "
            "optimizer loads sharded state only. Load a checkpoint written by accelerator.save_state with "
            "ZeroPlugin, or by zero_strategy.save_checkpoint"
        )


class _AcceleratePrepared(Protocol):
    """The plain attributes a prepared model gets, as Accelerate's own ``prepare`` sets them
    (``nn.Module``'s typed ``__setattr__`` describes tensors and modules only);
    ``_drop_forward_wrapper`` removes them."""

    forward: Callable[..., Any]
    _original_forward: Callable[..., Any]
    _is_accelerate_prepared: bool


class _Marker(dict):
    """A ZeRO model's entry in the weights list during ``save_state`` (removed by the pre-hook)."""


Entry = tuple[int, nn.Module, list[torch.optim.Optimizer]]


def _core_arg(opts: list[torch.optim.Optimizer]) -> Any:
    """What the core takes for a model's optimizers: None, the one, or the list of several."""
    return None if not opts else opts[0] if len(opts) == 1 else list(opts)


class _Binding:
    """The state shared by the functions bound onto one Accelerator: its ZeRO models, each with
    its optimizers (none, one, or several over disjoint parameters), in the order they were
    prepared. The Accelerator owns it (its methods are bound onto the instance), so it holds the
    Accelerator weakly: a dropped Accelerator is freed by reference counting, as without ZeroPlugin."""

    def __init__(self, accelerator: Accelerator) -> None:
        self._accelerator = weakref.ref(accelerator)
        self.entries: list[tuple[nn.Module, list[torch.optim.Optimizer]]] = []
        self.saving = False
        self.marker = _Marker()
        self.loaded_step: int | None = None
        # the Accelerator's own methods, for models and parameters that are not ours (a method
        # bound to it as its function: a bound method would hold the Accelerator)
        self._own = {name: _unbound(getattr(accelerator, name), accelerator) for name in (*_BOUND, *_WRAPPED)}

    @property
    def accelerator(self) -> Accelerator:
        accelerator = self._accelerator()
        if accelerator is None:
            raise RuntimeError(
                "ZeroPlugin: the Accelerator these methods were bound onto was dropped; call them on a live Accelerator"
            )
        return accelerator

    def original(self, name: str) -> Callable[..., Any]:
        """The Accelerator's own ``name`` (as it was before the first ZeroPlugin.prepare), bound."""
        own = self._own[name]
        return MethodType(own[0], self.accelerator) if own[1] else own[0]

    def add(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        self.entries.append((model, optimizers))

    def entry_of(self, model: Any) -> Entry | None:
        # the module itself also under torch.compile's wrapper (dynamo_backend)
        unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False) if model is not None else None
        for k, (m, opt) in enumerate(self.entries):
            if model is m or unwrapped is m:
                return k, m, opt
        return None

    def entry_of_parameters(
        self, parameters: Any, call: str
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], torch.optim.Optimizer | None] | None:
        """The ZeRO model whose parameters these are, its optimizers, and the one optimizer whose
        parameters they are exactly (several optimizers; None: the whole model's trainable ones);
        None if they belong to no ZeRO model."""
        given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ids = {id(p) for p in given}
        for m, opts in self.entries:
            every = {id(p) for p in m.parameters()}
            if not ids & every:
                continue
            trainable = {id(p) for p in m.parameters() if p.requires_grad}
            if not opts or trainable <= ids <= every:
                return m, opts, None
            for opt in opts if len(opts) > 1 else ():
                if ids == {id(p) for p in optimizer_parameters(opt)}:
                    return m, opts, opt
            raise ValueError(
                f"accelerator.{call}(parameters=<{len(given)} tensors>): with ZeroPlugin the gradients are "
                "sharded across processes, so clip the whole model: pass model.parameters() of the model "
                "prepared by ZeroPlugin.prepare"
                + (", or the parameters of exactly one of its optimizers" if len(opts) > 1 else "")
            )
        return None

    # -- bound methods -----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        kwargs.pop("learning_rate", None)  # LOMO's argument; not a ZeRO optimizer
        loss = loss / self.accelerator.gradient_accumulation_steps
        scaled = [m for m, opts in self.entries if opts and get_engine(m).scaler.enabled]
        if len(scaled) > 1:
            raise ValueError(
                f"accelerator.backward(): {len(scaled)} ZeroPlugin models train with an fp16 loss scale each, and "
                "backward cannot tell which scale this loss needs; train them in bf16, or with one Accelerator each"
            )
        if scaled:
            zs.backward(loss, model=scaled[0], **kwargs)
        else:
            loss.backward(**kwargs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor | None:
        found = self.entry_of_parameters(parameters, "clip_grad_norm_")
        if found is None or not found[1]:  # not ours, or model-only: full gradients in p.grad
            return self.original("clip_grad_norm_")(parameters, max_norm, norm_type)
        if not self.accelerator.sync_gradients:
            return None  # gradients are still accumulating: they are clipped at the synchronising micro-step
        model, _, one = found
        if one is not None:  # one of several optimizers: the norm over its parameters
            return get_engine(model).clip_grad_norm_(max_norm, norm_type, optimizer=one)
        return zs.clip_grad_norm_(model, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        found = self.entry_of_parameters(parameters, "clip_grad_value_")
        if found is None or not found[1]:
            return self.original("clip_grad_value_")(parameters, clip_value)
        if not self.accelerator.sync_gradients:
            return None
        # element-wise on this rank's averaged pieces (of one optimizer's parameters, or all)
        get_engine(found[0]).clip_grad_value_(clip_value, optimizer=found[2])
        return None

    def unscale_gradients(self, optimizer: Any = None) -> None:
        return None  # the engine unscales fp16 gradients as it reduces them

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        found = self.entry_of(model)
        if found is None:
            return self.original("get_state_dict")(model, unwrap=unwrap)
        if self.saving:
            return self.marker  # save_state: the shards are written by the pre-hook instead
        engine = get_engine(found[1])
        test = main_process_only_test() if engine.config.stage == 3 and engine.ctx.world_size > 1 else None
        if test is not None:  # the other processes never join the gathers: refused before the first
            raise RuntimeError(
                f"accelerator.get_state_dict(model) under `if {test}:` with a ZeRO-3 model: it gathers the sharded "
                "parameters from every process, so the main process alone would wait until the comm_timeout. Call "
                "it on every process, before the `if`: `state_dict = accelerator.get_state_dict(model)`, then use "
                "it under the `if` (the main process gets the full weights, the others {})"
            )
        return zs.full_state_dict(found[1])  # collective; rank 0 gets the weights, others {}

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        found = self.entry_of(model)
        if found is None:
            with self.original("trigger_sync_in_backward")(model):
                yield
            return
        get_engine(found[1]).sync_next_backward()  # as DDP's prepare_for_backward
        yield

    # -- save_state / load_state -------------------------------------------------------------
    @staticmethod
    def _dir(output_dir: str, k: int) -> str:
        return os.path.join(output_dir, CHECKPOINT_DIR if k == 0 else f"{CHECKPOINT_DIR}_{k}")

    def save_hook(self, models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        weights[:] = [w for w in weights if w is not self.marker]
        for k, (model, opts) in enumerate(self.entries):
            # keep_last=1: saving again into the same directory replaces it, as plain Accelerate does
            zs.save_checkpoint(self._dir(output_dir, k), model, _core_arg(opts), extra=self._extra(), keep_last=1)

    def load_hook(self, models: list[nn.Module], input_dir: str) -> None:
        ours = {id(m) for m, _ in self.entries}
        models[:] = [m for m in models if id(m) not in ours]
        for k, (model, opts) in enumerate(self.entries):
            root = self._dir(input_dir, k)
            if not os.path.isdir(root):
                raise FileNotFoundError(
                    f"accelerator.load_state({input_dir!r}): no {os.path.basename(root)}/ inside; the directory was not "
                    f"written by accelerator.save_state with ZeroPlugin for {len(self.entries)} ZeRO model(s), so it "
                    "holds no ZeRO shards to load"
                )
            extra = zs.load_checkpoint(root, model, _core_arg(opts))
            self.loaded_step = extra.get("accelerate_step")

    def _extra(self) -> dict[str, Any]:
        # lr and the other param-group settings are restored by zero_strategy.load_checkpoint
        return {"accelerate_step": int(self.accelerator.step)}

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        accelerator, save_state = self.accelerator, self.original("save_state")
        if output_dir is None or accelerator.project_configuration.automatic_checkpoint_naming:
            with _flag(self):  # Accelerate names a fresh directory per save itself
                return save_state(output_dir, safe_serialization, **kwargs)
        # One unit: everything this save writes (the shards, and Accelerate's scheduler, sampler
        # and RNG files) goes into a fresh versioned directory; `latest` names it only once all
        # of it is durable, so a crash never pairs new weights with an old scheduler.
        version = zs.begin_versioned_save(output_dir, f"state-{accelerator.step}")
        with _flag(self):
            save_state(version, safe_serialization, **kwargs)
        zs.commit_versioned_save(version, keep_last=1)  # the previous state goes once this one is durable
        return version

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        self.loaded_step = None
        if input_dir is not None:
            input_dir = zs.resolve_checkpoint(input_dir)  # follows `latest` (a plain name inside it)
        self.original("load_state")(input_dir, load_kwargs, **kwargs)
        if self.loaded_step is not None:  # the same on every rank, also ranks the save did not have
            self.accelerator.step = self.loaded_step


_BOUND = (
    "backward",
    "clip_grad_norm_",
    "clip_grad_value_",
    "unscale_gradients",
    "get_state_dict",
    "trigger_sync_in_backward",
)
_WRAPPED = ("save_state", "load_state")  # replaced too, and called inside the replacements


def _unbound(method: Any, owner: Any) -> tuple[Callable[..., Any], bool]:
    """(the function, True) for a method bound to ``owner``; (the callable, False) otherwise."""
    if isinstance(method, MethodType) and method.__self__ is owner:
        return method.__func__, True
    return method, False


def _drop_forward_wrapper(ref: weakref.ref[nn.Module]) -> None:
    """``zs.destroy``: the plain module gets its class's forward back (no Accelerate marks). The
    engine keeps this callback, so it holds the model weakly (the model owns the engine)."""
    model = ref()
    if model is None:
        return
    model.__dict__.pop("forward", None)
    model.__dict__.pop("_original_forward", None)
    model.__dict__.pop("_is_accelerate_prepared", None)


def check_accelerator(accelerator: Any) -> None:
    """Refuse what ``ZeroPlugin.prepare`` cannot run on: not an Accelerator, DeepSpeed/FSDP/
    Megatron, tensor or context parallelism (``ParallelismConfig``'s data-parallel sizes are shard
    groups: ``ZeroPlugin.resolved_config``), and a process that runs alone although it was launched as one of
    several (``_refuse_a_lone_process_of_a_launch``)."""
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"ZeroPlugin.prepare(accelerator=...): expected an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    if accelerator.distributed_type not in _SUPPORTED_TYPES:
        raise ValueError(
            f"ZeroPlugin.prepare(): the Accelerator runs {accelerator.distributed_type}; ZeroPlugin replaces DDP and works "
            "with plain data parallelism only (distributed_type NO, MULTI_CPU or MULTI_GPU). Remove the DeepSpeed/FSDP/"
            "Megatron settings from the accelerate config"
        )
    parallelism_shard_size(getattr(accelerator, "parallelism_config", None), "ZeroPlugin.prepare()")  # tp/cp refused
    _refuse_a_lone_process_of_a_launch(accelerator)


def _refuse_a_lone_process_of_a_launch(accelerator: Accelerator) -> None:
    """``accelerate launch --multi_gpu --num_processes N`` on a machine without GPUs and without
    ``ACCELERATE_USE_CPU``: the processes share one process group, but each Accelerator runs alone
    (``num_processes`` 1), so each would train on the whole dataset and save as the main process."""
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    group = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    processes = max(launched, group)
    if processes <= accelerator.num_processes:
        return
    raise RuntimeError(
        f"ZeroPlugin.prepare(): this process was started as one of {processes} processes (WORLD_SIZE={launched}), "
        f"but its Accelerator runs alone (num_processes={accelerator.num_processes}, distributed_type "
        f"{accelerator.distributed_type.value}): each process would train on the whole dataset and save as the main "
        "process. On a machine without GPUs Accelerate joins CPU processes only with ACCELERATE_USE_CPU=true: set it "
        "for `accelerate launch`, or start the script with `zero-strategy launch --zero-config FILE ...`, which sets "
        "it"
    )


@contextlib.contextmanager
def _flag(binding: _Binding) -> Iterator[None]:
    binding.saving = True
    try:
        yield
    finally:
        binding.saving = False


def _binding_of(accelerator: Accelerator) -> _Binding:
    """The Accelerator's binding, made (and its methods bound) on the first ZeroPlugin.prepare."""
    binding = getattr(accelerator, "_zero_binding", None)
    if binding is not None:
        return binding
    binding = _Binding(accelerator)
    for name in (*_BOUND, *_WRAPPED):
        setattr(accelerator, name, getattr(binding, name))
    accelerator.register_save_state_pre_hook(binding.save_hook)
    accelerator.register_load_state_pre_hook(binding.load_hook)
    accelerator._zero_binding = binding
    return binding


def _off_device(model: nn.Module, device: torch.device) -> bool:
    """Whether a parameter or buffer of ``model`` is not on ``device`` (so ``model.to`` has work).
    Launched CPU processes get ``cpu:0``, where ``model.to`` copies every CPU tensor (all CPU
    indices are one memory), so the CPU index is not compared."""
    want = torch.device(device)

    def off(d: torch.device) -> bool:
        return d.type != want.type or (want.type != "cpu" and want.index is not None and d.index != want.index)

    return any(off(t.device) for t in (*model.parameters(), *model.buffers()))


def prepare_with_zero(
    accelerator: Accelerator,
    objects: tuple[Any, ...],
    pairs: list[tuple[nn.Module, list[torch.optim.Optimizer]]],
    config: zs.ZeroConfig,
    policy: Any,
    mesh: Any = None,
) -> Any:
    """The body of ``ZeroPlugin.prepare(accelerator, *objects)``: ``pairs`` are the models among
    ``objects`` with their optimizers (``pair_models_and_optimizers``), ``config`` is
    ``ZeroPlugin.resolved_config(accelerator)``, ``policy`` the plugin's ZeRO-3 units and
    ``mesh`` a DeviceMesh given as its ``shard_size``."""
    _refuse_regional_compilation(accelerator)
    steps = accumulation_to_adopt(config, accelerator.gradient_accumulation_steps)
    if steps is not None:
        accelerator.gradient_accumulation_steps = steps  # the file's setting, which accumulate() runs
    # The Accelerator owns accumulation (loss division, no_sync, skipped steps); the engine
    # only needs to agree with it, which resolved_config checked.
    engine_config = frontend_engine_config(config)
    binding = _binding_of(accelerator)
    swapped: dict[int, Any] = {}
    for model, opts in pairs:
        if accelerator.device_placement and _off_device(model, accelerator.device):
            model.to(accelerator.device)  # only when needed: weights mapped from files would be copied
        zs.initialize(model, _core_arg(opts), config=engine_config, policy=policy, mesh=mesh)  # the same objects, bound
        prepared = cast(_AcceleratePrepared, model)
        if config.precision.autocast_dtype is not None:
            # as Accelerate's own mixed precision: the engine autocasts inside forward, the outputs
            # come back in fp32 (a loss computed from them outside forward is computed in fp32)
            forward = cast(MethodType, model.forward)  # the class's forward, bound to the model
            prepared._original_forward = forward
            prepared.forward = MethodType(convert_outputs_to_fp32(forward.__func__), model)
            get_engine(model).on_destroy(partial(_drop_forward_wrapper, weakref.ref(model)))
        prepared._is_accelerate_prepared = True  # tracked by the Accelerator, not wrapped in DDP or autocast
        for optimizer in opts:
            wrapped = ZeroAcceleratedOptimizer(optimizer, model)
            wrapped._is_accelerate_prepared = True
            swapped[id(optimizer)] = wrapped
        binding.add(model, opts)
    accelerator.scaler = None  # the engine's loss scaler replaces Accelerate's GradScaler
    prepared = accelerator.prepare(*(swapped.get(id(o), o) for o in objects))
    return _compiled(accelerator, prepared, [m for m, _ in pairs])


def attach_optimizers(accelerator: Accelerator, model: nn.Module, opts: list[torch.optim.Optimizer]) -> list[Any]:
    """Optimizers prepared in a later ``accelerator.prepare`` call than their model, which the
    engine took without one (Accelerate allows it): bound to the model's engine
    (``zs.replace_optimizer``), wrapped as in :func:`prepare_with_zero`; the wrappers, in order."""
    binding = _binding_of(accelerator)
    found = binding.entry_of(model)
    if found is None or found[2]:
        raise ValueError(f"attach_optimizers: {type(model).__name__} is not a ZeroPlugin model without an optimizer")
    zs.replace_optimizer(model, _core_arg(opts))  # the same objects, bound
    wrapped = []
    for optimizer in opts:
        w = ZeroAcceleratedOptimizer(optimizer, model)
        w._is_accelerate_prepared = True
        wrapped.append(w)
    binding.entries[found[0]] = (model, list(opts))
    return wrapped


def _compiled(accelerator: Accelerator, prepared: Any, models: list[nn.Module]) -> Any:
    """``Accelerator(dynamo_backend=...)`` (or ``ACCELERATE_DYNAMO_BACKEND``): the prepared models
    compiled as Accelerate's own ``prepare_model`` compiles them, last, with ``torch.compile`` and
    the plugin's arguments (the engine's hooks run eagerly at module boundaries, the module bodies
    are compiled: docs/advanced.md). Regional compilation is refused before (``_refuse_regional_compilation``)."""
    plugin = accelerator.state.dynamo_plugin
    if plugin.backend == DynamoBackend.NO or not models:
        return prepared
    ours = {id(m) for m in models}
    items = list(prepared) if isinstance(prepared, tuple) else [prepared]
    for k, obj in enumerate(items):
        if id(obj) in ours and not is_compiled_module(obj):
            compiled = torch.compile(obj, **plugin.to_kwargs())
            compiled._is_accelerate_prepared = True  # type: ignore[attr-defined]  # torch.compile returns an OptimizedModule
            items[k] = compiled
    return tuple(items) if isinstance(prepared, tuple) else items[0]


def _refuse_regional_compilation(accelerator: Accelerator) -> None:
    """Before the engine takes any model: regional compilation would compile its units, hooks included."""
    plugin = accelerator.state.dynamo_plugin
    if plugin.backend != DynamoBackend.NO and plugin.use_regional_compilation:
        raise ValueError(
            f"Accelerator(dynamo_backend={str(plugin.backend.value).lower()!r}) with use_regional_compilation: "
            "ZeroPlugin compiles the whole model (its hooks run eagerly around the compiled module bodies); regional "
            "compilation would compile the engine's units with their hooks. Set use_regional_compilation=False "
            "(ACCELERATE_USE_REGIONAL_COMPILATION=false)"
        )
