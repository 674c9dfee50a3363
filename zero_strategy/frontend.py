"""What every front-end (Lightning's strategies, the Accelerate plugin) does alike where its own
arguments meet the config file: the precision flags it accepts, its arguments over the file's
settings, adopting the file's ``gradient_accumulation_steps``, and the config the engine gets;
and, for several optimizers on one model, the model parameters each one steps.

A front-end's defaults ("32-true"/"no", accumulation 1) count as "not given", so the file's
values then apply; a value given on both sides that differs raises (``resolve_overrides``).
The front-end runs the accumulation loop itself, so the engine never accumulates on its own.
Front-end names are the keys of ``zero_strategy.config.FRONTEND_PRECISION``.

Shard groups: a front-end's ``shard_size=`` takes a number, ``"node"`` or a ``DeviceMesh``
(``split_shard_size``: the mesh goes to ``initialize(mesh=...)``, its shard size into the
config); Accelerate's ``ParallelismConfig`` maps to ``shard_size = dp_shard_size``
(``parallelism_shard_size``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import zero_strategy as zs
from zero_strategy.comm.collectives import mesh_groups
from zero_strategy.config import FRONTEND_PRECISION
from zero_strategy.runtime.optimizer import engine_of
from zero_strategy.runtime.shard_layout import mesh_shard_size

__all__ = [
    "accumulation_to_adopt",
    "apply_frontend_settings",
    "format_precision_flags",
    "frontend_engine_config",
    "optimizer_parameters",
    "parallelism_shard_size",
    "precision_flags",
    "split_shard_size",
]


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The model parameters a bound optimizer steps, in its ``param_groups`` order (which hold
    this rank's master pieces instead). Front-ends that set ``requires_grad`` per optimizer
    (Lightning's ``toggle_optimizer``) act on these."""
    engine = engine_of(optimizer)
    param_of = {id(m): p for g in engine.groups for p, m in zip(g.params, g.masters)}
    names = {id(p): p for p in engine.module.parameters()}
    out = []
    for group in optimizer.param_groups:
        for m in group["params"]:
            p = param_of.get(id(m), names.get(id(m)))  # a frozen parameter is kept as itself
            if p is not None:
                out.append(p)
    return out


def precision_flags(frontend: str) -> tuple[str, ...]:
    """The precision flags ``frontend`` accepts, one per precision (aliases such as Lightning's
    ``"32"`` for ``"32-true"`` left out), in the order of ``FRONTEND_PRECISION``."""
    try:
        table = FRONTEND_PRECISION[frontend]
    except KeyError:
        raise ValueError(
            f"precision_flags({frontend!r}): unknown front-end; use one of {sorted(FRONTEND_PRECISION)}"
        ) from None
    flags: list[str] = []
    names: list[str | None] = []
    for flag, name in table.items():
        if name not in names:
            names.append(name)
            flags.append(flag)
    return tuple(flags)


def format_precision_flags(frontend: str, *, sep: str = ", ", last: str = " or ") -> str:
    """``precision_flags(frontend)`` quoted for a message: ``'no', 'bf16' or 'fp16'``
    (``sep=" | ", last=" | "`` gives ``'32-true' | 'bf16-mixed' | ...``)."""
    quoted = [repr(flag) for flag in precision_flags(frontend)]
    return sep.join(quoted[:-1]) + last + quoted[-1] if len(quoted) > 1 else "".join(quoted)


def apply_frontend_settings(
    cfg: zs.ZeroConfig, *, source: str, precision: str | None, accumulation: int, **explicit: Any
) -> zs.ZeroConfig:
    """The front-end's arguments applied over ``cfg``; a conflicting value in the file raises.

    Args:
        cfg: the strategy's or plugin's config (from the file, or the defaults).
        source: the call that gave the arguments, named in a conflict's message.
        precision: the engine's precision name for the front-end's flag (``frontend_precision``),
            None for the front-end's default: the file's precision then applies.
        accumulation: the front-end's gradient accumulation; its default 1 counts as "not
            given", so the file's ``gradient_accumulation_steps`` then applies.
        **explicit: other ZeroConfig fields the front-end sets (None: not given).
    """
    doubled = sorted(explicit.keys() & {"precision", "gradient_accumulation_steps"})
    if doubled:
        raise TypeError(
            f"apply_frontend_settings({'=..., '.join(doubled)}=...): give the front-end's precision as precision= "
            "and its accumulation as accumulation="
        )
    # in this order: with several conflicts, the precision's is reported first, accumulation's last
    given: dict[str, Any] = {"precision": precision, **explicit}
    given["gradient_accumulation_steps"] = accumulation if accumulation != 1 else None
    return zs.resolve_overrides(cfg, source=source, **given)


def accumulation_to_adopt(cfg: zs.ZeroConfig, frontend_steps: int) -> int | None:
    """The file's ``gradient_accumulation_steps`` for a front-end that runs its default (1) and
    must now run the file's setting itself (Lightning's ``accumulate_grad_batches``, the
    Accelerator's ``gradient_accumulation_steps``); None when there is nothing to adopt. ``cfg``
    has been through ``apply_frontend_settings``, so the two values never disagree otherwise."""
    steps = cfg.gradient_accumulation_steps
    if steps not in (None, 1) and frontend_steps == 1:
        return steps
    return None


def frontend_engine_config(cfg: zs.ZeroConfig, *, frontend_clips: bool = False) -> zs.ZeroConfig:
    """The config the engine gets under a front-end: the front-end runs the accumulation loop
    (loss division, ``no_sync``, skipped steps), so the engine does not accumulate; when the
    front-end also clips (``frontend_clips``), the engine must not clip a second time."""
    changes: dict[str, Any] = {"gradient_accumulation_steps": None}
    if frontend_clips:
        changes["gradient_clipping"] = None
    return cfg.replace(**changes)


def split_shard_size(value: Any, call: str) -> tuple[Any, Any]:
    """A front-end's ``shard_size=`` as ``(the config's shard_size, the mesh for initialize)``: a
    ``DeviceMesh`` gives its shard size (dim 1; checked as ``initialize`` checks it) and itself,
    anything else (a number, ``"node"``, None) itself and no mesh."""
    if mesh_groups(value) is None:
        return value, None
    return mesh_shard_size(value, call), value


def parallelism_shard_size(pc: Any, call: str) -> int | None:
    """Accelerate's ``ParallelismConfig(dp_replicate_size, dp_shard_size)`` as ``shard_size``:
    ``dp_shard_size`` when it is above 1 (HSDP: shard groups of that many ranks, replicated
    ``dp_replicate_size`` times; 1 is Accelerate's default, read as "not given"). Tensor, context
    and sequence parallelism are refused: the engine shards data parallel only."""
    if pc is None:
        return None
    for name in ("tp_size", "cp_size", "sp_size"):
        size = getattr(pc, name, None) or 1
        if size > 1:
            raise ValueError(
                f"{call}: ParallelismConfig({name}={size}) is not supported: zero_strategy shards data parallel "
                f"only. Set {name}=1 and split the ranks as dp_replicate_size x dp_shard_size (shard groups of "
                "dp_shard_size ranks)"
            )
    shard = int(getattr(pc, "dp_shard_size", None) or 1)
    return shard if shard > 1 else None
