"""The public functions of the core. Front-ends (Lightning, Accelerate) use only these."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from zero_strategy.comm import collectives as C
from zero_strategy.config import ZeroConfig
from zero_strategy.offload.swapped_state import base_step
from zero_strategy.runtime.engine import ZeroEngine, live_engines
from zero_strategy.runtime.module import get_engine, swap_module_class
from zero_strategy.runtime.optimizer import bind_optimizer, build_optimizer, check_optimizer
from zero_strategy.runtime.optimizer_set import check_disjoint, refuse_several
from zero_strategy.runtime.shard_layout import MeshLayout, take_mesh
from zero_strategy.runtime.whole_params import whole_groups
from zero_strategy.sharding.construction import outside_sharded_init
from zero_strategy.sharding.partition import UnitPolicy
from zero_strategy.sharding.precision import select_precision
from zero_strategy.storage.offload import OnDisk, optimizer_offload, param_offload

__all__ = [
    "backward",
    "clip_grad_norm_",
    "destroy",
    "full_grad",
    "gathered_parameters",
    "initialize",
    "memory_stats",
    "replace_optimizer",
]

ConfigLike = ZeroConfig | Mapping[str, Any] | str | None
OptimizerLike = torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def initialize(
    model: nn.Module,
    optimizer: OptimizerLike | Sequence[torch.optim.Optimizer] | None,
    *,
    config: ConfigLike = None,
    process_group: Any = None,
    policy: UnitPolicy = None,
    mesh: Any = None,
    **overrides: Any,
) -> tuple[nn.Module, Any]:
    """Shard ``optimizer`` (and, with stage 2, gradients) of ``model`` across the ranks of
    ``process_group`` (default: the default group; none needed for a single process).

    ``config`` is a :class:`ZeroConfig`, a dict (DeepSpeed key names), or a YAML/JSON path;
    ``overrides`` are ZeroConfig fields given explicitly (they win over the file; a conflicting
    value in the file raises). Returns the same ``model`` and ``optimizer`` objects, changed in
    place: call ``model(...)``, ``loss.backward()``, ``optimizer.step()`` and
    ``optimizer.zero_grad()`` as usual.

    ``optimizer=None`` sets the model up without one (evaluation, inference, or gradients
    read by other code), as ``DistributedDataParallel(model)`` would: at ZeRO-1/2 a backward
    outside ``no_sync()`` leaves the full averaged gradient in every ``p.grad``; at ZeRO-3 the
    parameters are sharded. All parameters may be frozen then. Bind an optimizer later with
    :func:`replace_optimizer`.

    A list (or tuple) of optimizers over *disjoint* parameters of the model (a GAN's generator
    and discriminator) binds them all and returns them, the same objects, as a list: each ``step()``,
    ``zero_grad()`` and ``clip_grad_norm_`` acts on its own optimizer's parameters, as under
    DDP (``runtime/optimizer_set.py``); a parameter in two of them is refused.

    ``mesh``: a ``torch.distributed.device_mesh.DeviceMesh``, as FSDP2's ``fully_shard(mesh=...)``
    takes it (``shard_size=mesh`` is the same): 2-D, dim 0 replicates and dim 1 shards (shard
    groups, HSDP), on the mesh's own process groups; 1-D: flat over its group
    (``runtime/shard_layout.py``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(model=...): expected a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, "_zero_engine", None) is not None:
        raise RuntimeError("initialize(): this model is already managed by zero_strategy; initialize each model once")
    cfg = ZeroConfig.coerce(config)
    if overrides.get("shard_size") is not None and C.mesh_groups(overrides["shard_size"]) is not None:
        if mesh is not None:
            raise TypeError("initialize(): a DeviceMesh given as both mesh= and shard_size=; pass it once")
        mesh = overrides.pop("shard_size")
    if overrides:
        from zero_strategy.config import resolve_overrides

        cfg = resolve_overrides(cfg, source="initialize() keyword arguments", **overrides)
    rows, process_group, layout = take_mesh(mesh, process_group, "initialize(mesh=...)")
    if rows is not None:
        from zero_strategy.config import resolve_overrides

        cfg = resolve_overrides(cfg, source=f"initialize(mesh=...)'s mesh {rows}", shard_size=len(rows[0]))
    with outside_sharded_init():  # called inside a sharded_init block: take the pieces as they are
        return _initialize(model, optimizer, cfg, process_group, policy, layout)


def _initialize(
    model: nn.Module,
    optimizer: OptimizerLike | Sequence[torch.optim.Optimizer] | None,
    cfg: ZeroConfig,
    process_group: Any,
    policy: UnitPolicy | None,
    layout: MeshLayout | None = None,
) -> tuple[nn.Module, Any]:
    several = isinstance(optimizer, (list, tuple))
    opts = _built(optimizer, model, cfg, "initialize()", stacklevel=5)  # before anything is changed
    if opts and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "initialize(): the model has no parameter with requires_grad=True, so the optimizer has nothing to "
            "train; pass optimizer=None to set it up for evaluation or inference"
        )
    engine = ZeroEngine(model, cfg, process_group, policy, mesh=layout)
    swap_module_class(model, engine)
    if opts:
        engine.set_optimizers([bind_optimizer(opt, engine) for opt in opts])
    return model, (list(engine.opts.optimizers) if several else engine.optimizer)


def _built(
    optimizer: OptimizerLike | Sequence[torch.optim.Optimizer] | None,
    model: nn.Module,
    cfg: ZeroConfig,
    call: str,
    stacklevel: int,
) -> list[torch.optim.Optimizer]:
    """The optimizers to bind, checked before anything is changed: each one's class and
    parameters, disjoint parameters and the settings that take one optimizer only."""
    if optimizer is None:
        return []
    given: list[Any] = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not given:
        raise ValueError(f"{call}: an empty list of optimizers; pass None to set the model up without one")
    opts = [build_optimizer(o, model) for o in given]
    for opt in opts:
        check_optimizer(opt, model, stacklevel=stacklevel)
        on_disk = [f for f, pol in (("offload_optimizer", optimizer_offload(cfg)), ("offload_param", param_offload(cfg)))
                   if isinstance(pol, OnDisk)]  # fmt: skip
        if any(whole_groups(opt)) and on_disk:
            raise ValueError(
                f"{call}: {type(opt).__name__} steps parameters whole on an owner rank (whole_params.py), which "
                f"{on_disk[0]}: {{device: nvme}} does not support (the disk tier's swap files hold master pieces, "
                f"not the owners' whole matrices); use {on_disk[0]}: {{device: cpu}}, or remove {on_disk[0]}"
            )
        if isinstance(optimizer_offload(cfg), OnDisk):
            base_step(opt)  # an optimizer subclass whose step the disk tier cannot split is refused now
    check_disjoint(opts, model, call)
    refuse_several(
        len(opts),
        loss_scaling=select_precision(cfg.precision).uses_loss_scaling,
        on_disk=isinstance(optimizer_offload(cfg), OnDisk),
        compression=cfg.compression.enabled,
        call=call,
    )
    return opts


def replace_optimizer(model: nn.Module, optimizer: OptimizerLike | Sequence[torch.optim.Optimizer]) -> Any:
    """Bind a new optimizer (built on ``model.parameters()``; or a list of them over disjoint
    parameters) to a model that ``initialize`` already manages, and return it, as a fresh
    optimizer would start under DDP: the previous optimizers' state is dropped and stepping a
    previous optimizer raises. For front-ends that set a model up for evaluation first and for
    training later (Lightning's ``validate`` then ``fit``)."""
    engine = get_engine(model)
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if any(getattr(o, "zero_engine", None) is not None for o in given):
        raise ValueError(
            "replace_optimizer(optimizer=...): this optimizer is already bound to a zero_strategy model; build a new one"
        )
    opts = _built(optimizer, model, engine.config, "replace_optimizer()", stacklevel=4)
    engine.set_optimizers([bind_optimizer(opt, engine) for opt in opts])
    return list(engine.opts.optimizers) if isinstance(optimizer, (list, tuple)) else engine.opts.optimizers[0]


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip by the global gradient norm over all ranks' shards, of every parameter of the model
    (with one optimizer the same as ``optimizer.clip_grad_norm_``)."""
    return get_engine(model).clip_grad_norm_(max_norm, norm_type)


def _engine_for(model: nn.Module | None, call: str) -> ZeroEngine:
    if model is not None:
        return get_engine(model)
    engines = live_engines()
    if not engines:
        raise RuntimeError(f"{call}: no model is managed by zero_strategy; call zero_strategy.initialize() first")
    if len(engines) > 1:
        raise RuntimeError(f"{call}: {len(engines)} zero_strategy models are live; pass model= to say which one")
    return engines[0]


def backward(loss: torch.Tensor, *, model: nn.Module | None = None, **kwargs: Any) -> None:
    """``loss.backward()`` with the engine's fp16 loss scale applied (plain backward otherwise)."""
    _engine_for(model, "zero_strategy.backward()").scale_loss(loss).backward(**kwargs)


def full_grad(model: nn.Module, param: torch.Tensor) -> torch.Tensor | None:
    """The full, averaged gradient of ``param`` (None if no rank had one). Collective."""
    return get_engine(model).full_grad(param)


@contextlib.contextmanager
def gathered_parameters(model_or_params: Any, modifier_rank: int | None = None) -> Iterator[None]:
    """Make full parameters available inside the block (ZeRO-3 gathers them; ZeRO-1/2 have
    them already). ``model_or_params``: the model, or parameters of one model. With
    ``modifier_rank``, that rank's changes made inside the block are written to every rank's
    shards and masters on exit. Collective: every rank enters it with the same arguments."""
    if isinstance(model_or_params, nn.Module):
        engine, params = get_engine(model_or_params), None
    else:
        params = [model_or_params] if isinstance(model_or_params, torch.Tensor) else list(model_or_params)
        owners = [e for e in live_engines() if any(e.reducer.manages(p) or id(p) in e.param_names() for p in params)]
        if len(owners) != 1:
            raise ValueError(
                f"gathered_parameters(): the parameters belong to {len(owners)} zero_strategy models; pass the model itself"
            )
        engine = owners[0]
    with engine.gathered_parameters(params, modifier_rank):
        yield


def destroy(model: nn.Module) -> nn.Module:
    """Undo :func:`initialize`: the model gets its own class back with ordinary full parameters
    (ZeRO-3 gathers them: a collective), no hooks, and the engine's buffers are freed. Returns
    the model. Its optimizer cannot step afterwards."""
    get_engine(model).destroy()
    return model


def memory_stats(model: nn.Module) -> dict[str, int]:
    """Bytes this rank holds for the model, by kind (see ``ZeroEngine.memory_stats``)."""
    return get_engine(model).memory_stats()
