"""What ``zero-strategy bench`` and ``zero-strategy estimate`` do once their arguments are parsed
(the parser lives in :mod:`zero_strategy.cli`, which imports this module only when one runs)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from zero_strategy.bench.estimate import Setup, count_expert_params, count_model, format_estimate

__all__ = ["bench", "bench_links", "estimate", "machine_info"]


def estimate(
    params: float | None,
    ranks: int,
    stage: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    offload_optimizer: str = "none",
    offload_param: str = "none",
    largest_layer: float | None = None,
    model: str | None = None,
    persistent: float = 0.0,
    cache_budget: str | None = None,
    budget: str | None = None,
    moe: tuple[int, int, int] | None = None,
    expert_params: float | None = None,
) -> str:
    """Print (and return) the model-state bytes per rank from the four formulas. ``cache_budget``
    and ``budget`` are read as the ``zero_strategy: memory:`` block reads them (a fraction of
    the budget, or bytes); ``moe``: (experts, top-k, tokens)."""
    if model is not None:
        counted, largest = count_model(model)
        params = params or counted
        largest_layer = largest_layer or largest
        if moe is not None and expert_params is None:
            expert_params = count_expert_params(model)
    if params is None:
        raise ValueError("estimate: give --params N or --model PATH-OR-PRESET")
    experts, topk, tokens = moe or (0, 0, 0)
    if moe is not None and not expert_params:
        raise ValueError(
            "estimate: --moe-experts needs --expert-params N (or a --model whose expert modules it counts)"
        )
    text = format_estimate(
        Setup(
            float(params),
            ranks,
            stage,
            precision,
            optimizer,
            offload_optimizer,
            offload_param,
            float(largest_layer or 0),
            persistent,
            float(_cache_tier(cache_budget, budget)),
            experts,
            topk,
            tokens,
            float(expert_params or 0),
        )  # fmt: skip
    )
    print(text, end="")
    return text


def _cache_tier(cache: str | None, budget: str | None) -> int:
    """The cache tier in bytes, resolved by :class:`zero_strategy.config.memory.MemoryConfig` (only
    imported, with torch, when the option is given)."""
    if cache is None:
        if budget is not None:
            raise ValueError("estimate: --budget is read only with --cache-budget (a fraction of it)")
        return 0
    from zero_strategy.config.memory import MemoryConfig, to_size

    share = to_size(cache, "estimate --cache-budget")
    if isinstance(share, float) and budget is None:
        raise ValueError(f"estimate: --cache-budget {cache} is a fraction of the budget: give --budget BYTES too, "
                         "or the cache in bytes ('20GB')")  # fmt: skip
    whole = to_size(budget, "estimate --budget", zero=False) if budget is not None else share
    if isinstance(whole, float):
        raise ValueError(f"estimate: --budget {budget}: give bytes ('60GB'); a fraction of a device's memory needs "
                         "the device")  # fmt: skip
    return MemoryConfig(budget=whole, persistent=0.0, cache=share, working=0.0).resolve(None).cache


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu": cpu,
        "device": "cpu",  # the bench's ranks run on CPU/gloo
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def bench(
    model: str,
    ranks: tuple[int, ...],
    steps: int,
    warmup: int,
    repeats: int,
    batch: int,
    out: str,
    peers: bool,
    rows: tuple[str, ...] | None = None,
    update_results: str | None = None,
    progress: bool | None = None,
    fresh: bool = False,
    launcher: str = "auto",
) -> dict[str, Any]:
    """Run the bench, write ``out``/bench.{md,json} and three PNGs, print the table; with
    ``update_results`` regenerate that file's marked section (plot copied next to it)."""
    from zero_strategy.bench import harness

    opts = harness.BenchOptions(
        model=model, ranks=ranks, steps=steps, warmup=warmup, repeats=repeats, batch=batch, peers=peers,
        rows=rows or harness.CORE_ROWS, fresh=fresh, launcher=launcher, **({} if progress is None else {"progress": progress}),
    )  # fmt: skip
    info = machine_info()

    def log(msg: str) -> None:
        if not opts.progress:
            print(msg, file=sys.stderr, flush=True)

    data = harness.run_bench(opts, log)
    data["machine"] = info
    data["command"] = "zero-strategy " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    data["summary"] = harness.summarize(data)
    return publish(data, out, update_results)


def bench_links(
    layout: str,
    model: str,
    steps: int,
    warmup: int,
    batch: int,
    out: str,
    modes: tuple[str, ...] | None = None,
    launcher: str = "auto",
) -> dict[str, Any]:
    """``bench --links NODESxPER_NODE``: run :func:`zero_strategy.bench.links.run_links`, write
    ``out``/links.{md,json} and print the table."""
    from zero_strategy.bench import links

    nodes, sep, per_node = layout.lower().partition("x")
    if not (sep and nodes.strip().isdigit() and per_node.strip().isdigit()):
        raise ValueError(f"bench --links {layout!r}: give NODESxPER_NODE, e.g. 2x2")
    data = links.run_links(model, int(nodes), int(per_node), steps, warmup, batch, modes, launcher,
                           log=lambda msg: print(msg, file=sys.stderr, flush=True))  # fmt: skip
    data["machine"] = machine_info()
    data["command"] = "zero-strategy " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    data["summary"] = links.summarize_links(data)
    where = Path(out)
    where.mkdir(parents=True, exist_ok=True)
    (where / "links.json").write_text(json.dumps(data, indent=1))
    text = f"Command: `{data['command']}`\n\n{links.links_markdown(data)}\n"
    (where / "links.md").write_text(text)
    print(text)
    print(f"wrote {where / 'links.md'}, {where / 'links.json'}")
    return data


def redraw(json_path: str, out: str, update_results: str | None = None) -> dict[str, Any]:
    """Make the table, plots and ``update_results``' section again from a saved ``bench.json``."""
    data = json.loads(Path(json_path).read_text())
    return publish(data, out, update_results)


def publish(data: dict[str, Any], out: str, update_results: str | None) -> dict[str, Any]:
    from zero_strategy.bench import report

    paths = report.write_outputs(data, Path(out))
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if "memory" not in paths:
        print("plots skipped: matplotlib is not installed (pip install 'zero-strategy[bench]')")
    if update_results:
        target = Path(update_results)
        plots = target.parent / "plots"
        plots.mkdir(parents=True, exist_ok=True)
        for name in report.PLOTS:
            if name in paths:
                (plots / f"{name}.png").write_bytes(paths[name].read_bytes())
        report.update_results(target, data, plot="plots/memory.png" if "memory" in paths else None)
        print(f"updated {target}'s generated section")
    return data
