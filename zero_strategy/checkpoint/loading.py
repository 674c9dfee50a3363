"""Loading full weights into a model the engine manages, one tensor at a time.

``load_full_state_dict`` reads a state dict, a ``.safetensors`` file, a ``.pt``/``.bin``
file, or Hugging Face's multi-file layout (a directory or its ``model.safetensors.index.json``,
:mod:`.multi_file`) parameter by parameter, each file memory-mapped; each rank keeps only its pieces (ZeRO-3) or the full tensors it
needs (ZeRO-1/2), so a model that no rank can hold whole still loads pretrained weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch
from torch import nn

from zero_strategy.checkpoint.multi_file import open_weights
from zero_strategy.checkpoint.progress import byte_progress
from zero_strategy.runtime.module import get_engine

__all__ = ["load_full_state_dict"]


def _open_state_dict(
    source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
) -> tuple[Callable[[str], torch.Tensor], list[str], int]:
    if isinstance(source, Mapping):
        return (lambda k: source[k]), list(source.keys()), 0
    return open_weights(os.fspath(source), "load_full_state_dict()")


def load_full_state_dict(
    model: nn.Module, source: str | os.PathLike[str] | Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Load full weights into a model managed by ``initialize``, one tensor at a time, from a
    state dict, a weights file, or a multi-file directory (or its index); each
    rank keeps only its pieces (ZeRO-3) or the full tensors it needs (ZeRO-1/2). Not a
    collective: every rank reads the source itself. Reading a large file shows a progress bar
    with bytes/s on rank 0 when standard error is a terminal (:mod:`.progress`)."""
    engine = get_engine(model)
    get, keys, size = _open_state_dict(source)
    name = "" if isinstance(source, Mapping) else os.path.basename(os.path.normpath(os.fspath(source)))
    with byte_progress(size, f"load {name}", rank=engine.world.rank) as advance:

        def counted(key: str) -> torch.Tensor:
            t = get(key)
            advance(t.numel() * t.element_size())
            return t

        engine.load_full_state_dict(counted, keys, strict=strict)
