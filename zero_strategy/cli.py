"""Command line.

- ``zero-strategy export CHECKPOINT OUT.safetensors [--dtype bf16]``
- ``zero-strategy launch --zero-config zero3.yaml [--zero-stage N] [accelerate launch args] train.py [args]``:
  checks the config, sets ``ZERO_STRATEGY_CONFIG`` (and ``ZERO_STRATEGY_STAGE``) and hands over
  to ``accelerate launch``; the script builds ``accelerate_zero.ZeroPlugin.from_env()``.
  Accelerate is imported only inside this subcommand.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

__all__ = ["export", "launch", "main"]

LAUNCH_USAGE = (
    "usage: zero-strategy launch --zero-config FILE [--zero-stage N] [accelerate launch options] SCRIPT [SCRIPT ARGS]\n"
    "  Checks FILE, exports ZERO_STRATEGY_CONFIG=FILE (and ZERO_STRATEGY_STAGE=N) and runs `accelerate launch` with\n"
    "  the remaining arguments. On CPU, N processes need a config with distributed_type MULTI_GPU (or --multi_gpu)\n"
    "  and ACCELERATE_USE_CPU=true; `--cpu` starts one process."
)

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


def _launch_options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Our leading options (they must come first, so the script's own flags are never taken)."""
    ours = {"--zero-config": "ZERO_STRATEGY_CONFIG", "--zero-stage": "ZERO_STRATEGY_STAGE"}
    env: dict[str, str] = {}
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag not in ours:
            break
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"zero-strategy launch: {flag} needs a value\n{LAUNCH_USAGE}")
            value, i = argv[i + 1], i + 1
        env[ours[flag]] = os.path.abspath(value) if flag == "--zero-config" else value
        i += 1
    if "ZERO_STRATEGY_CONFIG" not in env:
        raise ValueError(f"zero-strategy launch: --zero-config FILE is required (before the accelerate arguments)\n{LAUNCH_USAGE}")
    return env, argv[i:]


def launch(argv: list[str]) -> None:
    """Check the ZeRO config, export it to the environment and run ``accelerate launch``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(LAUNCH_USAGE)
        return
    env, rest = _launch_options(argv)
    try:
        from accelerate.commands.launch import launch_command, launch_command_parser

        from accelerate_zero.plugin import ZeroPlugin
    except ImportError as exc:
        raise RuntimeError(f"zero-strategy launch needs Accelerate: pip install 'zero-strategy[accelerate]' ({exc})") from None
    ZeroPlugin.from_env(environ={**os.environ, **env})  # a bad file fails here, before any process starts
    args = launch_command_parser().parse_args(rest)
    if args.cpu and (args.num_processes or 1) > 1:
        raise ValueError(
            f"zero-strategy launch: --cpu with --num_processes {args.num_processes} starts ONE process in Accelerate; "
            "for N processes on CPU use --multi_gpu (or distributed_type: MULTI_GPU in the config file) and set "
            "ACCELERATE_USE_CPU=true"
        )
    os.environ.update(env)
    launch_command(args)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "launch":  # its arguments belong to `accelerate launch`: parsed there
        try:
            launch(args[1:])
        except (ValueError, TypeError, FileNotFoundError, RuntimeError) as exc:
            print(f"zero-strategy launch: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    from jsonargparse import CLI

    CLI({"export": export, "launch": _launch_help}, args=args)


def _launch_help() -> None:
    """Run a script with `accelerate launch` and a ZeRO config (see `zero-strategy launch --help`)."""
    print(LAUNCH_USAGE)


if __name__ == "__main__":
    main()
