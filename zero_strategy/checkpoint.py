"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

One saved layout whatever the stage and world size: every trainable parameter is saved as
the fp32 master of its *flattened* tensor, ``model.<fqn>``, as a DTensor ``Shard(0)`` whose
local piece is this rank's ``torch.chunk`` piece (the engine's layout at every stage), so DCP
writes each piece once and reshards on load to any world size and stage. Per-element
optimizer state is saved the same way (``optim.<fqn>.<key>``); other optimizer state
(``step``) and buffers (those ``state_dict()`` holds) are plain, replicated tensors. Frozen
parameters are flattened too: ZeRO-3 pieces (DTensors) or, at ZeRO-1/2, the full flat tensor. The original shapes
are in ``zero_meta.json`` beside the DCP files.

DCP treats a plain tensor as replicated (a per-rank piece saved as a plain tensor would be
replaced by rank 0's on load), which is why the pieces are DTensors.

Saves are atomic: ``save_checkpoint(root, ...)`` writes a versioned subdirectory
``root/<tag>`` (default ``step-<n>``), records every file's size in its metadata, and only
then replaces the small pointer file ``root/latest`` (write to a temporary file, then
``os.replace``). A process killed in the middle of a save leaves the previous checkpoint,
and the pointer to it, intact. ``load_checkpoint(root)`` follows ``latest``; it also accepts a
versioned subdirectory itself. A truncated file fails the load with an error naming it.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from zero_strategy import collectives as C
from zero_strategy.engine import ZeroEngine, get_engine, persistent_buffers
from zero_strategy.unit import ShardedParams

__all__ = ["load_checkpoint", "read_checkpoint_object", "save_checkpoint"]

META = "zero_meta.json"
LATEST = "latest"
FORMAT = 2  # 2: frozen parameters saved flattened (sharded at ZeRO-3)

# Fault injection for tests: called as FAULT_HOOK(point, rank) at "before_write",
# "after_write" and "before_latest"; a test can kill the process there.
FAULT_HOOK: Callable[[str, int], None] | None = None


def _fault(point: str, rank: int) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(point, rank)


def _mesh(engine: ZeroEngine) -> DeviceMesh | None:
    if not dist.is_initialized():
        return None
    group = engine.ctx.group if engine.ctx.group is not None else dist.group.WORLD
    return DeviceMesh.from_group(group, engine.ctx.device.type)


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` over exactly its own memory, without a copy, where ``t`` is a view into a larger CPU
    storage (a master piece inside a unit row or a full parameter). DCP's writer clones such a
    view before writing it and keeps every clone until the rank's file is closed: one extra
    copy of the rank's shard. Dtypes numpy lacks (bf16) stay views."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() == t.nbytes:
        return t
    try:
        return torch.from_numpy(t.detach().numpy())
    except (TypeError, RuntimeError):
        return t


def _piece(engine: ZeroEngine, mesh: DeviceMesh | None, local: torch.Tensor, numel: int) -> torch.Tensor:
    local = _compact(local)
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
        if id(p) in managed:
            continue
        # frozen: flattened too, so a ZeRO-3 run's pieces and a ZeRO-1/2 run's full tensor reshard
        where = engine.params.unit_of(p) if isinstance(engine.params, ShardedParams) else None
        if where is not None:
            unit, i = where
            sd[f"model.{fqn}"] = _piece(engine, mesh, unit.piece(i), p.numel())
        else:
            sd[f"model.{fqn}"] = p.data.view(-1)
    for fqn, b in persistent_buffers(engine.module).items():  # what state_dict() holds
        sd[f"model.{fqn}"] = b
    sd["engine.step_count"] = torch.tensor(engine.step_count, dtype=torch.int64)
    sd["engine.loss_scale"] = torch.tensor(engine.scaler.scale, dtype=torch.float64)
    return sd


def save_checkpoint(
    root: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    *,
    tag: str | None = None,
    objects: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> str:
    """Write a sharded checkpoint into ``root/<tag>`` (every rank writes its own pieces), then
    point ``root/latest`` at it. Returns the checkpoint directory. Collective.

    ``extra``: a JSON-serialisable dict, returned by :func:`load_checkpoint`. ``objects``: name
    -> any picklable object (a front-end's training state), written by rank 0 as
    ``<name>.pt`` inside the versioned directory before ``latest`` moves, so it is covered by
    the same atomicity and size checks; read back with :func:`read_checkpoint_object`.
    ``keep_last``: after the pointer moved, remove all but the newest ``keep_last`` versioned
    directories under ``root``."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"save_checkpoint(keep_last={keep_last}): keep at least 1 checkpoint, or pass None to keep all")
    for name in objects or {}:
        if not name.isidentifier():
            raise ValueError(f"save_checkpoint(objects={{{name!r}: ...}}): use a plain identifier as the name")
    engine = get_engine(model)
    engine.reducer.wait_all()
    explicit = tag is not None
    tag = tag or f"step-{engine.step_count}"
    if os.sep in tag or tag in ("", ".", "..", LATEST):
        raise ValueError(f"save_checkpoint(tag={tag!r}): use a plain directory name such as 'step-1000'")
    root = os.fspath(root)
    rank = engine.ctx.rank
    # Rank 0 alone chooses the directory (a second save at the same step gets a suffix; a save
    # never writes into an existing checkpoint) and pickles the objects; one all-reduce tells
    # every rank its choice and whether it worked, before any rank writes (DCP creates the
    # directory on each rank), so a failure raises everywhere instead of hanging the others.
    suffix, conflict = 0, 0
    blobs: dict[str, bytes] = {}
    failure: BaseException | None = None
    if rank == 0:
        if os.path.exists(os.path.join(root, tag)):
            conflict = int(explicit)
            suffix = 1
            while os.path.exists(os.path.join(root, f"{tag}.{suffix}")):
                suffix += 1
        try:
            for name, obj in (objects or {}).items():
                buf = io.BytesIO()
                torch.save(obj, buf)
                blobs[name] = buf.getvalue()
        except Exception as exc:  # reported on every rank below
            failure = exc
    flags = torch.tensor([int(failure is not None), suffix, conflict], dtype=torch.int64, device=engine.ctx.device)
    C.all_reduce(engine.ctx, flags, op="max", what="save_checkpoint start").wait()
    failed, suffix, conflict = (int(v) for v in flags.tolist())
    if conflict:
        raise ValueError(
            f"save_checkpoint(tag={tag!r}): {os.path.join(root, tag)!r} exists; a save never writes into an "
            "existing checkpoint (it could be the one `latest` names). Pick a new tag or remove it"
        )
    if failed:
        raise RuntimeError(
            f"save_checkpoint(objects=...): rank 0 could not pickle the objects ({failure!r}); save only "
            "picklable objects"
        ) from failure
    tag = f"{tag}.{suffix}" if suffix else tag
    path = os.path.join(root, tag)
    _fault("before_write", rank)
    dcp.save(_state(engine, optimizer, None), checkpoint_id=path, process_group=engine.ctx.group)
    failure = None
    if rank == 0:
        try:
            for name, blob in blobs.items():
                tmp = os.path.join(path, f".{name}.pt.tmp")
                with open(tmp, "wb") as f:
                    f.write(blob)
                os.replace(tmp, os.path.join(path, f"{name}.pt"))
        except Exception as exc:
            failure = exc
    _fault("after_write", rank)
    # every rank's files are complete before their sizes are recorded
    _agree(engine, failure, "save_checkpoint: writing the objects")
    failure = None
    if rank == 0:
        try:
            _write_meta(engine, optimizer, extra, path)
            _fault("before_latest", rank)
            _write_atomic(os.path.join(root, LATEST), tag + "\n")
            if keep_last is not None:
                _prune(root, tag, keep_last)
        except Exception as exc:
            failure = exc
    _agree(engine, failure, "save_checkpoint: writing the metadata")  # complete before anyone reads it
    return path


def _agree(engine: ZeroEngine, failure: BaseException | None, what: str) -> None:
    """A collective: raise on every rank if ``failure`` happened on any (here: rank 0)."""
    flag = torch.tensor([int(failure is not None)], dtype=torch.int32, device=engine.ctx.device)
    C.all_reduce(engine.ctx, flag, op="max", what=what).wait()
    if bool(flag.item()):
        detail = f": {failure!r}" if failure is not None else " on rank 0 (its log has the cause)"
        raise RuntimeError(f"{what} failed{detail}; the previous checkpoint and `latest` are unchanged") from failure


def _write_meta(engine: ZeroEngine, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any] | None, path: str) -> None:
    shapes = {n: list(p.shape) for n, p in engine.module.named_parameters()}
    names = engine.param_names()
    tensors = engine.module.state_dict(keep_vars=True)
    aliases = {n: names[id(t)] for n, t in tensors.items() if id(t) in names and names[id(t)] != n}
    meta = {
        "format": FORMAT,
        "stage": engine.config.stage,
        "world_size": engine.ctx.world_size,
        "torch": torch.__version__,
        "zero_strategy": _version(),
        "config": engine.config.to_dict(),
        "shapes": shapes,
        "extra": extra or {},
        # optimizer hyperparameters by group (lr as an LR scheduler left it, betas, ...)
        "param_groups": _group_settings(optimizer),
        # for export: every state_dict name (tied weights under each), its shape, and the
        # saved name it is an alias of
        "state_names": list(tensors),
        "state_shapes": {n: list(t.shape) for n, t in tensors.items()},
        "aliases": aliases,
        "files": {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path))},
    }
    _write_atomic(os.path.join(path, META), json.dumps(meta, indent=1, default=str))


def _group_settings(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]] | None:
    if optimizer is None:
        return None
    out = []
    for group in optimizer.param_groups:
        kept: dict[str, Any] = {}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, tuple):
                value = list(value)
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue  # not a plain setting; the optimizer's construction provides it
            kept[key] = value
        out.append(kept)
    return out


def _restore_group_settings(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]], path: str) -> None:
    for group, values in zip(optimizer.param_groups, saved):
        for key, value in values.items():
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                if value is not None:
                    current.fill_(value)
            elif isinstance(current, tuple):
                group[key] = tuple(value)
            else:
                group[key] = value


def _prune(root: str, current: str, keep_last: int) -> None:
    """Remove the oldest complete versioned directories beyond ``keep_last`` (never ``current``),
    and the remains of saves that died before their metadata (a directory holding DCP files
    but no ``zero_meta.json``, older than ``current``)."""
    import shutil

    def complete(d: str) -> bool:
        return os.path.exists(os.path.join(root, d, META))

    def partial(d: str) -> bool:
        full = os.path.join(root, d)
        return os.path.isdir(full) and not complete(d) and any(n.endswith(".distcp") for n in os.listdir(full))

    now = os.path.getmtime(os.path.join(root, current, META))
    versions = [d for d in os.listdir(root) if d != current and complete(d)]
    versions.sort(key=lambda d: os.path.getmtime(os.path.join(root, d, META)))
    doomed = versions[: max(0, len(versions) - (keep_last - 1))]
    doomed += [d for d in os.listdir(root) if d != current and partial(d) and os.path.getmtime(os.path.join(root, d)) < now]
    for d in doomed:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def read_checkpoint_object(path: str | os.PathLike[str], name: str, *, weights_only: bool = False) -> Any:
    """An object saved with ``save_checkpoint(..., objects={name: obj})`` (``path``: the root,
    whose ``latest`` is followed, or a versioned directory). Not collective. The file is a
    pickle: load only checkpoints you trust, or pass ``weights_only=True``."""
    path, meta = _read_meta(path, "read_checkpoint_object()")
    file = f"{name}.pt"
    if file not in meta.get("files", {}):
        saved = sorted(n[:-3] for n in meta.get("files", {}) if n.endswith(".pt"))
        raise ValueError(f"read_checkpoint_object(): checkpoint {path!r} has no object {name!r} (it has {saved})")
    _check_files(path, {"files": {file: meta["files"][file]}})
    return torch.load(os.path.join(path, file), map_location="cpu", weights_only=weights_only)


def _version() -> str:
    import zero_strategy

    return zero_strategy.__version__


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _resolve(path: str) -> str:
    pointer = os.path.join(path, LATEST)
    if os.path.exists(pointer):
        with open(pointer) as f:
            return os.path.join(path, f.read().strip())
    return path


def _read_meta(path: str | os.PathLike[str], caller: str) -> tuple[str, dict[str, Any]]:
    """The versioned directory ``path`` names (following ``latest``) and its metadata."""
    path = _resolve(os.fspath(path))
    meta_path = os.path.join(path, META)
    if not os.path.exists(meta_path):
        raise ValueError(f"{caller}: {path!r} is not a zero_strategy checkpoint (no {META})")
    with open(meta_path) as f:
        return path, json.load(f)


def _check_files(path: str, meta: dict[str, Any]) -> None:
    for name, size in meta.get("files", {}).items():
        full = os.path.join(path, name)
        if not os.path.exists(full):
            raise RuntimeError(f"load_checkpoint(): shard file {full!r} is missing; the checkpoint is incomplete")
        if os.path.getsize(full) != size:
            raise RuntimeError(
                f"load_checkpoint(): shard file {full!r} has {os.path.getsize(full)} bytes, {size} were written; "
                "it is truncated or corrupted (load an earlier checkpoint)"
            )


def load_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``path``: its root, whose
    ``latest`` is followed, or a versioned subdirectory) at any world size and stage into this
    model (and optimizer). The optimizer's param-group settings (lr as a scheduler left it,
    betas, weight decay, ...) are restored too, replacing the ones it was built with. Returns
    the ``extra`` dict that was saved. Collective."""
    engine = get_engine(model)
    path, meta = _read_meta(path, "load_checkpoint()")
    shapes = {n: list(p.shape) for n, p in engine.module.named_parameters()}
    for name, shape in shapes.items():
        if meta["shapes"].get(name) != shape:
            raise ValueError(
                f"load_checkpoint(): parameter '{name}' has shape {shape} in the model but "
                f"{meta['shapes'].get(name, 'no entry')} in the checkpoint {path!r}; load a checkpoint of this model"
            )
    _check_files(path, meta)
    groups = meta.get("param_groups")
    if optimizer is not None and groups is not None and len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"load_checkpoint(): the optimizer has {len(optimizer.param_groups)} parameter groups but the checkpoint "
            f"{path!r} has {len(groups)}; build the optimizer with the same groups as the saved run"
        )
    engine.reducer.wait_all()
    saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    want = {k for k in saved if k.startswith("optim.")} if optimizer is not None else None
    sd = _state(engine, optimizer, want)
    dcp.load(sd, checkpoint_id=path, process_group=engine.ctx.group)
    engine.step_count = int(sd["engine.step_count"])
    engine.scaler.scale = float(sd["engine.loss_scale"]) if engine.scaler.enabled else engine.scaler.scale
    engine.params.after_step(engine)  # full parameters / unit rows follow the loaded masters
    if optimizer is not None and meta.get("param_groups") is not None:
        _restore_group_settings(optimizer, meta["param_groups"], path)
    return dict(meta.get("extra", {}))
