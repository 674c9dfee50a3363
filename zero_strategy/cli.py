"""Command line: ``zero-strategy export CHECKPOINT OUT.safetensors [--dtype bf16]``."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["export", "main"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}  # fmt: skip


def export(checkpoint: str, out: str, dtype: Optional[str] = None) -> str:
    """Export a checkpoint directory (its root or a versioned subdirectory) to one file.

    Args:
        checkpoint: directory written by zero_strategy.save_checkpoint.
        out: output file, .safetensors (streamed, default) or .pt.
        dtype: cast floating tensors to fp32, bf16 or fp16 (default: as saved).
    """
    from zero_strategy.export import export_full

    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {sorted(_DTYPES)}")
    path = export_full(checkpoint, out, dtype=_DTYPES[dtype] if dtype else None)
    print(path)
    return path


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import CLI

    CLI({"export": export}, args=argv)


if __name__ == "__main__":
    main()
