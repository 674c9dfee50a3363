"""Loading full weights into a model the engine manages, one tensor at a time.

``load_full_state_dict`` reads a state dict, a ``.safetensors`` file or a ``.pt``/``.bin``
file parameter by parameter; each rank keeps only its pieces (ZeRO-3) or the full tensors it
needs (ZeRO-1/2), so a model that no rank can hold whole still loads pretrained weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch
from torch import nn

from zero_strategy.checkpoint.progress import byte_progress
from zero_strategy.runtime.module import get_engine

__all__ = ["load_full_state_dict"]


def _open_state_dict(
    source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
) -> tuple[Callable[[str], torch.Tensor], list[str]]:
    if isinstance(source, Mapping):
        return (lambda k: source[k]), list(source.keys())
    path = os.fspath(source)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load_full_state_dict(): no file at {path!r}")
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        f = safe_open(path, framework="pt")
        return f.get_tensor, list(f.keys())
    sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    return (lambda k: sd[k]), list(sd.keys())


def load_full_state_dict(
    model: nn.Module, source: str | os.PathLike[str] | Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Load full weights into a model managed by ``initialize``, one tensor at a time; each
    rank keeps only its pieces (ZeRO-3) or the full tensors it needs (ZeRO-1/2). Not a
    collective: every rank reads the source itself. Reading a large file shows a progress bar
    with bytes/s on rank 0 when standard error is a terminal (:mod:`.progress`)."""
    engine = get_engine(model)
    get, keys = _open_state_dict(source)
    path = None if isinstance(source, Mapping) else os.fspath(source)
    size, name = (os.path.getsize(path), os.path.basename(path)) if path is not None else (0, "")
    with byte_progress(size, f"load {name}", rank=engine.world.rank) as advance:

        def counted(key: str) -> torch.Tensor:
            t = get(key)
            advance(t.numel() * t.element_size())
            return t

        engine.load_full_state_dict(counted, keys, strict=strict)
