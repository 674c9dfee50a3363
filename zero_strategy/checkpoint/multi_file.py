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

__all__ = ["SAFE_INDEX", "open_weights", "parse_size", "shard_plan", "write_sharded"]

SAFE_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"
_DIR_CANDIDATES = (SAFE_INDEX, "model.safetensors", _BIN_INDEX, "pytorch_model.bin")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip

Getter = Callable[[str], torch.Tensor]


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


def open_weights(path: str, call: str) -> tuple[Getter, list[str], int]:
    """A getter for each tensor of ``path`` (a file, an index, or a directory holding one),
    the tensor names, and the bytes of the files (for a progress bar)."""
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
    if path.endswith(".index.json"):
        get, keys = _open_index(path, call)
        with open(path) as f:
            files = set(json.load(f)["weight_map"].values())
        size = sum(os.path.getsize(os.path.join(os.path.dirname(path), n)) for n in files)
        return get, keys, size
    get, keys = _open_file(path)
    return get, keys, os.path.getsize(path)


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
