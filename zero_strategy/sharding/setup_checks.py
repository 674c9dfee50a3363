"""Checks before an engine is built: the parameters can be sharded, every rank builds the same
model with the same config, and the precision suits the model's layers. Each raises an error
that names the parameter or field and the fix, on every rank at once where ranks differ."""

from __future__ import annotations

import json
import socket
import zlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from zero_strategy.comm import collectives as C
from zero_strategy.sharding.pieces import sharded_init_piece

__all__ = ["agree_on_setup", "check_params", "persistent_buffers", "refuse_norm_layers_with_running_stats"]


def check_params(named: list[tuple[str, nn.Parameter]], ctx: C.CommContext, owned: dict[int, str]) -> None:
    """Parameters the engine can shard: contiguous, real, on one device of the group's kind, and
    not already managed by another engine (``owned``: id(parameter) -> its model's class name)."""
    shared = next((n for n, p in named if id(p) in owned), None)
    if shared is not None:
        raise ValueError(
            f"initialize(): parameter '{shared}' already belongs to {owned[id(dict(named)[shared])]}, which "
            "zero_strategy manages; two engines would reduce and step the same parameter. Put both models "
            "into one module (e.g. an nn.ModuleDict) and initialize that once"
        )
    for n, p in named:
        if not p.is_contiguous() and sharded_init_piece(p) is None:
            raise ValueError(
                f"initialize(): parameter '{n}' is not contiguous (strides {p.stride()}); ZeRO shards flattened "
                "parameters, so make it contiguous first (e.g. model.to(memory_format=torch.contiguous_format))"
            )
        if p.device.type == "meta":
            raise ValueError(
                f"initialize(): parameter '{n}' is on the meta device (never materialised); build it on a real device"
            )
        if p.device != named[0][1].device:
            raise ValueError(
                f"initialize(): parameter '{n}' is on {p.device} but '{named[0][0]}' is on {named[0][1].device}; ZeRO "
                "shards one device's parameters per rank: move the model to one device before initialize()"
            )
        if p.device.type != ctx.device.type:
            raise ValueError(
                f"initialize(): parameter '{n}' is on {p.device} but the process group communicates on "
                f"{ctx.device.type}; move the model with model.to('{ctx.device}') before initialize()"
            )


def agree_on_setup(ctx: C.CommContext, settings: Mapping[str, Any], named: list[tuple[str, nn.Parameter]]) -> None:
    """One small all-gather at initialize: every rank must have the same config (``settings``:
    its resolved values, ``ZeroConfig.to_dict()``) and the same
    parameters (names, shapes, dtypes, trainable or not), and on CUDA its own (host, device).
    Otherwise every rank raises, naming the first difference, instead of the engines issuing
    collectives that do not match."""
    if not ctx.distributed:
        return
    desc = {
        "config": json.dumps(dict(settings), sort_keys=True, default=str),
        "params": [
            f"{n} {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}{'' if p.requires_grad else ' frozen'}"
            for n, p in named
        ],
    }
    digest = zlib.crc32(json.dumps(desc, sort_keys=True).encode())
    device = (socket.gethostname(), ctx.device.index) if ctx.device.type == "cuda" else None
    seen = C.all_gather_objects(ctx, (digest, device), what="initialize() agreement on the model and config")
    if ctx.device.type == "cuda":
        places: dict[Any, list[int]] = {}
        for r, (_, where) in enumerate(seen):
            places.setdefault(tuple(where), []).append(r)
        shared = [(where, ranks) for where, ranks in places.items() if len(ranks) > 1]
        if shared:
            (host, index), ranks = shared[0]
            raise RuntimeError(
                f"initialize(): ranks {ranks} all use cuda:{index} on host {host}; give every process its own GPU with "
                "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init_process_group()"
            )
    if len({d for d, _ in seen}) == 1:
        return
    everyone = C.all_gather_objects(ctx, desc, what="initialize() differences")
    for key in ("config", "params"):
        values = [e[key] for e in everyone]
        if all(v == values[0] for v in values):
            continue
        r = next(i for i, v in enumerate(values) if v != values[0])
        if key == "config":
            a, b = json.loads(values[0]), json.loads(values[r])
            field = next(k for k in a if a[k] != b.get(k))
            detail = f"config field {field!r} is {a[field]!r} on rank 0 but {b.get(field)!r} on rank {r}"
        else:
            a, b = values[0], values[r]
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            detail = (f"parameter #{i} is '{a[i] if i < len(a) else 'missing'}' on rank 0 but "
                      f"'{b[i] if i < len(b) else 'missing'}' on rank {r}")  # fmt: skip
        raise ValueError(
            f"initialize(): the ranks disagree: {detail}. Every rank must build the same model and pass the same "
            "config (seed and construct identically; read the same config file)"
        )


def refuse_norm_layers_with_running_stats(module: nn.Module, param_dtype: torch.dtype | None) -> None:
    """16-bit parameters: a BatchNorm's fp32 running statistics next to 16-bit weights fail in
    its kernel (FSDP keeps such modules in fp32; not done here). Mixed precision keeps fp32
    parameters, so BatchNorm is fine there."""
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats and m.affine:
            raise ValueError(
                f"initialize(): precision with 16-bit parameters ({param_dtype}) stores them in 16 "
                f"bits, but '{name or type(m).__name__}' ({type(m).__name__}) keeps fp32 running statistics beside "
                "its weights; use mixed precision instead ('bf16-mixed' / '16-mixed': fp32 parameters under "
                "autocast), or replace the BatchNorm layers (e.g. GroupNorm/LayerNorm)"
            )


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``state_dict()`` holds (non-persistent ones, such as RoPE's recomputed
    ``inv_freq``, are not saved or loaded): what the engine broadcasts, loads and checkpoints."""
    names = set(module.state_dict(keep_vars=True))
    return {n: b for n, b in module.named_buffers() if n in names}
