"""``zero-strategy launch --zero-config zero3.yaml [--zero-stage N] [accelerate launch args] train.py [args]``.

Checks the config, sets ``ZERO_STRATEGY_CONFIG`` (and ``ZERO_STRATEGY_STAGE``) and hands over to
``accelerate launch``; the script builds ``accelerate_zero.ZeroPlugin.from_env()``. Registered
as the ``launch`` entry point of the ``zero_strategy.commands`` group, so the core's
``zero-strategy`` command finds it without importing Accelerate itself.
"""

from __future__ import annotations

import os
import sys

from accelerate_zero.plugin import ZeroPlugin

__all__ = ["launch", "main"]

LAUNCH_USAGE = (
    "usage: zero-strategy launch --zero-config FILE [--zero-stage N] [accelerate launch options] SCRIPT [SCRIPT ARGS]\n"
    "  Checks FILE, exports ZERO_STRATEGY_CONFIG=FILE (and ZERO_STRATEGY_STAGE=N) and runs `accelerate launch` with\n"
    "  the remaining arguments. On CPU, N processes need a config with distributed_type MULTI_GPU (or --multi_gpu)\n"
    "  and ACCELERATE_USE_CPU=true; `--cpu` starts one process."
)


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
        raise ValueError(
            f"zero-strategy launch: --zero-config FILE is required (before the accelerate arguments)\n{LAUNCH_USAGE}"
        )
    return env, argv[i:]


def launch(argv: list[str]) -> None:
    """Check the ZeRO config, export it to the environment and run ``accelerate launch``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(LAUNCH_USAGE)
        return
    env, rest = _launch_options(argv)
    from accelerate.commands.launch import launch_command, launch_command_parser

    # a bad file fails here, before any process starts; so does a conflict in the config the processes will
    # resolve (ZeroConfig.conflicts: e.g. offload_param without stage 3, which the file alone may leave open)
    ZeroPlugin.from_env(environ={**os.environ, **env}).config.check(caller="the config from --zero-config/--zero-stage")
    args = launch_command_parser().parse_args(rest)
    if args.cpu and (args.num_processes or 1) > 1:
        raise ValueError(
            f"zero-strategy launch: --cpu with --num_processes {args.num_processes} starts ONE process in Accelerate; "
            "for N processes on CPU use --multi_gpu (or distributed_type: MULTI_GPU in the config file) and set "
            "ACCELERATE_USE_CPU=true"
        )
    os.environ.update(env)
    launch_command(args)


def main(argv: list[str]) -> None:
    """The ``launch`` subcommand: its arguments belong to ``accelerate launch`` and are parsed there."""
    try:
        launch(argv)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as exc:
        print(f"zero-strategy launch: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
