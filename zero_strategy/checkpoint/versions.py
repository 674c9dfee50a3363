"""Versioned checkpoint directories: ``root/<tag>`` created exclusively by rank 0 (a second
job saving into the same root gets another one), the small pointer file ``root/latest`` replaced
atomically once a save is complete (a process subgroup keeps a pointer of its own), pruning to
``keep_last``, and resolving what a load names: a root (through its pointer, a plain name inside
the root; nothing else is followed) or a versioned directory itself. Also the front-ends'
two-phase save (``begin_versioned_save``/``commit_versioned_save``) and the small metadata
readers (``read_meta``, ``read_checkpoint_object``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import zlib
from typing import Any

import torch
import torch.distributed as dist

from zero_strategy.checkpoint.files import (
    OWNER,
    CheckpointFileError,
    fsync_dir,
    inside,
    owner_is_gone,
    owner_record,
    read_owner,
    verify_checksums,
    write_atomic,
)
from zero_strategy.comm import collectives as C
from zero_strategy.runtime.engine import ZeroEngine

__all__ = [
    "begin_versioned_save",
    "commit_versioned_save",
    "read_checkpoint_object",
    "read_meta",
    "resolve_checkpoint",
]

META = "zero_meta.json"


LATEST = "latest"


COMPLETE = ".zero_complete"  # a versioned directory that a front-end's save filled (commit_versioned_save)


def _pointer_name(engine: ZeroEngine) -> str:
    """``latest`` for the whole world; a process subgroup (pipeline stages sharing a root) keeps
    its own pointer, ``latest-<first rank>-<last rank>-<crc of the ranks>``."""
    if not dist.is_initialized() or engine.world.world_size == dist.get_world_size():
        return LATEST
    ranks = engine.world.global_ranks
    return f"{LATEST}-{ranks[0]}-{ranks[-1]}-{zlib.crc32(repr(ranks).encode()):08x}"


def refuse_lone_processes(root: str) -> None:
    """Refuse a save from a process its launcher started as one of several (``WORLD_SIZE`` > 1)
    that has no process group: each such process trains alone as rank 0 of world size 1, and
    all of them would save into ``root`` (``accelerate launch`` on a CPU machine without
    ``ACCELERATE_USE_CPU=true`` does this)."""
    launched = os.environ.get("WORLD_SIZE", "1")
    if dist.is_initialized() or "RANK" not in os.environ or not launched.isdigit() or int(launched) <= 1:
        return  # RANK too: a launcher (torchrun, accelerate launch) set both for this process
    raise RuntimeError(
        f"saving into {root!r}: this process was started as one of WORLD_SIZE={launched} processes "
        f"(RANK={os.environ['RANK']}) but has no process group, so each of them trains alone as rank 0 of "
        "world size 1 and all would write this checkpoint. Initialise torch.distributed before initialize(); under "
        "`accelerate launch` on a machine without GPUs set ACCELERATE_USE_CPU=true (zero-strategy launch sets it)"
    )


def _create_version_dir(root: str, tag: str, explicit: bool, pointer: str = LATEST) -> str:
    """Rank 0: create ``root/<tag>`` (or ``<tag>.1``, ``.2``, ...) *exclusively*, so two jobs saving
    into one root never share a directory, and mark it with its owner and the pointer that will
    name it (pruning counts a subgroup's saves apart from another's). Returns the name."""
    refuse_lone_processes(root)
    os.makedirs(root, exist_ok=True)
    for k in range(10_000):
        name = tag if k == 0 else f"{tag}.{k}"
        try:
            os.mkdir(os.path.join(root, name))
        except FileExistsError:
            if explicit:
                raise ValueError(
                    f"save_checkpoint(tag={tag!r}): {os.path.join(root, tag)!r} exists; a save never writes into an "
                    "existing checkpoint (it could be the one `latest` names). Pick a new tag or remove it"
                ) from None
            continue
        write_atomic(os.path.join(root, name, OWNER), json.dumps({**owner_record(), "pointer": pointer}))
        fsync_dir(root)
        return name
    raise RuntimeError(f"save_checkpoint(): could not create a directory for tag {tag!r} under {root!r}")


def begin_versioned_save(root: str | os.PathLike[str], tag: str, *, process_group: Any = None) -> str:
    """Start a save that other code writes (a front-end's own files beside the shards): rank 0
    creates ``root/<tag>`` (or ``<tag>.1``, ...) exclusively, with its owner marker; returns its
    path on every rank. Write everything into it, then call :func:`commit_versioned_save`.
    Collective over ``process_group`` (default: the default group)."""
    ctx = C.make_context(process_group, None)
    root = os.fspath(root)
    name, failure = None, None
    if ctx.rank == 0:
        try:
            name = _create_version_dir(root, tag, explicit=False)
        except Exception as exc:  # reported on every rank
            failure = f"{type(exc).__name__}: {exc}"
    name, failure = C.all_gather_objects(ctx, (name, failure), what="begin_versioned_save")[0]
    if failure is not None:
        raise RuntimeError(f"begin_versioned_save(): could not create a directory under {root!r}: {failure}")
    return os.path.join(root, name)


def commit_versioned_save(
    path: str | os.PathLike[str], *, keep_last: int | None = None, process_group: Any = None
) -> None:
    """Finish a save begun with :func:`begin_versioned_save` once every rank has written its
    files into ``path``: rank 0 fsyncs them, marks the directory complete, points
    ``<root>/latest`` at it and prunes older complete ones beyond ``keep_last``. A crash before
    this leaves ``latest`` at the previous save, whole. Collective."""
    ctx = C.make_context(process_group, None)
    path = os.fspath(path).rstrip(os.sep)
    root, name = os.path.dirname(path), os.path.basename(path)
    C.all_gather_objects(ctx, None, what="commit_versioned_save: every rank has written")
    failure = None
    if ctx.rank == 0:
        try:
            for dirpath, _, files in os.walk(path):
                for f in files:
                    with open(os.path.join(dirpath, f), "rb") as fh:
                        os.fsync(fh.fileno())
                fsync_dir(dirpath)
            write_atomic(os.path.join(path, COMPLETE), "")
            write_atomic(os.path.join(root, LATEST), name + "\n")
            if keep_last is not None:
                _prune(root, name, keep_last)
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
    failure = C.all_gather_objects(ctx, failure, what="commit_versioned_save")[0]
    if failure is not None:
        raise RuntimeError(f"commit_versioned_save(): {failure}; `latest` still names the previous save")


def resolve_checkpoint(path: str | os.PathLike[str]) -> str:
    """The versioned directory ``path`` names: itself, or what its ``latest`` names (a plain name
    inside it; nothing else is followed)."""
    return _resolve(os.fspath(path))


def _prune(root: str, current: str, keep_last: int, pointer: str = LATEST) -> None:
    """Remove this library's oldest complete checkpoints beyond ``keep_last`` among those saved
    for ``pointer`` (never ``current``, never one that any ``latest*`` pointer names), and the
    remains of saves whose owner process is gone. Directories without the owner marker
    (another tool's, an unrelated DCP checkpoint), another process subgroup's saves and another
    live job's save in progress are never touched."""
    named = {current}
    for d in os.listdir(root):
        if (d == LATEST or d.startswith(f"{LATEST}-")) and os.path.isfile(os.path.join(root, d)):
            with contextlib.suppress(OSError, UnicodeDecodeError), open(os.path.join(root, d)) as f:
                named.add(f.read(4096).strip())
    entries = []
    for d in os.listdir(root):
        full = os.path.join(root, d)
        owner = read_owner(full) if d not in named and os.path.isdir(full) and not os.path.islink(full) else None
        if owner is None:
            continue
        complete = os.path.exists(os.path.join(full, META)) or os.path.exists(os.path.join(full, COMPLETE))
        entries.append((d, full, owner, complete))
    done = sorted(
        (e for e in entries if e[3] and e[2].get("pointer", LATEST) == pointer), key=lambda e: e[2].get("created", 0.0)
    )
    doomed = [e[1] for e in done[: max(0, len(done) - (keep_last - 1))]]
    doomed += [e[1] for e in entries if not e[3] and owner_is_gone(e[2])]
    for full in doomed:
        shutil.rmtree(full, ignore_errors=True)
    if doomed:
        fsync_dir(root)


def read_checkpoint_object(path: str | os.PathLike[str], name: str, *, weights_only: bool | None = True) -> Any:
    """An object saved with ``save_checkpoint(..., objects={name: obj})`` (``path``: the root,
    whose ``latest`` is followed, or a versioned directory). Not collective. Read with torch's
    ``weights_only`` unpickler unless ``weights_only=False`` is passed (``None``, as Lightning
    passes it, is read as True: torch < 2.6 and TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD would make it
    False); ``weights_only=False`` runs whatever the file's pickle says: only for files you trust."""
    path, meta = read_meta(path, "read_checkpoint_object()")
    file = f"{name}.pt"
    files = meta.get("files", {})
    if file not in files:
        saved = sorted(n[:-3] for n in files if n.endswith(".pt"))
        raise ValueError(f"read_checkpoint_object(): checkpoint {path!r} has no object {name!r} (it has {saved})")
    verify_checksums(path, _file_records(files), [file])
    return torch.load(
        inside(path, file, "read_checkpoint_object()"), map_location="cpu", weights_only=weights_only is not False
    )


def _resolve(path: str, pointer: str = LATEST) -> str:
    """The versioned directory ``path`` names: ``path`` itself, or the one its pointer file names
    (this group's own, else ``latest``, else the only subgroup pointer there is), which must be a
    plain name inside ``path``."""
    candidates = list(dict.fromkeys((pointer, LATEST)))
    if os.path.isdir(path):  # a root saved by one process subgroup only: its pointer, whatever group loads
        others = sorted(n for n in os.listdir(path) if n.startswith(LATEST + "-") and ".tmp-" not in n)
        candidates += others if len(others) == 1 else []
    for candidate in candidates:
        file = os.path.join(path, candidate)
        if os.path.isfile(file):
            with open(file) as f:
                target = f.read().strip()
            return inside(path, target, f"{file}")
    return path


def read_meta(path: str | os.PathLike[str], caller: str, pointer: str = LATEST) -> tuple[str, dict[str, Any]]:
    """The versioned directory ``path`` names (following its pointer) and its metadata."""
    path = _resolve(os.fspath(path), pointer)
    meta_path = os.path.join(path, META)
    if not os.path.exists(meta_path):
        raise ValueError(f"{caller}: {path!r} is not a zero_strategy checkpoint (no {META})")
    inside(path, META, caller)  # a symlink out of the checkpoint is not followed
    with open(meta_path) as f:
        try:
            meta = json.load(f)
        except ValueError as exc:
            raise CheckpointFileError(
                f"{caller}: {meta_path!r} is not valid JSON ({exc}); the checkpoint is corrupted"
            ) from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("files", {}), dict):
        raise CheckpointFileError(f"{caller}: {meta_path!r} is not zero_strategy metadata")
    for name in meta.get("files", {}):
        inside(path, name, f"{meta_path}: file")
    return path, meta


def _file_records(files: dict[str, Any]) -> dict[str, dict[str, int]]:
    """``files`` of zero_meta.json; format 1 recorded a size alone."""
    return {n: (v if isinstance(v, dict) else {"size": int(v)}) for n, v in files.items()}
