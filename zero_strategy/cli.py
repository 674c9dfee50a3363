"""Command line.

- ``zero-strategy export CHECKPOINT OUT.safetensors [--dtype bf16]``
- subcommands that front-ends register as ``zero_strategy.commands`` entry points, such as
  ``zero-strategy launch`` from ``accelerate_zero`` (see ``accelerate_zero.launch``); the core
  itself imports no front-end framework.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from zero_strategy.config import DTYPES

__all__ = ["export", "main"]


def export(checkpoint: str, out: str, dtype: Optional[str] = None) -> str:
    """Export a checkpoint directory (its root or a versioned subdirectory) to one file.

    Args:
        checkpoint: directory written by zero_strategy.save_checkpoint.
        out: output file, .safetensors (streamed, default) or .pt.
        dtype: cast floating tensors to fp32, bf16 or fp16, or another name in
            :data:`zero_strategy.config.DTYPES` (default: as saved).
    """
    from zero_strategy.checkpoint.export import export_full

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    path = export_full(checkpoint, out, dtype=DTYPES[dtype] if dtype else None)
    print(path)
    return path


COMMANDS_GROUP = "zero_strategy.commands"  # front-ends add subcommands here (entry points)


def _plugin_commands() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def _parser(commands: dict[str, Any]) -> argparse.ArgumentParser:
    extra = ", ".join(sorted(commands))
    parser = argparse.ArgumentParser(
        prog="zero-strategy",
        description="zero_strategy commands"
        + (f"; also from installed front-ends: {extra} (see `zero-strategy NAME --help`)" if extra else ""),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ex = sub.add_parser("export", help="export a checkpoint to one .safetensors or .pt file", description=export.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ex.add_argument(
        "checkpoint", help="directory written by zero_strategy.save_checkpoint (its root or a versioned subdirectory)"
    )
    ex.add_argument("out", help="output file, .safetensors (streamed) or .pt")
    ex.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating tensors (default: as saved)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    commands = _plugin_commands()
    if args and args[0] in commands:  # e.g. `launch` from accelerate_zero: it parses its own arguments
        commands[args[0]].load()(args[1:])
        return
    parser = _parser(commands)
    ns = parser.parse_args(args)
    try:
        export(ns.checkpoint, ns.out, ns.dtype)
    except (ValueError, OSError, RuntimeError) as exc:  # a bad path or checkpoint: the message says what to do
        parser.exit(1, f"zero-strategy {ns.command}: error: {exc}\n")


if __name__ == "__main__":
    main()
