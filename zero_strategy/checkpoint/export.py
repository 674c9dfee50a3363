"""Export one consolidated state dict, tensor by tensor, for people who do not use this library.

``export_full(source, out_file, dtype=None)``:

- ``source`` a checkpoint directory (its root, whose ``latest`` is followed, or a versioned
  subdirectory): offline, in one process, no ranks started;
- ``source`` a live model managed by ``initialize``: a collective; rank 0 writes.

``full_state_dict(source)`` gives the same tensors as a dict, from a directory or a live model.

``max_shard_size`` (``"5GB"``, bytes) writes Hugging Face's multi-file layout instead: ``out``
is a directory that gets ``model-0000k-of-0000n.safetensors`` files and
``model.safetensors.index.json`` (:mod:`.multi_file`), which ``from_pretrained`` loads.

``.safetensors`` (default) is streamed: the header is written first (every tensor's shape and
dtype are known from the checkpoint's metadata), then each tensor is read, reshaped to the
parameter's original shape and appended, so host memory stays near one tensor.
``safetensors.torch.save_file`` would need the whole dict in memory. ``.pt`` goes through
``torch.save`` and does hold the whole dict. The file loads into the plain model class with
``load_state_dict(strict=True)`` (tied weights are written under every name).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from zero_strategy.api import gathered_parameters
from zero_strategy.checkpoint.files import SafeFileSystemReader, single_process_quiet
from zero_strategy.checkpoint.multi_file import parse_size, write_sharded
from zero_strategy.checkpoint.progress import byte_progress
from zero_strategy.checkpoint.versions import read_meta
from zero_strategy.runtime.module import get_engine

__all__ = ["export_full", "full_state_dict"]

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def _write_safetensors(
    out_file: str,
    entries: list[tuple[str, list[int], torch.dtype]],
    read: Callable[[str], torch.Tensor],
    *,
    write: bool = True,
) -> None:
    """Header first, then one tensor at a time. With ``write=False`` only ``read`` is called
    for every entry, in order (the other ranks' part of a live, collective export)."""
    if not write:
        for name, _, _ in entries:
            read(name)
        return
    header, offset = {}, 0
    for name, shape, dtype in entries:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = f"{out_file}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f, byte_progress(offset, f"export {os.path.basename(out_file)}") as advance:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in entries:
            t = read(name).to(dtype).reshape(shape).contiguous()
            f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            advance(t.numel() * t.element_size())
    os.replace(tmp, out_file)


def _checkpoint_entries(
    path: str, dtype: torch.dtype | None
) -> tuple[list[tuple[str, list[int], torch.dtype]], Callable[[str], torch.Tensor]]:
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"export_full(): {path!r} is not a directory; give a checkpoint written by save_checkpoint"
        )
    path, meta = read_meta(path, "export_full()")
    saved = SafeFileSystemReader(path).tensor_entries()
    names = meta.get("state_names") or meta["shapes"]
    entries = []
    for name in names:
        key = f"model.{meta.get('aliases', {}).get(name, name)}"
        md = saved[key]
        saved_dtype = md.properties.dtype
        out_dtype = (
            dtype if dtype is not None and saved_dtype.is_floating_point else saved_dtype
        )  # ints, bools: as saved
        entries.append((name, list(meta.get("state_shapes", meta["shapes"])[name]), out_dtype))

    def read(name: str) -> torch.Tensor:
        key = f"model.{meta.get('aliases', {}).get(name, name)}"
        md = saved[key]
        t = torch.empty(md.size, dtype=md.properties.dtype)
        with single_process_quiet():
            dcp.load({key: t}, storage_reader=SafeFileSystemReader(path), no_dist=True)
        return t

    return entries, read


def _live_entries(
    model: nn.Module, dtype: torch.dtype | None
) -> tuple[list[tuple[str, list[int], torch.dtype]], Callable[[str], torch.Tensor]]:
    tensors = model.state_dict(keep_vars=True)
    entries = [(n, list(t.shape), (dtype or t.dtype) if t.is_floating_point() else t.dtype) for n, t in tensors.items()]
    unit_of = getattr(get_engine(model).params, "unit_of", None)  # ZeRO-3: parameters live in units
    unread = {id(t) for t in tensors.values() if isinstance(t, nn.Parameter)}
    pending: dict[int, torch.Tensor] = {}  # copied when their unit was gathered for an earlier name

    def read(name: str) -> torch.Tensor:  # collective: one gather per ZeRO-3 unit, on every rank alike
        t = tensors[name]
        if not isinstance(t, nn.Parameter):
            return t.detach()
        unread.discard(id(t))
        if id(t) in pending:
            return pending.pop(id(t))
        where = unit_of(t) if unit_of is not None else None
        mates = [p for p in where[0].params if id(p) in unread] if where is not None else []
        with gathered_parameters([t, *mates]):  # the unit once, with the parameters still to read (frozen too)
            for p in mates:
                unread.discard(id(p))
                pending[id(p)] = p.detach().clone()
            return t.detach().clone()

    return entries, read


def export_full(
    source: str | os.PathLike[str] | nn.Module,
    out_file: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    *,
    max_shard_size: int | str | None = None,
) -> str:
    """Write ``source``'s full state dict to ``out_file`` (``.safetensors`` or ``.pt``), or,
    with ``max_shard_size``, to the directory ``out_file`` as several safetensors files of at
    most that size and their index (returned: the index's path)."""
    out_file = os.fspath(out_file)
    fmt = "pt" if out_file.endswith((".pt", ".pth", ".bin")) else "safetensors"
    limit = None if max_shard_size is None else parse_size(max_shard_size, what="export_full(max_shard_size)")
    if limit is not None and (fmt == "pt" or out_file.endswith(".safetensors")):
        raise ValueError(
            f"export_full(max_shard_size=...): {out_file!r} is a file name; give the directory to write the "
            "safetensors files and model.safetensors.index.json into"
        )
    if isinstance(source, nn.Module):
        entries, read = _live_entries(source, dtype)
        write = get_engine(source).world.rank == 0  # one writer, also with shard groups
    else:
        entries, read = _checkpoint_entries(os.fspath(source), dtype)
        write = True
    if limit is not None:
        return write_sharded(out_file, entries, read, limit, _write_safetensors, write=write)
    if fmt == "pt":
        full = {n: read(n).to(d).reshape(s) for n, s, d in entries}
        if write:
            torch.save(full, out_file)
    else:
        _write_safetensors(out_file, entries, read, write=write)
    return out_file


def full_state_dict(
    model: nn.Module | str | os.PathLike[str],
    *,
    rank0_only: bool = True,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """The model's full state dict (original names and shapes), gathered unit by unit (ZeRO-3:
    each unit once, with all its parameters).

    ``model`` a checkpoint directory (its root or a versioned subdirectory): read offline, in
    this process alone, as ``export_full`` reads it (``rank0_only`` does not apply).

    For a live model: collective, every rank calls it. With ``rank0_only`` (default) only rank 0 keeps the
    tensors and the other ranks get ``{}``, so one process holds the full model, as with
    FSDP's ``full_state_dict`` option; ``rank0_only=False`` gives it to every rank. Floating
    tensors are cast to ``dtype`` if given. Parameters come as the model stores them (the
    engine's ``param_dtype`` under mixed precision). Tied parameters (one Parameter under two
    names, as GPT-2's embedding and head) are gathered once and share one tensor, as in
    ``model.state_dict()``, so ``save_pretrained`` writes them once.
    """
    if not isinstance(model, nn.Module):
        entries, read_saved = _checkpoint_entries(os.fspath(model), dtype)
        return {n: read_saved(n).to(device=device, dtype=d).reshape(s) for n, s, d in entries}
    keep = not rank0_only or get_engine(model).world.rank == 0
    entries, read = _live_entries(model, dtype)
    live = model.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}  # tied parameters: one gather, one tensor under every name
    for name, _, d in entries:
        seen = first.setdefault(id(live[name]), name)
        if seen != name:
            if keep:
                out[name] = out[seen]
            continue
        t = read(name)
        if keep:
            out[name] = t.to(device=device, dtype=d)
    return out
