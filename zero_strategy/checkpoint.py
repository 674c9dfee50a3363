"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

One saved layout whatever the stage and world size: every trainable parameter is saved as
the fp32 master of its *flattened* tensor, ``model.<fqn>``, as a DTensor ``Shard(0)`` whose
local piece is this rank's ``torch.chunk`` piece (the engine's layout at every stage), so DCP
writes each piece once and reshards on load to any world size and stage. Per-element
optimizer state is saved the same way (``optim.<fqn>.<key>``); other optimizer state
(``step``), frozen parameters and buffers are plain, replicated tensors. The original shapes
are in ``zero_meta.json`` beside the DCP files.

DCP treats a plain tensor as replicated (a per-rank piece saved as a plain tensor would be
replaced by rank 0's on load), which is why the pieces are DTensors.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from zero_strategy import collectives as C
from zero_strategy.engine import ZeroEngine, get_engine

__all__ = ["load_checkpoint", "save_checkpoint"]

META = "zero_meta.json"
FORMAT = 1


def _mesh(engine: ZeroEngine) -> DeviceMesh | None:
    if not dist.is_initialized():
        return None
    group = engine.ctx.group if engine.ctx.group is not None else dist.group.WORLD
    return DeviceMesh.from_group(group, engine.ctx.device.type)


def _piece(engine: ZeroEngine, mesh: DeviceMesh | None, local: torch.Tensor, numel: int) -> torch.Tensor:
    if mesh is None:  # one process without a group: the piece is the whole flattened tensor
        return local
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,))


def _state(engine: ZeroEngine, optimizer: torch.optim.Optimizer | None, want_optim: set[str] | None) -> dict[str, Any]:
    """The DCP state dict; its tensors alias the engine's own storage where possible.

    ``want_optim``: on load, the optimizer keys present in the checkpoint, created (zeros) where
    the optimizer has no state yet, so DCP can load into them."""
    mesh = _mesh(engine)
    sd: dict[str, Any] = {}
    names = engine.param_names()
    for g in engine.groups:
        for i, (p, m) in enumerate(zip(g.params, g.masters)):
            fqn, numel = names[id(p)], g.layout.numels[i]
            sd[f"model.{fqn}"] = _piece(engine, mesh, m.data, numel)
            if optimizer is None:
                continue
            state = optimizer.state[m]
            if want_optim is not None:
                prefix = f"optim.{fqn}."
                for key in [k[len(prefix) :] for k in want_optim if k.startswith(prefix)]:
                    if key not in state:
                        state[key] = torch.zeros((), dtype=torch.float32) if key == "step" else torch.zeros_like(m.data)
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                per_element = value.shape == m.shape and key != "step"
                sd[f"optim.{fqn}.{key}"] = _piece(engine, mesh, value, numel) if per_element else value
    managed = {id(p) for g in engine.groups for p in g.params}
    for fqn, p in engine.module.named_parameters():
        if id(p) not in managed:
            sd[f"model.{fqn}"] = p.data
    for fqn, b in engine.module.named_buffers():
        sd[f"model.{fqn}"] = b
    sd["engine.step_count"] = torch.tensor(engine.step_count, dtype=torch.int64)
    sd["engine.loss_scale"] = torch.tensor(engine.scaler.scale, dtype=torch.float64)
    return sd


def save_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, extra: dict[str, Any] | None = None) -> None:
    """Write a sharded checkpoint directory: every rank writes its own pieces. Collective."""
    engine = get_engine(model)
    engine.reducer.wait_all()
    path = os.fspath(path)
    dcp.save(_state(engine, optimizer, None), checkpoint_id=path, process_group=engine.ctx.group)
    if engine.ctx.rank == 0:
        shapes = {n: list(p.shape) for n, p in engine.module.named_parameters()}
        meta = {
            "format": FORMAT,
            "stage": engine.config.stage,
            "world_size": engine.ctx.world_size,
            "torch": torch.__version__,
            "config": engine.config.to_dict(),
            "shapes": shapes,
            "extra": extra or {},
        }
        with open(os.path.join(path, META), "w") as f:
            json.dump(meta, f, indent=1, default=str)
    C.barrier(engine.ctx)  # the metadata exists before anyone reads it


def load_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` at any world size and stage into
    this model (and optimizer). Returns the ``extra`` dict that was saved. Collective."""
    engine = get_engine(model)
    path = os.fspath(path)
    meta_path = os.path.join(path, META)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"load_checkpoint(): {path!r} is not a zero_strategy checkpoint (no {META})")
    with open(meta_path) as f:
        meta = json.load(f)
    shapes = {n: list(p.shape) for n, p in engine.module.named_parameters()}
    for name, shape in shapes.items():
        if meta["shapes"].get(name) != shape:
            raise ValueError(
                f"load_checkpoint(): parameter '{name}' has shape {shape} in the model but "
                f"{meta['shapes'].get(name, 'no entry')} in the checkpoint {path!r}; load a checkpoint of this model"
            )
    engine.reducer.wait_all()
    saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    want = {k for k in saved if k.startswith("optim.")} if optimizer is not None else None
    sd = _state(engine, optimizer, want)
    dcp.load(sd, checkpoint_id=path, process_group=engine.ctx.group)
    engine.step_count = int(sd["engine.step_count"])
    engine.scaler.scale = float(sd["engine.loss_scale"]) if engine.scaler.enabled else engine.scaler.scale
    engine.params.after_step(engine)  # full parameters / unit rows follow the loaded masters
    return dict(meta.get("extra", {}))
