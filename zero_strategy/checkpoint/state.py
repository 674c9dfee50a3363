"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

One saved layout whatever the stage and world size: every trainable parameter is saved as
the fp32 master of its *flattened* tensor, ``model.<fqn>``, as a DTensor ``Shard(0)`` whose
local piece is this rank's ``torch.chunk`` piece (the engine's layout at every stage), so DCP
writes each piece once and reshards on load to any world size and stage. Per-element
optimizer state is saved the same way (``optim.<fqn>.<key>``); other optimizer state
(``step``) and buffers (those ``state_dict()`` holds) are plain, replicated tensors. Frozen
parameters are flattened too: ZeRO-3 pieces (DTensors) or, at ZeRO-1/2, the full flat tensor.
The original shapes are in ``zero_meta.json`` beside the DCP files.

DCP treats a plain tensor as replicated (a per-rank piece saved as a plain tensor would be
replaced by rank 0's on load), which is why the pieces are DTensors.

Saves are atomic and durable: ``save_checkpoint(root, ...)`` writes a versioned subdirectory
``root/<tag>`` (default ``step-<n>``) that rank 0 created exclusively (a second job saving into
the same root gets another one), records every file's size and CRC32 in its metadata, fsyncs
files and directories, and only then replaces the small pointer file ``root/latest`` (a
temporary file, then ``os.replace``). A process killed at any point of a save leaves the
previous checkpoint, and the pointer to it, intact; a failed save removes its directory.
``load_checkpoint(root)`` follows ``latest`` (a plain name inside the root; nothing else is
followed); it also accepts a versioned subdirectory itself. A missing, truncated or corrupted
file fails the load on every rank with an error naming it, and no file is unpickled with code
execution (see ``files.py``; the directories and pointers are ``versions.py``).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from zero_strategy._version import __version__
from zero_strategy.checkpoint.dcp_pieces import ScatteredPiece, UnevenPiece
from zero_strategy.checkpoint.deepspeed_files import is_deepspeed_checkpoint
from zero_strategy.checkpoint.files import (
    OWNER,
    CheckpointFileError,
    SafeFileSystemReader,
    checksumming_writer,
    single_process_quiet,
    verify_checksums,
    write_atomic,
)
from zero_strategy.checkpoint.foreign import is_foreign_dcp, is_imported, load_foreign
from zero_strategy.checkpoint.optim_state import fresh_state, group_settings, restore_group_settings, saved_groups
from zero_strategy.checkpoint.progress import dir_bytes, log
from zero_strategy.checkpoint.versions import (
    COMPLETE,
    LATEST,
    META,
    _create_version_dir,
    _file_records,
    _pointer_name,
    _prune,
    read_meta,
)
from zero_strategy.comm import collectives as C
from zero_strategy.runtime.engine import ZeroEngine
from zero_strategy.runtime.module import get_engine
from zero_strategy.sharding.setup_checks import persistent_buffers

__all__ = ["load_checkpoint", "save_checkpoint"]

# 2: frozen parameters saved flattened (sharded at ZeRO-3); 3: CRC32 of every file; 4: the fp16
# loss scaler's counters; 5: top-k residuals per parameter (``compression.world<N>.<fqn>``)
FORMAT = 5

# Fault injection for tests: called as FAULT_HOOK(point, rank) at "before_write",
# "after_write" and "before_latest"; a test can kill the process there.
FAULT_HOOK: Callable[[str, int], None] | None = None


def _fault(point: str, rank: int) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(point, rank)


class _Meshes:
    """One DeviceMesh per device type over the engine's group, made on first need: a piece's
    DTensor must name the device the piece is on (``DTensor.from_local`` copies a tensor to
    its mesh's device, so an offloaded host piece on a "cuda" mesh would be saved from, and
    loaded into, a temporary GPU copy)."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.group = None
        if dist.is_initialized():
            self.group = engine.ctx.group if engine.ctx.group is not None else dist.group.WORLD
            if self.group is None:
                raise RuntimeError(
                    "zero_strategy checkpoints: torch.distributed is initialized but has no default process group; "
                    "call torch.distributed.init_process_group() before saving or loading"
                )
        self._by_type: dict[str, DeviceMesh] = {}

    def __call__(self, device_type: str) -> DeviceMesh | None:
        if self.group is None:
            return None
        if device_type not in self._by_type:
            self._by_type[device_type] = DeviceMesh.from_group(self.group, device_type)
        return self._by_type[device_type]


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


def _piece(
    engine: ZeroEngine, meshes: _Meshes, local: torch.Tensor, numel: int, offset: int | None = None
) -> torch.Tensor:
    """This rank's piece of a flat tensor of ``numel`` elements, for DCP: a ``Shard(0)`` DTensor
    (``torch.chunk``'s offsets), or with ``offset`` (load-balanced, uneven pieces) an
    :class:`UnevenPiece` that records where the piece really starts."""
    local = _compact(local)
    mesh = meshes(local.device.type)
    if mesh is None:  # one process without a group: the piece is the whole flattened tensor
        return local
    if offset is not None:
        return UnevenPiece(local, offset, numel)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,))


OptimizerArg = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def _optimizers(
    optimizer: OptimizerArg, engine: ZeroEngine | None = None, call: str = ""
) -> list[torch.optim.Optimizer]:
    """The optimizers given to a save or a load: none, one, or several over disjoint parameters
    (their state is saved by parameter name, so one checkpoint holds all of them). With
    ``engine``: when the model trains with several optimizers, all of them, each once (a subset
    would drop the others' state, and state looked up for a master another optimizer steps)."""
    if optimizer is None:
        return []
    given: list[torch.optim.Optimizer] = (
        list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]  # type: ignore[list-item]  # narrowed by isinstance
    )
    if engine is not None and (len(engine.opts) > 1 or len(given) > 1):
        bound = {id(o.param_groups) for o in engine.opts.optimizers}
        keys = [id(o.param_groups) for o in given]
        if len(set(keys)) != len(keys) or set(keys) != bound:
            raise ValueError(
                f"{call}: the model trains with {len(engine.opts)} optimizer(s) and {len(given)} were given; pass "
                "every optimizer the model was initialized with, each once (a subset would leave the others' state "
                "out of the checkpoint)"
            )
    return given


def _owned_names(engine: ZeroEngine, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the parameters ``optimizer`` steps (what ties a saved optimizer's settings to
    the optimizer that loads them, whatever order the optimizers are given in)."""
    names = engine.param_names()
    of_master = {id(m): names[id(p)] for g in engine.groups for p, m in zip(g.params, g.masters)}
    of_master.update({id(e.proxy): names[id(e.param)] for e in engine.whole.entries})  # stepped whole
    return sorted(of_master[id(m)] for group in optimizer.param_groups for m in group["params"] if id(m) in of_master)


def _groups_in_given_order(
    engine: ZeroEngine, meta: dict[str, Any], optimizers: list[torch.optim.Optimizer], path: str
) -> list[list[dict[str, Any]]] | None:
    """The saved param-group settings, one list per given optimizer: matched by the parameters
    each optimizer steps when the checkpoint names them (several optimizers), else by position."""
    saved = saved_groups(meta)
    owned = meta.get("optimizer_params")
    if saved is None or not owned or len(optimizers) < 2:
        return saved
    out = []
    for k, optimizer in enumerate(optimizers):
        mine = _owned_names(engine, optimizer)
        match = [j for j, names in enumerate(owned) if names == mine]
        if len(match) != 1:
            raise ValueError(
                f"load_checkpoint(): optimizer {k} steps {len(mine)} parameters ({', '.join(mine[:3])} ...) that no "
                f"optimizer saved in {path!r} stepped; build each optimizer over the same parameters as the saved run"
            )
        out.append(saved[match[0]])
    return out


def _state(
    engine: ZeroEngine,
    optimizers: list[torch.optim.Optimizer],
    want_optim: Mapping[str, Any] | None,
    swapped: dict[int, dict[str, torch.Tensor]],
    saved: set[str] | None = None,
) -> dict[str, Any]:
    """The DCP state dict; its tensors alias the engine's own storage where possible.

    ``want_optim``: on load, the optimizer keys present in the checkpoint with their DCP
    metadata, created (zeros, see :func:`fresh_state`) where the optimizer has no state yet, so
    DCP can load into them. ``swapped``: per master, its state on disk (memory maps of the swap
    files, ``engine.swapped_state``)."""
    mesh = _Meshes(engine)
    sd: dict[str, Any] = {}
    names = engine.param_names()
    group_of = {id(m): group for opt in optimizers for group in opt.param_groups for m in group["params"]}
    opt_of = {id(m): opt for opt in optimizers for group in opt.param_groups for m in group["params"]}
    whole = {id(e.master): e for e in engine.whole.entries}
    for g in engine.groups:
        for i, (p, m) in enumerate(zip(g.params, g.masters)):
            fqn, numel = names[id(p)], g.layout.numels[i]
            offset = None if g.layout.even else g.layout.local_range(i)[0]
            sd[f"model.{fqn}"] = _piece(engine, mesh, m.data, numel, offset)
            entry = whole.get(id(m))
            if entry is not None:  # stepped whole on its owner rank: its state is saved by matrix
                opt = opt_of.get(id(entry.proxy))
                sd.update(_whole_state(engine, mesh, entry, opt, want_optim, group_of, f"optim.{fqn}.", numel))
                continue
            optimizer = opt_of.get(id(m), optimizers[0] if len(optimizers) == 1 else None)
            if optimizer is None:  # no optimizer, or a parameter none of several steps
                continue
            state = optimizer.state[m]
            on_disk = swapped.get(id(m), {})
            if want_optim is not None:  # load: only what the checkpoint has (what is left counts as loaded)
                for key in [k for k in on_disk if f"optim.{fqn}.{k}" not in want_optim]:
                    del on_disk[key]
                prefix = f"optim.{fqn}."
                for key in [k[len(prefix) :] for k in want_optim if k.startswith(prefix)]:
                    if key not in state and key not in on_disk:
                        state[key] = fresh_state(key, m, want_optim[prefix + key], group_of.get(id(m), {}), numel)
            for key, value in {**state, **on_disk}.items():
                if not isinstance(value, torch.Tensor):
                    continue
                per_element = value.shape == m.shape and key != "step"
                sd[f"optim.{fqn}.{key}"] = _piece(engine, mesh, value, numel, offset) if per_element else value
    for fqn, p in engine.module.named_parameters():
        if engine.master_of(p) is not None:
            continue
        # frozen: flattened too, so a ZeRO-3 run's pieces and a ZeRO-1/2 run's full tensor reshard
        flat = engine.flat_value(p)
        if engine.config.stage == 3:  # its piece of the unit's row
            sd[f"model.{fqn}"] = _piece(engine, mesh, flat, p.numel(), engine.flat_offset(p))
        else:
            sd[f"model.{fqn}"] = flat
    for fqn, b in persistent_buffers(engine.module).items():  # what state_dict() holds
        sd[f"model.{fqn}"] = b
    sd.update(engine.progress_state())
    sd.update(_residuals(engine, mesh, saved))
    return sd


def _whole_state(
    engine: ZeroEngine,
    mesh: _Meshes,
    entry: Any,
    optimizer: torch.optim.Optimizer | None,
    want_optim: Mapping[str, Any] | None,
    group_of: dict[int, Any],
    prefix: str,
    numel: int,
) -> dict[str, Any]:
    """The state of a parameter stepped whole on its owner (``whole_params.py``): per-element
    values as the owner's one piece covering the whole flattened parameter (so it loads at any
    world size and stage, onto whichever rank owns it there, or as pieces into an element-wise
    optimizer); other tensors (a step, a preconditioner) as they are, from the owner. The other
    ranks hold none of it and add nothing."""
    if optimizer is None or not entry.proxy.numel():
        return {}
    state = optimizer.state[entry.proxy]
    if want_optim is not None:  # load: create what the checkpoint has and the optimizer lacks
        for key in [k[len(prefix) :] for k in want_optim if k.startswith(prefix)]:
            if key not in state:
                group = group_of.get(id(entry.proxy), {})
                state[key] = fresh_state(key, entry.proxy, want_optim[prefix + key], group, numel)
                if state[key].numel() == numel and state[key].dim() == 1:
                    state[key] = state[key].view(entry.proxy.shape)
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            per_element = value.shape == entry.proxy.shape and key != "step"
            out[prefix + key] = _piece(engine, mesh, value.view(-1), numel, 0) if per_element else value
    return out


def _residuals(engine: ZeroEngine, mesh: _Meshes, saved: set[str] | None) -> dict[str, Any]:
    """Top-k compression's residuals (``compression.py``) in parameter coordinates: per
    parameter, every rank's residual side by side, each rank's read from (and loaded into) its
    padded rows in place. So they load under other buckets, another load-balance split and
    another stage 1/2. On load (``saved``: the checkpoint's keys) a parameter whose residuals
    were saved at another world size (or not at all) starts from zero, with a warning."""
    fb = engine.reducer.compression
    if fb is None:
        return {}
    names = engine.param_names()
    if saved is not None:
        in_file = {k for k in saved if k.startswith("compression.")}
        if not in_file:
            fb.reset()  # saved without residuals (dense, or in the warm-up): none carried over
            return {}
        fb.allocate()
        fb.reset()  # what the checkpoint does not cover (the rows' padding too) is zero
    state = fb.checkpoint_pieces(lambda p: names[id(p)])
    if saved is not None and not set(state) <= in_file:
        missing = set(state) - in_file
        warnings.warn(
            f"load_checkpoint(): the checkpoint has no top-k residuals for {len(missing)} of {len(state)} parameters "
            f"at world size {engine.ctx.world_size} (saved at another world size, or before they were kept per "
            "parameter); those start from zero here, as error feedback does at the start of training",
            UserWarning,
            stacklevel=3,
        )
        state = {k: v for k, v in state.items() if k not in missing}
    out: dict[str, Any] = {}
    for key, (numel, pieces) in state.items():
        pieces = [(offset, _compact(local)) for offset, local in pieces]  # views, saved without a clone
        like = pieces[0][1]
        # one process without a group: its only piece is the whole tensor
        out[key] = like if mesh(like.device.type) is None else ScatteredPiece(pieces, numel, like)
    return out


def save_checkpoint(
    root: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: OptimizerArg = None,
    extra: dict[str, Any] | None = None,
    *,
    tag: str | None = None,
    objects: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> str:
    """Write a sharded checkpoint into ``root/<tag>`` (every rank writes its own pieces), then
    point ``root/latest`` at it. Returns the checkpoint directory. Collective.

    ``optimizer``: one, or a list of the model's optimizers over disjoint parameters (all of
    their state is saved). ``extra``: a JSON-serialisable dict, returned by
    :func:`load_checkpoint`. ``objects``: name
    -> any picklable object (a front-end's training state), written by rank 0 as
    ``<name>.pt`` inside the versioned directory before ``latest`` moves, so it is covered by
    the same atomicity and checks; read back with :func:`read_checkpoint_object`.
    ``keep_last``: once the new checkpoint is durable and ``latest`` names it, remove all but
    the newest ``keep_last`` of this library's complete checkpoints under ``root``.

    Order, each step durable (fsynced) before the next: rank 0 creates the directory
    exclusively; every rank writes its shards; rank 0 writes the objects and ``zero_meta.json``
    (size and CRC32 of every file); ``latest`` moves; pruning. A failure at any point (a full
    disk) removes the partial directory and raises on every rank; ``latest`` and the previous
    checkpoint are untouched."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(
            f"save_checkpoint(keep_last={keep_last}): keep at least 1 checkpoint, or pass None to keep all"
        )
    for key in objects or {}:
        if not key.isidentifier():
            raise ValueError(f"save_checkpoint(objects={{{key!r}: ...}}): use a plain identifier as the name")
    started = time.perf_counter()
    engine = get_engine(model)
    optimizers = _optimizers(optimizer, engine, "save_checkpoint()")
    engine.wait_for_reductions()
    explicit = tag is not None
    tag = tag or f"step-{engine.step_count}"
    if "/" in tag or os.sep in tag or tag.startswith(".") or tag == LATEST or tag.startswith(LATEST + "-"):
        raise ValueError(f"save_checkpoint(tag={tag!r}): use a plain directory name such as 'step-1000'")
    root = os.fspath(root)
    rank = engine.world.rank
    # Rank 0 alone creates the directory and pickles the objects; the outcome reaches every rank
    # before any rank writes, so a failure raises everywhere instead of hanging the others.
    name: str | None = None
    blobs: dict[str, bytes] = {}
    failure: BaseException | None = None
    if rank == 0:
        try:
            name = _create_version_dir(root, tag, explicit, _pointer_name(engine))
            for obj_name, obj in (objects or {}).items():
                buf = io.BytesIO()
                torch.save(obj, buf)
                blobs[obj_name] = buf.getvalue()
        except Exception as exc:  # reported on every rank below
            failure = exc
    text = (
        None
        if failure is None
        else str(failure)
        if isinstance(failure, ValueError)
        else f"{type(failure).__name__}: {failure}"
    )
    starts = C.all_gather_objects(
        engine.world, (name, text, isinstance(failure, ValueError), tag), what="save_checkpoint start"
    )
    name, failed, user_error, _ = starts[0]
    tags = [t for *_, t in starts]
    if failed is None and len(set(tags)) > 1:  # every rank must mean the same save
        failed, user_error = (
            f"save_checkpoint(tag=...): the ranks asked for different tags {tags}; pass the same tag on every rank",
            True,
        )
    if failed is not None:
        if rank == 0 and name is not None:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        if user_error:
            raise ValueError(failed) from failure
        raise RuntimeError(
            f"save_checkpoint(): rank 0 could not start the save ({failed}); check that the root is writable and that the objects can be pickled"
        ) from failure
    path = os.path.join(root, name)
    write_errors: list[OSError] = []
    try:
        _fault("before_write", rank)
        writer, sums, write_errors = checksumming_writer(path)
        with engine.swapped_state(writable=False) as swapped, single_process_quiet():
            dcp.save(
                _state(engine, optimizers, None, swapped),
                storage_writer=writer,
                process_group=C.bounded_group(engine.world),  # shard groups: each piece written once
            )
        _fault("after_shards", rank)
        all_sums: dict[str, int] = {}
        for part in C.all_gather_objects(engine.world, sums, what="checkpoint checksums"):
            all_sums.update(part)
        failure = None
        if rank == 0:
            try:
                for obj_name, blob in blobs.items():
                    tmp = os.path.join(path, f".{obj_name}.pt.tmp")
                    with open(tmp, "wb") as f:
                        f.write(blob)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, os.path.join(path, f"{obj_name}.pt"))
                    all_sums[f"{obj_name}.pt"] = zlib.crc32(blob)
                _fault("after_objects", rank)
                _write_meta(engine, optimizers, extra, path, all_sums)
                _fault("before_latest", rank)
            except Exception as exc:
                failure = exc
        _fault("after_write", rank)
        _agree(engine, failure, "save_checkpoint: writing the objects and metadata")
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        # a failed write (a full disk, ...) on any rank: DCP raised it on every rank. Remove what
        # was written, so no partial directory is ever mistaken for a checkpoint
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        cause = repr(write_errors[0]) if write_errors else _root_cause(exc)  # a full disk's OSError, not its echo
        raise RuntimeError(
            f"save_checkpoint(): writing {path!r} failed ({cause}); the partial directory was removed and "
            "`latest` still names the previous checkpoint. Free disk space (or fix the cause) and save again"
        ) from exc
    failure = None
    if rank == 0:
        try:
            write_atomic(os.path.join(root, _pointer_name(engine)), name + "\n")  # complete and durable: point at it
            _fault("after_latest", rank)
            if keep_last is not None:
                _prune(root, name, keep_last, _pointer_name(engine))
        except Exception as exc:
            failure = exc
    _agree(engine, failure, "save_checkpoint: moving `latest`")
    if rank == 0:
        log.info("save_checkpoint: wrote %s, %.1f MiB, in %.2f s", path, dir_bytes(path) / 2**20,
                 time.perf_counter() - started)  # fmt: skip
    return path


def _root_cause(exc: BaseException) -> str:
    """The innermost error of a chain (DCP wraps each rank's failure), as text."""
    inner = exc
    while inner.__cause__ is not None:
        inner = inner.__cause__
    return f"{type(inner).__name__}: {inner}"


def _agree(engine: ZeroEngine, failure: BaseException | None, what: str) -> None:
    """A collective: raise on every rank if ``failure`` happened on any."""
    flag = torch.tensor([int(failure is not None)], dtype=torch.int32, device=engine.world.device)
    C.all_reduce(engine.world, flag, op="max", what=what).wait()
    if bool(flag.item()):
        detail = f": {failure!r}" if failure is not None else " on another rank (its log has the cause)"
        raise RuntimeError(f"{what} failed{detail}") from failure


def _write_meta(engine: ZeroEngine, optimizers: list[torch.optim.Optimizer], extra: dict[str, Any] | None, path: str,
                sums: dict[str, int]) -> None:  # fmt: skip
    shapes = {n: list(p.shape) for n, p in engine.module.named_parameters()}
    names = engine.param_names()
    tensors = engine.module.state_dict(keep_vars=True)
    aliases = {n: names[id(t)] for n, t in tensors.items() if id(t) in names and names[id(t)] != n}
    files = {}
    for n in sorted(os.listdir(path)):
        if n in (META, OWNER, COMPLETE) or n.endswith(".tmp") or ".tmp-" in n:
            continue
        if n not in sums:
            raise AssertionError(f"save_checkpoint(): {n} in {path} was not written through the checksumming writer")
        files[n] = {"size": os.path.getsize(os.path.join(path, n)), "crc32": sums[n]}
    meta = {
        "format": FORMAT,
        "stage": engine.config.stage,
        "world_size": engine.world.world_size,
        # the ranks each piece was cut over (shard groups: every group held the same pieces)
        "shard_size": engine.ctx.world_size,
        "torch": torch.__version__,
        "zero_strategy": __version__,
        "config": engine.config.to_dict(),
        "shapes": shapes,
        "extra": extra or {},
        # optimizer hyperparameters by group (lr as an LR scheduler left it, betas, ...)
        # (several optimizers: one such list per optimizer, in order)
        "param_groups": group_settings(optimizers[0]) if len(optimizers) == 1 else None,
        "param_groups_per_optimizer": [group_settings(o) for o in optimizers] if len(optimizers) > 1 else None,
        # several optimizers: the parameters each steps, which matches them at load in any order
        "optimizer_params": [_owned_names(engine, o) for o in optimizers] if len(optimizers) > 1 else None,
        # for export: every state_dict name (tied weights under each), its shape, and the
        # saved name it is an alias of
        "state_names": list(tensors),
        "state_shapes": {n: list(t.shape) for n, t in tensors.items()},
        "aliases": aliases,
        "files": files,
    }
    write_atomic(os.path.join(path, META), json.dumps(meta, indent=1, default=str))


def _validate_for_load(
    engine: ZeroEngine, path: str, meta: dict[str, Any], optimizers: list[torch.optim.Optimizer]
) -> None:
    """This rank's checks before any collective of the load (shapes, groups, its share of the
    files' sizes and checksums)."""
    shapes = {n: list(p.shape) for n, p in engine.module.named_parameters()}
    for name, shape in shapes.items():
        if meta["shapes"].get(name) != shape:
            raise ValueError(
                f"load_checkpoint(): parameter '{name}' has shape {shape} in the model but "
                f"{meta['shapes'].get(name, 'no entry')} in the checkpoint {path!r}; load a checkpoint of this model"
            )
    saved = saved_groups(meta)
    if optimizers and saved is not None and len(saved) != len(optimizers):
        raise ValueError(
            f"load_checkpoint(): {len(optimizers)} optimizer(s) given but the checkpoint {path!r} holds {len(saved)}; "
            "pass the same optimizers, in the same order, as the saved run"
        )
    ordered = _groups_in_given_order(engine, meta, optimizers, path) if optimizers and saved is not None else None
    for k, (optimizer, groups) in enumerate(zip(optimizers, ordered or [])):
        if len(groups) != len(optimizer.param_groups):
            which = "the optimizer" if len(optimizers) == 1 else f"optimizer {k}"
            raise ValueError(
                f"load_checkpoint(): {which} has {len(optimizer.param_groups)} parameter groups but the checkpoint "
                f"{path!r} has {len(groups)}; build the optimizer with the same groups as the saved run"
            )
    files = _file_records(meta.get("files", {}))
    names = sorted(files)
    n, r = engine.world.world_size, engine.world.rank
    verify_checksums(path, files, names[r::n])  # the ranks share the reading


def load_checkpoint(
    path: str | os.PathLike[str], model: torch.nn.Module, optimizer: OptimizerArg = None
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``path``: its root, whose
    ``latest`` is followed, or a versioned subdirectory) at any world size and stage into this
    model (and optimizer, or the list of optimizers saved with it). The optimizer's param-group settings (lr as a scheduler left it,
    betas, weight decay, ...) are restored too, replacing the ones it was built with. Returns
    the ``extra`` dict that was saved. Collective.

    Every rank checks what it can first (shapes, and its share of the files' sizes and CRC32s);
    then the ranks agree, so either all load or all raise the same error naming the file, and
    none waits in a collective the others never reach. Files are read without running code
    (:class:`SafeFileSystemReader`)."""
    started = time.perf_counter()
    engine = get_engine(model)
    optimizers = _optimizers(optimizer, engine, "load_checkpoint()")
    if is_foreign_dcp(path) or is_imported(path, _pointer_name(engine)):  # FSDP2's, torchtitan's (foreign.py)
        return load_foreign(os.fspath(path), engine, optimizers, pointer=_pointer_name(engine))
    if is_deepspeed_checkpoint(path):
        raise ValueError(
            f"load_checkpoint(): {os.fspath(path)!r} is a DeepSpeed checkpoint; convert it once in one process with "
            "`zero-strategy import-checkpoint SRC DST` (masters and Adam moments kept), then load DST"
        )
    failure: BaseException | None = None
    resolved = os.fspath(path)
    meta: dict[str, Any] = {}
    in_file: dict[str, Any] = {}  # key -> its DCP metadata (size, dtype)
    try:
        resolved, meta = read_meta(path, "load_checkpoint()", _pointer_name(engine))
        _validate_for_load(engine, resolved, meta, optimizers)
        in_file = dict(SafeFileSystemReader(resolved).read_metadata().state_dict_metadata)
    except Exception as exc:
        failure = exc
    errors = C.all_gather_objects(
        engine.world, None if failure is None else (type(failure).__name__, str(failure)), what="load_checkpoint checks"
    )
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        if failure is not None:
            raise failure
        kind, text = first
        raise (ValueError if kind == "ValueError" else CheckpointFileError)(
            f"load_checkpoint(): another rank refused the checkpoint: {text}"
        )
    engine.wait_for_reductions()
    want = {k: v for k, v in in_file.items() if k.startswith("optim.")} if optimizers else None
    with engine.swapped_state(writable=True) as swapped:
        sd = _state(engine, optimizers, want, swapped, set(in_file))
        if int(meta.get("format", 1)) < 4:
            del sd["engine.loss_scaler_counters"]  # an older checkpoint: the schedule restarts its window
        with single_process_quiet():
            dcp.load(sd, storage_reader=SafeFileSystemReader(resolved), process_group=C.bounded_group(engine.world))
    engine.load_progress(sd)  # step, loss scale; the parameters follow the loaded masters
    for optimizer, groups in zip(optimizers, _groups_in_given_order(engine, meta, optimizers, resolved) or []):
        restore_group_settings(optimizer, groups)
    if engine.world.rank == 0:
        log.info("load_checkpoint: read %s, %.1f MiB, in %.2f s", resolved, dir_bytes(resolved) / 2**20,
                 time.perf_counter() - started)  # fmt: skip
    return dict(meta.get("extra", {}))
