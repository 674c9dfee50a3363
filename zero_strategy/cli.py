"""Command line.

- ``zero-strategy export CHECKPOINT OUT.safetensors [--dtype bf16]``
- subcommands that front-ends register as ``zero_strategy.commands`` entry points, such as
  ``zero-strategy launch`` from ``accelerate_zero`` (see ``accelerate_zero.launch``); the core
  itself imports no front-end framework.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

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


COMMANDS_GROUP = "zero_strategy.commands"  # front-ends add subcommands here (entry points)


def _plugin_commands() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    commands = _plugin_commands()
    if args and args[0] in commands:  # e.g. `launch` from accelerate_zero: it parses its own arguments
        commands[args[0]].load()(args[1:])
        return
    from jsonargparse import CLI

    extra = ", ".join(sorted(commands))
    description = "zero_strategy commands" + (f"; also from installed front-ends: {extra} (see `zero-strategy NAME --help`)" if extra else "")
    CLI({"export": export}, args=args, description=description)


if __name__ == "__main__":
    main()
