"""``zero-strategy launch --zero-config zero3.yaml [--zero-stage N] [accelerate launch args] train.py [args]``.

Checks the config, sets ``ZERO_STRATEGY_CONFIG`` (and ``ZERO_STRATEGY_STAGE``) and hands over to
``accelerate launch``. In the processes it starts, the start-up hook installed with the package
(``accelerate_zero._autostart``) routes the script's own ``accelerator.prepare(model, optimizer,
...)`` to the engine, so the script needs no change; one that builds
``accelerate_zero.ZeroPlugin.from_env()`` itself works the same. ``launch`` refuses to start when
the hook is not installed (the processes would train plain DDP). Registered
as the ``launch`` entry point of the ``zero_strategy.commands`` group, so the core's
``zero-strategy`` command finds it without importing Accelerate itself.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from accelerate_zero._autostart import PTH_NAME
from accelerate_zero.plugin import ZeroPlugin

__all__ = ["check_hook_installed", "hook_active", "hook_files", "launch", "main"]

LAUNCH_USAGE = (
    "usage: zero-strategy launch --zero-config FILE [--zero-stage N] [accelerate launch options] SCRIPT [SCRIPT ARGS]\n"
    "  Checks FILE, exports ZERO_STRATEGY_CONFIG=FILE (and ZERO_STRATEGY_STAGE=N) and runs `accelerate launch` with\n"
    "  the remaining arguments; the script's accelerator.prepare(model, optimizer, ...) then runs on the ZeRO engine\n"
    "  (no code change: ZERO_STRATEGY_CONFIG=FILE accelerate launch ... does the same). FILE: a path or a built-in\n"
    "  name (zero1, zero2, zero2_offload, zero3, zero3_offload, zero3_offload_nvme). On a machine without GPUs, N\n"
    "  processes need distributed_type MULTI_GPU in the --config_file (or --multi_gpu); launch then sets\n"
    "  ACCELERATE_USE_CPU=true. `--cpu` starts one process; without --config_file Accelerate's defaults start one."
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
        if flag == "--zero-config" and os.path.isfile(value):  # a file, for the processes; else a preset's name
            value = os.path.abspath(value)
        env[ours[flag]] = value
        i += 1
    if "ZERO_STRATEGY_CONFIG" not in env:
        raise ValueError(
            f"zero-strategy launch: --zero-config FILE is required (before the accelerate arguments)\n{LAUNCH_USAGE}"
        )
    return env, argv[i:]


def hook_files() -> list[str]:
    """The installed start-up lines (``zero_strategy_accelerate.pth``) this interpreter reads."""
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return [p for p in (os.path.join(d, PTH_NAME) for d in dirs) if os.path.isfile(p)]


def hook_active(environ: dict[str, str]) -> bool:
    """Whether a process started with ``environ`` (``ZERO_STRATEGY_CONFIG`` set) runs the hook:
    a child Python reports the finder the ``.pth`` line installs (it imports no torch)."""
    import subprocess

    probe = "import sys; print(any(type(f).__name__ == '_PatchOnImport' for f in sys.meta_path))"
    done = subprocess.run([sys.executable, "-c", probe], env=environ, capture_output=True, text=True, check=False)
    return done.returncode == 0 and done.stdout.strip() == "True"


def check_hook_installed(environ: dict[str, str]) -> None:
    """Refuse to launch when the processes would not run the start-up hook: they would train DDP."""
    if not hook_active(environ):
        found = ", ".join(hook_files()) or "none found"
        raise RuntimeError(
            f"the start-up hook ({PTH_NAME}) does not run in this Python (installed lines: {found}), so the "
            "launched script's accelerator.prepare would wrap the model in plain DDP. Install the package with "
            "pip (pip install 'zero-strategy[accelerate]', or pip install -e . in a checkout), or prepare the "
            "model in code with accelerate_zero.ZeroPlugin.from_env().prepare(accelerator, ...)"
        )


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
    check_hook_installed({**os.environ, **env})
    args = launch_command_parser().parse_args(rest)
    if args.cpu and (args.num_processes or 1) > 1:
        raise ValueError(
            f"zero-strategy launch: --cpu with --num_processes {args.num_processes} starts ONE process in Accelerate; "
            "for N processes on CPU use --multi_gpu (or distributed_type: MULTI_GPU in the config file) and set "
            "ACCELERATE_USE_CPU=true"
        )
    _check_script(args)
    _refuse_deepspeed_flag(args, env["ZERO_STRATEGY_CONFIG"])
    env.update(_cpu_processes(args))
    os.environ.update(env)
    launch_command(args)


def _check_script(args: Any) -> None:
    """A missing script fails here in one line, not in every process under torch's traceback."""
    script = args.training_script
    if args.module or args.no_python or os.path.isfile(script):
        return
    raise FileNotFoundError(f"the training script {script!r} does not exist (relative to {os.getcwd()!r})")


def _refuse_deepspeed_flag(args: Any, zero_config: str) -> None:
    """A script still given ``--deepspeed ds_config.json`` (the ``Trainer``'s flag) would start
    DeepSpeed in every process (or fail in transformers, ``PackageNotFoundError: deepspeed``, where
    it is not installed): refused before anything starts, naming the fix."""
    script_args = list(args.training_script_args or [])
    for i, arg in enumerate(script_args):
        flag, eq, value = arg.partition("=")
        if flag != "--deepspeed":
            continue
        value = value if eq else (script_args[i + 1] if i + 1 < len(script_args) else "FILE")
        raise ValueError(
            f"the script's arguments still hold --deepspeed {value}, which makes the Trainer start DeepSpeed "
            f"(where it is not installed, transformers fails with PackageNotFoundError). The engine's config comes "
            f"from --zero-config (here {zero_config!r}): drop --deepspeed {value} from the script's arguments, and "
            f"pass that file to the launch instead: zero-strategy launch --zero-config {value} ... "
            f"{args.training_script} ..."
        )


def _cpu_processes(args: Any) -> dict[str, str]:
    """``ACCELERATE_USE_CPU=true`` when the launch asks for several processes (``--multi_gpu``, or
    ``distributed_type: MULTI_GPU`` in the config file) on a machine without GPUs: without it each
    process would train alone at world size 1. Empty when it is set already or not needed."""
    if os.environ.get("ACCELERATE_USE_CPU") is not None:
        return {}
    import torch
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file

    if torch.cuda.is_available():
        return {}
    multi, processes = bool(args.multi_gpu), args.num_processes
    config_file = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    if config_file is not None and not args.cpu:
        defaults = load_config_from_file(config_file)
        multi = multi or str(getattr(defaults.distributed_type, "value", defaults.distributed_type)) == "MULTI_GPU"
        processes = processes if processes is not None else defaults.num_processes
    if not multi or (processes or 1) < 2:
        return {}
    print(
        f"zero-strategy launch: no GPU here: {processes} CPU processes (gloo), ACCELERATE_USE_CPU=true", file=sys.stderr
    )
    return {"ACCELERATE_USE_CPU": "true"}


def main(argv: list[str]) -> None:
    """The ``launch`` subcommand: its arguments belong to ``accelerate launch`` and are parsed there."""
    try:
        launch(argv)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as exc:
        print(f"zero-strategy launch: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
