"""A real-text corpus that needs no download: the Python standard library's own source files.

Byte-level (vocabulary 256). The files are read in sorted order, so every process of a run
sees the same corpus; :func:`text_batch` picks windows with a generator seeded by
(seed, step, rank), so runs are reproducible and ranks see different data.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

__all__ = ["stdlib_corpus", "text_batch"]


def stdlib_corpus(max_bytes: int = 8_000_000) -> torch.Tensor:
    """Up to ``max_bytes`` of ``*.py`` source from the standard library, as uint8 tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    paths = sorted(root.glob("*.py")) + sorted(p for p in root.glob("*/*.py") if "site-packages" not in p.parts)
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if size == 0:
        raise RuntimeError(f"stdlib_corpus(): found no .py files under {root}; pass your own token tensor instead")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


def text_batch(
    corpus: torch.Tensor, batch: int, seq_len: int, step: int, rank: int = 0, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, ``(batch, seq_len)`` each, as int64."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1009 + rank)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch,), generator=g)
    windows = torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
