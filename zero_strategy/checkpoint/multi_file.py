"""Multi-file weights, as Hugging Face lays out a large model: several ``.safetensors`` (or
``.bin``) files and an index, ``model.safetensors.index.json``, whose ``weight_map`` names the
file of every tensor.

Reading (:func:`open_weights`): a file, an index file, or a directory (its index is looked for
first, then a single ``model.safetensors``, then the ``pytorch_model.bin`` pair). Each tensor is
read on demand from its own file, memory-mapped, so loading touches one tensor at a time and
never the whole model.

Writing (:func:`write_sharded`): the tensors cut, in order, into files of at most
``max_shard_bytes`` each (a tensor larger than that gets a file of its own), named
``model-00001-of-00003.safetensors`` as ``save_pretrained`` names them, and the index beside
them. Each file is streamed (its header first, then one tensor at a time), so ``export`` of a
live or saved model holds one tensor, and ``from_pretrained`` loads the directory unchanged.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SAFE_INDEX", "open_ranges", "open_weights", "parse_size", "shard_plan", "write_sharded"]

SAFE_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"
_DIR_CANDIDATES = (SAFE_INDEX, "model.safetensors", _BIN_INDEX, "pytorch_model.bin")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip

Getter = Callable[[str], torch.Tensor]
Ranges = Callable[[str, int, int], torch.Tensor]  # (name, lo, hi) -> elements lo:hi of the flattened tensor


def parse_size(size: int | str, *, what: str) -> int:
    """Bytes from ``5GB``, ``500MB``, ``2GiB`` or an int (``save_pretrained``'s ``max_shard_size``)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(f"{what}={size!r}: give bytes as an int or a size such as '5GB', '500MB' or '2GiB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise ValueError(f"{what}={size!r}: give a positive size")
    return n


def _open_file(path: str) -> tuple[Getter, list[str]]:
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        f = safe_open(path, framework="pt")
        return f.get_tensor, list(f.keys())
    sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    return (lambda k: sd[k]), list(sd.keys())


def _open_index(path: str, call: str) -> tuple[Getter, list[str]]:
    with open(path) as f:
        index = json.load(f)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{call}: {path!r} has no 'weight_map'; give a Hugging Face index file or a weights file")
    root = os.path.dirname(path)
    missing = sorted({f for f in weight_map.values() if not os.path.exists(os.path.join(root, f))})
    if missing:
        raise FileNotFoundError(f"{call}: {path!r} names files that are not beside it: {missing[:5]}")
    opened: dict[str, Getter] = {}

    def get(key: str) -> torch.Tensor:
        file = weight_map[key]
        if file not in opened:  # memory-mapped: opening costs no host memory until a tensor is read
            opened[file] = _open_file(os.path.join(root, file))[0]
        return opened[file](key)

    return get, list(weight_map)


def _resolve(path: str, call: str) -> str:
    """The weights file or index that ``path`` (a file, an index, or a directory) names."""
    if os.path.isdir(path):
        found = [c for c in _DIR_CANDIDATES if os.path.exists(os.path.join(path, c))]
        if not found:
            raise FileNotFoundError(
                f"{call}: the directory {path!r} holds none of {list(_DIR_CANDIDATES)}; give a weights file or a "
                "directory written by save_pretrained or zero_strategy.export_full"
            )
        path = os.path.join(path, found[0])
    if not os.path.exists(path):
        raise FileNotFoundError(f"{call}: no file at {path!r}")
    return path


def open_weights(path: str, call: str) -> tuple[Getter, list[str], int]:
    """A getter for each tensor of ``path`` (a file, an index, or a directory holding one),
    the tensor names, and the bytes of the files (for a progress bar)."""
    path = _resolve(path, call)
    if path.endswith(".index.json"):
        get, keys = _open_index(path, call)
        with open(path) as f:
            files = set(json.load(f)["weight_map"].values())
        size = sum(os.path.getsize(os.path.join(os.path.dirname(path), n)) for n in files)
        return get, keys, size
    get, keys = _open_file(path)
    return get, keys, os.path.getsize(path)


_SAFE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}  # fmt: skip


def _file_ranges(path: str) -> tuple[Ranges, dict[str, tuple[torch.Size, torch.dtype]]]:
    if not path.endswith(".safetensors"):  # a torch file, memory-mapped: a slice touches only its pages
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return (lambda k, lo, hi: sd[k].reshape(-1)[lo:hi].clone()), {k: (v.shape, v.dtype) for k, v in sd.items()}
    from safetensors import safe_open

    f = safe_open(path, framework="pt")
    meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for k in f.keys():
        sl = f.get_slice(k)
        meta[k] = (torch.Size(sl.get_shape()), _SAFE_DTYPES.get(sl.get_dtype(), torch.float32))

    def read(key: str, lo: int, hi: int) -> torch.Tensor:
        shape = meta[key][0]
        if len(shape) == 0 or hi <= lo:
            return f.get_tensor(key).reshape(-1)[lo:hi].clone()
        row = shape[1:].numel()  # the rows that hold elements lo:hi, read alone from the map
        first, last = lo // row, -(-hi // row)
        rows = f.get_slice(key)[first:last]  # a copy of those rows alone: no second copy of the piece
        return rows.reshape(-1)[lo - first * row : hi - first * row]

    return read, meta


def open_ranges(path: str, call: str) -> tuple[Ranges, dict[str, tuple[torch.Size, torch.dtype]]]:
    """A reader of element ranges of each tensor of ``path`` (a file, an index, or a directory
    holding one), and each tensor's shape and dtype: a rank reads just the rows that hold its
    piece, from a memory map (a safetensors slice), never the whole tensor."""
    path = _resolve(path, call)
    if not path.endswith(".index.json"):
        return _file_ranges(path)
    with open(path) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{call}: {path!r} has no 'weight_map'; give a Hugging Face index file or a weights file")
    root = os.path.dirname(path)
    readers: dict[str, Ranges] = {}
    meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for file in dict.fromkeys(weight_map.values()):
        if not os.path.exists(os.path.join(root, file)):
            raise FileNotFoundError(f"{call}: {path!r} names a file that is not beside it: {file!r}")
        readers[file], file_meta = _file_ranges(os.path.join(root, file))
        meta.update({k: v for k, v in file_meta.items() if weight_map.get(k) == file})
    return (lambda k, lo, hi: readers[weight_map[k]](k, lo, hi)), meta


def _nbytes(shape: list[int], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def shard_plan(entries: list[tuple[str, list[int], torch.dtype]], max_shard_bytes: int) -> list[list[int]]:
    """Indices of ``entries`` per file, in order: a file closes when the next tensor would take
    it over ``max_shard_bytes`` (a larger tensor alone in its file)."""
    plan: list[list[int]] = [[]]
    used = 0
    for i, (_, shape, dtype) in enumerate(entries):
        n = _nbytes(shape, dtype)
        if plan[-1] and used + n > max_shard_bytes:
            plan.append([])
            used = 0
        plan[-1].append(i)
        used += n
    return plan


def write_sharded(
    out_dir: str,
    entries: list[tuple[str, list[int], torch.dtype]],
    read: Getter,
    max_shard_bytes: int,
    write_file: Callable[..., None],
    *,
    write: bool = True,
) -> str:
    """Write ``entries`` (read by ``read`` in order) as several safetensors files and the index
    into ``out_dir``; ``write_file(path, entries, read, write=...)`` streams one file. Returns
    the index's path. With ``write=False`` every tensor is still read, in the same order (the
    other ranks' part of a live, collective export)."""
    plan = shard_plan(entries, max_shard_bytes)
    if write:
        os.makedirs(out_dir, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for k, idx in enumerate(plan, start=1):
        name = f"model-{k:05d}-of-{len(plan):05d}.safetensors"
        part = [entries[i] for i in idx]
        write_file(os.path.join(out_dir, name), part, read, write=write)
        for n, shape, dtype in part:
            weight_map[n] = name
            total += _nbytes(shape, dtype)
    index = os.path.join(out_dir, SAFE_INDEX)
    if write:
        body: dict[str, Any] = {"metadata": {"total_size": total}, "weight_map": weight_map}
        tmp = f"{index}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(body, f, indent=2)
        os.replace(tmp, index)
    return index
