"""Command line.

- ``zero-strategy export CHECKPOINT OUT.safetensors [--dtype bf16]``
- ``zero-strategy check FILE [--stage N] [--world-size N]``: every problem of a config file in
  one run (unknown keys, bad values, conflicting settings), or the resolved config with the
  DeepSpeed keys honoured and ignored (:mod:`zero_strategy.config.report`)
- subcommands that front-ends register as ``zero_strategy.commands`` entry points, such as
  ``zero-strategy launch`` from ``accelerate_zero`` (see ``accelerate_zero.launch``); the core
  itself imports no front-end framework.

``--help`` answers without importing torch: the entry points' names come from the installed
metadata, and a subcommand's module is imported only when it runs. So this module imports
nothing of the engine at the top (``zero_strategy/__init__`` loads its names on first use).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

__all__ = ["check", "export", "main"]


def export(checkpoint: str, out: str, dtype: Optional[str] = None) -> str:
    """Export a checkpoint directory (its root or a versioned subdirectory) to one file.

    Args:
        checkpoint: directory written by zero_strategy.save_checkpoint.
        out: output file, .safetensors (streamed, default) or .pt.
        dtype: cast floating tensors to fp32, bf16 or fp16, or another name in
            :data:`zero_strategy.config.DTYPES` (default: as saved).
    """
    from zero_strategy.checkpoint.export import export_full
    from zero_strategy.config import DTYPES

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    path = export_full(checkpoint, out, dtype=DTYPES[dtype] if dtype else None)
    print(path)
    return path


def check(file: str, stage: Optional[int] = None, world_size: Optional[int] = None) -> bool:
    """Check a config file (YAML/JSON, DeepSpeed key names): print every problem, or the
    resolved config with the DeepSpeed keys honoured, read but not applied, and ignored.
    Returns whether the file is usable.

    Args:
        file: the config file.
        stage: the ZeRO stage a front-end will set (``ZeroStrategy(stage=...)``,
            ``zero-strategy launch --zero-stage``), applied first.
        world_size: the number of processes, to check what depends on it
            (``load_balance.scores``: one per rank).
    """
    from zero_strategy.config.report import check_file

    report = check_file(file, stage=stage, world_size=world_size)
    print(report.format(), end="", file=sys.stdout if report.ok else sys.stderr)
    return report.ok


COMMANDS_GROUP = "zero_strategy.commands"  # front-ends add subcommands here (entry points)


def _plugin_commands() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def _parser(commands: dict[str, Any]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero-strategy", description="zero_strategy commands")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ex = sub.add_parser("export", help="export a checkpoint to one .safetensors or .pt file", description=export.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ex.add_argument(
        "checkpoint", help="directory written by zero_strategy.save_checkpoint (its root or a versioned subdirectory)"
    )
    ex.add_argument("out", help="output file, .safetensors (streamed) or .pt")
    ex.add_argument("--dtype", help="cast floating tensors: fp32, bf16 or fp16 (default: as saved)")
    ck = sub.add_parser("check", help="check a config file: every problem, or the resolved config",
                        description=check.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ck.add_argument("file", help="a YAML/JSON config file (DeepSpeed key names, or the flat form of ZeroConfig)")
    ck.add_argument("--stage", type=int, help="the stage a front-end will set (applied first)")
    ck.add_argument("--world-size", type=int, help="the number of processes (checks load_balance.scores)")
    for name, ep in sorted(commands.items()):  # listed here; run by main() with their own parser
        sub.add_parser(name, help=f"from {ep.value.split(':')[0]} (see `zero-strategy {name} --help`)", add_help=False)
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
        if ns.command == "check":
            raise SystemExit(0 if check(ns.file, ns.stage, ns.world_size) else 1)
        export(ns.checkpoint, ns.out, ns.dtype)
    except (ValueError, OSError, RuntimeError) as exc:  # a bad path or checkpoint: the message says what to do
        parser.exit(1, f"zero-strategy {ns.command}: error: {exc}\n")


if __name__ == "__main__":
    main()
