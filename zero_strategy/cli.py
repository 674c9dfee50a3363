"""Command line.

- ``zero-strategy export CHECKPOINT OUT.safetensors [--dtype bf16]``
- ``zero-strategy import-checkpoint SRC DST``: another engine's checkpoint (FSDP2's or torchtitan's DCP
  directory, DeepSpeed's ZeRO-1/2/3 ``global_step*/`` partitions) copied into a zero_strategy checkpoint root, with a report of what it holds
  (:func:`zero_strategy.checkpoint.foreign.import_checkpoint`)
- ``zero-strategy check FILE [--stage N] [--world-size N]``: every problem of a config file in
  one run (unknown keys, bad values, conflicting settings), or the resolved config with the
  DeepSpeed keys honoured and ignored (:mod:`zero_strategy.config.report`)
- ``zero-strategy estimate --params 175e9 --ranks 8 --stage 3 [--precision bf16] [--offload-optimizer cpu]
  [--offload-param nvme] [--model PATH-OR-PRESET]``: model-state bytes per rank, four formulas side by side
  (:mod:`zero_strategy.bench.estimate`)
- ``zero-strategy bench --model small --ranks 1,2 --steps 5 --out DIR``: the benchmark table (DDP, ZeRO-1/2/3,
  offload), its JSON and three plots (:mod:`zero_strategy.bench`; ``docs/bench.md``); ``--links 2x2``: bytes per
  step per link class of the hybrid layouts on emulated nodes (:mod:`zero_strategy.bench.links`)
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

__all__ = ["check", "export", "import_checkpoint", "main"]

OFFLOAD_CHOICES = ("none", "cpu", "nvme")


def export(checkpoint: str, out: str, dtype: Optional[str] = None, max_shard_size: Optional[str] = None) -> str:
    """Export a checkpoint directory (its root or a versioned subdirectory) to one file.

    Args:
        checkpoint: directory written by zero_strategy.save_checkpoint.
        out: output file, .safetensors (streamed, default) or .pt.
        dtype: cast floating tensors to fp32, bf16 or fp16, or another name in
            :data:`zero_strategy.config.DTYPES` (default: as saved).
        max_shard_size: write ``out`` as a directory of safetensors files of at most this
            size (``5GB``, ``500MB``) and ``model.safetensors.index.json``, as
            ``save_pretrained`` does (``from_pretrained`` loads it).
    """
    from zero_strategy.checkpoint.export import export_full
    from zero_strategy.config import DTYPES

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    path = export_full(checkpoint, out, dtype=DTYPES[dtype] if dtype else None, max_shard_size=max_shard_size)
    print(path)
    return path


def import_checkpoint(src: str, dst: str) -> dict[str, Any]:
    """Copy another engine's DCP checkpoint into a zero_strategy checkpoint root and print what
    it read: tensors, optimizer state, the step, the LR scheduler's state, what was left out."""
    from zero_strategy.checkpoint.foreign import import_checkpoint as run

    report = run(src, dst)
    state = report["optimizer_state"]
    print(f"read {report['path']} ({report['layout']} layout)")
    if "deepspeed_stage" in report:
        print(f"  DeepSpeed ZeRO-{report['deepspeed_stage']} ({report['deepspeed_optimizer']}) at "
              f"{report['deepspeed_world_size']} ranks, {report['tag']}, DeepSpeed {report['ds_version']}")  # fmt: skip
        if report["frozen"]:
            print(f"  frozen parameters (values, no optimizer state): {', '.join(report['frozen'])}")
    print(f"  model: {report['model_tensors']} tensors, {report['model_elements']} elements")
    print(f"  optimizer state: {state['parameters']} parameters, keys {', '.join(state['keys']) or 'none'}; "
          f"{report['param_groups']} param group(s)")  # fmt: skip
    print(f"  step: {report['step']}")
    print(f"  scheduler: {report['scheduler'] or 'none'}")
    others = [k for k in report["objects"] if k not in report["scheduler"]]
    if others:
        print(f"  other entries (not loaded into the model): {', '.join(others)}")
    if report["left_out"]:
        print(f"  left out (not readable without running code): {', '.join(report['left_out'])}")
    print(f"wrote {report['written']}; zs.load_checkpoint({dst!r}, model, optimizer) resumes from it")
    return report


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


class _WithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, 0.0) or action.help is None:
            return action.help
        return super()._get_help_string(action)


COMMANDS_GROUP = "zero_strategy.commands"  # front-ends add subcommands here (entry points)


def _plugin_commands() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def _parser(commands: dict[str, Any]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero-strategy", description="zero_strategy commands")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ex = sub.add_parser("export", help="export a checkpoint to one .safetensors or .pt file",
                        description="Export a checkpoint directory (its root or a versioned subdirectory) to one "
                        "file, offline, tensor by tensor (docs/checkpoints.md).")  # fmt: skip
    ex.add_argument(
        "checkpoint", help="directory written by zero_strategy.save_checkpoint (its root or a versioned subdirectory)"
    )
    ex.add_argument("out", help="output file, .safetensors (streamed) or .pt")
    ex.add_argument("--dtype", help="cast floating tensors: fp32, bf16 or fp16 (default: as saved)")
    ex.add_argument("--max-shard-size", help="write OUT as a directory of safetensors files of at most this size "
                    "(5GB, 500MB) and model.safetensors.index.json, as save_pretrained does")  # fmt: skip
    ck = sub.add_parser("check", help="check a config file: every problem, or the resolved config",
                        description="Check a config file (YAML/JSON, DeepSpeed key names) or a built-in preset: print "
                        "every problem, or the resolved config with the DeepSpeed keys honoured, read but not applied, "
                        "and ignored. Exits 1 when the file is not usable (docs/config.md).")  # fmt: skip
    ck.add_argument("file", help="a YAML/JSON config file (DeepSpeed key names, or the flat form of ZeroConfig), or a "
                    "built-in name: zero1, zero2, zero2_offload, zero3, zero3_offload, zero3_offload_nvme")  # fmt: skip
    ck.add_argument("--stage", type=int, help="the stage a front-end will set (applied first)")
    ck.add_argument("--world-size", type=int, help="the number of processes (checks load_balance.scores)")
    im = sub.add_parser("import-checkpoint", help="copy an FSDP2, torchtitan or DeepSpeed checkpoint into a zero_strategy one",
                        description="Read another engine's checkpoint (a DCP directory of get_model_state_dict and "
                        "get_optimizer_state_dict: FSDP2's docs, torchtitan; or DeepSpeed ZeRO-1/2/3's save_checkpoint "
                        "directory), report what it holds, and write it as a zero_strategy checkpoint root that "
                        "load_checkpoint resumes from (docs/migrating_fsdp.md, docs/migrating_deepspeed.md).")  # fmt: skip
    im.add_argument("src", help="the directory dcp.save wrote (its .metadata file and shards), or DeepSpeed's "
                    "checkpoint directory (its latest file and global_step*/)")  # fmt: skip
    im.add_argument("dst", help="a zero_strategy checkpoint root: DST/step-<n> and DST/latest are written")
    _add_estimate(sub)
    _add_bench(sub)
    for name, ep in sorted(commands.items()):  # listed here; run by main() with their own parser
        sub.add_parser(name, help=f"from {ep.value.split(':')[0]} (see `zero-strategy {name} --help`)", add_help=False)
    return parser


def _add_estimate(sub: Any) -> None:
    es = sub.add_parser("estimate", help="model-state memory per rank: four formulas side by side",
                        description="Per-rank device, host and disk bytes of parameters, gradients and optimizer "
                        "state from section 1.1's arithmetic, the ZeRO paper, DeepSpeed's estimator and this "
                        "engine's layout (docs/bench.md).",
                        formatter_class=_WithDefaults)  # fmt: skip
    es.add_argument("--params", type=_count, help="number of parameters: 7B, 70e9, 1.5T, 350M (or --model)")
    es.add_argument(
        "--model", help="count parameters of a bundled GPT preset/spec or a Hugging Face config (meta device)"
    )
    es.add_argument("--ranks", type=int, required=True, help="data-parallel ranks (GPUs)")
    es.add_argument("--stage", type=int, required=True, choices=(0, 1, 2, 3), help="ZeRO stage (0: DDP)")
    es.add_argument("--precision", default="fp32", choices=("fp16", "bf16", "fp32"),
                    help="training precision (the engine's default: fp32; bf16/fp16: 16-bit parameters, fp32 masters)")  # fmt: skip
    es.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd-momentum, sgd, ... (state bytes/param)")
    es.add_argument("--offload-optimizer", default="none", choices=OFFLOAD_CHOICES)
    es.add_argument("--offload-param", default="none", choices=OFFLOAD_CHOICES)
    es.add_argument("--largest-layer", type=float, help="parameters of the largest layer (DeepSpeed's 4 B x term)")
    es.add_argument(
        "--persistent",
        type=float,
        default=0.0,
        help="ZeRO-3: parameters of units kept gathered (stage3_param_persistence_threshold)",
    )
    es.add_argument("--cache-budget", metavar="SIZE",
                    help="ZeRO-3: the cache tier (zero_strategy: memory: cache): bytes ('20GB') or a fraction of --budget")  # fmt: skip
    es.add_argument("--budget", metavar="BYTES", help="the memory budget a fractional --cache-budget is taken of")
    es.add_argument("--moe-experts", type=int, metavar="E", help="MoE: experts per layer (with --moe-topk, --tokens)")
    es.add_argument("--moe-topk", type=int, metavar="K", help="MoE: experts each token is routed to")
    es.add_argument("--tokens", type=int, metavar="T", help="MoE: tokens per micro-batch and rank")
    es.add_argument("--expert-params", type=float, help="MoE: parameters inside the experts (--model counts them)")


COUNT_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def _count(text: str) -> float:
    """A parameter count: ``7e9``, ``7B`` (billions), ``350M``, ``1.5T``."""
    t = text.strip().replace("_", "")
    scale = COUNT_SUFFIXES.get(t[-1:].upper(), 1.0) if t[-1:].isalpha() else 1.0
    try:
        value = float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"--params {text!r}: a number like 7e9, 7B, 350M or 1.5T") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"--params {text!r}: give a positive number of parameters")
    return value


def _ranks(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks {text!r}: a comma list of integers, e.g. 1,2,4") from None


def _add_bench(sub: Any) -> None:
    be = sub.add_parser("bench", help="the benchmark table: DDP, ZeRO-1/2/3, offload; Markdown, JSON, plots",
                        description="Train the bundled GPT with every row at every rank count (fresh CPU/gloo "
                        "ranks), and write bench.md, bench.json and memory/breakdown/losses PNGs (docs/bench.md).",
                        formatter_class=_WithDefaults)  # fmt: skip
    be.add_argument("--model", default="small", help="tiny, small, medium, large, or a spec 'd=256,layers=4,heads=4'")
    be.add_argument("--ranks", type=_ranks, default=(1, 2), help="comma list of rank counts, the plots' x axis")
    be.add_argument("--steps", type=int, default=5, help="measured steps per run")
    be.add_argument("--warmup", type=int, default=2, help="unmeasured steps per run")
    be.add_argument("--repeats", type=int, default=1, help="interleaved repeats of every run (medians are reported)")
    be.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    be.add_argument("--out", default="bench-out", help="directory for bench.md, bench.json and the PNGs")
    be.add_argument("--peers", action="store_true", help="add FSDP2 and DeepSpeed rows (when installed)")
    be.add_argument("--rows", help="a comma subset of ddp,zero1,zero2,zero3,zero3_cpu,zero3_nvme")
    be.add_argument(
        "--fresh-processes",
        action="store_true",
        help="start every row in its own ranks: a clean peak-RSS column, one start (~10 s of CPU) more per row",
    )
    be.add_argument(
        "--from-json",
        metavar="BENCH_JSON",
        help="run nothing: make the table, plots (and --update-results) again from a saved bench.json",
    )
    be.add_argument("--update-results", nargs="?", const="bench/RESULTS.md", metavar="RESULTS_MD",
                    help="regenerate the marked section of this file (default bench/RESULTS.md), plots in plots/")  # fmt: skip
    be.add_argument("--launcher", default="auto", choices=("auto", "torchrun", "own"),
                    help="how ranks start: torchrun (auto: when torch has it) or zero-strategy's own launcher")  # fmt: skip
    be.add_argument("--links", nargs="?", const="2x2", metavar="NODESxPER_NODE",
                    help="instead of the table: NODES x PER_NODE ranks (default 2x2) as emulated nodes, bytes per "
                    "step per link class (intra/inter node) and step time of flat ZeRO-3, shard groups, hpZ and the "
                    "quantized modes (those this build has) and FSDP2 HSDP; writes links.md and links.json")  # fmt: skip
    be.add_argument("--link-modes", help="with --links: a comma subset of zero3,shard,hpz,qwz,qgz,zeropp,fsdp2_hsdp")


def _run(ns: argparse.Namespace) -> None:
    if ns.command == "check":
        raise SystemExit(0 if check(ns.file, ns.stage, ns.world_size) else 1)
    if ns.command == "estimate":
        from zero_strategy.bench.command import estimate

        moe = None
        if ns.moe_experts is not None or ns.moe_topk is not None or ns.tokens is not None:
            if None in (ns.moe_experts, ns.moe_topk, ns.tokens):
                raise SystemExit("zero-strategy estimate: error: --moe-experts, --moe-topk and --tokens go together")
            moe = (ns.moe_experts, ns.moe_topk, ns.tokens)
        estimate(ns.params, ns.ranks, ns.stage, ns.precision, ns.optimizer, ns.offload_optimizer,
                 ns.offload_param, ns.largest_layer, ns.model, ns.persistent, ns.cache_budget, ns.budget,
                 moe, ns.expert_params)  # fmt: skip
        return
    if ns.command == "bench":
        from zero_strategy.bench.command import bench, redraw

        if ns.from_json:
            redraw(ns.from_json, ns.out, ns.update_results)
            return
        if ns.links:
            from zero_strategy.bench.command import bench_links

            modes = tuple(m.strip() for m in ns.link_modes.split(",")) if ns.link_modes else None
            bench_links(ns.links, ns.model, ns.steps, ns.warmup, ns.batch, ns.out, modes, launcher=ns.launcher)
            return
        rows = tuple(r.strip() for r in ns.rows.split(",")) if ns.rows else None
        bench(ns.model, ns.ranks, ns.steps, ns.warmup, ns.repeats, ns.batch, ns.out, ns.peers, rows,
              ns.update_results, fresh=ns.fresh_processes, launcher=ns.launcher)  # fmt: skip
        return
    if ns.command == "import-checkpoint":
        import_checkpoint(ns.src, ns.dst)
        return
    export(ns.checkpoint, ns.out, ns.dtype, ns.max_shard_size)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    commands = _plugin_commands()
    if args and args[0] in commands:  # e.g. `launch` from accelerate_zero: it parses its own arguments
        commands[args[0]].load()(args[1:])
        return
    parser = _parser(commands)
    ns = parser.parse_args(args)
    try:
        _run(ns)
    except (ValueError, OSError, RuntimeError) as exc:  # a bad path or checkpoint: the message says what to do
        parser.exit(1, f"zero-strategy {ns.command}: error: {exc}\n")


if __name__ == "__main__":
    main()
